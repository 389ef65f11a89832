//! The first stage's cache of encoded image and video features, by content
//! (vLLM's multimodal cache): a grid's features depend only on its patch
//! rows and size, so a repeated image or video chunk is taken from here
//! instead of encoded again. Bounded in bytes; the least recently used
//! entries are given up first.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// A grid's content hash (its size and every patch value).
pub type GridKey = [u8; 32];

/// Encoded features by content, the least recently used given up first
/// once the bytes pass the bound.
pub struct EncoderCache {
    limit: u64,
    entries: HashMap<GridKey, (Arc<Vec<f32>>, u64)>,
    /// Last use → key, oldest first.
    order: BTreeMap<u64, GridKey>,
    clock: u64,
    bytes: u64,
    pub hits: u64,
    pub misses: u64,
}

impl EncoderCache {
    pub fn new(limit: u64) -> EncoderCache {
        EncoderCache { limit, entries: HashMap::new(), order: BTreeMap::new(), clock: 0, bytes: 0, hits: 0, misses: 0 }
    }

    /// The features of grid `key`, counted as a hit or a miss.
    pub fn get(&mut self, key: &GridKey) -> Option<Arc<Vec<f32>>> {
        self.clock += 1;
        let Some((feats, used)) = self.entries.get_mut(key) else {
            self.misses += 1;
            return None;
        };
        self.order.remove(used);
        *used = self.clock;
        self.order.insert(self.clock, *key);
        self.hits += 1;
        Some(feats.clone())
    }

    /// Keeps `feats` for `key`, giving up the oldest entries to stay within
    /// the bound (features larger than the whole bound are not kept).
    pub fn put(&mut self, key: GridKey, feats: Arc<Vec<f32>>) {
        let size = feats.len() as u64 * 4;
        if size > self.limit || self.entries.contains_key(&key) {
            return;
        }
        while self.bytes + size > self.limit {
            let Some((_, old)) = self.order.pop_first() else { break };
            if let Some((f, _)) = self.entries.remove(&old) {
                self.bytes -= f.len() as u64 * 4;
            }
        }
        self.clock += 1;
        self.order.insert(self.clock, key);
        self.entries.insert(key, (feats, self.clock));
        self.bytes += size;
    }

    /// (entries, bytes) held.
    pub fn held(&self) -> (u64, u64) {
        (self.entries.len() as u64, self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_keeps_what_fits_and_gives_up_the_oldest() {
        let mut c = EncoderCache::new(40);
        let f = |n: usize| Arc::new(vec![0f32; n]);
        c.put([1; 32], f(4));
        c.put([2; 32], f(4));
        assert!(c.get(&[1; 32]).is_some());
        // 16 + 16 + 16 > 40: the least recently used (2) goes.
        c.put([3; 32], f(4));
        assert!(c.get(&[2; 32]).is_none());
        assert!(c.get(&[1; 32]).is_some() && c.get(&[3; 32]).is_some());
        assert_eq!(c.held(), (2, 32));
        // Larger than the whole bound: not kept.
        c.put([4; 32], f(11));
        assert!(c.get(&[4; 32]).is_none());
        assert_eq!((c.hits, c.misses), (3, 2));
    }
}
