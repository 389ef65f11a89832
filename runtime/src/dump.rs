//! `--dump`: the last stage's logits and ids as safetensors, with the tensor
//! names of the fixtures' golden.safetensors.

use crate::error::StageError;
use std::path::{Path, PathBuf};

pub struct SeqRecord {
    pub prompt: Vec<i64>,
    pub prefill_logits: Vec<f32>,
    pub generated: Vec<i64>,
    pub decode_logits: Vec<f32>,
}

/// The dump file of prompt `i` of `n`: FILE itself for one prompt, else
/// `STEM.p{i}.EXT` (`out.safetensors` → `out.p0.safetensors`, ...).
pub fn dump_path(file: &Path, i: usize, n: usize) -> PathBuf {
    if n == 1 {
        return file.to_path_buf();
    }
    let stem = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match file.extension() {
        Some(ext) => format!("{stem}.p{i}.{}", ext.to_string_lossy()),
        None => format!("{stem}.p{i}"),
    };
    file.with_file_name(name)
}

pub fn write(path: &Path, r: &SeqRecord, vocab: usize) -> Result<(), StageError> {
    let le_i64 = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let le_f32 = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let tensors: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = vec![
        ("decode_logits", "F32", vec![r.decode_logits.len() / vocab, vocab], le_f32(&r.decode_logits)),
        ("generated_ids", "I64", vec![r.generated.len()], le_i64(&r.generated)),
        ("prefill_logits", "F32", vec![r.prefill_logits.len() / vocab, vocab], le_f32(&r.prefill_logits)),
        ("prompt_ids", "I64", vec![r.prompt.len()], le_i64(&r.prompt)),
    ];
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, dtype, shape, data) in &tensors {
        header.insert(name.to_string(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + data.len()]}));
        off += data.len();
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).map_err(|e| StageError::Output(e.to_string()))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + off);
    out.extend((h.len() as u64).to_le_bytes());
    out.extend(h);
    for (_, _, _, data) in tensors {
        out.extend(data);
    }
    check_target(path)?;
    // A name no other writer uses, beside the target, then a rename: the
    // target is whole or untouched, and nothing else is overwritten.
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
    let written = std::fs::write(&tmp, &out).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        std::fs::remove_file(&tmp).ok();
        return Err(StageError::Output(format!("--dump {}: {e}", path.display())));
    }
    Ok(())
}

/// Checks a dump target before any work: its folder exists, and what is
/// there now, if anything, is a regular file (a device, folder or symbolic
/// link is never replaced).
pub fn check_target(path: &Path) -> Result<(), StageError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(StageError::Output(format!("--dump {}: the folder {} does not exist", path.display(), dir.display())));
    }
    if path.file_name().is_none() {
        return Err(StageError::Output(format!("--dump {}: needs a file name", path.display())));
    }
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_file() {
            let kind = if m.file_type().is_symlink() { "a symbolic link" } else { m3c_contract::input::kind_of(&m) };
            return Err(StageError::Output(format!("--dump {}: is {kind}; m3c only replaces regular files", path.display())));
        }
    }
    Ok(())
}

/// `--expect GOLDEN`: compares a sequence's record with the golden file of
/// the fixtures (same tensor names). Returns the report line, or an error
/// when the tokens differ or a logit is off by more than `tol`.
pub fn check(golden: &Path, r: &SeqRecord, vocab: usize, tol: f32) -> Result<String, StageError> {
    let bytes = m3c_contract::input::read_bytes(golden, "--expect", 1 << 32).map_err(|e| StageError::Output(e.to_string()))?;
    let st =
        safetensors::SafeTensors::deserialize(&bytes).map_err(|e| StageError::Output(format!("--expect {}: {e}", golden.display())))?;
    let get = |name: &str| st.tensor(name).map_err(|_| StageError::Output(format!("--expect {}: no tensor `{name}`", golden.display())));
    let i64s = |name: &str| -> Result<Vec<i64>, StageError> {
        Ok(get(name)?.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect())
    };
    let f32s = |name: &str| -> Result<Vec<f32>, StageError> {
        Ok(get(name)?.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
    };
    if i64s("prompt_ids")? != r.prompt {
        return Err(StageError::Output(format!("--expect {}: its prompt_ids are not this run's prompt", golden.display())));
    }
    let max_diff = |a: &[f32], b: &[f32]| -> Result<f32, StageError> {
        if a.len() != b.len() {
            return Err(StageError::Output(format!("--expect: {} logits here, {} in the golden file (vocab {vocab})", a.len(), b.len())));
        }
        Ok(a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max))
    };
    let gen = i64s("generated_ids")?;
    let n = r.generated.len().min(gen.len());
    let dp = max_diff(&r.prefill_logits, &f32s("prefill_logits")?)?;
    let want_decode = f32s("decode_logits")?;
    let rows = (r.decode_logits.len() / vocab).min(want_decode.len() / vocab);
    let dd = max_diff(&r.decode_logits[..rows * vocab], &want_decode[..rows * vocab])?;
    let same = r.generated[..n] == gen[..n];
    let line = format!(
        "m3c check against {}: prefill max |Δ| {dp:.2e}, decode max |Δ| {dd:.2e} (tolerance {tol:.0e}), {n} generated ids {}",
        golden.display(),
        if same { "equal" } else { "DIFFER" }
    );
    if same && dp <= tol && dd <= tol {
        Ok(line)
    } else {
        Err(StageError::Output(line))
    }
}
