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
//! rows are far from free; a draft head's proposals cost their own passes,
//! so steps that ask for them are timed apart) and each sequence's
//! acceptance (the chance a draft token is kept, pooled over all sequences
//! for a new one). The micro-batch takes the count of drafts that gives
//! the most expected tokens per second, none included, and drafts only
//! when that beats plain steps by a margin; so drafts are made only where
//! they are expected to pay for their rows. What a step's tokens are worth
//! depends on the load:
//!
//! - requests waiting: every token kept counts (the sum), since a sequence
//!   that ends sooner frees its slot for the next; drafts are ranked most
//!   likely kept first;
//! - nobody waiting: a step is worth what its slowest sequence gains, times
//!   the sequences (a draft that speeds one sequence while every other's
//!   step takes longer costs those requests their latency, and a batch of
//!   them ends with its last); drafts are ranked level by level, every
//!   sequence's first before any second.
//!
//! What it has not measured yet (a plain step's cost, or a drafting one's)
//! it measures, with no drafts or with the proposer's full K, and it tries
//! the full K again once in a while, so a choice not to speculate is
//! revisited. Where drafts cost nothing to make (n-gram lookup, in the
//! engine), a plain step's draft is made anyway and checked against the
//! token drawn ([`Speculator::shadow`]): acceptance stays measured while
//! nothing is drafted, so text that starts to repeat is drafted within a
//! few steps rather than at the next try.
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
    /// Whether its proposals are made on the stages (a draft head), so a
    /// step that asks for them costs more than its rows.
    fn runs_on_stages(&self) -> bool {
        false
    }
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

    /// The estimate, with `prior` counting as `weight` verifies' worth.
    fn rate(&self, prior: f64, weight: f64) -> f64 {
        (self.kept + weight * prior) / (self.kept + self.lost + weight)
    }
}

/// How many verifies' worth the pooled rate counts for in a sequence's
/// own: the sequence picked for a draft is the one that looks likeliest,
/// so a few lucky verifies must not make it look sure.
const PRIOR_WEIGHT: f64 = 4.0;

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
    /// Its step decodes (feeds its last token): a batch of such steps is
    /// one whose time the cost model learns, so only such a batch explores.
    pub decode: bool,
}

/// Plans between tries of drafting when speculation is not chosen; each
/// try after which the model still chooses no drafts doubles it, up to
/// [`MAX_RETRY_EVERY`] (a try costs a verify row per sequence and, with a
/// draft head, its proposals: where drafts never pay, tries must not add
/// up), and a choice to draft brings it back.
const RETRY_EVERY: u64 = 256;
const MAX_RETRY_EVERY: u64 = 4096;
/// Plans between plain steps when it is (so the cost it is weighed
/// against stays measured: a first plain step is often slow).
const REFRESH_EVERY: u64 = 64;
/// Measurements a cost needs before the model trusts it.
const TRUSTED: usize = 3;
/// How much faster than plain steps drafting must be expected to run
/// before it is chosen: step times of a fraction of a millisecond are
/// noisy, and a draft that only breaks even costs its rows when the
/// estimate is off.
const MARGIN: f64 = 0.05;

/// What a micro-batch's expected tokens are worth (see the module's header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Worth {
    /// Requests wait: every token kept.
    Sum,
    /// Nobody waits: the slowest sequence's tokens, times the sequences.
    Slowest,
}

