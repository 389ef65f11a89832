//! config.json → [`ModelConfig`]: the file, its `architectures` (which
//! picks the family), then the family's own reading.

use super::Family;
use crate::config::json::{quoted, short, Obj};
use crate::config::{ConfigError, ModelConfig};
use serde_json::Value;
use std::path::Path;

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
