//! The reading of config.json that every model family shares: the size
//! bounds and checks (`family::load_config` picks the family by its
//! `architectures`, and the family reads the rest).

use super::json::Obj;
use super::*;
use serde_json::Value;

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

pub(crate) fn check(cond: bool, obj: &Obj, key: &str, expected: &str) -> Result<(), ConfigError> {
    if cond {
        Ok(())
    } else {
        Err(obj.invalid(key, expected, obj.map.get(key).unwrap_or(&Value::Null)))
    }
}
