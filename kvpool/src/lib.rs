//! The KV block pool's allocator: every layer's caches are stored in
//! blocks of `B` positions, and this is the one allocator of their ids, run
//! by the first stage for the whole pipeline (every stage has the same block
//! count, and the steps carry the ids each sequence takes). The ids and the
//! content hashes are the contract's formats (`m3c_contract::blocks`).
//!
//! A block is either
//! - **free** (on the free list, no contents that matter),
//! - **in use** (held by one or more sequences: a reference count), or
//! - **cached** (no sequence holds it, but it is full and its contents are
//!   known by a [`BlockHash`]; it may be taken back by a later sequence with
//!   the same prefix, or evicted, least recently released first, when the
//!   free list is empty).
//!
//! Free blocks are handed out lowest id first, so a pool that is never
//! full touches only its low blocks (on the host, memory the OS never had to
//! provide stays untouched), and every decision is a function of the calls
//! made: two pools given the same calls give the same ids.

mod features;
pub use features::{EncoderCache, GridKey};

use m3c_contract::blocks::{BlockHash, BlockId, MAX_BLOCKS};
use std::collections::{BTreeMap, BTreeSet, HashMap};

#[derive(Debug, Clone, Default)]
struct Block {
    refs: u32,
    hash: Option<BlockHash>,
    /// When it was last released to the cache (its LRU key).
    released: u64,
}

/// The allocator of a pool of `total` blocks, with the prefix cache.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    free: BTreeSet<BlockId>,
    by_hash: HashMap<BlockHash, BlockId>,
    /// Cached blocks no sequence holds, by release time: the eviction order.
    evictable: BTreeMap<u64, BlockId>,
    clock: u64,
    /// Hashes of cached blocks evicted since [`BlockPool::take_evicted`]
    /// (what KV-cache events report as removed).
    evicted: Vec<BlockHash>,
}

impl BlockPool {
    pub fn new(total: usize) -> BlockPool {
        let total = total.min(MAX_BLOCKS);
        BlockPool {
            blocks: vec![Block::default(); total],
            free: (0..total as BlockId).collect(),
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            clock: 0,
            evicted: Vec::new(),
        }
    }

    pub fn total(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks a sequence could take now: free ones and evictable cached ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks some sequence holds.
    pub fn in_use(&self) -> usize {
        self.blocks.len() - self.available()
    }

    /// Blocks that hold cached contents (held or not).
    pub fn cached(&self) -> usize {
        self.by_hash.len()
    }

    /// Cached blocks no sequence holds: what stays of a pool when every
    /// sequence has ended.
    pub fn cached_idle(&self) -> usize {
        self.evictable.len()
    }

    /// References to `id` (0 for a free or idle cached block).
    pub fn refs(&self, id: BlockId) -> u32 {
        self.blocks.get(id as usize).map_or(0, |b| b.refs)
    }

    /// A fresh block for one sequence (reference count 1): the lowest free
    /// id, else the least recently released cached block, whose hash is
    /// forgotten. None when every block is in use.
    pub fn alloc(&mut self) -> Option<BlockId> {
        let id = match self.free.pop_first() {
            Some(id) => id,
            None => {
                let (_, id) = self.evictable.pop_first()?;
                if let Some(h) = self.blocks[id as usize].hash.take() {
                    self.by_hash.remove(&h);
                    self.evicted.push(h);
                }
                id
            }
        };
        self.blocks[id as usize].refs = 1;
        Some(id)
    }

    /// The cached block with contents `hash`, now held once more, if there is one.
    pub fn lookup(&mut self, hash: &BlockHash) -> Option<BlockId> {
        let id = *self.by_hash.get(hash)?;
        let b = &mut self.blocks[id as usize];
        if b.refs == 0 {
            self.evictable.remove(&b.released);
        }
        b.refs += 1;
        Some(id)
    }

    /// Whether a block with contents `hash` is cached (nothing changes).
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.by_hash.contains_key(hash)
    }

    /// Records that held block `id` is full with contents `hash`, so later
    /// sequences may share it. When another block already has those
    /// contents, `id` stays uncached (it is freed, not kept, on release).
    /// Returns whether the cache now holds it through `id`.
    pub fn commit(&mut self, id: BlockId, hash: BlockHash) -> bool {
        let Some(b) = self.blocks.get_mut(id as usize) else { return false };
        if b.refs == 0 || b.hash.is_some() || self.by_hash.contains_key(&hash) {
            return false;
        }
        b.hash = Some(hash);
        self.by_hash.insert(hash, id);
        true
    }

    /// The hashes of the cached blocks evicted since the last call.
    pub fn take_evicted(&mut self) -> Vec<BlockHash> {
        std::mem::take(&mut self.evicted)
    }

    /// Drops one reference to `id`. A block no one holds becomes free, or,
    /// when it has cached contents, the most recently released evictable
    /// block. Releasing a block no one holds is ignored.
    pub fn release(&mut self, id: BlockId) {
        let Some(b) = self.blocks.get_mut(id as usize) else { return };
        if b.refs == 0 {
            return;
        }
        b.refs -= 1;
        if b.refs > 0 {
            return;
        }
        if b.hash.is_some() {
            self.clock += 1;
            b.released = self.clock;
            self.evictable.insert(self.clock, id);
        } else {
            self.free.insert(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u8) -> BlockHash {
        BlockHash([n; 32])
    }

    /// A pool of two blocks, `a` committed with contents `ha` and `b`
    /// with `hb`; `b` released, `a` still held.
    fn two_committed(ha: u8, hb: u8) -> (BlockPool, BlockId, BlockId) {
        let mut p = BlockPool::new(2);
        let (a, b) = (p.alloc().unwrap(), p.alloc().unwrap());
        p.commit(a, h(ha));
        p.commit(b, h(hb));
        p.release(b);
        (p, a, b)
    }

    #[test]
    fn free_blocks_go_lowest_first_and_come_back() {
        let mut p = BlockPool::new(3);
        assert_eq!((p.alloc(), p.alloc()), (Some(0), Some(1)));
        p.release(0);
        assert_eq!(p.alloc(), Some(0));
        assert_eq!(p.alloc(), Some(2));
        assert_eq!(p.alloc(), None);
        assert_eq!(p.in_use(), 3);
    }

    #[test]
    fn cached_blocks_are_shared_then_evicted_least_recent_first() {
        let (mut p, a, b) = two_committed(1, 2);
        p.release(a);
        assert_eq!((p.available(), p.cached_idle()), (2, 2));
        // A hit holds the block again; the other is evicted for a fresh one.
        assert_eq!(p.lookup(&h(1)), Some(a));
        assert_eq!(p.alloc(), Some(b));
        assert!(!p.contains(&h(2)));
        assert_eq!(p.lookup(&h(1)), Some(a));
        assert_eq!(p.refs(a), 2);
    }

    #[test]
    fn a_second_block_with_known_contents_is_not_cached() {
        let (mut p, _, b) = two_committed(1, 1);
        assert_eq!(p.cached_idle(), 0);
        assert_eq!(p.alloc(), Some(b));
    }
}
