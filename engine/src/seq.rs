//! A request as the engine takes it, and the record it keeps of each
//! sequence while it lives.

use crate::kv::{ImageRows, SeqBlocks};
use crate::lifecycle::Phase;
use crate::stop::StopText;
use m3c_contract::blocks::BlockHash;
use m3c_contract::protocol::SeqRequest;
use std::collections::VecDeque;

/// What the engine needs of a request (the rest of `SeqRequest` is the
/// stages': sampling, grammar, images' pixels).
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub seq: usize,
    pub prompt: Vec<i64>,
    pub max_new: usize,
    pub ignore_eos: bool,
    /// Stop strings (bytes). Under a grammar there are none: the grammar
    /// decides where the output ends.
    pub stops: Vec<Vec<u8>>,
    pub stop_ids: Vec<i64>,
    /// It asked for prompt logprobs: its first start computes every row.
    pub prompt_logprobs: bool,
    /// Its images' content hashes and placeholder rows (prefix-cache keys).
    pub images: Vec<ImageRows>,
    /// What it generated on a pipeline that was lost: it goes on from there.
    pub resumed: Vec<i64>,
}

impl Request {
    /// The engine's part of `a`, with its images' rows.
    pub fn of(a: &SeqRequest, images: Vec<ImageRows>) -> Request {
        Request {
            seq: a.seq,
            prompt: a.prompt.clone(),
            max_new: a.max_new,
            ignore_eos: a.ignore_eos,
            stops: if a.grammar.is_some() { Vec::new() } else { a.stops.clone() },
            stop_ids: a.stop_ids.clone(),
            prompt_logprobs: a.prompt_logprobs.is_some(),
            images,
            resumed: a.resumed.clone(),
        }
    }

    /// The cache rows it may reach: its prompt, its new tokens and the row
    /// its last token is fed in.
    pub fn capacity(&self) -> usize {
        self.prompt.len() + self.max_new + 1
    }
}

/// A live sequence.
#[derive(Debug)]
pub(crate) struct Seq {
    pub phase: Phase,
    pub prompt_len: usize,
    pub max_new: usize,
    pub ignore_eos: bool,
    /// Its inputs so far: the prompt, then each generated token.
    pub ids: Vec<i64>,
    /// The hashes of the full blocks of `ids` (its prefix-cache keys).
    pub chain: Vec<BlockHash>,
    pub images: Vec<ImageRows>,
    /// Steps still to take before its next draw: (first position, ids).
    pub chunks: VecDeque<(usize, Vec<i64>)>,
    pub generated: usize,
    pub last_id: i64,
    /// A step of it is in flight.
    pub busy: bool,
    pub cancelled: bool,
    pub stop: StopText,
    pub stop_ids: Vec<i64>,
    pub kv: SeqBlocks,
    /// When it arrived: the latest arrival is preempted first, so the
    /// oldest request always goes on (were it the last one *started*, a
    /// resumed request would be first in line to be preempted again, and
    /// two could take turns forever).
    pub arrival: u64,
    /// Its first start was reported (the prefix-cache counts).
    pub counted: bool,
    pub prompt_rows: bool,
    /// The drafts its step in flight verifies.
    pub drafts: Vec<i64>,
    pub preemptions: u32,
}

impl Seq {
    /// A sequence of `r`; a resumed one holds what it generated before
    /// and recomputes its rows when it is admitted, as after a preemption.
    pub fn new(r: Request, phase: Phase) -> Seq {
        let (generated, last_id) = (r.resumed.len(), r.resumed.last().copied().unwrap_or(0));
        let mut ids = r.prompt;
        let prompt_len = ids.len();
        ids.extend(r.resumed);
        Seq {
            phase,
            prompt_len,
            max_new: r.max_new,
            ignore_eos: r.ignore_eos,
            ids,
            chain: Vec::new(),
            images: r.images,
            chunks: VecDeque::new(),
            generated,
            last_id,
            busy: false,
            cancelled: false,
            stop: StopText::new(r.stops),
            stop_ids: r.stop_ids,
            kv: SeqBlocks::default(),
            arrival: 0,
            counted: false,
            // A resumed request reported its prompt's logprobs before.
            prompt_rows: r.prompt_logprobs && generated == 0,
            drafts: Vec::new(),
            preemptions: 0,
        }
    }

    /// Where its next draw is: the row of its last prompt token, or, once
    /// it has generated, the row of its last token (fed as a decode step).
    pub fn draw_row(&self) -> usize {
        self.prompt_len + self.generated - 1
    }

    /// The most positions it may reach.
    pub fn capacity(&self) -> usize {
        self.prompt_len + self.max_new + 1
    }
}
