//! The stage's weights: found by name in the checkpoint (single file or
//! sharded with an index), checked against the compiled dtype and shape, and
//! memory-mapped one tensor at a time, so a stage maps only its own bytes.

use crate::meta::StageMeta;
use memmap2::{Mmap, MmapOptions};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

pub struct StageWeights {
    maps: Vec<Mmap>,
    /// Synthetic weights own their bytes.
    owned: Vec<Vec<u8>>,
    /// Pointer to each tensor's first element, in slot order.
    pub ptrs: Vec<*const u8>,
    /// Each tensor's size in bytes, in slot order.
    pub sizes: Vec<u64>,
    pub bytes: u64,
}

struct Entry {
    file: PathBuf,
    dtype: String,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    start: u64,
    end: u64,
}

fn read_header(path: &Path) -> Result<BTreeMap<String, Entry>, String> {
    let bad = |m: String| format!("{}: not a safetensors file: {m}", path.display());
    let mut f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let size = f.metadata().map_err(|e| format!("{}: {e}", path.display()))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| bad("shorter than 8 bytes".into()))?;
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 || 8 + n > size {
        return Err(bad(format!("header length {n} does not fit the file ({size} bytes)")));
    }
    let mut h = vec![0u8; n as usize];
    f.read_exact(&mut h).map_err(|e| bad(e.to_string()))?;
    let v: serde_json::Value = serde_json::from_slice(&h).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| bad("header is not an object".into()))?;
    let mut out = BTreeMap::new();
    for (name, t) in obj {
        if name == "__metadata__" {
            continue;
        }
        let dtype = t.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad(format!("{name}: no dtype")))?;
        let shape = t
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| bad(format!("{name}: no shape")))?;
        let off = t
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| Some((a.first()?.as_u64()?, a.get(1)?.as_u64()?)))
            .ok_or_else(|| bad(format!("{name}: no data_offsets")))?;
        let (start, end) = (8 + n + off.0, 8 + n + off.1);
        if start > end || end > size {
            return Err(bad(format!("{name}: data_offsets {:?} run past the end of the file", off)));
        }
        out.insert(name.clone(), Entry { file: path.to_path_buf(), dtype: dtype.to_string(), shape, start, end });
    }
    Ok(out)
}

fn dtype_size(d: &str) -> usize {
    match d {
        "F64" | "I64" => 8,
        "F32" | "I32" => 4,
        "BF16" | "F16" => 2,
        _ => 1,
    }
}

/// sha256 of `DIR/config.json`, which must equal the one OUT was compiled from.
pub fn check_config(dir: &Path, meta: &StageMeta) -> Result<(), String> {
    let cfg = dir.join("config.json");
    let bytes = std::fs::read(&cfg).map_err(|e| format!("--model {}: cannot read {} ({e})", dir.display(), cfg.display()))?;
    let hash = hex(&Sha256::digest(&bytes));
    if hash != meta.config_sha256 {
        return Err(format!(
            "--model {}: {} is not the config these stages were compiled from (sha256 {}…, compiled for {}…); \
             recompile with `m3c compile --model {}` or pass the model folder it was compiled for",
            dir.display(),
            cfg.display(),
            &hash[..12],
            &meta.config_sha256[..12.min(meta.config_sha256.len())],
            dir.display()
        ));
    }
    Ok(())
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn checkpoint_index(dir: &Path) -> Result<HashMap<String, Entry>, String> {
    let index = dir.join("model.safetensors.index.json");
    let single = dir.join("model.safetensors");
    let mut files: Vec<PathBuf> = Vec::new();
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| format!("{}: {e}", index.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| format!("{}: missing object `weight_map`", index.display()))?;
        for f in map.values().filter_map(|f| f.as_str()) {
            let p = dir.join(f);
            if !files.contains(&p) {
                files.push(p);
            }
        }
        files.sort();
    } else if single.is_file() {
        files.push(single);
    } else {
        return Err(format!(
            "--model {}: no weights (neither model.safetensors nor model.safetensors.index.json)",
            dir.display()
        ));
    }
    let mut all = HashMap::new();
    for f in files {
        if !f.is_file() {
            return Err(format!("{}: lists shard {}, which does not exist", index.display(), f.display()));
        }
        all.extend(read_header(&f)?);
    }
    Ok(all)
}