/// The speculation of one engine: its proposer and what it measured.
pub struct Speculator {
    proposer: Box<dyn Proposer>,
    /// Seconds per decode step by rows: plain steps, and (for a proposer
    /// that runs on the stages) steps that also ask it for proposals.
    cost: StepCost,
    asking: StepCost,
    seqs: BTreeMap<usize, Acceptance>,
    pooled: Acceptance,
    /// vLLM's `disable_by_batch_size`: no drafts while more sequences run.
    pub disable_by_batch_size: Option<usize>,
    /// Every decode step drafts this many (at most), whatever it costs:
    /// vLLM's behaviour, for measuring the cost model against.
    pub fixed: Option<usize>,
    /// Micro-batches planned, the last one that carried drafts, and the
    /// last one that did not.
    plans: u64,
    last_drafted: u64,
    last_plain: u64,
    /// Plans between tries now, and whether the last drafting plan was a
    /// try whose verdict the model has not given yet.
    retry_every: u64,
    retrying: bool,
    /// The last plan could have drafted (speculation not disabled by the
    /// batch size, nor fixed at none): only then is a try ever due.
    may_draft: bool,
    /// Draft lengths chosen for each sequence's last step (its next ask).
    chosen: BTreeMap<usize, usize>,
    /// Where drafts cost nothing to make (the engine's own lookup), the
    /// first token a sequence's plain decode step would have drafted: the
    /// token it draws says whether that draft would have been kept.
    shadow: BTreeMap<usize, i64>,
}

impl Speculator {
    pub fn new(proposer: Box<dyn Proposer>, disable_by_batch_size: Option<usize>) -> Speculator {
        Speculator {
            proposer,
            cost: StepCost::default(),
            asking: StepCost::default(),
            seqs: BTreeMap::new(),
            pooled: Acceptance::default(),
            disable_by_batch_size,
            fixed: None,
            plans: 0,
            last_drafted: 0,
            last_plain: 0,
            retry_every: RETRY_EVERY,
            retrying: false,
            may_draft: false,
            chosen: BTreeMap::new(),
            shadow: BTreeMap::new(),
        }
    }

