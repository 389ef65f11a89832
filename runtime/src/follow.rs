//! A stage after the first, for `m3c run` and `m3c serve` alike: it applies
//! joins and leaves (`KIND_ADD`, `KIND_DROP`: a sequence's caches live
//! exactly as long as it does), steps each micro-batch it receives, passes
//! the activations on, and (the last stage) samples and returns the ids to
//! the first stage.

use crate::books::{LastBooks, OutputSpec};
use crate::error::StageError;
use crate::liveness::Peers;
use crate::stage::{Segment, Stage};
use crate::tag;
use crate::wire::{
    self, bytes_f32, f32_bytes, message, message_step, Outbox, KIND_ADD, KIND_DROP, KIND_RESET, KIND_STATS, KIND_STEP, KIND_STOP,
    KIND_TRACE,
};
use m3c_contract::protocol::{Command, SeqRequest};
use mpi::topology::SimpleCommunicator;

/// A `KIND_ADD` message: the sequence, its cache capacity, and the request
/// as the protocol's own `add` line (`m3c_contract::protocol`: the one
/// encoding of a request, on the first stage's standard input and between
/// stages alike), without its images, which only the first stage encodes.
pub(crate) fn add_message(a: &SeqRequest) -> Vec<u8> {
    let line = Command::Add(SeqRequest { images: None, ..a.clone() }).encode();
    message(KIND_ADD, &[Segment { seq: a.seq, pos0: 0, rows: capacity(a) }], line.as_bytes())
}

/// The request a `KIND_ADD` payload carries ([`add_message`]).
pub(crate) fn parse_add(payload: &[u8]) -> Result<SeqRequest, StageError> {
    let bad = |why: String| StageError::Peer(format!("a malformed add message: {why}"));
    let line = std::str::from_utf8(payload).map_err(|_| bad("not UTF-8".into()))?;
    match Command::parse(line).map_err(bad)? {
        Command::Add(r) => Ok(r),
        other => Err(bad(format!("`{}` is not an add", other.encode()))),
    }
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
/// The next pipeline message from the previous stage, serving encode jobs
/// while it waits (as `wire::recv` waits: a silent neighbour is an error).
fn recv_serving_encodes(
    world: &SimpleCommunicator,
    peers: &mut Peers,
    st: &mut Stage,
    e: &mut crate::encoder::Remote,
    outbox: &mut Outbox,
) -> Result<wire::Msg, StageError> {
    let from = st.meta.stage - 1;
    loop {
        if let Some(m) = wire::try_recv(world, peers, from, tag::ACT) {
            return m;
        }
        let (served, _) = e.serve(world, peers, st, outbox)?;
        outbox.poll();
        peers.drain(world);
        if let Some(r) = peers.silent([from, 0]) {
            return Err(StageError::Peer(crate::liveness::silent_message(r, peers.timeout)));
        }
        if !served {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}

pub(crate) fn follow(world: &SimpleCommunicator, peers: &mut Peers, st: &mut Stage, books: &mut LastBooks) -> Result<(), StageError> {
    let (rank, last) = (st.meta.stage, st.meta.last_stage);
    let mut outbox = Outbox::default();
    // The tower's stage, when it is not the first, serves encode jobs
    // between its steps.
    let mut encodes = st.holds_tower().then(|| crate::encoder::Remote::new(st));
    loop {
        outbox.poll();
        let m = match encodes.as_mut() {
            None => wire::recv(world, peers, rank - 1, tag::ACT)?,
            Some(e) => recv_serving_encodes(world, peers, st, e, &mut outbox)?,
        };
        let pass_on = |outbox: &mut Outbox, kind, payload: &[u8]| {
            if !last {
                outbox.send(world, rank + 1, tag::ACT, message_step(kind, &m.segments, &m.blocks, &m.drafts, &m.propose, payload));
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
                    let r = parse_add(&m.payload)?;
                    if r.seq != s.seq || capacity(&r) != s.rows {
                        return Err(StageError::Peer(format!("an add message for sequence {} carries the request of {}", s.seq, r.seq)));
                    }
                    let out = OutputSpec::of(&r);
                    books.start(s.seq, r.prompt, r.sampling, r.max_new, out);
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
                let (to, tag) = if last { (0, tag::IDS) } else { (rank + 1, tag::ACT) };
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
    let mut x = if st.uses_collectives() { vec![0f32; tokens * st.meta.carry_words()] } else { bytes_f32(payload) };
    if !st.uses_collectives() && x.len() != tokens * st.meta.carry_in_words() {
        return Err(StageError::Peer(format!("a step of {tokens} rows came with {} activation words", x.len())));
    }
    // The aux slots this stage adds (an EAGLE3 draft's) follow those it received.
    x.resize(tokens * st.meta.carry_words(), 0.0);
    if !last && st.uses_collectives() {
        // The step's NCCL send waits for the receiver, who needs the header first.
        outbox.send(world, rank + 1, tag::ACT, message_step(KIND_STEP, segs, &m.blocks, &m.drafts, &m.propose, &[]));
    }
    let started = std::time::Instant::now();
    let sample = if last { Some(books.sample_in(segs, &m.drafts, st.meta.vocab)?) } else { None };
    let out = st.step(segs, &[], &mut x, sample, !m.drafts.is_empty())?;
    // (A last stage's step leaves its `x` rows unwritten, and its aux states after them.)
    if last {
        let mut got = books.finish(segs, &m.drafts, &out, st.meta.vocab, rank)?;
        crate::draft::attach(st, books.drafter.as_ref(), &*books, segs, &m.drafts, &m.propose, &mut got, &x)?;
        // The step's busy time first (speculation's cost model), then the ids.
        let micros = started.elapsed().as_micros().min(i64::MAX as u128) as i64;
        let mut payload = micros.to_le_bytes().to_vec();
        payload.extend(crate::books::Drawn::encode(&got));
        outbox.send(world, 0, tag::IDS, message(KIND_STEP, segs, &payload));
    } else if !st.uses_collectives() {
        outbox.send(world, rank + 1, tag::ACT, message_step(KIND_STEP, segs, &m.blocks, &m.drafts, &m.propose, &f32_bytes(&x)));
    }
    Ok(())
}
