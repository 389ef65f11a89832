//! The first stage's view of the KV pool: which blocks each sequence
//! holds, and the prefix cache (lookups when a sequence starts or resumes,
//! commits once a step that filled a block has come back from the last
//! stage, so every stage has written it). Every stage's pool has the same
//! block count, so these ids are every stage's: each step carries the
//! blocks its sequences took since their last step.

use m3c_contract::blocks::{blocks_for, image_extra, BlockHash, BlockId};
use m3c_kvpool::BlockPool;
use std::collections::HashMap;

/// An image of a sequence, for the hashes of the blocks its rows are in:
/// its content hash and the positions of its placeholder rows.
pub type ImageRows = ([u8; 32], Vec<usize>);

/// A sequence's blocks.
#[derive(Debug, Default)]
pub struct SeqBlocks {
    /// The pool block of each `kv_block` positions, in order.
    pub blocks: Vec<BlockId>,
    /// How many of `blocks` the stages have been told of.
    sent: usize,
    /// How many of its first blocks are known to the cache (found there or
    /// committed).
    committed: usize,
    /// Blocks it is computing that others with the same prefix wait for.
    pending: Vec<BlockHash>,
}

pub struct Kv {
    pool: BlockPool,
    pub block: usize,
    /// Automatic prefix caching (`--no-enable-prefix-caching` turns it off).
    pub caching: bool,
    /// Blocks being computed (not yet committed), by contents: the
    /// sequence computing each. A sequence whose next block is one of these
    /// waits for it rather than computing it a second time.
    pending: HashMap<BlockHash, usize>,
    /// KV-cache events (blocks stored in and evicted from the prefix
    /// cache, in order), kept only when asked for (`--kv-events`).
    pub events: Option<Vec<m3c_contract::protocol::Event>>,
}

/// The hashes of the full blocks of `ids`, extending `chain` (which holds
/// the first ones already).
pub fn extend_chain(chain: &mut Vec<BlockHash>, ids: &[i64], images: &[ImageRows], block: usize) {
    BlockHash::extend_chain(chain, ids, block, |i| image_extra(images, i * block, block));
}

impl Kv {
    pub fn new(blocks: usize, block: usize, caching: bool) -> Kv {
        Kv { pool: BlockPool::new(blocks), block, caching, pending: HashMap::new(), events: None }
    }

    pub fn total(&self) -> usize {
        self.pool.total()
    }

    /// Blocks a sequence could take now.
    pub fn available(&self) -> usize {
        self.pool.available()
    }

    /// (blocks sequences hold, cached blocks nobody holds, all blocks).
    pub fn usage(&self) -> (usize, usize, usize) {
        (self.pool.in_use(), self.pool.cached_idle(), self.pool.total())
    }

    /// More blocks positions `0..end` need beyond what `s` holds.
    pub fn need(&self, s: &SeqBlocks, end: usize) -> usize {
        blocks_for(end, self.block).saturating_sub(s.blocks.len())
    }

    /// For a sequence that holds no block: takes the cached blocks of the
    /// longest prefix of `chain` in the cache (at most `limit`); returns
    /// the positions they cover.
    pub fn lookup(&mut self, s: &mut SeqBlocks, chain: &[BlockHash], limit: usize) -> usize {
        debug_assert!(s.blocks.is_empty());
        if !self.caching {
            return 0;
        }
        for h in chain.iter().take(limit) {
            match self.pool.lookup(h) {
                Some(id) => s.blocks.push(id),
                None => break,
            }
        }
        s.committed = s.blocks.len();
        s.blocks.len() * self.block
    }

    /// Whether block `i` of `chain` is being computed by a sequence other
    /// than `seq` (which should then wait for it).
    pub fn computed_elsewhere(&self, chain: &[BlockHash], i: usize, seq: usize) -> bool {
        self.caching && chain.get(i).and_then(|h| self.pending.get(h)).is_some_and(|&other| other != seq)
    }

    /// Records that `seq` computes blocks `from..` of `chain` (those no one
    /// else computes yet).
    pub fn will_compute(&mut self, s: &mut SeqBlocks, chain: &[BlockHash], from: usize, seq: usize) {
        if !self.caching {
            return;
        }
        for h in chain.iter().skip(from) {
            if !self.pending.contains_key(h) && !self.pool.contains(h) {
                self.pending.insert(*h, seq);
                s.pending.push(*h);
            }
        }
    }

    /// Blocks for positions `0..end`; false, with nothing taken, when the
    /// pool has too few.
    pub fn grow(&mut self, s: &mut SeqBlocks, end: usize) -> bool {
        let need = self.need(s, end);
        if need > self.pool.available() {
            return false;
        }
        for _ in 0..need {
            match self.pool.alloc() {
                Some(id) => s.blocks.push(id),
                None => return false,
            }
        }
        let evicted = self.pool.take_evicted();
        if let (Some(events), false) = (self.events.as_mut(), evicted.is_empty()) {
            events.push(m3c_contract::protocol::Event::BlocksRemoved { hashes: evicted });
        }
        true
    }

    /// The blocks the stages have not been told of yet (now told).
    pub fn unsent(s: &mut SeqBlocks) -> Vec<u32> {
        let new = s.blocks[s.sent..].to_vec();
        s.sent = s.blocks.len();
        new
    }

    /// Once every stage has written positions `0..done` of a sequence
    /// whose full blocks hash to `chain` (its ids `ids`), those blocks
    /// become shareable.
    pub fn commit(&mut self, s: &mut SeqBlocks, chain: &[BlockHash], ids: &[i64], done: usize) {
        if !self.caching {
            return;
        }
        let full = (done / self.block).min(s.blocks.len()).min(chain.len());
        while s.committed < full {
            let (i, h) = (s.committed, chain[s.committed]);
            let stored = self.pool.commit(s.blocks[i], h);
            if let (Some(events), true) = (self.events.as_mut(), stored) {
                let tokens = ids.get(i * self.block..(i + 1) * self.block).unwrap_or_default().to_vec();
                events.push(m3c_contract::protocol::Event::BlockStored { parent: i.checked_sub(1).map(|p| chain[p]), hash: h, tokens });
            }
            if let Some(k) = s.pending.iter().position(|p| *p == h) {
                s.pending.swap_remove(k);
                self.pending.remove(&h);
            }
            s.committed += 1;
        }
    }

    /// Gives every block of `s` back (committed ones stay cached) and
    /// forgets what it was computing.
    pub fn release(&mut self, s: &mut SeqBlocks) {
        for b in s.blocks.drain(..) {
            self.pool.release(b);
        }
        for h in s.pending.drain(..) {
            self.pending.remove(&h);
        }
        s.sent = 0;
        s.committed = 0;
    }
}
