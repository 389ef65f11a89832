//! Which replica takes a request (`--data-parallel-size`), as SGLang's
//! cache-aware router decides: the one whose prefix cache holds the
//! longest start of its prompt, when that is at least half the prompt and
//! the replica is less than a batch busier than the least busy one;
//! otherwise the least busy, and among equals the one holding the fewest
//! blocks, so that new prefixes spread over the replicas instead of
//! following the short start (a chat template's) that every prompt shares.
//! What each replica holds is known from its first stage's block events
//! (stored, evicted) and from the prompts routed to it, whose blocks it
//! will hold once they are prefilled: requests of one prefix that arrive
//! together go to one replica, not one each.

use m3c_contract::blocks::BlockHash;
use std::collections::HashMap;

/// A replica that can take requests: its load (requests running and
/// waiting in the front), how many leading blocks of the prompt its cache
/// holds, and how many blocks it holds in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub load: usize,
    pub matched: usize,
    pub held: usize,
}

/// The replica for a request of `blocks` full blocks among `candidates`
/// (`None`: down). The best match wins when it covers at least half the
/// prompt and its load is below the least load plus `slack` (a batch);
/// otherwise the least loaded, ties to the one holding fewer blocks, then
/// the lower index. `None` when every replica is down.
pub fn pick(candidates: &[Option<Candidate>], blocks: usize, slack: usize) -> Option<usize> {
    let up = || candidates.iter().enumerate().filter_map(|(i, c)| c.map(|c| (i, c)));
    let (least, low) = up().min_by_key(|&(i, c)| (c.load, c.held, i))?;
    let (best, b) = up().min_by_key(|&(i, c)| (std::cmp::Reverse(c.matched), c.load, i))?;
    if b.matched > 0 && 2 * b.matched >= blocks && b.load < low.load + slack.max(1) {
        Some(best)
    } else {
        Some(least)
    }
}

/// The block hashes a replica is known or expected to hold, each with when
/// it was last stored or routed there.
#[derive(Debug, Default)]
pub struct Affinity {
    held: HashMap<BlockHash, u64>,
    tick: u64,
    /// Hashes kept at most: those routed but never stored (a request
    /// cancelled before its prefill) age out, oldest first.
    cap: usize,
}

impl Affinity {
    pub fn new(cap: usize) -> Affinity {
        Affinity { held: HashMap::new(), tick: 0, cap: cap.max(16) }
    }

    /// How many leading blocks of `chain` this replica holds.
    pub fn matched(&self, chain: &[BlockHash]) -> usize {
        chain.iter().take_while(|h| self.held.contains_key(h)).count()
    }

    /// `chain`'s blocks will be held here (a request was routed here).
    pub fn routed(&mut self, chain: &[BlockHash]) {
        for h in chain {
            self.touch(*h);
        }
    }

    /// The first stage stored a block in its prefix cache.
    pub fn stored(&mut self, h: BlockHash) {
        self.touch(h);
    }

    /// The first stage evicted these blocks.
    pub fn removed(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            self.held.remove(h);
        }
    }

    /// The pipeline (re)started with an empty pool.
    pub fn clear(&mut self) {
        self.held.clear();
    }

    /// Blocks held or expected.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    fn touch(&mut self, h: BlockHash) {
        self.tick += 1;
        self.held.insert(h, self.tick);
        if self.held.len() > self.cap {
            // Keep the newest three quarters.
            let mut ticks: Vec<u64> = self.held.values().copied().collect();
            let cut = ticks.len() - self.cap * 3 / 4;
            let (_, &mut at, _) = ticks.select_nth_unstable(cut);
            self.held.retain(|_, t| *t >= at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(ids: &[i64]) -> Vec<BlockHash> {
        let mut c = Vec::new();
        BlockHash::extend_chain(&mut c, ids, 2, |_| Vec::new());
        c
    }

    #[test]
    fn the_longest_match_wins_within_a_batch_of_the_least_load() {
        let c = |load, matched, held| Some(Candidate { load, matched, held });
        // No match anywhere: the least loaded, then the emptier cache, then the lower index.
        assert_eq!(pick(&[c(3, 0, 0), c(1, 0, 0), c(1, 0, 0)], 4, 8), Some(1));
        assert_eq!(pick(&[c(1, 0, 50), c(1, 0, 20)], 4, 8), Some(1));
        // A match of half the prompt or more wins over a lighter load.
        assert_eq!(pick(&[c(5, 2, 9), c(0, 0, 0)], 4, 8), Some(0));
        // ... the longer one over a shorter.
        assert_eq!(pick(&[c(1, 2, 9), c(2, 3, 9)], 4, 8), Some(1));
        // ... but not once it is a whole batch busier.
        assert_eq!(pick(&[c(8, 4, 9), c(0, 0, 0)], 4, 8), Some(1));
        // A short shared start (a chat template's) does not pull a new
        // prefix to the replica that has it: the emptier one takes it.
        assert_eq!(pick(&[c(0, 1, 40), c(0, 0, 10)], 10, 8), Some(1));
        // A replica that is down takes nothing; none up: none.
        assert_eq!(pick(&[None, c(9, 0, 0)], 4, 8), Some(1));
        assert_eq!(pick(&[None, None], 4, 8), None);
    }

    #[test]
    fn routed_and_stored_blocks_match_and_evicted_ones_do_not() {
        let mut a = Affinity::new(64);
        let p = chain(&[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(p.len(), 3);
        assert_eq!(a.matched(&p), 0);
        a.routed(&p[..2]);
        assert_eq!(a.matched(&p), 2);
        a.stored(p[2]);
        assert_eq!(a.matched(&p), 3);
        // An evicted middle block ends the match there (the chain is a prefix).
        a.removed(&[p[1]]);
        assert_eq!(a.matched(&p), 1);
        a.clear();
        assert_eq!(a.matched(&p), 0);
    }

    #[test]
    fn the_oldest_hashes_age_out_past_the_cap() {
        let mut a = Affinity::new(16);
        let old = chain(&[9, 9]);
        a.routed(&old);
        for i in 0..40 {
            a.routed(&chain(&[i, i + 1]));
        }
        assert!(a.len() <= 16, "{}", a.len());
        assert_eq!(a.matched(&old), 0);
        assert_eq!(a.matched(&chain(&[39, 40])), 1);
    }
}
