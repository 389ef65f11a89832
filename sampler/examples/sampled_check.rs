//! Checks a device sampler on the device's own logits: reads a stage
//! `--dump` (prompt_ids, prefill_logits, decode_logits, generated_ids) of a
//! sampled run and replays every draw with the host sampler. Used by
//! `scripts/gpu-check.sh`; exit status 1 when any id differs.
//!
//!     sampled_check DUMP.safetensors TEMPERATURE TOP_K TOP_P MIN_P PENALTY SEED

use m3c_contract::sampling::SamplingParams;
use m3c_sampler::replay_mismatches;

fn tensor(bytes: &[u8], name: &str) -> Result<(Vec<usize>, Vec<u8>), String> {
    let n = u64::from_le_bytes(bytes.get(..8).ok_or("not a safetensors file")?.try_into().map_err(|_| "header")?) as usize;
    let header: serde_json::Value = serde_json::from_slice(bytes.get(8..8 + n).ok_or("truncated header")?).map_err(|e| e.to_string())?;
    let t = &header[name];
    let shape: Vec<usize> =
        t["shape"].as_array().ok_or(format!("no tensor {name}"))?.iter().filter_map(|v| v.as_u64().map(|v| v as usize)).collect();
    let (s, e) = (t["data_offsets"][0].as_u64().unwrap_or(0) as usize, t["data_offsets"][1].as_u64().unwrap_or(0) as usize);
    Ok((shape, bytes.get(8 + n + s..8 + n + e).ok_or("truncated data")?.to_vec()))
}

fn main() -> Result<(), String> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 8 {
        return Err("usage: sampled_check DUMP T K P MIN_P R SEED".into());
    }
    let bytes = std::fs::read(&a[1]).map_err(|e| format!("{}: {e}", a[1]))?;
    let num = |i: usize| a[i].parse::<f32>().map_err(|_| format!("`{}` is not a number", a[i]));
    let p = SamplingParams {
        temperature: num(2)?,
        top_k: a[3].parse().map_err(|_| "top-k")?,
        top_p: num(4)?,
        min_p: num(5)?,
        repetition_penalty: num(6)?,
        seed: a[7].parse().map_err(|_| "seed")?,
        ..SamplingParams::GREEDY
    };
    let ints = |b: Vec<u8>| b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as u32).collect::<Vec<u32>>();
    let floats = |b: Vec<u8>| b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap_or([0; 4]))).collect::<Vec<f32>>();
    let prompt = ints(tensor(&bytes, "prompt_ids")?.1);
    let generated = ints(tensor(&bytes, "generated_ids")?.1);
    let (pshape, prefill) = tensor(&bytes, "prefill_logits")?;
    let vocab = *pshape.last().ok_or("prefill_logits has no shape")?;
    let mut rows = floats(prefill).split_off((pshape[0] - 1) * vocab);
    rows.extend(floats(tensor(&bytes, "decode_logits")?.1));
    let bad = replay_mismatches(&prompt, &rows, vocab, &generated, &p);
    println!("device sampler: {}/{} ids equal the host sampler's on the device's logits", generated.len() - bad.len(), generated.len());
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("the draws at steps {bad:?} differ"))
    }
}
