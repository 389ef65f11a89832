//! A stage after the first, for `m3c run` and `m3c serve` alike: it applies
//! joins and leaves (`KIND_ADD`, `KIND_DROP`: a sequence's caches live
//! exactly as long as it does), steps each micro-batch it receives, passes
//! the activations on, and (the last stage) samples and returns the ids to
//! the first stage.

use crate::books::{LastBooks, OutputSpec};
use crate::error::StageError;
use crate::liveness::Peers;
use crate::stage::{Segment, Stage};
use crate::wire::{
    self, bytes_f32, f32_bytes, message, message_blocks, Outbox, KIND_ADD, KIND_DROP, KIND_RESET, KIND_STATS, KIND_STEP, KIND_STOP,
    KIND_TRACE, TAG_ACT, TAG_IDS,
};
use m3c_contract::protocol::SeqRequest;
use m3c_contract::sampling::{row_params, row_words, SamplingParams, ROW_WORDS};
use m3c_contract::thinking::{ThinkBudget, ThinkStart};
use mpi::topology::SimpleCommunicator;

/// The reasoning starts an add message numbers (from 1; 0 is none).
const THINK_STARTS: [ThinkStart; 3] = [ThinkStart::Open, ThinkStart::Closed, ThinkStart::Adaptive];

/// A `KIND_ADD` message: the sequence, its cache capacity, and a payload of
/// i64 words (its sampling-table row, logprobs in the row's `LOGPROBS`
/// word and `min_tokens` in its `MIN_TOKENS` word; the prompt's length and
/// ids; the stop ids' count and ids; the logit biases' count and entries
/// (id in the low half, the bias's f32 bits in the high); the reasoning
/// budget's start (0: none, else 1 + its index in [`THINK_STARTS`]) and
/// size; 1 when a grammar follows, else 0) and then the grammar's text.
pub(crate) fn add_message(a: &SeqRequest) -> Vec<u8> {
    use m3c_contract::sampling::row;
    let mut w = row_words(&a.sampling, 0, 0, true, 0);
    w[row::LOGPROBS] = a.logprobs.map_or(0, |k| i64::from(k) + 1);
    w[row::MIN_TOKENS] = a.min_tokens as i64;
    w[row::PROMPT_LOGPROBS] = a.prompt_logprobs.map_or(0, |k| i64::from(k) + 1);
    let (think, budget) = match a.think {
        None => (0, 0),
        Some(t) => (1 + THINK_STARTS.iter().position(|&s| s == t.start).unwrap_or(0) as i64, i64::from(t.budget)),
    };
    let words = w
        .iter()
        .copied()
        .chain([a.prompt.len() as i64])
        .chain(a.prompt.iter().copied())
        .chain([a.stop_ids.len() as i64])
        .chain(a.stop_ids.iter().copied())
        .chain([a.logit_bias.len() as i64])
        .chain(a.logit_bias.iter().map(|&(id, b)| (u64::from(id) | u64::from(b.to_bits()) << 32) as i64))
        .chain([think, budget, i64::from(a.grammar.is_some())]);
    let mut payload: Vec<u8> = words.flat_map(|w| w.to_le_bytes()).collect();
    if let Some(text) = &a.grammar {
        payload.extend_from_slice(text.as_bytes());
    }
    message(KIND_ADD, &[Segment { seq: a.seq, pos0: 0, rows: capacity(a) }], &payload)
}

