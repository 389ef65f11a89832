//! The shape of a tiny random model (`m3c init-tiny`): what a family's
//! `tiny_config` and `tiny_values` are given.

use super::Family;
use anyhow::{bail, Result};

/// The shape of a tiny model. Defaults mirror the golden fixtures.
#[derive(Debug, Clone, PartialEq)]
pub struct TinySpec {
    /// The family whose tiny model this is.
    pub family: Family,
    pub seed: u64,
    pub layers: usize,
    pub hidden: usize,
    pub mxfp8: bool,
    pub vision: TinyVision,
}

/// The vision tower's widths (MiniMax-M3's: hidden 1280, 16 heads, MLP
/// 5120, 32 layers, projector 6144).
#[derive(Debug, Clone, PartialEq)]
pub struct TinyVision {
    pub hidden: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub projector: usize,
}

impl Default for TinyVision {
    fn default() -> Self {
        TinyVision { hidden: 64, heads: 4, intermediate: 128, layers: 2, projector: 96 }
    }
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec { family: Family::default(), seed: 0, layers: 8, hidden: 128, mxfp8: false, vision: TinyVision::default() }
    }
}

/// Head width of every tiny model.
pub const HEAD_DIM: usize = 32;

impl TinySpec {
    pub(crate) fn check(&self) -> Result<()> {
        if self.layers == 0 || self.layers > 256 {
            bail!("--layers must be from 1 to 256 (found {})", self.layers);
        }
        if self.hidden > 16384 {
            bail!("--hidden must be at most 16384 (found {}): init-tiny makes small test models", self.hidden);
        }
        if self.hidden < 128 || !self.hidden.is_multiple_of(128) {
            bail!("--hidden must be a positive multiple of 128 (found {}): heads are {HEAD_DIM} wide and come in groups of 4", self.hidden);
        }
        let v = &self.vision;
        for (flag, n) in [("--vision-hidden", v.hidden), ("--vision-mlp", v.intermediate), ("--projector-hidden", v.projector)] {
            if n == 0 || n > 16384 {
                bail!("{flag} must be from 1 to 16384 (found {n})");
            }
        }
        if v.layers == 0 || v.layers > 64 {
            bail!("--vision-layers must be from 1 to 64 (found {})", v.layers);
        }
        if v.heads == 0 || !v.hidden.is_multiple_of(v.heads) || v.hidden / v.heads < 6 || !(v.hidden / v.heads).is_multiple_of(8) {
            bail!(
                "--vision-heads {} must divide --vision-hidden {} into heads of at least 6 channels, a multiple of 8 (3-D RoPE takes a third of each)",
                v.heads,
                v.hidden
            );
        }
        Ok(())
    }

    /// The hub-style config.json of this model (its family's).
    pub fn config_json(&self) -> serde_json::Value {
        self.family.model().tiny_config(self)
    }
}
