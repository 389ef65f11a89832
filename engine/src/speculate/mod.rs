//! Speculative decoding: a [`Proposer`] guesses the tokens a sequence will
//! draw next, and a decode step verifies them all at once (K + 1 rows). A
//! draft token is kept only when it equals the draw plain decoding makes
//! at its position, so speculation changes no output; it changes only how
//! many steps a sequence takes, and what each costs.
//!
//! How many tokens to propose, zero included, is decided per micro-batch
//! by [`Speculator::lengths`] from what it measures while serving: the
//! seconds a step takes at each row count ([`cost::StepCost`]; on a
//! mixture of experts every verify row reads its own experts' weights, so
//! rows are far from free) and each sequence's acceptance (the chance a
//! draft token is kept, pooled over all sequences for a new one). Drafts
//! are added one at a time, most likely first, while the expected tokens
//! per second of the micro-batch rise; so a draft is made only where it
//! is expected to pay for its rows. What it has not measured yet (the
//! cost of more rows, a new sequence's acceptance) it tries, with the
//! proposer's full K, and then once in a while again, so a choice not to
//! speculate is revisited.
//!
//! A third method is one file: a type that implements [`Proposer`].

pub mod cost;
pub mod eagle3;
pub mod ngram;

use crate::plan::Ask;
use cost::StepCost;
use std::collections::BTreeMap;

/// A method of speculation.
pub trait Proposer: Send {
    /// vLLM's name of the method (`ngram`, `eagle3`).
    fn method(&self) -> &'static str;
    /// The most tokens it proposes for one step (vLLM's `num_speculative_tokens`).
    fn max_tokens(&self) -> usize;
    /// Its draft for sequence `seq`'s next step, whose ids so far are
    /// `ids`: at most `limit` tokens (fewer, or none, when it has no
    /// better guess).
    fn draft(&mut self, seq: usize, ids: &[i64], limit: usize) -> Vec<i64>;
    /// What the last stage's draft head does after a step of `seq`, when
    /// the sequence's next step would take `next` drafts: methods without a
    /// head leave it be.
    fn ask(&self, _seq: usize, _next: usize) -> Ask {
        Ask::CacheOnly
    }
    /// A step of `seq` came back with these proposals (a draft head's).
    fn proposed(&mut self, _seq: usize, _proposals: &[i64]) {}
    /// Sequence `seq` ended (or was preempted): what the proposer keeps of
    /// it goes.
    fn forget(&mut self, _seq: usize) {}
}

/// The chance a draft token is kept, from decayed counts of kept and lost
/// drafts (a verify step keeps its first `a` drafts and loses the next).
#[derive(Debug, Clone, Copy, Default)]
struct Acceptance {
    kept: f64,
    lost: f64,
}

/// How much older verify steps count against a new one.
const DECAY: f64 = 0.8;

impl Acceptance {
    fn observe(&mut self, drafted: usize, accepted: usize) {
        self.kept = DECAY * self.kept + accepted as f64;
        self.lost = DECAY * self.lost + f64::from(accepted < drafted);
    }

    /// The estimate, with `prior` counting as one verify's worth.
    fn rate(&self, prior: f64) -> f64 {
        (self.kept + prior) / (self.kept + self.lost + 1.0)
    }
}

/// A sequence's turn in the next micro-batch, as the speculator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub seq: usize,
    /// Its rows without drafts (1 for a decode step, a chunk's length).
    pub rows: usize,
    /// Its step draws a token.
    pub draws: bool,
    /// The most drafts it may take (0: none: a prefill chunk, or a
    /// sequence about to reach its `max_tokens`).
    pub room: usize,
}

/// Plans between tries of the full K when speculation is not chosen.
const RETRY_EVERY: u64 = 256;

/// The speculation of one engine: its proposer and what it measured.
pub struct Speculator {
    proposer: Box<dyn Proposer>,
    cost: StepCost,
    seqs: BTreeMap<usize, Acceptance>,
    pooled: Acceptance,
    /// vLLM's `disable_by_batch_size`: no drafts while more sequences run.
    pub disable_by_batch_size: Option<usize>,
    /// Micro-batches planned, and the last one that carried drafts.
    plans: u64,
    last_drafted: u64,
    /// Draft lengths chosen for each sequence's last step (its next ask).
    chosen: BTreeMap<usize, usize>,
}

