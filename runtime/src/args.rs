//! Command-line arguments of a stage executable (every rank gets the same).

use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct RunArgs {
    /// The checkpoint folder; `None` with `--synthetic-weights`.
    pub model: Option<PathBuf>,
    /// Random weights of the compiled shapes instead of a checkpoint (for
    /// timing real-size layers without their files).
    pub synthetic_seed: Option<u64>,
    /// A golden file (the fixtures' tensor names) the last stage compares its results with.
    pub expect: Option<PathBuf>,
    pub prompts: Vec<Vec<i64>>,
    pub max_new_tokens: usize,
    pub dump: Option<PathBuf>,
    /// Seconds a rank waits for a message before it gives up.
    pub timeout_s: f64,
    /// Sequences per micro-batch (default: the prompts shared over the stages).
    pub micro_batch: Option<usize>,
    /// Prefill prompts in chunks of this many tokens.
    pub prefill_chunk: Option<usize>,
    /// CUDA stages: replay each decode micro-batch's step as a captured CUDA graph.
    pub cuda_graphs: bool,
    /// CUDA stages: prefill linears with bf16 or MXFP8 weights on cuBLAS (tensor cores).
    pub prefill_gemm_cublas: bool,
    /// Print each generated id as it arrives (`m3c-id SEQ ID`) instead of
    /// every prompt's ids at the end: what `m3c run` reads to stream text.
    pub stream_ids: bool,
    /// How the last stage picks each token (greedy by default).
    pub sampling: SamplingParams,
    /// Ids that end a sequence (after being emitted); empty: none.
    pub eos_ids: Vec<i64>,
    /// Byte strings that end a sequence once its generated text holds one
    /// (given in hex, so any bytes survive the command line).
    pub stops: Vec<Vec<u8>>,
    /// Per-sequence sampling that differs from `sampling` (a `--prompts`
    /// JSONL line's own settings).
    pub seq_sampling: Vec<(usize, SamplingParams)>,
    /// Serve requests that arrive on the first stage's standard input
    /// (`m3c serve`) instead of running a fixed set of prompts.
    pub serve: bool,
    /// The images of the prompts (`m3c_contract::images`), read by the stage
    /// that encodes them.
    pub images: Option<PathBuf>,
}

impl RunArgs {
    /// The sampling of sequence `seq`.
    pub fn sampling_for(&self, seq: usize) -> &SamplingParams {
        self.seq_sampling.iter().rev().find(|(s, _)| *s == seq).map_or(&self.sampling, |(_, p)| p)
    }
}

/// Seconds without a heartbeat before a peer counts as lost.
pub const DEFAULT_TIMEOUT_S: f64 = 30.0;

pub const USAGE: &str = "usage: stage-K (--model DIR | --synthetic-weights SEED) ((--prompt-ids 1,2,3 [--prompt-ids ...] | --prompts FILE) \
--max-new-tokens N | --serve) [--micro-batch SEQS] [--prefill-chunk TOKENS] [--dump FILE.safetensors] [--expect GOLDEN.safetensors] [--timeout-s S] [--cuda-graphs on|off] [--prefill-gemm cublas|off] [--stream-ids] \
[--temperature T] [--top-k K] [--top-p P] [--min-p P] [--repetition-penalty R] [--seed S] [--eos-ids 1,2] [--stop HEX ...] [--seq-sampling SEQ:T:K:P:MINP:R:SEED ...] [--images FILE.safetensors]";

use crate::error::StageError;
use m3c_contract::prompts::{parse_count, parse_ids, parse_number, parse_prompts_file, parse_timeout_s};
use m3c_contract::sampling::SamplingParams;

/// `SEQ:T:K:P:MINP:R:SEED`, one sequence's sampling.
fn parse_seq_sampling(v: &str) -> Result<(usize, SamplingParams), String> {
    let bad = |what: &str| format!("--seq-sampling `{v}`: {what}; expected SEQ:T:K:P:MINP:R:SEED");
    let f: Vec<&str> = v.split(':').collect();
    if f.len() != 7 {
        return Err(bad("not seven fields"));
    }
    let num = |i: usize| parse_number(f[i], "--seq-sampling");
    let p = SamplingParams {
        temperature: num(1)?,
        top_k: parse_count(f[2], "--seq-sampling top-k", false)?,
        top_p: num(3)?,
        min_p: num(4)?,
        repetition_penalty: num(5)?,
        seed: f[6].parse::<u64>().map_err(|_| bad("the seed is not an integer"))?,
    };
    p.check().map_err(|e| bad(&e))?;
    Ok((parse_count(f[0], "--seq-sampling sequence", false)?, p))
}

/// A stop string's bytes from hex (`0a0a` for "\n\n").
fn parse_hex(v: &str) -> Result<Vec<u8>, String> {
    let bad = || format!("--stop: `{v}` is not a non-empty even-length hex string");
    if v.is_empty() || !v.len().is_multiple_of(2) || v.len() > 2048 {
        return Err(bad());
    }
    (0..v.len()).step_by(2).map(|i| v.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()).ok_or_else(bad)).collect()
}

/// Parses the stage arguments.
pub fn parse(args: &[String]) -> Result<RunArgs, StageError> {
    parse_args(args).map_err(StageError::Args)
}

