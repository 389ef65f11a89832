//! The KV block pool: every layer's caches are stored in blocks of `B`
//! positions, and this is the one allocator of their ids, run by the first
//! stage for the whole pipeline (every stage has the same block count, and
//! the steps carry the ids each sequence takes).
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

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// A block's id: its index in every layer's pool.
pub type BlockId = u32;

/// The most blocks a pool may have (2^31 positions at MiniMax-M3's 128).
pub const MAX_BLOCKS: usize = 1 << 24;

/// What a full block holds, as a chain: the hash of the previous block's
/// [`BlockHash`] (or none, for a sequence's first block), the block's token
/// ids and what else decides its rows (an image's content hash for image
/// placeholder rows). Equal hashes mean equal cache rows on every stage,
/// because each row's keys and values depend only on the rows before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// The hash of the block after `prev` (none for the first block) holding
    /// `ids`, with `extra` the bytes of what else its rows depend on (see
    /// [`image_extra`]; empty for text).
    pub fn chain(prev: Option<&BlockHash>, ids: &[i64], extra: &[u8]) -> BlockHash {
        let mut h = Sha256::new();
        h.update(b"m3c-block-v1");
        match prev {
            Some(p) => {
                h.update([1u8]);
                h.update(p.0);
            }
            None => h.update([0u8]),
        }
        h.update((ids.len() as u64).to_le_bytes());
        for id in ids {
            h.update(id.to_le_bytes());
        }
        h.update((extra.len() as u64).to_le_bytes());
        h.update(extra);
        BlockHash(h.finalize().into())
    }

    /// Extends `chain` (the hashes of the first full blocks of `ids`) to
    /// every full block of `ids`: block `i` covers ids `i·B .. (i+1)·B`; a
    /// last partial block has none. `extra(i)` gives the bytes of block
    /// `i`'s non-token inputs.
    pub fn extend_chain(chain: &mut Vec<BlockHash>, ids: &[i64], block: usize, extra: impl Fn(usize) -> Vec<u8>) {
        if block == 0 {
            return;
        }
        while (chain.len() + 1) * block <= ids.len() {
            let i = chain.len();
            let h = BlockHash::chain(chain.last(), &ids[i * block..(i + 1) * block], &extra(i));
            chain.push(h);
        }
    }
}

/// The extra bytes of a block with image placeholder rows: for each image
/// whose placeholders overlap positions `start..start + len`, its content
/// hash and the index of its first placeholder in the block. `images` is
/// each image's (content hash, positions of its placeholder rows, ascending).
pub fn image_extra(images: &[([u8; 32], Vec<usize>)], start: usize, len: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for (hash, rows) in images {
        let first = rows.partition_point(|&p| p < start);
        if rows.get(first).is_some_and(|&p| p < start + len) {
            out.extend_from_slice(hash);
            out.extend((first as u64).to_le_bytes());
        }
    }
    out
}

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
    pub fn commit(&mut self, id: BlockId, hash: BlockHash) {
        let Some(b) = self.blocks.get_mut(id as usize) else { return };
        if b.refs == 0 || b.hash.is_some() || self.by_hash.contains_key(&hash) {
            return;
        }
        b.hash = Some(hash);
        self.by_hash.insert(hash, id);
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

/// The blocks that positions `0..positions` need.
pub fn blocks_for(positions: usize, block: usize) -> usize {
    positions.div_ceil(block.max(1))
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

    #[test]
    fn hash_chains_differ_by_prefix_ids_and_images() {
        let ids = [1i64, 2, 3, 4, 5, 6, 7, 8, 9];
        let chain = |ids: &[i64], extra: &dyn Fn(usize) -> Vec<u8>| {
            let mut c = Vec::new();
            BlockHash::extend_chain(&mut c, ids, 4, extra);
            c
        };
        let c = chain(&ids, &|_| Vec::new());
        assert_eq!(c.len(), 2);
        let mut other = ids;
        other[0] = 0;
        let d = chain(&other, &|_| Vec::new());
        // A change in block 0 changes every later hash too.
        assert!(c[0] != d[0] && c[1] != d[1]);
        let imgs = vec![([7u8; 32], vec![5usize, 6])];
        let e = chain(&ids, &|i| image_extra(&imgs, i * 4, 4));
        assert_eq!(e[0], c[0]);
        assert_ne!(e[1], c[1]);
        let imgs2 = vec![([8u8; 32], vec![5usize, 6])];
        let f = chain(&ids, &|i| image_extra(&imgs2, i * 4, 4));
        assert_ne!(f[1], e[1]);
    }
}
