//! A pipeline in miniature for the engine's tests: it executes plans as
//! the stages do (checking that every row fed is the sequence's own id at
//! that position, that its blocks cover the rows, and that no row is fed
//! before the rows under it exist), draws each token from a model that is
//! a pure function of the sequence's ids, verifies drafts as the last
//! stage does, and returns micro-batches in order, up to one per stage.

use crate::drawn::{Drawn, Token};
use crate::kv::ImageRows;
use crate::plan::StepPlan;
use crate::speculate::Speculator;
use crate::{Config, Effect, Engine, Request};
use m3c_contract::protocol::{EndReason, Event};
use std::collections::{BTreeMap, VecDeque};

/// The model: the next id after `ids`.
pub type Model = fn(&[i64]) -> i64;

/// Repeats the id four back (so prompt lookup guesses well), seeded by the
/// length for short prompts.
pub fn periodic(ids: &[i64]) -> i64 {
    let n = ids.len();
    if n >= 4 {
        ids[n - 4]
    } else {
        (n as i64 * 5) % VOCAB as i64
    }
}

/// An id nothing predicts (a hash of every id).
pub fn hashed(ids: &[i64]) -> i64 {
    let mut h = 1469598103934665603u64;
    for &i in ids {
        h = (h ^ i as u64).wrapping_mul(1099511628211);
    }
    (h % (VOCAB as u64 - 1)) as i64
}

pub const VOCAB: usize = 32;

pub fn config() -> Config {
    Config {
        stages: 1,
        per_batch: 4,
        chunk: 4,
        eos: vec![VOCAB as i64 - 1],
        score_last: false,
        prefix_caching: true,
        blocks: 64,
        block: 4,
        max_positions: 4096,
        vocab: VOCAB,
        kv_events: false,
    }
}

pub fn request(seq: usize, prompt: &[i64], max_new: usize) -> Request {
    Request {
        seq,
        prompt: prompt.to_vec(),
        max_new,
        ignore_eos: false,
        stops: Vec::new(),
        stop_ids: Vec::new(),
        prompt_logprobs: false,
        images: Vec::<ImageRows>::new(),
        resumed: Vec::new(),
    }
}

/// What a sequence's stages hold: its block table and the rows written.
#[derive(Debug, Default, Clone)]
struct StageSeq {
    table: Vec<u32>,
}

pub struct Sim {
    pub e: Engine,
    model: Model,
    /// Every live sequence's ids as the front knows them (prompt, then each
    /// token it heard of).
    pub ids: BTreeMap<usize, Vec<i64>>,
    prompt_len: BTreeMap<usize, usize>,
    stage: BTreeMap<usize, StageSeq>,
    in_flight: VecDeque<StepPlan>,
    /// What each pool block's rows hold (the id fed at each row).
    rows: BTreeMap<u32, Vec<Option<i64>>>,
    /// What the engine emitted, in order.
    pub plans: Vec<StepPlan>,
    pub events: Vec<Event>,
    pub ended: Vec<(usize, EndReason, bool)>,
    pub resets: Vec<usize>,
    /// Each finished sequence's generated ids.
    pub outputs: BTreeMap<usize, Vec<i64>>,
    /// Verify steps: (drafted, accepted).
    pub verified: Vec<(usize, usize)>,
    /// Seconds a step "takes", fed to the cost model.
    pub step_seconds: Option<fn(&StepPlan) -> f64>,
}

impl Sim {
    pub fn new(cfg: Config, model: Model) -> Sim {
        Sim::with(Engine::new(cfg, None), model)
    }

    pub fn spec(cfg: Config, model: Model, spec: Speculator) -> Sim {
        Sim::with(Engine::new(cfg, Some(spec)), model)
    }

    fn with(e: Engine, model: Model) -> Sim {
        Sim {
            e,
            model,
            ids: BTreeMap::new(),
            prompt_len: BTreeMap::new(),
            stage: BTreeMap::new(),
            in_flight: VecDeque::new(),
            rows: BTreeMap::new(),
            plans: Vec::new(),
            events: Vec::new(),
            ended: Vec::new(),
            resets: Vec::new(),
            outputs: BTreeMap::new(),
            verified: Vec::new(),
            step_seconds: None,
        }
    }

    /// Adds `r` if the engine takes it; the refusal otherwise.
    pub fn add(&mut self, r: Request, encoding: bool) -> Result<(), String> {
        self.e.check(&r)?;
        self.ids.insert(r.seq, [&r.prompt[..], &r.resumed[..]].concat());
        self.prompt_len.insert(r.seq, r.prompt.len());
        self.stage.insert(r.seq, StageSeq::default());
        self.e.add(r, encoding);
        self.apply();
        Ok(())
    }

    pub fn cancel(&mut self, seq: usize) {
        self.e.cancel(seq);
        self.apply();
    }

    pub fn encoded(&mut self, seq: usize) -> bool {
        let joined = self.e.encoded(seq);
        self.apply();
        joined
    }

