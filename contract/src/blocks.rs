//! The KV block pool's formats: every layer's caches are stored in blocks
//! of `B` positions, named by a [`BlockId`]; a full block's contents are
//! named by a [`BlockHash`] chain (what the prefix cache is keyed by). The
//! allocator of the ids, with the prefix cache, is `m3c_kvpool::BlockPool`.
//!
//! (In the allocator, a block is either
//! - **free** (on the free list, no contents that matter),
//! - **in use** (held by one or more sequences: a reference count), or
//! - **cached** (no sequence holds it, but it is full and its contents are
//!   known by a [`BlockHash`]; it may be taken back by a later sequence with
//!   the same prefix, or evicted, least recently released first, when the
//!   free list is empty).
//!
//! Free blocks are handed out lowest id first, and every decision is a
//! function of the calls made.)

use sha2::{Digest, Sha256};

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
    /// Lower-case hex, as the stage protocol writes it.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The hash [`hex`](Self::hex) wrote.
    pub fn from_hex(text: &str) -> Option<BlockHash> {
        if text.len() != 64 || !text.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(BlockHash(out))
    }

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

/// The blocks that positions `0..positions` need.
pub fn blocks_for(positions: usize, block: usize) -> usize {
    positions.div_ceil(block.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

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
