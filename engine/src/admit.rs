//! Admission: waiting sequences start, oldest first (preempted ones are at
//! the head of the line), while the pool has the blocks of their first
//! step.

use crate::lifecycle::Phase;
use crate::{kv, Effect, Engine};
use m3c_contract::blocks::blocks_for;
use m3c_contract::protocol::Event;

/// Whether a waiting sequence starts now.
enum Start {
    Now,
    /// Another sequence is computing its next block: it waits for that
    /// one (the others behind it may go on).
    AfterOther,
    /// The pool is short: it and everything behind it wait.
    NoRoom,
}

impl Engine {
    /// Starts waiting sequences while the pool has the blocks of their
    /// first step (beyond one block per running sequence, so those can go
    /// on): each takes the longest prefix the cache holds and prefills the
    /// rest, or, preempted, recomputes what it had. Returns whether any
    /// started.
    pub fn admit(&mut self) -> bool {
        let mut started = false;
        let mut deferred = Vec::new();
        let reserved: usize =
            self.seqs.values().filter(|s| s.phase != Phase::Encoding).map(|s| blocks_for(s.capacity(), self.kv.block)).sum();
        while let Some(seq) = self.waiting.pop_front() {
            match self.try_start(seq, reserved) {
                Start::Now => started = true,
                Start::AfterOther => deferred.push(seq),
                Start::NoRoom => {
                    deferred.push(seq);
                    break;
                }
            }
        }
        // The deferred keep their places at the head of the queue.
        for seq in deferred.into_iter().rev() {
            self.waiting.push_front(seq);
        }
        started
    }

    /// Sequence `seq` takes its cached prefix and the blocks of its first
    /// step, and becomes ready; or gives back what it took and waits.
    fn try_start(&mut self, seq: usize, reserved: usize) -> Start {
        let running = self.running();
        let (b, chunk, score_last) = (self.kv.block, self.cfg.chunk, self.cfg.score_last);
        let Some(s) = self.seqs.get_mut(&seq) else { return Start::Now };
        // Its rows up to the next draw: computed, or from the cache.
        let draw = s.draw_row();
        let cold = score_last || (s.prompt_rows && s.generated == 0);
        if self.kv.caching && s.chain.len() * b < s.ids.len() {
            kv::extend_chain(&mut s.chain, &s.ids, &s.images, b);
        }
        let limit = if cold { 0 } else { draw / b };
        let hit = self.kv.lookup(&mut s.kv, &s.chain, limit);
        let first_end = hit.saturating_add(chunk).min(draw + 1);
        let next_block = hit / b;
        let wait_for_other = hit < draw && !cold && self.kv.computed_elsewhere(&s.chain, next_block, seq);
        let need = self.kv.need(&s.kv, first_end);
        // Beyond its own, a block for each running sequence to go on with,
        // unless every live sequence's whole need fits the pool (then none
        // can run out: an `m3c run` sizes it so).
        let watermark = if reserved <= self.kv.total() { 0 } else { running };
        let room = self.kv.available() >= need + watermark;
        if wait_for_other || (!room && running > 0) || !self.kv.grow(&mut s.kv, first_end) {
            self.kv.release(&mut s.kv);
            return if wait_for_other { Start::AfterOther } else { Start::NoRoom };
        }
        // Its steps up to the next draw: chunks from the first row not
        // cached; a resumed sequence then feeds its last token as usual.
        let upto = if s.generated == 0 { s.prompt_len } else { draw };
        s.chunks = s.ids[hit..upto].chunks(chunk).enumerate().map(|(k, c)| (hit + k * chunk, c.to_vec())).collect();
        if !cold {
            self.kv.will_compute(&mut s.kv, &s.chain, next_block, seq);
        }
        s.phase = if s.chunks.is_empty() { Phase::Decoding } else { Phase::Prefilling };
        if !s.counted {
            s.counted = true;
            let queried = s.prompt_len;
            self.effects.push(Effect::Event(Event::Prefix { seq, queried, hit: hit.min(queried) }));
        }
        self.ready.push_back(seq);
        Start::Now
    }
}
