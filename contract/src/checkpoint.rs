//! The one safetensors checkpoint reader of m3c: `m3c inspect`, `m3c run`'s
//! stages and the weight binder all see a checkpoint through it, so a file
//! the compiler rejects is never accepted by a stage (and the reverse).
//!
//! It reads headers only (the data is mapped later, by whoever needs it) and
//! checks everything a reader could trip on: the header length against the
//! file, a JSON object with no key twice, a known element type, a shape whose
//! byte size does not overflow, and data offsets that tile the data section
//! exactly (sorted, no gap, no overlap, ending where the file ends). A shard
//! index must name plain files inside the checkpoint folder.

use crate::dtype::DType;
use crate::input::{self, limits, InputError};
use crate::unique_map::{duplicate_key, UniqueMap};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";
/// safetensors' own bound on the JSON header.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot read {file}: {err}")]
    Io { file: PathBuf, err: std::io::Error },
    #[error(transparent)]
    Input(#[from] InputError),
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

/// One tensor of a safetensors header, its offsets relative to the data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub start: u64,
    pub end: u64,
}

/// Why a header is not valid, before it is tied to a file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderProblem {
    Invalid(String),
    Dtype { tensor: String, dtype: String },
}

/// Parses and checks a safetensors JSON header whose data section is
/// `data_len` bytes long. Tensors come back sorted by name.
pub fn parse_header(json: &[u8], data_len: u64) -> Result<Vec<HeaderTensor>, HeaderProblem> {
    let bad = |m: String| HeaderProblem::Invalid(m);
    let map: UniqueMap = serde_json::from_slice(json).map_err(|e| {
        let m = e.to_string();
        match duplicate_key(&m) {
            Some(k) => bad(format!("the header names `{k}` twice")),
            None => bad(format!("the header is not a JSON object: {m}")),
        }
    })?;
    let mut out = Vec::with_capacity(map.0.len());
    for (name, t) in map.0 {
        if name == "__metadata__" {
            match t.as_object() {
                Some(o) if o.values().all(|v| v.is_string()) => continue,
                _ => return Err(bad("`__metadata__` must map strings to strings".into())),
            }
        }
        let obj = t.as_object().ok_or_else(|| bad(format!("`{name}`: expected an object with dtype, shape and data_offsets")))?;
        let dtype_name = obj.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad(format!("`{name}`: no string `dtype`")))?;
        let dtype = DType::from_safetensors_name(dtype_name)
            .ok_or_else(|| HeaderProblem::Dtype { tensor: name.clone(), dtype: dtype_name.into() })?;
        let shape: Vec<usize> = obj
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok())).collect::<Option<Vec<_>>>())
            .ok_or_else(|| bad(format!("`{name}`: `shape` must be a list of non-negative integers")))?;
        let offsets = obj
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
            .ok_or_else(|| bad(format!("`{name}`: `data_offsets` must be two non-negative integers")))?;
        let bytes = shape
            .iter()
            .try_fold(dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(|| bad(format!("`{name}`: shape {shape:?} is too large")))?;
        let (start, end) = offsets;
        if end < start || end - start != bytes {
            return Err(bad(format!(
                "tensor `{name}` has byte range {start}..{end}, which does not fit its shape {shape:?} of {dtype} ({bytes} bytes)"
            )));
        }
        out.push(HeaderTensor { name, dtype, shape, start, end });
    }
    // The data ranges must tile the data section: sorted by start, each
    // beginning where the previous ended, the last ending at the file's end.
    let mut by_start: Vec<&HeaderTensor> = out.iter().collect();
    by_start.sort_by_key(|t| (t.start, t.end));
    let mut at = 0u64;
    for t in &by_start {
        if t.start != at {
            return Err(bad(if t.start < at {
                format!("tensor `{}` at bytes {}..{} overlaps the tensor before it (which ends at {at})", t.name, t.start, t.end)
            } else {
                format!("a gap of {} bytes before tensor `{}` at byte {}", t.start - at, t.name, t.start)
            }));
        }
        at = t.end;
    }
    if at != data_len {
        return Err(bad(format!("the tensors cover {at} bytes of data, but the file holds {data_len}")));
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The header length, header and data length of a safetensors file, read
/// from its first bytes (the data is not read).
pub fn read_header(path: &Path) -> Result<(u64, Vec<HeaderTensor>), CheckpointError> {
    let size = input::regular_file(path, "weights")?;
    let bad = |message: String| CheckpointError::Header { file: path.to_path_buf(), message };
    let io = |err| CheckpointError::Io { file: path.to_path_buf(), err };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut n = [0u8; 8];
    if size < 8 {
        return Err(bad(format!("{size} bytes, shorter than the 8-byte header length")));
    }
    f.read_exact(&mut n).map_err(io)?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER_BYTES || n > size - 8 {
        return Err(bad(format!("header length {n} does not fit the file ({size} bytes)")));
    }
    let mut h = vec![0u8; n as usize];
    f.read_exact(&mut h).map_err(io)?;
    let tensors = parse_header(&h, size - 8 - n).map_err(|p| match p {
        HeaderProblem::Invalid(m) => bad(m),
        HeaderProblem::Dtype { tensor, dtype } => CheckpointError::UnsupportedDtype { file: path.to_path_buf(), tensor, dtype },
    })?;
    Ok((8 + n, tensors))
}

/// Parses a shard index: tensor name → shard file name, in file order.
/// Every entry must be a string naming a plain file (no folder part, no
/// `..`), so an index can never point outside its checkpoint folder.
pub fn parse_index(text: &str) -> Result<Vec<(String, String)>, String> {
    let root: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let map = root.as_object().and_then(|o| o.get("weight_map")).ok_or("missing object `weight_map` (tensor name → shard file)")?;
    // Read `weight_map` again with duplicates refused.
    let entries: UniqueMap = serde_json::from_value(map.clone()).map_err(|e| {
        let m = e.to_string();
        match duplicate_key(&m) {
            Some(k) => format!("weight_map lists tensor `{k}` twice"),
            None => format!("`weight_map` must be an object (tensor name → shard file): {m}"),
        }
    })?;
    // serde_json::Value already merged duplicate keys; find them in the text.
    if let Some(k) = duplicate_in_weight_map(text) {
        return Err(format!("weight_map lists tensor `{k}` twice"));
    }
    let mut out = Vec::with_capacity(entries.0.len());
    for (tensor, file) in entries.0 {
        let file = file.as_str().ok_or_else(|| format!("weight_map.{tensor}: expected a shard file name, found {file}"))?;
        if !is_plain_file_name(file) {
            return Err(format!("weight_map.{tensor}: shard `{file}` must be a file name inside the checkpoint folder"));
        }
        out.push((tensor, file.to_string()));
    }
    Ok(out)
}

/// The first tensor named twice inside the top-level `weight_map` of an
/// index (a second parse with a visitor that keeps every key).
fn duplicate_in_weight_map(text: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Index {
        #[serde(rename = "weight_map")]
        _weight_map: UniqueMap,
    }
    match serde_json::from_str::<Index>(text) {
        Err(e) => duplicate_key(&e.to_string()).map(str::to_string),
        Ok(_) => None,
    }
}

/// A file name with no folder part: what an index may name.
pub fn is_plain_file_name(f: &str) -> bool {
    !f.is_empty() && f != "." && f != ".." && !f.contains('/') && !f.contains('\\') && !f.contains('\0')
}

/// Where one tensor's bytes are: file number, absolute byte range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLocation {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Index into [`CheckpointLayout::files`].
    pub file: usize,
    /// Absolute byte range in that file.
    pub start: u64,
    pub end: u64,
}