/// The last stage's reading of a `KIND_ADD` payload ([`add_message`]):
/// sampling, prompt and what the sequence asks of its output.
pub(crate) fn parse_add(payload: &[u8]) -> Result<(SamplingParams, Vec<i64>, OutputSpec), StageError> {
    let short = || StageError::Peer("a short or malformed add message".into());
    let word = |i: usize| payload.get(i * 8..i * 8 + 8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
    let table: Vec<i64> = (0..ROW_WORDS).map(word).collect::<Option<_>>().ok_or_else(short)?;
    let table: [i64; ROW_WORDS] = table.try_into().map_err(|_| short())?;
    let (sampling, ..) = row_params(&table);
    let n = word(ROW_WORDS).and_then(|n| usize::try_from(n).ok()).filter(|&n| n <= payload.len() / 8).ok_or_else(short)?;
    let prompt: Vec<i64> = (ROW_WORDS + 1..ROW_WORDS + 1 + n).map(word).collect::<Option<_>>().ok_or_else(short)?;
    let at = ROW_WORDS + 1 + n;
    let ns = word(at).and_then(|k| usize::try_from(k).ok()).filter(|&k| k <= payload.len() / 8).ok_or_else(short)?;
    let stop_ids: Vec<i64> = (at + 1..at + 1 + ns).map(word).collect::<Option<_>>().ok_or_else(short)?;
    let at = at + 1 + ns;
    let nb = word(at).and_then(|k| usize::try_from(k).ok()).filter(|&k| k <= payload.len() / 8).ok_or_else(short)?;
    let logit_bias: Vec<(u32, f32)> = (at + 1..at + 1 + nb)
        .map(|i| word(i).map(|w| (w as u64 as u32, f32::from_bits((w as u64 >> 32) as u32))))
        .collect::<Option<_>>()
        .ok_or_else(short)?;
    let at = at + 1 + nb;
    let (think, budget, has_grammar) = (word(at).ok_or_else(short)?, word(at + 1).ok_or_else(short)?, word(at + 2).ok_or_else(short)?);
    let count = |word: usize| match table[word] {
        0 => Ok(None),
        k => u8::try_from(k - 1).map(Some).map_err(|_| StageError::Peer("an add message's logprobs are out of range".into())),
    };
    let logprobs = count(m3c_contract::sampling::row::LOGPROBS)?;
    let prompt_logprobs = count(m3c_contract::sampling::row::PROMPT_LOGPROBS)?;
    let rest = payload.get((at + 3) * 8..).ok_or_else(short)?;
    let min_tokens = usize::try_from(table[m3c_contract::sampling::row::MIN_TOKENS]).map_err(|_| short())?;
    let grammar = match has_grammar {
        0 => None,
        _ => Some(String::from_utf8(rest.to_vec()).map_err(|_| short())?),
    };
    let think = match think {
        0 => None,
        k => Some(ThinkBudget {
            start: *usize::try_from(k - 1).ok().and_then(|i| THINK_STARTS.get(i)).ok_or_else(short)?,
            budget: u32::try_from(budget).map_err(|_| short())?,
        }),
    };
    Ok((sampling, prompt, OutputSpec { logprobs, grammar, think, min_tokens, stop_ids, logit_bias, prompt_logprobs }))
}

/// Cache rows a sequence needs: its prompt and every token it may generate
/// (the last one's row too, for a step that only scores it).
pub(crate) fn capacity(a: &SeqRequest) -> usize {
    a.prompt.len() + a.max_new + 1
}

/// Words of an i64 payload.
pub(crate) fn words(payload: &[u8]) -> Vec<i64> {
    payload.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect()
}

/// A stage's own line of a stats message: (stage, steps, busy microseconds).
pub(crate) fn stats_words(st: &Stage) -> [i64; 3] {
    let (steps, busy) = st.busy();
    [st.meta.stage as i64, steps as i64, (busy * 1e6) as i64]
}

/// Runs a stage after the first until the first stage stops the pipeline.
pub(crate) fn follow(world: &SimpleCommunicator, peers: &mut Peers, st: &mut Stage, books: &mut LastBooks) -> Result<(), StageError> {
    let (rank, last) = (st.meta.stage, st.meta.last_stage);
    let mut outbox = Outbox::default();
    loop {
        outbox.poll();
        let m = wire::recv(world, peers, rank - 1, TAG_ACT)?;
        let pass_on = |outbox: &mut Outbox, kind, payload: &[u8]| {
            if !last {
                outbox.send(world, rank + 1, TAG_ACT, message_blocks(kind, &m.segments, &m.blocks, payload));
            }
        };
        match m.kind {
            KIND_STOP => {
                pass_on(&mut outbox, KIND_STOP, &[]);
                return outbox.drain(world, peers);
            }
            KIND_ADD => {
                let s = m.segments.first().ok_or_else(|| StageError::Peer("an add message without its sequence".into()))?;
                st.start_seq(s.seq, s.rows)?;
                if last {
                    let (sampling, prompt, out) = parse_add(&m.payload)?;
                    let max_new = s
                        .rows
                        .checked_sub(prompt.len() + 1)
                        .ok_or_else(|| StageError::Peer("an add message's capacity is short".into()))?;
                    books.start(s.seq, prompt, sampling, max_new, out);
                }
                pass_on(&mut outbox, KIND_ADD, &m.payload);
            }
            KIND_DROP => {
                for s in &m.segments {
                    st.end_seq(s.seq);
                    books.end(s.seq);
                }
                pass_on(&mut outbox, KIND_DROP, &[]);
            }
            KIND_RESET => {
                for s in &m.segments {
                    st.reset_seq(s.seq);
                }
                pass_on(&mut outbox, KIND_RESET, &[]);
            }
            KIND_STATS => {
                let mut payload = m.payload;
                payload.extend(stats_words(st).iter().flat_map(|w| w.to_le_bytes()));
                let (to, tag) = if last { (0, TAG_IDS) } else { (rank + 1, TAG_ACT) };
                outbox.send(world, to, tag, message(KIND_STATS, &[], &payload));
            }
            KIND_STEP => step(world, st, books, &mut outbox, &m)?,
            KIND_TRACE => {
                let on = m.payload.first() == Some(&1);
                crate::trace::set_recording(on);
                pass_on(&mut outbox, KIND_TRACE, &m.payload);
                if !on {
                    crate::trace_exchange::gather(world, peers, &crate::host_name())?;
                }
            }
            k => return Err(StageError::Peer(format!("a message of unknown kind {k}"))),
        }
    }
}

/// One micro-batch through this stage: activations in, on to the next
/// stage, or (the last) sampled and the ids back to the first.
fn step(world: &SimpleCommunicator, st: &mut Stage, books: &mut LastBooks, outbox: &mut Outbox, m: &wire::Msg) -> Result<(), StageError> {
    let (segs, payload) = (&m.segments[..], &m.payload[..]);
    let (rank, last) = (st.meta.stage, st.meta.last_stage);
    for (s, b) in segs.iter().zip(&m.blocks) {
        st.grow_seq(s.seq, b)?;
    }
    let tokens: usize = segs.iter().map(|s| s.rows).sum();
    let mut x = if st.uses_nccl() { vec![0f32; tokens * st.meta.x_words()] } else { bytes_f32(payload) };
    if !last && st.uses_nccl() {
        // The step's NCCL send waits for the receiver, who needs the header first.
        outbox.send(world, rank + 1, TAG_ACT, message_blocks(KIND_STEP, segs, &m.blocks, &[]));
    }
    let sample = if last { Some(books.sample_in(segs, st.meta.vocab)?) } else { None };
    let out = st.step(segs, &[], &mut x, sample)?;
    if last {
        let got = books.finish(segs, &out, st.meta.vocab, rank)?;
        outbox.send(world, 0, TAG_IDS, message(KIND_STEP, segs, &crate::books::Drawn::encode(&got)));
    } else if !st.uses_nccl() {
        outbox.send(world, rank + 1, TAG_ACT, message_blocks(KIND_STEP, segs, &m.blocks, &f32_bytes(&x)));
    }
    Ok(())
}
