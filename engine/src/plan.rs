//! What the engine asks the stages to do: one [`StepPlan`] per
//! micro-batch, a [`SeqStep`] per sequence in it. The runtime executes a
//! plan as it is (the rows through every stage, the blocks into each
//! sequence's table, the drafts verified, the proposals asked of the last
//! stage's draft head) and feeds what came back to the engine.

/// One sequence's part of a micro-batch step, as the stages see it: its
/// rows are positions `pos0..pos0 + rows` (the wire and the stage entry
/// carry this).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment {
    pub seq: usize,
    pub pos0: usize,
    pub rows: usize,
}

/// What the last stage's draft head (EAGLE3) is asked to do after a step
/// of a sequence. On the wire it is one word: K, 0 or −1
/// ([`Ask::word`], [`Ask::from_word`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ask {
    /// Nothing: the head does not run for it (its head cache then has
    /// holes, which only make later proposals worse).
    Nothing,
    /// Only its cache rows, so later proposals can be made (what a step
    /// asks when nothing else is asked: the wire's empty list).
    #[default]
    CacheOnly,
    /// This many proposals for its next step.
    Drafts(usize),
}

impl Ask {
    /// The wire's word.
    pub fn word(self) -> i64 {
        match self {
            Ask::Nothing => -1,
            Ask::CacheOnly => 0,
            Ask::Drafts(k) => k as i64,
        }
    }

    /// From the wire's word.
    pub fn from_word(w: i64) -> Ask {
        match w {
            ..=-1 => Ask::Nothing,
            0 => Ask::CacheOnly,
            k => Ask::Drafts(k as usize),
        }
    }
}

/// One sequence's step in a micro-batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqStep {
    /// The rows: positions `pos0..pos0 + ids.len()`.
    pub seq: usize,
    pub pos0: usize,
    /// The ids fed: a prefill chunk, or the last token then its drafts.
    pub ids: Vec<i64>,
    /// Blocks it took since its last step (appended to its table on every
    /// stage, in order).
    pub blocks: Vec<u32>,
    /// The drafts this step verifies (the rows after the first).
    pub drafts: Vec<i64>,
    /// What the draft head does after this step.
    pub ask: Ask,
}

impl SeqStep {
    pub fn segment(&self) -> Segment {
        Segment { seq: self.seq, pos0: self.pos0, rows: self.ids.len() }
    }
}

/// One micro-batch: the sequences that step together, in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepPlan {
    pub seqs: Vec<SeqStep>,
}

impl StepPlan {
    pub fn segments(&self) -> Vec<Segment> {
        self.seqs.iter().map(SeqStep::segment).collect()
    }

    /// Every row's id, sequence by sequence.
    pub fn ids(&self) -> Vec<i64> {
        self.seqs.iter().flat_map(|s| s.ids.iter().copied()).collect()
    }

    pub fn rows(&self) -> usize {
        self.seqs.iter().map(|s| s.ids.len()).sum()
    }

    /// Whether any sequence verifies drafts.
    pub fn verifies(&self) -> bool {
        self.seqs.iter().any(|s| !s.drafts.is_empty())
    }

    /// Whether every sequence decodes (feeds its last token, and its drafts
    /// if any): the steps whose time speculation's cost model learns from
    /// (a prefill chunk's rows say little of a verify step's).
    pub fn decodes_only(&self) -> bool {
        self.seqs.iter().all(|s| s.ids.len() == s.drafts.len() + 1)
    }

    /// Whether any sequence took blocks.
    pub fn grows(&self) -> bool {
        self.seqs.iter().any(|s| !s.blocks.is_empty())
    }

    /// Whether any sequence asks the draft head for something.
    pub fn asks(&self) -> bool {
        self.seqs.iter().any(|s| s.ask != Ask::CacheOnly)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_travel_as_one_word() {
        for a in [Ask::Nothing, Ask::CacheOnly, Ask::Drafts(1), Ask::Drafts(5)] {
            assert_eq!(Ask::from_word(a.word()), a);
        }
        assert_eq!(Ask::from_word(-7), Ask::Nothing);
    }

    #[test]
    fn a_plan_lists_its_rows_in_order() {
        let p = StepPlan {
            seqs: vec![
                SeqStep { seq: 4, pos0: 0, ids: vec![1, 2, 3], blocks: vec![0], drafts: vec![], ask: Ask::CacheOnly },
                SeqStep { seq: 7, pos0: 9, ids: vec![5, 6], blocks: vec![], drafts: vec![6], ask: Ask::Drafts(2) },
            ],
        };
        assert_eq!(p.segments(), [Segment { seq: 4, pos0: 0, rows: 3 }, Segment { seq: 7, pos0: 9, rows: 2 }]);
        assert_eq!(p.ids(), [1, 2, 3, 5, 6]);
        assert_eq!(p.rows(), 5);
        assert!(p.verifies() && p.grows() && p.asks() && !p.decodes_only());
        assert!(StepPlan { seqs: p.seqs[1..].to_vec() }.decodes_only());
    }
}