fn parse_args(args: &[String]) -> Result<RunArgs, String> {
    let mut model = None;
    let mut prompts = Vec::new();
    let mut prompts_file = None;
    let mut max_new = None;
    let mut dump = None;
    let mut expect = None;
    let mut synthetic_seed = None;
    let mut timeout_s = DEFAULT_TIMEOUT_S;
    let mut micro_batch = None;
    let mut prefill_chunk = None;
    let mut cuda_graphs = true;
    let mut prefill_gemm_cublas = false;
    let mut stream_ids = false;
    let mut sampling = SamplingParams::GREEDY;
    let mut eos_ids = Vec::new();
    let mut stops = Vec::new();
    let mut seq_sampling = Vec::new();
    let mut serve = false;
    let mut images = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value; {USAGE}"));
        match a.as_str() {
            "--model" => model = Some(PathBuf::from(value("--model")?)),
            "--prompt-ids" => prompts.push(parse_ids(&value("--prompt-ids")?, "--prompt-ids")?),
            "--prompts" => prompts_file = Some(PathBuf::from(value("--prompts")?)),
            "--max-new-tokens" => max_new = Some(parse_count(&value("--max-new-tokens")?, "--max-new-tokens", false)?),
            "--dump" => dump = Some(PathBuf::from(value("--dump")?)),
            "--expect" => expect = Some(PathBuf::from(value("--expect")?)),
            "--prefill-chunk" => prefill_chunk = Some(parse_count(&value("--prefill-chunk")?, "--prefill-chunk", true)?),
            "--micro-batch" => micro_batch = Some(parse_count(&value("--micro-batch")?, "--micro-batch", true)?),
            "--synthetic-weights" => {
                let v = value("--synthetic-weights")?;
                synthetic_seed = Some(v.parse::<u64>().map_err(|_| format!("--synthetic-weights: `{v}` is not a seed (an integer)"))?);
            }
            "--timeout-s" => timeout_s = parse_timeout_s(&value("--timeout-s")?)?,
            "--cuda-graphs" => {
                cuda_graphs = match value("--cuda-graphs")?.as_str() {
                    "on" => true,
                    "off" => false,
                    v => return Err(format!("--cuda-graphs: `{v}` is not `on` or `off`")),
                }
            }
            "--prefill-gemm" => {
                prefill_gemm_cublas = match value("--prefill-gemm")?.as_str() {
                    "cublas" => true,
                    "off" => false,
                    v => return Err(format!("--prefill-gemm: `{v}` is not `cublas` or `off`")),
                }
            }
            "--stream-ids" => stream_ids = true,
            "--images" => images = Some(PathBuf::from(value("--images")?)),
            "--serve" => serve = true,
            "--temperature" => sampling.temperature = parse_number(&value("--temperature")?, "--temperature")?,
            "--top-k" => sampling.top_k = parse_count(&value("--top-k")?, "--top-k", false)?,
            "--top-p" => sampling.top_p = parse_number(&value("--top-p")?, "--top-p")?,
            "--min-p" => sampling.min_p = parse_number(&value("--min-p")?, "--min-p")?,
            "--repetition-penalty" => sampling.repetition_penalty = parse_number(&value("--repetition-penalty")?, "--repetition-penalty")?,
            "--seed" => {
                let v = value("--seed")?;
                sampling.seed =
                    v.trim().parse::<u64>().map_err(|_| format!("--seed: `{v}` is not a seed (an integer 0 to {})", u64::MAX))?;
            }
            "--eos-ids" => eos_ids = parse_ids(&value("--eos-ids")?, "--eos-ids")?,
            "--stop" => stops.push(parse_hex(&value("--stop")?)?),
            "--seq-sampling" => seq_sampling.push(parse_seq_sampling(&value("--seq-sampling")?)?),
            other => return Err(format!("unknown argument `{other}`; {USAGE}")),
        }
    }
    if let Some(f) = prompts_file {
        if !prompts.is_empty() {
            return Err("give --prompt-ids or --prompts, not both".into());
        }
        let text = m3c_contract::read_user_file(&f, "--prompts", m3c_contract::input::limits::PROMPTS).map_err(|e| e.to_string())?;
        prompts = parse_prompts_file(&text, &f.display().to_string())?;
    }
    sampling.check()?;
    if serve && (!prompts.is_empty() || max_new.is_some() || dump.is_some() || expect.is_some()) {
        return Err("--serve takes its prompts from the first stage's standard input: no --prompt-ids, --prompts, --max-new-tokens, --dump or --expect".into());
    }
    if prompts.is_empty() && !serve {
        return Err(format!("no prompt: give --prompt-ids or --prompts; {USAGE}"));
    }
    if model.is_none() && synthetic_seed.is_none() {
        return Err(format!("--model DIR is required; {USAGE}"));
    }
    if model.is_some() && synthetic_seed.is_some() {
        return Err("give --model or --synthetic-weights, not both".into());
    }
    Ok(RunArgs {
        model,
        synthetic_seed,
        expect,
        prompts,
        max_new_tokens: if serve { 0 } else { max_new.ok_or_else(|| format!("--max-new-tokens is required; {USAGE}"))? },
        dump,
        timeout_s,
        micro_batch,
        prefill_chunk,
        cuda_graphs,
        prefill_gemm_cublas,
        stream_ids,
        sampling,
        eos_ids,
        stops,
        seq_sampling,
        serve,
        images,
    })
}
