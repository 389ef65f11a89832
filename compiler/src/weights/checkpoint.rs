//! An opened checkpoint: the contract's reader (`m3c_contract::checkpoint`,
//! the same one the stage runtime uses) finds and checks every tensor, and
//! each file is then memory-mapped for reading values.

use crate::dtype::DType;
use m3c_contract::checkpoint::CheckpointLayout;
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

pub use m3c_contract::checkpoint::{INDEX_FILE, SINGLE_FILE};
pub use m3c_contract::CheckpointError as WeightsError;

/// One mapped `.safetensors` file.
pub struct Shard {
    pub path: PathBuf,
    map: Mmap,
}

/// Where one tensor's bytes live.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub shard: usize,
    /// Absolute byte range inside the shard file.
    pub range: (usize, usize),
}

/// An opened checkpoint: every tensor of every shard, by name.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub shards: Vec<Shard>,
    pub tensors: BTreeMap<String, TensorEntry>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` if present, else `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Checkpoint, WeightsError> {
        let layout = CheckpointLayout::open(dir)?;
        let mut shards = Vec::with_capacity(layout.files.len());
        for (path, &size) in layout.files.iter().zip(&layout.file_sizes) {
            let file = File::open(path).map_err(|err| WeightsError::Io { file: path.clone(), err })?;
            // SAFETY: the checkpoint is read-only input; m3c never writes to it.
            // Its size is checked against the headers below, so every range
            // read through the map lies inside it while the file is unchanged.
            let map = unsafe { Mmap::map(&file) }.map_err(|err| WeightsError::Io { file: path.clone(), err })?;
            if map.len() as u64 != size {
                return Err(WeightsError::Header {
                    file: path.clone(),
                    message: format!("changed size while being read ({size} → {} bytes)", map.len()),
                });
            }
            shards.push(Shard { path: path.clone(), map });
        }
        let tensors = layout
            .tensors
            .into_iter()
            .map(|(name, t)| {
                let e = TensorEntry {
                    name: name.clone(),
                    dtype: t.dtype,
                    shape: t.shape,
                    shard: t.file,
                    range: (t.start as usize, t.end as usize),
                };
                (name, e)
            })
            .collect();
        Ok(Checkpoint { dir: dir.to_path_buf(), shards, tensors })
    }

    /// The raw little-endian bytes of a tensor (a view into the mapped file).
    pub fn bytes(&self, e: &TensorEntry) -> &[u8] {
        &self.shards[e.shard].map[e.range.0..e.range.1]
    }

    pub fn file_of(&self, e: &TensorEntry) -> &Path {
        &self.shards[e.shard].path
    }

    /// Total bytes of tensor data by element type.
    pub fn bytes_by_dtype(&self) -> BTreeMap<DType, u64> {
        let mut m = BTreeMap::new();
        for e in self.tensors.values() {
            *m.entry(e.dtype).or_insert(0) += (e.range.1 - e.range.0) as u64;
        }
        m
    }
}
