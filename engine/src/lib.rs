//! The engine: m3c's scheduler as a pure function of its events. It keeps
//! every request's lifecycle ([`lifecycle`]), the KV pool's blocks and the
//! prefix cache ([`kv`]), and speculation ([`speculate`]); it consumes what
//! happens (a request added, cancelled, its encodes done, a micro-batch's
//! results, a step's time) and emits one typed [`StepPlan`] per
//! micro-batch, plus the [`Effect`]s the runtime carries out (events for
//! the front, sequences the stages must reset or drop). It links no MPI,
//! device or HTTP: the runtime (the first stage's loop) executes the plans
//! and feeds the results back, and the tests drive it directly.
//!
//! How it schedules (continuous batching): a request waits until the pool
//! has the blocks of its first step (one whose next block another request
//! is computing waits for that one, so a shared prefix is computed once);
//! it then takes the longest prefix the cache holds and runs. Each running
//! sequence's next item (a prefill chunk of at most `chunk` tokens, or one
//! decode token and its drafts) waits in a ready queue; up to one
//! micro-batch per stage is in flight, each of up to `per_batch`
//! sequences. When the pool runs out, a draft is dropped first, then the
//! latest-arrived running sequence gives its blocks back (preemption) and waits
//! again, first in line. What a sequence generates does not depend on any
//! of this: the stages are batch- and chunk-invariant and each draw is
//! keyed by the sequence's own step.

mod admit;
mod batch;
pub mod drawn;
pub mod kv;
pub mod lifecycle;
pub mod plan;
mod results;
mod seq;
pub mod speculate;
pub mod stop;

pub use drawn::{Drawn, Failure, Token};
pub use lifecycle::{Phase, SeqState};
pub use plan::{Ask, Segment, SeqStep, StepPlan};
pub use seq::Request;

use kv::Kv;
use m3c_contract::blocks::blocks_for;
use m3c_contract::protocol::{EndReason, Event};
use seq::Seq;
use speculate::Speculator;
use std::collections::{BTreeMap, VecDeque};

/// The most cache rows a sequence may ask for (a bound, not a budget: the
/// KV pool is the budget).
pub const MAX_CAPACITY: usize = 1 << 24;

/// How the engine batches, and what it schedules for.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Micro-batches in flight at once (one per pipeline stage).
    pub stages: usize,
    /// Sequences per micro-batch.
    pub per_batch: usize,
    /// Prompt tokens per prefill step of a sequence.
    pub chunk: usize,
    /// The ids that end a sequence (kept as its last token).
    pub eos: Vec<i64>,
    /// One more step after a sequence's last token, whose logits the run's
    /// dump or `--expect` records (its id is not kept). Such a run computes
    /// every row (no prefix-cache hits), since the dump holds every row.
    pub score_last: bool,
    /// Automatic prefix caching.
    pub prefix_caching: bool,
    /// The KV pool: blocks, and positions per block.
    pub blocks: usize,
    pub block: usize,
    /// The model's context and vocabulary (what a request is checked against).
    pub max_positions: usize,
    pub vocab: usize,
    /// Report blocks stored in and evicted from the prefix cache as events
    /// (`Event::BlockStored`, `Event::BlocksRemoved`), for KV-cache-aware
    /// routers.
    pub kv_events: bool,
}

/// Something the runtime carries out, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// For the front: a token, its logprobs, a prefix-cache count, a
    /// preemption, a verify step.
    Event(Event),
    /// Every stage forgets sequence `seq`'s cache rows (a preemption); it
    /// resumes by recomputing them.
    Reset(usize),
    /// Sequence `seq` ended: every stage frees it (when it had `joined`
    /// them: a request that ends while its images encode never did), and
    /// the front is told why.
    Ended { seq: usize, reason: EndReason, joined: bool },
}

/// The results of a micro-batch do not fit what was asked (a damaged or
/// confused peer, or a bug).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EngineError(pub String);

/// The scheduler's state.
pub struct Engine {
    cfg: Config,
    seqs: BTreeMap<usize, Seq>,
    /// Waiting for blocks, in order (preempted ones first).
    waiting: VecDeque<usize>,
    ready: VecDeque<usize>,
    in_flight: usize,
    kv: Kv,
    /// Requests added so far (each one's arrival).
    arrivals: u64,
    /// Each token id's bytes, for stop strings (the runtime reads them).
    token_bytes: Option<Vec<Vec<u8>>>,
    spec: Option<Speculator>,
    effects: Vec<Effect>,
}

