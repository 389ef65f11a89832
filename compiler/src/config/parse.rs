//! config.json → [`ModelConfig`]: the reading shared by every model family
//! (the file, its `architectures`, the size bounds); the family reads the rest.

use super::json::{quoted, short, Obj};
use super::*;
use crate::family::Family;
use serde_json::Value;
use std::path::Path;

/// Upper bounds of the config's sizes: far above any real model (MiniMax-M3
/// uses hidden 6144, 200,064 tokens, 1M positions, 128 experts), low enough
/// that every product the compiler forms (a tensor's elements, the
/// parameter count, a kernel's index arithmetic) fits 64 bits with room.
pub mod bounds {
    pub const WIDTH: usize = 1 << 16;
    pub const INTERMEDIATE: usize = 1 << 18;
    pub const LAYERS: usize = 1024;
    pub const HEADS: usize = 1024;
    pub const HEAD_DIM: usize = 1024;
    pub const VOCAB: usize = 1 << 22;
    pub const EXPERTS: usize = 4096;
    /// Experts over all layers (MiniMax-M3: 60 × 128 = 7,680).
    pub const EXPERT_TENSORS: usize = 1 << 16;
    pub const EXPERTS_PER_TOKEN: usize = 256;
    pub const SHARED_EXPERTS: usize = 64;
    pub const POSITIONS: usize = 1 << 24;
    pub const BLOCK: usize = 1 << 16;
    pub const BLOCKS: usize = 1 << 20;
    pub const PATCH: usize = 1024;
    pub const CHANNELS: usize = 64;
}

/// A positive size of at most `max`.
pub(crate) fn size(o: &Obj, key: &str, max: usize) -> Result<usize, ConfigError> {
    let n = o.positive(key)?;
    check(n <= max, o, key, &format!("a positive integer of at most {max}"))?;
    Ok(n)
}

/// An optional size in `0..=max`.
pub(crate) fn opt_size(o: &Obj, key: &str, max: usize) -> Result<Option<usize>, ConfigError> {
    let n = o.opt_uint(key)?;
    if let Some(n) = n {
        check(n <= max, o, key, &format!("an integer of at most {max}"))?;
    }
    Ok(n)
}

/// Reads and validates a config.json file (a regular file of at most 4 MB).
pub fn load_config(path: &Path) -> Result<ModelConfig, ConfigError> {
    let text = m3c_contract::read_user_file(path, "config", m3c_contract::input::limits::CONFIG)?;
    parse_config(path, &text)
}

/// Parses and validates config.json text; `path` is used in messages. The
/// `architectures` key picks the model family, which reads the rest.
pub fn parse_config(path: &Path, text: &str) -> Result<ModelConfig, ConfigError> {
    let text = m3c_contract::input::strip_bom(text);
    let value: Value = serde_json::from_str(text).map_err(|err| ConfigError::Json { file: path.to_path_buf(), err })?;
    let root = Obj::root(path, &value)?;
    let (family, architecture) = architecture(&root)?;
    family.model().parse_config(&root, &architecture)
}

fn architecture(root: &Obj) -> Result<(Family, String), ConfigError> {
    let all = Family::all_architectures();
    if !root.has("architectures") {
        return Err(root.missing("architectures", format!("a list with one of {}", quoted(&all))));
    }
    let list = root.string_list("architectures")?;
    match list.as_slice() {
        [one] => match Family::of_architecture(one) {
            Some(f) => Ok((f, one.clone())),
            None => Err(unsupported(root, &all)),
        },
        _ => Err(unsupported(root, &all)),
    }
}

fn unsupported(root: &Obj, all: &[&str]) -> ConfigError {
    ConfigError::Architecture { file: root.file.to_path_buf(), found: short(&root.map["architectures"]), expected: quoted(all) }
}

pub(crate) fn check(cond: bool, obj: &Obj, key: &str, expected: &str) -> Result<(), ConfigError> {
    if cond {
        Ok(())
    } else {
        Err(obj.invalid(key, expected, obj.map.get(key).unwrap_or(&Value::Null)))
    }
}