impl Speculator {
    pub fn new(proposer: Box<dyn Proposer>, disable_by_batch_size: Option<usize>) -> Speculator {
        Speculator {
            proposer,
            cost: StepCost::default(),
            seqs: BTreeMap::new(),
            pooled: Acceptance::default(),
            disable_by_batch_size,
            plans: 0,
            last_drafted: 0,
            chosen: BTreeMap::new(),
        }
    }

    pub fn method(&self) -> &'static str {
        self.proposer.method()
    }

    pub fn max_tokens(&self) -> usize {
        self.proposer.max_tokens()
    }

    /// A step of `rows` rows took `seconds` (the engine's runtime measures).
    pub fn observe_step(&mut self, rows: usize, seconds: f64) {
        self.cost.observe(rows, seconds);
    }

    /// A verify step of `seq` kept `accepted` of its `drafted` drafts.
    pub fn observe_verify(&mut self, seq: usize, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.seqs.entry(seq).or_default().observe(drafted, accepted);
        self.pooled.observe(drafted, accepted);
    }

    fn acceptance(&self, seq: usize) -> f64 {
        let prior = self.pooled.rate(0.5);
        self.seqs.get(&seq).map_or(prior, |a| a.rate(prior))
    }

    /// Whether this plan tries the full K: what a choice needs is not
    /// measured yet (the cost of a step of `rows` rows, or of more), or
    /// speculation has not been tried for a while.
    fn trying(&self, rows: usize) -> bool {
        !self.cost.measured(rows) || !self.cost.measured_above(rows) || self.plans.saturating_sub(self.last_drafted) >= RETRY_EVERY
    }

    /// The draft length of each candidate of a micro-batch (`running`:
    /// the sequences running now): drafts added one at a time, most likely
    /// first, while they raise the batch's expected tokens per second.
    pub fn lengths(&mut self, cands: &[Candidate], running: usize) -> Vec<usize> {
        self.plans += 1;
        let mut k = vec![0usize; cands.len()];
        let cap = self.proposer.max_tokens();
        if self.disable_by_batch_size.is_some_and(|b| running > b) {
            return k;
        }
        let mut rows: usize = cands.iter().map(|c| c.rows).sum();
        let mut tokens = cands.iter().filter(|c| c.draws).count() as f64;
        let trying = self.trying(rows);
        let alpha: Vec<f64> = cands.iter().map(|c| self.acceptance(c.seq)).collect();
        loop {
            // The next draft most likely kept: draft j of a sequence is
            // kept with the chance that all j are.
            let best = (0..cands.len())
                .filter(|&i| cands[i].draws && k[i] < cands[i].room.min(cap))
                .map(|i| (alpha[i].powi(k[i] as i32 + 1), i))
                .max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
            let Some((gain, i)) = best else { break };
            let pays = trying
                || match (self.cost.estimate(rows), self.cost.estimate(rows + 1)) {
                    (Some(t0), Some(t1)) => (tokens + gain) * t0 > tokens * t1,
                    _ => false,
                };
            if !pays {
                break;
            }
            k[i] += 1;
            rows += 1;
            tokens += gain;
        }
        if k.iter().any(|&n| n > 0) {
            self.last_drafted = self.plans;
        }
        for (c, &n) in cands.iter().zip(&k) {
            self.chosen.insert(c.seq, n);
        }
        k
    }

    /// The proposer's draft for `seq`, at most `limit` tokens.
    pub fn draft(&mut self, seq: usize, ids: &[i64], limit: usize) -> Vec<i64> {
        if limit == 0 {
            return Vec::new();
        }
        self.proposer.draft(seq, ids, limit)
    }

    /// What the draft head does after this step of `seq`: proposals when
    /// its next step is likely to take some (it took some now, or a try is
    /// due), else nothing.
    pub fn ask(&self, seq: usize) -> Ask {
        let next = self.chosen.get(&seq).copied().unwrap_or(0);
        let due = !self.cost.measured_above(1) || self.plans + 1 - self.last_drafted >= RETRY_EVERY;
        self.proposer.ask(seq, if next > 0 || due { self.proposer.max_tokens() } else { 0 })
    }

    pub fn proposed(&mut self, seq: usize, proposals: &[i64]) {
        self.proposer.proposed(seq, proposals);
    }

    /// `seq` was preempted: the head's proposals for it are gone with its
    /// cache (what it measured of its acceptance stays).
    pub fn preempted(&mut self, seq: usize) {
        self.proposer.forget(seq);
        self.chosen.remove(&seq);
    }

    pub fn forget(&mut self, seq: usize) {
        self.proposer.forget(seq);
        self.seqs.remove(&seq);
        self.chosen.remove(&seq);
    }
}
