//! The stage's weights: found by name in the checkpoint (single file or
//! sharded with an index), checked against the compiled dtype and shape, and
//! memory-mapped one tensor at a time, so a stage maps only its own bytes.

use crate::error::StageError;
use crate::meta::StageMeta;
use m3c_contract::{CheckpointLayout, DType};
use memmap2::{Mmap, MmapOptions};
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

pub struct StageWeights {
    maps: Vec<Mmap>,
    /// Each mapping's address range and file, for naming a file that
    /// changes under the mapping (SIGBUS).
    pub regions: Vec<(usize, usize, std::path::PathBuf)>,
    /// Synthetic weights own their bytes.
    owned: Vec<Vec<u8>>,
    /// Pointer to each tensor's first element, in slot order.
    pub ptrs: Vec<*const u8>,
    /// Each tensor's size in bytes, in slot order.
    pub sizes: Vec<u64>,
    pub bytes: u64,
}

/// sha256 of `DIR/config.json`, which must equal the one OUT was compiled
/// from (the contract's check, which the front makes first).
pub fn check_config(dir: &Path, meta: &StageMeta) -> Result<(), StageError> {
    m3c_contract::manifest::check_config(dir, &meta.config_sha256).map_err(StageError::Weights)
}

/// Slot names of an EAGLE3 draft head's tensors start with this (the
/// compiler's `graph::draft::PREFIX`).
pub const DRAFT_PREFIX: &str = "draft/";

/// sha256 of the draft's `config.json`, which must equal the one its head
/// was compiled from (the contract's check, which the front also runs).
pub fn check_draft_config(dir: &Path, meta: &StageMeta) -> Result<(), StageError> {
    let Some(d) = &meta.draft else { return Ok(()) };
    m3c_contract::manifest::check_draft_config(dir, Some(&d.config_sha256)).map_err(StageError::Weights)
}

impl StageWeights {
    /// Finds, checks and maps every tensor of the stage: the target's from
    /// `dir`, an EAGLE3 draft head's (slots named `draft/…`) from `draft`,
    /// or, without one, none of the head's (its entries never run then:
    /// the stage decodes without speculation). All problems are reported
    /// together.
    pub fn open(dir: &Path, draft: Option<&Path>, meta: &StageMeta) -> Result<StageWeights, StageError> {
        // The contract's reader: exactly what `m3c inspect` accepts.
        let layout = CheckpointLayout::open(dir).map_err(|e| StageError::Weights(e.to_string()))?;
        let draft_layout = match (meta.draft.is_some(), draft) {
            (true, Some(d)) => Some(CheckpointLayout::open(d).map_err(|e| StageError::Weights(e.to_string()))?),
            _ => None,
        };
        let mut problems = Vec::new();
        let mut entries = Vec::new();
        for slot in &meta.tensors {
            let (layout, dir, name) = match (slot.name.strip_prefix(DRAFT_PREFIX), &draft_layout, draft) {
                (Some(n), Some(l), Some(d)) => (l, d, n),
                (Some(_), _, _) => {
                    entries.push(None);
                    continue;
                }
                _ => (&layout, dir, slot.name.as_str()),
            };
            let file = |t: &m3c_contract::TensorLocation| layout.files[t.file].display().to_string();
            match layout.tensors.get(name) {
                None => problems.push(format!("tensor `{name}` is missing from the checkpoint in {}", dir.display())),
                Some(e) if e.dtype != slot.dtype || e.shape != slot.shape => problems.push(format!(
                    "tensor `{}` in {} is {} {:?}; the stage was compiled for {} {:?}",
                    slot.name,
                    file(e),
                    e.dtype.safetensors_name(),
                    e.shape,
                    slot.dtype.safetensors_name(),
                    slot.shape
                )),
                Some(e) => entries.push(Some((layout, e))),
            }
        }
        if !problems.is_empty() {
            let n = problems.len();
            let shown: Vec<String> = problems.into_iter().take(20).collect();
            return Err(StageError::Weights(format!("{n} weight problem(s) for {}:\n  {}", meta.holds, shown.join("\n  "))));
        }
        let page = 4096u64;
        let mut maps = Vec::new();
        let mut ptrs = Vec::new();
        let mut sizes = Vec::new();
        let mut bytes = 0;
        let mut files: HashMap<std::path::PathBuf, File> = HashMap::new();
        for entry in entries {
            let Some((layout, e)) = entry else {
                ptrs.push(std::ptr::null());
                sizes.push(0);
                continue;
            };
            let path = &layout.files[e.file];
            let file = match files.get(path) {
                Some(f) => f,
                None => {
                    let f = File::open(path).map_err(|err| StageError::Weights(format!("{}: {err}", path.display())))?;
                    // The headers were checked against this size; a file
                    // changed since then is refused rather than mapped.
                    let now = f.metadata().map_err(|err| StageError::Weights(format!("{}: {err}", path.display())))?.len();
                    if now != layout.file_sizes[e.file] {
                        return Err(StageError::Weights(format!(
                            "{}: changed while the stage was starting ({} → {now} bytes)",
                            path.display(),
                            layout.file_sizes[e.file]
                        )));
                    }
                    files.entry(path.clone()).or_insert(f)
                }
            };
            let base = e.start / page * page;
            let len = (e.end - base).max(1) as usize;
            // SAFETY: a read-only private mapping of a range the checked
            // header places inside the file. A file truncated later makes a
            // read fault, which `liveness::watch_mappings` reports by name.
            let map = unsafe { MmapOptions::new().offset(base).len(len).map(file) }
                .map_err(|err| StageError::Weights(format!("{}: mmap: {err}", path.display())))?;
            // SAFETY: `e.start - base` < `len`, so the pointer is inside the mapping.
            ptrs.push(unsafe { map.as_ptr().add((e.start - base) as usize) });
            bytes += e.end - e.start;
            sizes.push(e.end - e.start);
            maps.push((map, path.clone()));
        }
        let regions = maps.iter().map(|(m, p)| (m.as_ptr() as usize, m.len(), p.clone())).collect();
        Ok(StageWeights { maps: maps.into_iter().map(|(m, _)| m).collect(), regions, owned: Vec::new(), ptrs, sizes, bytes })
    }

