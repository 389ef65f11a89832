use crate::dtype::DType;
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("cannot read {file}: {err}")]
    Io { file: PathBuf, err: std::io::Error },
    #[error("{file}: not a valid safetensors file: {message}")]
    Header { file: PathBuf, message: String },
    #[error("{file}: not a valid shard index: {message}")]
    Index { file: PathBuf, message: String },
    #[error("{index}: tensor `{tensor}` is listed in shard {shard}, which does not exist")]
    MissingShard { index: PathBuf, tensor: String, shard: String },
    #[error("{index}: tensor `{tensor}` is listed in {listed}, but that file does not contain it")]
    NotInShard { index: PathBuf, tensor: String, listed: PathBuf },
    #[error("tensor `{tensor}` appears in both {first} and {second}")]
    Duplicate { tensor: String, first: PathBuf, second: PathBuf },
    #[error("{file}: tensor `{tensor}` has element type {dtype}, which m3c does not read")]
    UnsupportedDtype { file: PathBuf, tensor: String, dtype: String },
    #[error("{dir}: no {SINGLE_FILE} or {INDEX_FILE} (expected a Hugging Face checkpoint folder)")]
    NoWeights { dir: PathBuf },
}

/// One mapped `.safetensors` file.
pub struct Shard {
    pub path: PathBuf,
    map: Mmap,
    /// Byte offset of the data section (after the length and JSON header).
    data_start: usize,
}

/// Where one tensor's bytes live.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub shard: usize,
    /// Byte range inside the shard's data section.
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
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        if index.is_file() {
            Self::open_sharded(dir, &index)
        } else if single.is_file() {
            let mut ck = Checkpoint { dir: dir.to_path_buf(), shards: Vec::new(), tensors: BTreeMap::new() };
            ck.add_shard(&single)?;
            Ok(ck)
        } else {
            Err(WeightsError::NoWeights { dir: dir.to_path_buf() })
        }
    }

    fn open_sharded(dir: &Path, index: &Path) -> Result<Checkpoint, WeightsError> {
        let text = std::fs::read_to_string(index).map_err(|err| WeightsError::Io { file: index.into(), err })?;
        let bad = |message: String| WeightsError::Index { file: index.to_path_buf(), message };
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("missing object `weight_map` (tensor name → shard file)".into()))?;
        // Shard names, deduplicated and sorted so that shard numbering is stable.
        let mut listed: BTreeMap<String, String> = BTreeMap::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| bad(format!("weight_map.{tensor}: expected a file name")))?;
            if file.contains('/') || file.contains("..") {
                return Err(bad(format!("weight_map.{tensor}: shard `{file}` must be a file name inside {}", dir.display())));
            }
            listed.insert(tensor.clone(), file.to_string());
        }
        let mut files: Vec<&String> = listed.values().collect();
        files.sort();
        files.dedup();
        let mut ck = Checkpoint { dir: dir.to_path_buf(), shards: Vec::new(), tensors: BTreeMap::new() };
        for f in files {
            let path = dir.join(f);
            if !path.is_file() {
                let tensor = listed.iter().find(|(_, v)| *v == f).map(|(k, _)| k.clone()).unwrap_or_default();
                return Err(WeightsError::MissingShard { index: index.into(), tensor, shard: f.clone() });
            }
            ck.add_shard(&path)?;
        }
        for (tensor, file) in &listed {
            let path = dir.join(file);
            match ck.tensors.get(tensor) {
                Some(e) if ck.shards[e.shard].path == path => {}
                _ => return Err(WeightsError::NotInShard { index: index.into(), tensor: tensor.clone(), listed: path }),
            }
        }
        Ok(ck)
    }

    fn add_shard(&mut self, path: &Path) -> Result<(), WeightsError> {
        let file = File::open(path).map_err(|err| WeightsError::Io { file: path.into(), err })?;
        // SAFETY: the checkpoint is read-only input; m3c never writes to it, and
        // a concurrent writer is outside what any loader can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(|err| WeightsError::Io { file: path.into(), err })?;
        let header_err = |message: String| WeightsError::Header { file: path.to_path_buf(), message };
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map[..]).map_err(|e| header_err(e.to_string()))?;
        let data_start = 8 + header_len;
        let data_len = map.len() - data_start;
        let shard = self.shards.len();
        let mut names: Vec<(String, &safetensors::tensor::TensorInfo)> = meta.tensors().into_iter().collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, info) in names {
            let name = &name;
            let dtype = DType::from_safetensors(info.dtype).ok_or_else(|| WeightsError::UnsupportedDtype {
                file: path.into(),
                tensor: name.clone(),
                dtype: format!("{:?}", info.dtype),
            })?;
            let (start, end) = info.data_offsets;
            let numel: usize = info.shape.iter().product();
            if end > data_len || end < start || end - start != numel * dtype.size_bytes() {
                return Err(header_err(format!("tensor `{name}` has byte range {start}..{end}, which does not fit its shape {:?}", info.shape)));
            }
            let entry = TensorEntry { name: name.clone(), dtype, shape: info.shape.clone(), shard, range: (start, end) };
            if let Some(prev) = self.tensors.get(name) {
                return Err(WeightsError::Duplicate {
                    tensor: name.clone(),
                    first: self.shards[prev.shard].path.clone(),
                    second: path.into(),
                });
            }
            self.tensors.insert(name.clone(), entry);
        }
        self.shards.push(Shard { path: path.to_path_buf(), map, data_start });
        Ok(())
    }

    /// The raw little-endian bytes of a tensor (a view into the mapped file).
    pub fn bytes(&self, e: &TensorEntry) -> &[u8] {
        let s = &self.shards[e.shard];
        &s.map[s.data_start + e.range.0..s.data_start + e.range.1]
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
