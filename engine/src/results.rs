//! A micro-batch's results: per segment the tokens the last stage drew
//! (none for a prefill chunk, one for a decode step, the accepted drafts
//! and one more for a verify step), which the engine turns into events, a
//! sequence's end or its next turn, and prefix-cache commits.

use crate::drawn::{Drawn, Failure};
use crate::plan::Segment;
use crate::seq::Seq;
use crate::{kv, Effect, Engine, EngineError};
use m3c_contract::protocol::{EndReason, Event};

impl Engine {
    /// Micro-batch `segs` came back with `drawn` (one entry per segment).
    pub fn returned(&mut self, segs: &[Segment], drawn: &[Drawn]) -> Result<(), EngineError> {
        if drawn.len() != segs.len() {
            return Err(EngineError("an id message with one entry per segment expected".into()));
        }
        self.in_flight = self.in_flight.saturating_sub(1);
        for (s, d) in segs.iter().zip(drawn) {
            self.segment_returned(s, d)?;
        }
        Ok(())
    }

    fn segment_returned(&mut self, s: &Segment, d: &Drawn) -> Result<(), EngineError> {
        // Prompt logprobs: row j predicts prompt token pos0 + j + 1.
        for (j, (tok, lp)) in d.prompt.iter().enumerate() {
            self.effects.push(Effect::Event(Event::PromptLogprobs { seq: s.seq, pos: s.pos0 + j + 1, id: *tok, lp: lp.clone() }));
        }
        let l = self.seqs.get_mut(&s.seq).ok_or_else(|| EngineError(format!("ids for sequence {}, which is not live", s.seq)))?;
        l.busy = false;
        let drafts = std::mem::take(&mut l.drafts);
        // The step reached its next draw (else it was a prefill chunk
        // before the prompt's last, or recomputed a resumed sequence's rows).
        let draws = s.pos0 + s.rows == l.prompt_len + l.generated + drafts.len();
        let (taken, mut reason) = take_tokens(l, s, d, draws, &self.cfg, self.token_bytes.as_deref(), &mut self.effects)?;
        if draws && reason.is_none() && (taken == 0 || taken > drafts.len() + 1) {
            // Nothing more to generate: this step only scored the last
            // token (or, with max_new 0, the prompt).
            if l.generated >= l.max_new && taken == 0 {
                reason = Some(EndReason::Length);
            } else {
                return Err(EngineError(format!("{} tokens for sequence {}'s step of {} drafts", taken, s.seq, drafts.len())));
            }
        }
        if let Some(sp) = self.spec.as_mut() {
            sp.proposed(s.seq, &d.proposals);
            if drafts.is_empty() {
                // The step's token: `take_tokens` appended the `taken` it kept.
                if taken > 0 {
                    sp.observe_drawn(s.seq, l.ids[l.ids.len() - taken]);
                }
            } else {
                let accepted = taken.saturating_sub(1).min(drafts.len());
                sp.observe_verify(s.seq, drafts.len(), accepted);
                self.effects.push(Effect::Event(Event::Spec { seq: s.seq, drafted: drafts.len(), accepted }));
            }
        }
        let b = self.kv.block;
        if self.kv.caching && (l.chain.len() + 1) * b <= l.ids.len() {
            kv::extend_chain(&mut l.chain, &l.ids, &l.images, b);
        }
        // Every stage has written these rows: their full blocks can be
        // shared. A verify step's rows hold its fed token and the accepted
        // drafts; those after hold rejected drafts, which the sequence's
        // next steps overwrite.
        let written = if drafts.is_empty() { s.pos0 + s.rows } else { s.pos0 + taken.max(1) };
        self.kv.commit(&mut l.kv, &l.chain, &l.ids, written);
        match reason {
            Some(r) => self.end(s.seq, r),
            None => self.ready.push_back(s.seq),
        }
        Ok(())
    }
}

/// Sequence `l` keeps the tokens its step drew, up to its `max_new`, and
/// the front hears of each; returns how many it kept and why it ends, if
/// it does.
fn take_tokens(
    l: &mut Seq,
    s: &Segment,
    d: &Drawn,
    draws: bool,
    cfg: &crate::Config,
    token_bytes: Option<&[Vec<u8>]>,
    effects: &mut Vec<Effect>,
) -> Result<(usize, Option<EndReason>), EngineError> {
    let mut reason = if l.cancelled { Some(EndReason::Cancelled) } else { None };
    let mut taken = 0;
    for t in &d.tokens {
        if reason.is_some() {
            break;
        }
        if let Some(why) = Failure::of_id(t.id) {
            // Its logits were not finite, or its grammar failed: it ends,
            // the others go on.
            reason = Some(why.end_reason());
            break;
        }
        if !draws {
            return Err(EngineError(format!("a token for sequence {}'s prefill chunk", s.seq)));
        }
        if l.generated >= l.max_new {
            break;
        }
        let id = t.id;
        taken += 1;
        l.generated += 1;
        l.last_id = id;
        l.ids.push(id);
        if let Some(lp) = &t.logprobs {
            effects.push(Effect::Event(Event::Logprobs { seq: s.seq, id: id as u32, lp: lp.clone() }));
        }
        effects.push(Effect::Event(Event::Id { seq: s.seq, id: id as u32 }));
        let eos = !l.ignore_eos && cfg.eos.contains(&id);
        if eos || l.stop_ids.contains(&id) || l.stop.ends(id, token_bytes) {
            reason = Some(EndReason::Stop);
        } else if l.generated >= l.max_new && !cfg.score_last {
            reason = Some(EndReason::Length);
        }
    }
    Ok((taken, reason))
}