    pub fn mapped(&self) -> usize {
        self.maps.len() + self.owned.len()
    }

    /// Random weights of the compiled dtypes and shapes: small bf16/f32
    /// values, fp8 bytes that are never NaN, E8M0 scales of 2^-7..2^-4.
    /// For timing layers of the real size without their checkpoint.
    pub fn synthetic(meta: &StageMeta, seed: u64) -> StageWeights {
        let sizes: Vec<u64> = meta.tensors.iter().map(|t| (t.shape.iter().product::<usize>() * t.dtype.size_bytes()) as u64).collect();
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
                        fill(buf, meta.tensors[i].dtype, seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    }
                });
            }
        });
        let ptrs = owned.iter().map(|b| b.as_ptr()).collect();
        let bytes = sizes.iter().sum();
        StageWeights { maps: Vec::new(), regions: Vec::new(), owned, ptrs, sizes, bytes }
    }
}

fn fill(buf: &mut [u8], dtype: DType, seed: u64) {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match dtype {
        DType::BF16 => {
            for c in buf.chunks_exact_mut(2) {
                // ±[0, 0.03): sign, exponent 2^-8..2^-6, random mantissa.
                let r = next();
                let bits: u16 = (((r & 1) as u16) << 15) | ((119 + (r >> 1) % 3) as u16) << 7 | ((r >> 8) & 0x7F) as u16;
                c.copy_from_slice(&bits.to_le_bytes());
            }
        }
        DType::F32 => {
            for c in buf.chunks_exact_mut(4) {
                let r = next();
                let v = ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.06;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F8E4M3 => {
            for b in buf.iter_mut() {
                let r = next();
                *b = ((r & 0x80) as u8) | ((r >> 8) % 0x7F) as u8;
            }
        }
        DType::U8 => {
            for b in buf.iter_mut() {
                *b = 120 + (next() % 4) as u8;
            }
        }
        _ => {}
    }
}

/// The bytes of every token id, from the checkpoint's `tokenizer.json`.
pub(crate) fn load_token_bytes(model: Option<&std::path::Path>) -> Result<Vec<Vec<u8>>, String> {
    let dir = model.ok_or("stop strings need --model DIR with a tokenizer.json")?;
    let file = dir.join("tokenizer.json");
    let json = m3c_contract::read_user_file(&file, "tokenizer", m3c_contract::input::limits::TOKENIZER)
        .map_err(|e| format!("stop strings: {e}"))?;
    m3c_contract::token_bytes::byte_level_table(&json).map_err(|e| format!("stop strings: {}: {e}", file.display()))
}