    /// Admits, then launches what can start; whether a plan started.
    pub fn launch(&mut self) -> bool {
        self.e.admit();
        self.apply();
        let plan = self.e.next_plan().expect("a plan");
        self.apply();
        let Some(plan) = plan else { return false };
        for s in &plan.seqs {
            let st = self.stage.get_mut(&s.seq).expect("a planned sequence is on the stages");
            st.table.extend_from_slice(&s.blocks);
            let ids = &self.ids[&s.seq];
            let end = s.pos0 + s.ids.len() - s.drafts.len();
            assert!(end <= ids.len(), "seq {}: rows {}..{end} past its {} ids", s.seq, s.pos0, ids.len());
            assert_eq!(&s.ids[..s.ids.len() - s.drafts.len()], &ids[s.pos0..end], "seq {}: the rows fed are its ids", s.seq);
            assert_eq!(&s.ids[s.ids.len() - s.drafts.len()..], s.drafts.as_slice());
            let block = self.e.config().block;
            assert!(st.table.len() * block >= s.pos0 + s.ids.len(), "seq {}: blocks {:?} do not cover its rows", s.seq, st.table);
            // Attention reads every row before the step's: each must hold
            // the sequence's own id (computed by it, or shared from the
            // prefix cache), then the step writes its rows.
            for p in 0..s.pos0 {
                let held = self.rows.get(&st.table[p / block]).and_then(|r| r[p % block]);
                assert_eq!(held, Some(ids[p]), "seq {}: row {p} (block {}) holds {held:?}", s.seq, st.table[p / block]);
            }
            for (j, &id) in s.ids.iter().enumerate() {
                let p = s.pos0 + j;
                self.rows.entry(st.table[p / block]).or_insert_with(|| vec![None; block])[p % block] = Some(id);
            }
        }
        self.plans.push(plan.clone());
        self.in_flight.push_back(plan);
        true
    }

    /// The oldest micro-batch in flight comes back; whether one did.
    pub fn land(&mut self) -> bool {
        let Some(plan) = self.in_flight.pop_front() else { return false };
        let drawn: Vec<Drawn> = plan.seqs.iter().map(|s| self.draw(s)).collect();
        if let Some(f) = self.step_seconds {
            self.e.timed(&plan, f(&plan));
        }
        self.e.returned(&plan.segments(), &drawn).expect("results fit the plan");
        self.apply();
        true
    }

    /// What the last stage draws for one sequence's step.
    fn draw(&self, s: &crate::SeqStep) -> Drawn {
        let ids = &self.ids[&s.seq];
        let fed = s.pos0 + s.ids.len() - s.drafts.len();
        if fed < ids.len() {
            return Drawn::default();
        }
        let mut ctx = ids.clone();
        let mut tokens = Vec::new();
        for j in 0..=s.drafts.len() {
            let t = (self.model)(&ctx);
            tokens.push(Token { id: t, logprobs: None });
            ctx.push(t);
            if s.drafts.get(j) != Some(&t) {
                break;
            }
        }
        // A draft head that knows the model: it proposes what comes next.
        let mut proposals = Vec::new();
        if let crate::plan::Ask::Drafts(k) = s.ask {
            for _ in 0..k {
                let t = (self.model)(&ctx);
                proposals.push(t);
                ctx.push(t);
            }
        }
        Drawn { tokens, proposals, ..Drawn::default() }
    }

    /// Carries out the engine's effects.
    fn apply(&mut self) {
        for eff in self.e.effects() {
            match eff {
                Effect::Event(ev) => {
                    if let Event::Id { seq, id } = ev {
                        self.ids.get_mut(&seq).expect("a token of a live sequence").push(i64::from(id));
                    }
                    if let Event::Spec { drafted, accepted, .. } = ev {
                        self.verified.push((drafted, accepted));
                    }
                    self.events.push(ev);
                }
                Effect::Reset(seq) => {
                    self.resets.push(seq);
                    self.stage.get_mut(&seq).expect("a reset of a live sequence").table.clear();
                }
                Effect::Ended { seq, reason, joined } => {
                    self.ended.push((seq, reason, joined));
                    let ids = self.ids.remove(&seq).expect("an end of a live sequence");
                    self.outputs.insert(seq, ids[self.prompt_len[&seq]..].to_vec());
                    self.stage.remove(&seq);
                }
            }
        }
    }

    /// Steps until nothing is live or in flight (at most `limit` turns).
    pub fn run(&mut self, limit: usize) {
        // A turn may only preempt (the sequence picked gave its blocks
        // back): a few turns without a step are progress, many are a stall.
        let mut idle_turns = 0;
        for _ in 0..limit {
            if self.e.idle() {
                return;
            }
            let launched = self.launch();
            let landed = (!launched || self.in_flight.len() >= self.e.config().stages) && self.land();
            idle_turns = if launched || landed { 0 } else { idle_turns + 1 };
            assert!(idle_turns < 4, "the engine stalled: {:?}", self.e.states());
        }
        panic!("not idle after {limit} turns: {:?}", self.e.states());
    }
}

/// What a sequence generates alone: the model's ids after `prompt` until
/// an EOS or `max_new`.
pub fn solo(model: Model, prompt: &[i64], max_new: usize, eos: i64) -> Vec<i64> {
    let mut ids = prompt.to_vec();
    for _ in 0..max_new {
        let t = model(&ids);
        ids.push(t);
        if t == eos {
            break;
        }
    }
    ids[prompt.len()..].to_vec()
}