impl Engine {
    /// `spec`: speculation, when a run asks for it.
    pub fn new(cfg: Config, spec: Option<Speculator>) -> Engine {
        let mut kv = Kv::new(cfg.blocks, cfg.block, cfg.prefix_caching);
        kv.events = cfg.kv_events.then(Vec::new);
        Engine {
            cfg,
            seqs: BTreeMap::new(),
            waiting: VecDeque::new(),
            ready: VecDeque::new(),
            in_flight: 0,
            kv,
            arrivals: 0,
            token_bytes: None,
            spec,
            effects: Vec::new(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Whether a request is refused, and why (the front's 400, or a failed
    /// run): it must be new, its ids in the vocabulary, and it must fit the
    /// model's context and, alone, the KV pool.
    pub fn check(&self, r: &Request) -> Result<(), String> {
        let c = &self.cfg;
        if self.seqs.contains_key(&r.seq) {
            return Err("the sequence is already live".into());
        }
        if r.prompt.is_empty() {
            return Err("the prompt is empty".into());
        }
        if let Some(bad) = r.prompt.iter().find(|&&i| i < 0 || i as usize >= c.vocab) {
            return Err(format!("token id {bad} is outside the vocabulary (0..{})", c.vocab));
        }
        if r.stop_ids.iter().any(|&i| i < 0 || i as usize >= c.vocab) {
            return Err("a stop id is outside the vocabulary".into());
        }
        if r.resumed.iter().any(|&i| i < 0 || i as usize >= c.vocab) {
            return Err("a resumed token id is outside the vocabulary".into());
        }
        if !r.resumed.is_empty() && r.resumed.len() >= r.max_new {
            return Err(format!("{} resumed tokens leave none of max_new {} to generate", r.resumed.len(), r.max_new));
        }
        let (p, m) = (r.prompt.len(), r.max_new);
        if p.checked_add(m).is_none_or(|n| n > c.max_positions) {
            return Err(format!("{p} prompt tokens + {m} new exceed the model's {} positions (max_position_embeddings)", c.max_positions));
        }
        if p.checked_add(m).and_then(|n| n.checked_add(1)).is_none_or(|n| n > MAX_CAPACITY) {
            return Err(format!("the prompt and max_new exceed {MAX_CAPACITY} positions"));
        }
        let blocks = blocks_for(r.capacity(), c.block);
        if blocks > self.kv.total() {
            return Err(format!(
                "{p} prompt tokens + {m} new need {blocks} cache blocks of {} positions; the KV pool has {}",
                c.block,
                self.kv.total()
            ));
        }
        Ok(())
    }

    /// Whether the token bytes must be given ([`Engine::set_token_bytes`])
    /// before `r` is added: it has stop strings.
    pub fn needs_token_bytes(&self, r: &Request) -> bool {
        !r.stops.is_empty() && self.token_bytes.is_none()
    }

    pub fn set_token_bytes(&mut self, table: Vec<Vec<u8>>) {
        self.token_bytes = Some(table);
    }

    /// A checked request joins: it waits for blocks, or first for its
    /// images' encodes (`encoding`; [`Engine::encoded`]).
    pub fn add(&mut self, r: Request, encoding: bool) {
        let seq = r.seq;
        let phase = if encoding { Phase::Encoding } else { Phase::Waiting };
        let resumed = r.resumed.clone();
        let mut s = Seq::new(r, phase);
        // Its stop strings see the text it generated before.
        for &id in &resumed {
            s.stop.ends(id, self.token_bytes.as_deref());
        }
        self.arrivals += 1;
        s.arrival = self.arrivals;
        if self.kv.caching {
            kv::extend_chain(&mut s.chain, &s.ids, &s.images, self.kv.block);
        }
        self.seqs.insert(seq, s);
        if !encoding {
            self.waiting.push_back(seq);
        }
    }

    /// Sequence `seq`'s encodes are done: it waits for blocks (true), or,
    /// cancelled meanwhile, ends (false: it never joined the stages).
    pub fn encoded(&mut self, seq: usize) -> bool {
        let Some(s) = self.seqs.get_mut(&seq).filter(|s| s.phase == Phase::Encoding) else { return false };
        if s.cancelled {
            self.seqs.remove(&seq);
            self.effects.push(Effect::Ended { seq, reason: EndReason::Cancelled, joined: false });
            return false;
        }
        s.phase = Phase::Waiting;
        self.waiting.push_back(seq);
        true
    }

    /// The front cancels `seq`: it ends now, or when its step in flight or
    /// its encodes come back.
    pub fn cancel(&mut self, seq: usize) {
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        s.cancelled = true;
        if !s.busy && s.phase != Phase::Encoding {
            self.end(seq, EndReason::Cancelled);
        }
    }

    /// Micro-batch `plan` took `seconds` (speculation's cost model, which
    /// learns from steps that only decode: a prefill chunk's rows say
    /// little of a verify step's).
    pub fn timed(&mut self, plan: &StepPlan, seconds: f64) {
        if let Some(s) = self.spec.as_mut().filter(|_| plan.decodes_only()) {
            let asked = plan.seqs.iter().any(|x| matches!(x.ask, Ask::Drafts(_)));
            s.observe_step(plan.rows(), asked, seconds);
        }
    }

    /// What the runtime has to carry out, in order (taken); the KV-cache
    /// events since the last call come last.
    pub fn effects(&mut self) -> Vec<Effect> {
        let mut out = std::mem::take(&mut self.effects);
        if let Some(events) = self.kv.events.as_mut() {
            out.extend(events.drain(..).map(Effect::Event));
        }
        out
    }

    /// Micro-batches in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Whether another micro-batch could start now.
    pub fn can_step(&self) -> bool {
        self.in_flight < self.cfg.stages && !self.ready.is_empty()
    }

    /// Whether nothing is live, encoding or in flight.
    pub fn idle(&self) -> bool {
        self.seqs.is_empty() && self.in_flight == 0
    }

    /// Requests whose encodes are in flight.
    pub fn encoding(&self) -> usize {
        self.seqs.values().filter(|s| s.phase == Phase::Encoding).count()
    }

    pub fn running(&self) -> usize {
        self.seqs.values().filter(|s| s.phase.running()).count()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// (blocks sequences hold, cached blocks nobody holds, all blocks).
    pub fn blocks(&self) -> (usize, usize, usize) {
        self.kv.usage()
    }

    /// The speculation method, if any.
    pub fn speculation(&self) -> Option<&Speculator> {
        self.spec.as_ref()
    }

    /// Sequence `seq`'s lifecycle state, while it lives.
    pub fn state(&self, seq: usize) -> Option<SeqState> {
        self.seqs.get(&seq).map(|s| SeqState {
            seq,
            phase: s.phase,
            prompt: s.ids[..s.prompt_len].to_vec(),
            generated: s.ids[s.prompt_len..].to_vec(),
            max_new: s.max_new,
            preemptions: s.preemptions,
        })
    }

    /// Every live sequence's state, by sequence.
    pub fn states(&self) -> Vec<SeqState> {
        self.seqs.keys().filter_map(|&s| self.state(s)).collect()
    }

    /// Sequence `seq` (running, no step in flight) gives its blocks back
    /// on every stage and waits again, first in line; what it generated
    /// stays, and it resumes by recomputing its rows, from the cache where
    /// it can.
    fn preempt(&mut self, seq: usize) {
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        self.kv.release(&mut s.kv);
        s.phase = Phase::Preempted;
        s.preemptions += 1;
        s.chunks.clear();
        self.ready.retain(|&x| x != seq);
        self.waiting.push_front(seq);
        if let Some(sp) = self.spec.as_mut() {
            sp.preempted(seq);
        }
        self.effects.push(Effect::Reset(seq));
        self.effects.push(Effect::Event(Event::Preempted { seq }));
    }

    /// A sequence leaves: its blocks go back (the full ones stay cached).
    fn end(&mut self, seq: usize, reason: EndReason) {
        if let Some(mut s) = self.seqs.remove(&seq) {
            self.kv.release(&mut s.kv);
        }
        self.ready.retain(|&x| x != seq);
        self.waiting.retain(|&x| x != seq);
        if let Some(sp) = self.spec.as_mut() {
            sp.forget(seq);
        }
        self.effects.push(Effect::Ended { seq, reason, joined: true });
    }
}

#[cfg(test)]
mod tests;
