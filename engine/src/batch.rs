//! The next micro-batch: ready sequences in order, each with its next item
//! (a prefill chunk, or its last token and the drafts speculation chose),
//! the blocks its positions reach (preempting the latest-arrived running sequence
//! when the pool is out of them), and what the draft head is to do after.

use crate::lifecycle::Phase;
use crate::plan::{Ask, SeqStep, StepPlan};
use crate::speculate::Candidate;
use crate::{kv::Kv, Engine, EngineError};

/// How one sequence's step came out.
enum Planned {
    Step(SeqStep),
    /// It was the latest-arrived running sequence and gave its blocks back.
    Preempted,
    /// Every block is held by steps in flight: it waits for them.
    Stalled,
}

impl Engine {
    /// The next micro-batch to step, if one can start (fewer than one per
    /// stage in flight, and a ready sequence that can take its step).
    pub fn next_plan(&mut self) -> Result<Option<StepPlan>, EngineError> {
        if !self.can_step() {
            return Ok(None);
        }
        let running = self.running();
        let picked: Vec<usize> = (0..self.cfg.per_batch).map_while(|_| self.ready.pop_front()).collect();
        let lengths = self.draft_lengths(&picked, running)?;
        let mut plan = StepPlan::default();
        for (i, &seq) in picked.iter().enumerate() {
            // An earlier one's preemption may have taken this one's blocks.
            if !self.seqs.get(&seq).is_some_and(|s| s.phase.running()) {
                continue;
            }
            match self.plan_seq(seq, lengths[i])? {
                Planned::Step(s) => plan.seqs.push(s),
                Planned::Preempted => {}
                Planned::Stalled => {
                    // It and those behind it keep their places.
                    let later = picked[i..].iter().filter(|s| self.seqs.get(s).is_some_and(|s| s.phase.running()));
                    let back: Vec<usize> = later.copied().collect();
                    for s in back.into_iter().rev() {
                        self.ready.push_front(s);
                    }
                    break;
                }
            }
        }
        if plan.seqs.is_empty() {
            return Ok(None);
        }
        self.in_flight += 1;
        Ok(Some(plan))
    }

    /// Each picked sequence's draft length, as speculation chooses it: a
    /// decode step may verify drafts, at most the tokens it may still
    /// generate less the one the step draws anyway.
    fn draft_lengths(&mut self, picked: &[usize], running: usize) -> Result<Vec<usize>, EngineError> {
        let Some(spec) = self.spec.as_mut() else { return Ok(vec![0; picked.len()]) };
        let mut cands = Vec::with_capacity(picked.len());
        for &seq in picked {
            let s = self.seqs.get(&seq).ok_or_else(|| EngineError(format!("engine bug: sequence {seq} is ready but not live")))?;
            let decode = s.chunks.is_empty();
            let rows = s.chunks.front().map_or(1, |(_, c)| c.len());
            let room = if decode && !s.cancelled { s.max_new.saturating_sub(s.generated + 1) } else { 0 };
            cands.push(Candidate { seq, rows, draws: s.chunks.len() <= 1, room, decode });
        }
        let waiting = self.waiting.len();
        Ok(spec.lengths(&cands, running, waiting))
    }

    /// Sequence `seq`'s next item with `k` drafts, and the blocks it needs.
    fn plan_seq(&mut self, seq: usize, k: usize) -> Result<Planned, EngineError> {
        let bug = || EngineError(format!("engine bug: sequence {seq} vanished"));
        let s = self.seqs.get(&seq).ok_or_else(bug)?;
        let (pos0, mut ids) = match s.chunks.front() {
            Some((p, c)) => (*p, c.clone()),
            None => (s.prompt_len + s.generated - 1, vec![s.last_id]),
        };
        let draws = s.chunks.len() <= 1;
        // (The proposer reads the ids in place: a copy of every sequence's
        // history each plan would cost more than most drafts save.)
        let (draft, ask) = match self.spec.as_mut() {
            Some(sp) => {
                if k == 0 && s.chunks.is_empty() {
                    sp.shadow(seq, &s.ids);
                }
                (sp.draft(seq, &s.ids, k), if draws { sp.ask(seq, s.chunks.is_empty()) } else { Ask::CacheOnly })
            }
            None => (Vec::new(), Ask::CacheOnly),
        };
        ids.extend_from_slice(&draft);
        // The draft head writes its own rows up to K − 1 positions past the
        // step's when it proposes after it: blocks for them come now.
        let ahead = match ask {
            Ask::Drafts(n) if draws => n.saturating_sub(1),
            _ => 0,
        };
        if let Some(p) = self.reach(seq, pos0, &mut ids, ahead)? {
            return Ok(p);
        }
        let s = self.seqs.get_mut(&seq).ok_or_else(bug)?;
        // A decode item's rows after the first are its draft.
        s.drafts = if s.chunks.pop_front().is_none() { ids[1..].to_vec() } else { Vec::new() };
        if s.chunks.is_empty() {
            s.phase = Phase::Decoding;
        }
        s.busy = true;
        let blocks = Kv::unsent(&mut s.kv);
        Ok(Planned::Step(SeqStep { seq, pos0, drafts: s.drafts.clone(), ids, blocks, ask }))
    }

    /// The blocks positions `pos0..pos0 + ids.len() + ahead` reach; when the
    /// pool is out of them, a draft is dropped first, then the latest-arrived
    /// running sequence not in flight gives its back. `None` once `seq`
    /// holds them.
    fn reach(&mut self, seq: usize, pos0: usize, ids: &mut Vec<i64>, ahead: usize) -> Result<Option<Planned>, EngineError> {
        loop {
            let s = self.seqs.get_mut(&seq).ok_or_else(|| EngineError(format!("engine bug: sequence {seq} vanished")))?;
            let end = pos0 + ids.len();
            let reach = (end + ahead).min(s.capacity());
            if self.kv.grow(&mut s.kv, reach) || (ahead > 0 && reach > end && self.kv.grow(&mut s.kv, end)) {
                return Ok(None);
            }
            if ids.len() > 1 && s.chunks.is_empty() {
                ids.truncate(1);
                continue;
            }
            // Only a later arrival gives way, so the oldest request always
            // goes on: the latest not in flight, or `seq` itself when no
            // later one is in flight either (else it waits for those).
            let me = s.arrival;
            let later_busy = self.seqs.values().any(|v| v.phase.running() && v.busy && v.arrival > me);
            let victim = self
                .seqs
                .iter()
                .filter(|(_, v)| v.phase.running() && !v.busy && v.arrival >= me)
                .max_by_key(|(_, v)| v.arrival)
                .map(|(&k, _)| k);
            match victim {
                Some(v) if v != seq => self.preempt(v),
                Some(_) if !later_busy => {
                    self.preempt(seq);
                    return Ok(Some(Planned::Preempted));
                }
                _ => return Ok(Some(Planned::Stalled)),
            }
        }
    }
}
