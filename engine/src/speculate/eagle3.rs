//! EAGLE3 (vLLM's `eagle3`): a draft head compiled into the last stage
//! proposes a sequence's next tokens right after each of its steps, from
//! the target's hidden states, and the proposals come back with the step's
//! ids. The proposer keeps them until the sequence's next step, and tells
//! the head what to do after each step ([`Ask`]): propose, only keep its
//! cache rows, or nothing at all when the sequence will not speculate
//! (then the head costs that step nothing; its cache then has holes,
//! which only make later proposals worse).

use super::Proposer;
use crate::plan::Ask;
use std::collections::BTreeMap;

pub struct Eagle3Proposer {
    /// vLLM's `num_speculative_tokens`.
    pub tokens: usize,
    proposals: BTreeMap<usize, Vec<i64>>,
}

impl Eagle3Proposer {
    pub fn new(tokens: usize) -> Eagle3Proposer {
        Eagle3Proposer { tokens, proposals: BTreeMap::new() }
    }
}

impl Proposer for Eagle3Proposer {
    fn method(&self) -> &'static str {
        "eagle3"
    }

    fn max_tokens(&self) -> usize {
        self.tokens
    }

    fn draft(&mut self, seq: usize, _ids: &[i64], limit: usize) -> Vec<i64> {
        self.proposals.get(&seq).map_or_else(Vec::new, |p| p.iter().copied().take(limit).collect())
    }

    fn ask(&self, _seq: usize, next: usize) -> Ask {
        if next > 0 {
            Ask::Drafts(next.min(self.tokens))
        } else {
            Ask::Nothing
        }
    }

    fn runs_on_stages(&self) -> bool {
        true
    }

    fn proposed(&mut self, seq: usize, proposals: &[i64]) {
        self.proposals.insert(seq, proposals.to_vec());
    }

    fn forget(&mut self, seq: usize) {
        self.proposals.remove(&seq);
    }
}