    pub fn method(&self) -> &'static str {
        self.proposer.method()
    }

    pub fn max_tokens(&self) -> usize {
        self.proposer.max_tokens()
    }

    /// A decode step of `rows` rows took `seconds`; `asked`: it asked the
    /// proposer for proposals.
    pub fn observe_step(&mut self, rows: usize, asked: bool, seconds: f64) {
        if asked && self.proposer.runs_on_stages() {
            self.asking.observe(rows, seconds);
        } else {
            self.cost.observe(rows, seconds);
        }
    }

    /// What a step that drafts costs: one that asks the proposer where it
    /// runs on the stages.
    fn drafting_cost(&self) -> &StepCost {
        if self.proposer.runs_on_stages() {
            &self.asking
        } else {
            &self.cost
        }
    }

    /// What a drafting step of `rows` rows is expected to cost. Past the
    /// one row count a draft head's steps were measured at, the cost
    /// rises as it did from the plain step below it to that count (rows
    /// are not free on a mixture of experts; a flat guess would send the
    /// model after long drafts the next verify step then shows too dear).
    fn drafting_estimate(&self, rows: usize) -> Option<f64> {
        let d = self.drafting_cost();
        let estimate = d.estimate(rows)?;
        if !self.proposer.runs_on_stages() || d.counts() != 1 {
            return Some(estimate);
        }
        let Some((r1, s1)) = d.largest_below(usize::MAX).filter(|&(r1, _)| rows > r1) else { return Some(estimate) };
        match self.cost.largest_below(r1) {
            Some((r0, s0)) => Some(s1 + ((s1 - s0) / (r1 - r0) as f64).max(0.0) * (rows - r1) as f64),
            None => Some(estimate),
        }
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
        let prior = self.pooled.rate(0.5, 1.0);
        self.seqs.get(&seq).map_or(prior, |a| a.rate(prior, PRIOR_WEIGHT))
    }

    /// What this plan measures instead of choosing by the model:
    /// `Some(true)` one draft per sequence, the cheapest drafting step
    /// (drafting steps above `rows` have fewer than [`TRUSTED`]
    /// measurements, or none was tried for [`RETRY_EVERY`] plans),
    /// `Some(false)` a plain step (its cost at `rows` is not measured
    /// enough, or none was taken for [`REFRESH_EVERY`] plans), `None`:
    /// neither. Longer drafts
    /// are then chosen by the model, whose first estimate of them is
    /// optimistic (flat past the last count measured) and corrected once
    /// measured.
    fn explore(&self, rows: usize) -> Option<bool> {
        let since = |plan: u64| self.plans.saturating_sub(plan);
        if self.drafting_cost().samples_above(rows) < TRUSTED {
            Some(true)
        } else if self.cost.samples(rows) < TRUSTED || since(self.last_plain) >= REFRESH_EVERY {
            Some(false)
        } else if since(self.last_drafted) >= self.retry_every {
            Some(true)
        } else {
            None
        }
    }

    /// After the model's choice of `take` drafts: a try that did not change
    /// its mind makes the next one wait twice as long; drafting resets it.
    fn back_off(&mut self, take: usize) {
        if take > 0 {
            self.retry_every = RETRY_EVERY;
        } else if std::mem::take(&mut self.retrying) {
            self.retry_every = (2 * self.retry_every).min(MAX_RETRY_EVERY);
        }
    }

    /// The draft length of each candidate of a micro-batch (`running`:
    /// the sequences running now). Drafts are ranked most likely kept
    /// first; the batch takes the number of them that gives the most
    /// expected tokens per second, none included (a draft head's fixed
    /// cost can pay only over several drafts, so every count is weighed,
    /// not only the next draft).
    pub fn lengths(&mut self, cands: &[Candidate], running: usize, waiting: usize) -> Vec<usize> {
        self.plans += 1;
        let mut k = vec![0usize; cands.len()];
        self.may_draft = self.disable_by_batch_size.is_none_or(|b| running <= b) && self.fixed != Some(0);
        if self.may_draft {
            let rows: usize = cands.iter().map(|c| c.rows).sum();
            let decoding = cands.iter().all(|c| c.decode);
            let worth = if waiting > 0 { Worth::Sum } else { Worth::Slowest };
            let ranked = self.ranked(cands, worth);
            let take = match self.explore(rows).filter(|_| decoding && self.fixed.is_none()) {
                Some(false) => 0,
                Some(true) => {
                    // A try, once the cost of drafting is known.
                    self.retrying |= self.drafting_cost().samples_above(rows) >= TRUSTED;
                    cands.iter().filter(|c| c.draws && c.room > 0).count()
                }
                None if self.fixed.is_some() => usize::MAX,
                None => {
                    let n = self.best_count(cands, &ranked, rows, worth);
                    self.back_off(n);
                    n
                }
            };
            for &i in ranked.iter().take(take) {
                k[i] += 1;
            }
        }
        if k.iter().any(|&n| n > 0) {
            self.last_drafted = self.plans;
        } else {
            self.last_plain = self.plans;
        }
        for (c, &n) in cands.iter().zip(&k) {
            self.chosen.insert(c.seq, n);
        }
        k
    }

    /// Every draft the candidates may take, as the index of its sequence:
    /// most likely kept first (draft j of a sequence is kept with the
    /// chance that all j are), or, where a step is worth its slowest
    /// sequence's gain, level by level (likeliest first within a level).
    fn ranked(&self, cands: &[Candidate], worth: Worth) -> Vec<usize> {
        let cap = self.fixed.unwrap_or(usize::MAX).min(self.proposer.max_tokens());
        let mut all: Vec<(usize, f64, usize)> = Vec::new();
        for (i, c) in cands.iter().enumerate().filter(|(_, c)| c.draws) {
            let alpha = self.acceptance(c.seq);
            let level = |j: usize| if worth == Worth::Slowest { j } else { 0 };
            all.extend((1..=c.room.min(cap)).map(|j| (level(j), alpha.powi(j as i32), i)));
        }
        // Stable: ties keep the batch's order (and a sequence's own drafts theirs).
        all.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)));
        all.into_iter().map(|(_, _, i)| i).collect()
    }

    /// How many of the ranked drafts give the most expected tokens per
    /// second, by the measured costs (none unless that beats plain steps
    /// by [`MARGIN`]).
    fn best_count(&self, cands: &[Candidate], ranked: &[usize], rows: usize, worth: Worth) -> usize {
        let drawing: Vec<usize> = (0..cands.len()).filter(|&i| cands[i].draws).collect();
        let tokens = drawing.len() as f64;
        let Some(plain) = self.cost.estimate(rows) else { return 0 };
        let (mut best, mut best_rate) = (0, (1.0 + MARGIN) * tokens / plain);
        let alphas: Vec<f64> = cands.iter().map(|c| self.acceptance(c.seq)).collect();
        let (mut taken, mut expected) = (vec![0i32; cands.len()], vec![1.0; cands.len()]);
        for (n, &i) in ranked.iter().enumerate() {
            taken[i] += 1;
            expected[i] += alphas[i].powi(taken[i]);
            let gained = match worth {
                Worth::Sum => drawing.iter().map(|&d| expected[d]).sum::<f64>(),
                Worth::Slowest => tokens * drawing.iter().map(|&d| expected[d]).fold(f64::INFINITY, f64::min),
            };
            let Some(t) = self.drafting_estimate(rows + n + 1) else { break };
            if gained / t > best_rate {
                (best, best_rate) = (n + 1, gained / t);
            }
        }
        best
    }

    /// The proposer's draft for `seq`, at most `limit` tokens.
    pub fn draft(&mut self, seq: usize, ids: &[i64], limit: usize) -> Vec<i64> {
        if limit == 0 {
            return Vec::new();
        }
        self.proposer.draft(seq, ids, limit)
    }

    /// `seq`'s decode step takes no drafts: where a draft costs nothing to
    /// make (not a head on the stages), its first token is kept aside, and
    /// [`Speculator::observe_drawn`] learns from the drawn token whether it
    /// would have been kept. So a sequence's acceptance stays measured
    /// while it does not draft: a choice not to draft, made on the misses
    /// of a generation's first steps, is revised as soon as its text starts
    /// to repeat, not only at the next try.
    pub fn shadow(&mut self, seq: usize, ids: &[i64]) {
        self.shadow.remove(&seq);
        if !self.may_draft || self.fixed.is_some() || self.proposer.runs_on_stages() {
            return;
        }
        if let Some(&guess) = self.proposer.draft(seq, ids, 1).first() {
            self.shadow.insert(seq, guess);
        }
    }

    /// `seq`'s plain decode step drew `id`: its shadow draft, if it had one,
    /// counts as a verify of one draft.
    pub fn observe_drawn(&mut self, seq: usize, id: i64) {
        if let Some(guess) = self.shadow.remove(&seq) {
            self.observe_verify(seq, 1, usize::from(guess == id));
        }
    }

    /// What the draft head does after this step of `seq` (one that draws;
    /// `decode`: a decode step, else its prompt's last chunk): proposals
    /// when its next step is likely to take some (a decode step took some
    /// now; after a prompt, while speculation is on or being measured; or
    /// a try is due), else nothing, except that a prompt's rows always go
    /// into the head's cache (every later proposal reads them).
    pub fn ask(&self, seq: usize, decode: bool) -> Ask {
        let due = self.may_draft && self.plans + 1 - self.last_drafted >= self.retry_every;
        let want = if decode {
            self.chosen.get(&seq).is_some_and(|&k| k > 0)
        } else if self.fixed.is_some() {
            true
        } else {
            self.drafting_cost().samples_above(1) < TRUSTED || self.last_drafted > self.last_plain
        };
        match self.proposer.ask(seq, if want || due { self.proposer.max_tokens() } else { 0 }) {
            Ask::Nothing if !decode => Ask::CacheOnly,
            a => a,
        }
    }

    pub fn proposed(&mut self, seq: usize, proposals: &[i64]) {
        self.proposer.proposed(seq, proposals);
    }

    /// `seq` was preempted: the head's proposals for it are gone with its
    /// cache (what it measured of its acceptance stays).
    pub fn preempted(&mut self, seq: usize) {
        self.proposer.forget(seq);
        self.chosen.remove(&seq);
        self.shadow.remove(&seq);
    }

    pub fn forget(&mut self, seq: usize) {
        self.proposer.forget(seq);
        self.seqs.remove(&seq);
        self.chosen.remove(&seq);
        self.shadow.remove(&seq);
    }
}