/// A checkpoint folder as headers: its files and every tensor by name.
#[derive(Debug)]
pub struct CheckpointLayout {
    pub dir: PathBuf,
    /// The safetensors files, sorted by name.
    pub files: Vec<PathBuf>,
    /// Each file's size when its header was read.
    pub file_sizes: Vec<u64>,
    /// The index file, for a sharded checkpoint.
    pub index: Option<PathBuf>,
    pub tensors: BTreeMap<String, TensorLocation>,
}

impl CheckpointLayout {
    /// Reads `dir/model.safetensors.index.json` and its shards when the index
    /// exists, else `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<CheckpointLayout, CheckpointError> {
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let mut ck =
            CheckpointLayout { dir: dir.to_path_buf(), files: Vec::new(), file_sizes: Vec::new(), index: None, tensors: BTreeMap::new() };
        if std::fs::symlink_metadata(&index).is_ok() {
            ck.open_sharded(&index)?;
        } else if std::fs::symlink_metadata(&single).is_ok() {
            ck.add_file(&single)?;
        } else {
            return Err(CheckpointError::NoWeights { dir: dir.to_path_buf() });
        }
        Ok(ck)
    }

    fn open_sharded(&mut self, index: &Path) -> Result<(), CheckpointError> {
        let text = input::read_user_file(index, "shard index", limits::INDEX)?;
        let listed = parse_index(&text).map_err(|message| CheckpointError::Index { file: index.to_path_buf(), message })?;
        self.index = Some(index.to_path_buf());
        // Shards by name, so that file numbering is stable.
        let mut files: Vec<&str> = listed.iter().map(|(_, f)| f.as_str()).collect();
        files.sort_unstable();
        files.dedup();
        for f in files {
            let path = self.dir.join(f);
            if std::fs::symlink_metadata(&path).is_err() {
                let tensor = listed.iter().find(|(_, v)| v == f).map(|(k, _)| k.clone()).unwrap_or_default();
                return Err(CheckpointError::MissingShard { index: index.into(), tensor, shard: f.into() });
            }
            self.add_file(&path)?;
        }
        for (tensor, file) in &listed {
            let path = self.dir.join(file);
            match self.tensors.get(tensor) {
                Some(e) if self.files[e.file] == path => {}
                _ => return Err(CheckpointError::NotInShard { index: index.into(), tensor: tensor.clone(), listed: path }),
            }
        }
        Ok(())
    }

    fn add_file(&mut self, path: &Path) -> Result<(), CheckpointError> {
        let (data_start, header) = read_header(path)?;
        let size = std::fs::metadata(path).map_err(|err| CheckpointError::Io { file: path.into(), err })?.len();
        let file = self.files.len();
        for t in header {
            if let Some(prev) = self.tensors.get(&t.name) {
                return Err(CheckpointError::Duplicate { tensor: t.name, first: self.files[prev.file].clone(), second: path.into() });
            }
            let loc = TensorLocation {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape,
                file,
                start: data_start + t.start,
                end: data_start + t.end,
            };
            self.tensors.insert(t.name, loc);
        }
        self.files.push(path.to_path_buf());
        self.file_sizes.push(size);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(entries: &[(&str, &str, &[usize], u64, u64)]) -> Vec<u8> {
        let mut m = serde_json::Map::new();
        for (n, d, s, a, b) in entries {
            m.insert(n.to_string(), serde_json::json!({"dtype": d, "shape": s, "data_offsets": [a, b]}));
        }
        serde_json::to_vec(&m).unwrap()
    }

    #[test]
    fn valid_headers_parse_and_damaged_ones_are_named() {
        let h = header(&[("a", "F32", &[2], 0, 8), ("b", "BF16", &[3], 8, 14)]);
        let t = parse_header(&h, 14).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!((t[1].start, t[1].end), (8, 14));
        // Overlap, gap, wrap, short data, wrong size.
        let over = header(&[("a", "F32", &[2], 0, 8), ("b", "F32", &[2], 4, 12)]);
        assert!(matches!(parse_header(&over, 12), Err(HeaderProblem::Invalid(m)) if m.contains("overlaps")));
        let gap = header(&[("a", "F32", &[2], 4, 12)]);
        assert!(matches!(parse_header(&gap, 12), Err(HeaderProblem::Invalid(m)) if m.contains("gap")));
        let wrap = header(&[("a", "F32", &[2], u64::MAX - 3, 4)]);
        assert!(parse_header(&wrap, 8).is_err());
        let short = header(&[("a", "F32", &[2], 0, 8)]);
        assert!(matches!(parse_header(&short, 16), Err(HeaderProblem::Invalid(m)) if m.contains("holds 16")));
        let huge = header(&[("a", "F32", &[usize::MAX, 4], 0, 8)]);
        assert!(matches!(parse_header(&huge, 8), Err(HeaderProblem::Invalid(m)) if m.contains("too large")));
        let dup = br#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}"#;
        assert!(matches!(parse_header(dup, 8), Err(HeaderProblem::Invalid(m)) if m.contains("`a` twice")));
        let odd = header(&[("a", "F8_E5M2", &[2], 0, 2)]);
        assert!(matches!(parse_header(&odd, 2), Err(HeaderProblem::Dtype { .. })));
    }

    #[test]
    fn index_entries_must_be_plain_strings_once() {
        assert_eq!(parse_index(r#"{"weight_map": {"a": "x.safetensors"}}"#).unwrap(), vec![("a".into(), "x.safetensors".into())]);
        for bad in [
            r#"{"weight_map": {"a": "../outside/evil.safetensors"}}"#,
            r#"{"weight_map": {"a": "/etc/passwd"}}"#,
            r#"{"weight_map": {"a": 3}}"#,
            r#"{"weight_map": {"a": "x", "a": "y"}}"#,
            r#"{"weight_map": []}"#,
            r#"{"weights": {}}"#,
        ] {
            assert!(parse_index(bad).is_err(), "{bad}");
        }
    }
}
