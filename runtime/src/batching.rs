//! How the first stage batches and speculates: the engine's knobs, as
//! `m3c run` and `m3c serve` set them.

use crate::args::RunArgs;
use m3c_engine::speculate::{eagle3::Eagle3Proposer, ngram::NgramProposer, Speculator};

/// How the scheduler batches (the engine's knobs a run or serve sets).
pub(crate) struct Batching {
    pub per_batch: usize,
    pub chunk: usize,
    pub eos: Vec<i64>,
    /// One more step after each sequence's last token, for the run's dump
    /// or `--expect` (which then computes every row).
    pub score_last: bool,
    pub prefix_caching: bool,
    /// Blocks stored and evicted reported as events (`--kv-events`).
    pub kv_events: bool,
    /// Speculative decoding, as the run asks ([`speculator`]).
    pub spec: Option<Speculator>,
    /// How images and videos are encoded (beside the loop, the cache).
    pub encoder: m3c_contract::stage_args::EncoderOptions,
}

/// The speculation a run asks for: prompt lookup, or the last stage's
/// EAGLE3 head (whose proposals come back with each step's ids).
pub(crate) fn speculator(args: &RunArgs) -> Option<Speculator> {
    let mut s = match (args.speculative, args.eagle3.as_ref()) {
        (Some(n), _) => Speculator::new(Box::new(NgramProposer { config: n }), n.disable_by_batch_size),
        (None, Some(e)) => Speculator::new(Box::new(Eagle3Proposer::new(e.tokens)), e.disable_by_batch_size),
        (None, None) => return None,
    };
    // Benchmark hook (documented in ARCHITECTURE.md): every decode step
    // drafts K, as vLLM does, to measure the cost model against.
    s.fixed = std::env::var("M3C_SPEC_FIXED_K").ok().and_then(|k| k.parse().ok());
    Some(s)
}