impl StageWeights {
    /// Finds, checks and maps every tensor of the stage. All problems are
    /// reported together.
    pub fn open(dir: &Path, meta: &StageMeta) -> Result<StageWeights, String> {
        let index = checkpoint_index(dir)?;
        let mut problems = Vec::new();
        let mut entries = Vec::new();
        for slot in &meta.tensors {
            match index.get(&slot.name) {
                None => problems.push(format!("tensor `{}` is missing from the checkpoint in {}", slot.name, dir.display())),
                Some(e) if e.dtype != slot.dtype || e.shape != slot.shape => problems.push(format!(
                    "tensor `{}` in {} is {} {:?}; the stage was compiled for {} {:?}",
                    slot.name,
                    e.file.display(),
                    e.dtype,
                    e.shape,
                    slot.dtype,
                    slot.shape
                )),
                Some(e) => {
                    let want = slot.shape.iter().product::<usize>() * dtype_size(&e.dtype);
                    if (e.end - e.start) as usize != want {
                        problems.push(format!("tensor `{}` in {}: {} bytes stored, {want} expected", slot.name, e.file.display(), e.end - e.start));
                    }
                    entries.push(e);
                }
            }
        }
        if !problems.is_empty() {
            let n = problems.len();
            let shown: Vec<String> = problems.into_iter().take(20).collect();
            return Err(format!("{n} weight problem(s) for {}:\n  {}", meta.holds, shown.join("\n  ")));
        }
        let page = 4096u64;
        let mut maps = Vec::new();
        let mut ptrs = Vec::new();
        let mut sizes = Vec::new();
        let mut bytes = 0;
        let mut files: HashMap<PathBuf, File> = HashMap::new();
        for e in entries {
            let file = match files.get(&e.file) {
                Some(f) => f,
                None => {
                    let f = File::open(&e.file).map_err(|err| format!("{}: {err}", e.file.display()))?;
                    files.entry(e.file.clone()).or_insert(f)
                }
            };
            let base = e.start / page * page;
            let len = (e.end - base).max(1) as usize;
            // SAFETY: read-only private mapping; the checkpoint must not be
            // modified while the stage runs (as with every mmap loader).
            let map = unsafe { MmapOptions::new().offset(base).len(len).map(file) }.map_err(|err| format!("{}: mmap: {err}", e.file.display()))?;
            ptrs.push(unsafe { map.as_ptr().add((e.start - base) as usize) });
            bytes += e.end - e.start;
            sizes.push(e.end - e.start);
            maps.push(map);
        }
        Ok(StageWeights { maps, owned: Vec::new(), ptrs, sizes, bytes })
    }

    pub fn mapped(&self) -> usize {
        self.maps.len() + self.owned.len()
    }

    /// Random weights of the compiled dtypes and shapes: small bf16/f32
    /// values, fp8 bytes that are never NaN, E8M0 scales of 2^-7..2^-4.
    /// For timing layers of the real size without their checkpoint.
    pub fn synthetic(meta: &StageMeta, seed: u64) -> StageWeights {
        let sizes: Vec<u64> = meta.tensors.iter().map(|t| (t.shape.iter().product::<usize>() * dtype_size(&t.dtype)) as u64).collect();
        let mut owned: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n as usize]).collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let chunks: Vec<(usize, &mut Vec<u8>)> = owned.iter_mut().enumerate().collect();
        let per = chunks.len().div_ceil(threads).max(1);
        let mut rest = chunks;
        std::thread::scope(|s| {
            while !rest.is_empty() {
                let take = per.min(rest.len());
                let batch: Vec<(usize, &mut Vec<u8>)> = rest.drain(..take).collect();
                s.spawn(move || {
                    for (i, buf) in batch {
                        fill(buf, &meta.tensors[i].dtype, seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    }
                });
            }
        });
        let ptrs = owned.iter().map(|b| b.as_ptr()).collect();
        let bytes = sizes.iter().sum();
        StageWeights { maps: Vec::new(), owned, ptrs, sizes, bytes }
    }
}

fn fill(buf: &mut [u8], dtype: &str, seed: u64) {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match dtype {
        "BF16" => {
            for c in buf.chunks_exact_mut(2) {
                // ±[0, 0.03): sign, exponent 2^-8..2^-6, random mantissa.
                let r = next();
                let bits: u16 = (((r & 1) as u16) << 15) | ((119 + (r >> 1) % 3) as u16) << 7 | ((r >> 8) & 0x7F) as u16;
                c.copy_from_slice(&bits.to_le_bytes());
            }
        }
        "F32" => {
            for c in buf.chunks_exact_mut(4) {
                let r = next();
                let v = ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.06;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        "F8_E4M3" => {
            for b in buf.iter_mut() {
                let r = next();
                *b = ((r & 0x80) as u8) | ((r >> 8) % 0x7F) as u8;
            }
        }
        "U8" => {
            for b in buf.iter_mut() {
                *b = 120 + (next() % 4) as u8;
            }
        }
        _ => {}
    }
}
