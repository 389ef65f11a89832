//! Prompt lookup (vLLM's `ngram`): the draft is what followed the
//! longest recent n-gram's earliest earlier occurrence in the sequence's
//! own ids (prompt and output). The configuration is the contract's
//! `Ngram` (`--speculative-config`); the lookup and the proposer are here.

use super::Proposer;
use m3c_contract::speculative::Ngram;

/// The n-gram proposer.
pub struct NgramProposer {
    pub config: Ngram,
}

impl Proposer for NgramProposer {
    fn method(&self) -> &'static str {
        "ngram"
    }

    fn max_tokens(&self) -> usize {
        self.config.tokens
    }

    fn draft(&mut self, _seq: usize, ids: &[i64], limit: usize) -> Vec<i64> {
        lookup(&self.config, ids, limit)
    }
}

/// The draft for a sequence whose ids so far are `ids`, at most `limit`
/// tokens, as vLLM's prompt lookup proposes it: the longest suffix of
/// `min..=max` tokens that also occurs earlier (the occurrence ends
/// before the last id; it may overlap the suffix), at its earliest
/// occurrence, proposes the ids that followed it. Empty when no suffix
/// of those lengths recurs.
///
/// One pass over the ids (the first stage runs it for every decode
/// step of every sequence): the Z-function of the reversed ids gives,
/// for each earlier end, how long a suffix ends there too.
pub fn lookup(cfg: &Ngram, ids: &[i64], limit: usize) -> Vec<i64> {
    let k = cfg.tokens.min(limit);
    let len = ids.len();
    if k == 0 || len < 2 {
        return Vec::new();
    }
    let rev = |i: usize| ids[len - 1 - i];
    // z[i]: the longest common prefix of the reversed ids and their
    // suffix from i, i.e. how many ids before end `len - i` match the
    // sequence's own last ids.
    let mut z = vec![0usize; len];
    let (mut l, mut r) = (0, 0);
    for i in 1..len {
        let mut n = if i < r { (r - i).min(z[i - l]) } else { 0 };
        while i + n < len && rev(n) == rev(i + n) {
            n += 1;
        }
        if i + n > r {
            (l, r) = (i, i + n);
        }
        z[i] = n;
    }
    // The longest match (at most `max`), at its earliest start: for a
    // given length, the largest i.
    let best = (1..len).map(|i| (z[i].min(cfg.max), i)).max();
    match best {
        Some((n, i)) if n >= cfg.min => ids[len - i..].iter().take(k).copied().collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_takes_the_longest_recurring_suffix_at_its_earliest_match() {
        let n = Ngram { tokens: 3, min: 1, max: 3, disable_by_batch_size: None };
        // Suffix [1, 2] occurs at 0 and at 4; the earliest is followed by 5.
        assert_eq!(lookup(&n, &[1, 2, 5, 6, 1, 2, 9, 8, 7, 1, 2], 8), vec![5, 6, 1]);
        // Capped by the limit, and by the ids that follow the match.
        assert_eq!(lookup(&n, &[1, 2, 5, 6, 1, 2, 9, 8, 7, 1, 2], 2), vec![5, 6]);
        assert_eq!(lookup(&n, &[4, 4], 8), vec![4]);
        // An occurrence may overlap the suffix (only what follows it is proposed).
        assert_eq!(lookup(&n, &[3, 4, 4, 4, 4], 8), vec![4]);
        // The longest suffix wins over a shorter, earlier one.
        assert_eq!(lookup(&n, &[7, 3, 5, 2, 3, 9, 2, 3, 0, 1, 2, 3], 3), vec![9, 2, 3]);
        assert_eq!(lookup(&n, &[1, 2, 3], 8), Vec::<i64>::new());
        let min2 = Ngram { tokens: 3, min: 2, max: 3, disable_by_batch_size: None };
        assert_eq!(lookup(&min2, &[5, 1, 6, 1], 8), Vec::<i64>::new(), "only a 1-gram recurs");
    }

    /// The rule as written: for n from `max` down to `min`, the earliest
    /// start of the last n ids ending before the last id.
    fn propose_plainly(n: &Ngram, ids: &[i64], limit: usize) -> Vec<i64> {
        let (k, len) = (n.tokens.min(limit), ids.len());
        if k == 0 || len < 2 {
            return Vec::new();
        }
        for w in (n.min..=n.max.min(len - 1)).rev() {
            if let Some(start) = (0..len - w).find(|&s| ids[s..s + w] == ids[len - w..]) {
                return ids[start + w..].iter().take(k).copied().collect();
            }
        }
        Vec::new()
    }

    #[test]
    fn the_one_pass_lookup_proposes_what_the_plain_rule_does() {
        // A small alphabet, so suffixes recur at many lengths and places.
        let mut x = 12345u64;
        for _ in 0..3000 {
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let len = (next() % 40) as usize;
            let ids: Vec<i64> = (0..len).map(|_| (next() % 3) as i64).collect();
            let min = 1 + (next() % 4) as usize;
            let n = Ngram { tokens: 1 + (next() % 5) as usize, min, max: min + (next() % 4) as usize, disable_by_batch_size: None };
            let limit = (next() % 8) as usize;
            assert_eq!(lookup(&n, &ids, limit), propose_plainly(&n, &ids, limit), "{n:?} {ids:?} limit {limit}");
        }
    }
}
