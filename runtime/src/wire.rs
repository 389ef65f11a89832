//! The wire protocol between stages (MPI point-to-point): a step header
//! (kind, then each sequence's segment, then, when the step gives
//! sequences new cache blocks, each segment's new block ids, then, when
//! it verifies draft tokens, each segment's drafts) followed by a
//! payload, which is the
//! step's activations (`[S, hidden]` as f32 words, two bf16 to a word under
//! `--activations bf16`) on the way down the pipeline, or, on the way back
//! to the first, the last stage's busy microseconds for the step (one
//! word) and its ids (`m3c_engine::Drawn`, per segment).

use crate::error::StageError;
use crate::liveness::{self, Peers};
use m3c_engine::Segment;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use std::time::Duration;

pub const KIND_STEP: i64 = 0;
pub const KIND_STOP: i64 = 1;
/// `m3c serve`: a sequence joins (one segment: the sequence and its cache
/// capacity in `rows`; payload: its sampling-table row, then its prompt ids).
pub const KIND_ADD: i64 = 2;
/// `m3c serve`: sequences leave (their caches are freed).
pub const KIND_DROP: i64 = 3;
/// `m3c serve`: each stage appends (stage, steps, busy seconds) and passes
/// it on; the last stage returns it to the first.
pub const KIND_STATS: i64 = 4;
/// `m3c serve`: a timeline window starts (payload `[1]`) or ends (`[0]`:
/// each stage then sends its events to the first).
pub const KIND_TRACE: i64 = 5;
/// A sequence gives its cache blocks back (preempted) but stays live: the
/// last stage keeps its books, and later steps give it blocks again.
pub const KIND_RESET: i64 = 6;

/// The most segments a step may carry (a micro-batch's sequences).
const MAX_SEGMENTS: usize = 1 << 20;

pub fn message(kind: i64, segments: &[Segment], payload: &[u8]) -> Vec<u8> {
    message_step(kind, segments, &[], &[], &[], payload)
}

/// A step's message. `blocks` is empty (no segment takes new cache
/// blocks) or has one list per segment, the pool blocks for its next
/// positions; `drafts` is empty (no segment verifies a draft) or has one
/// list per segment, the draft ids its rows after the first hold (which
/// the last stage checks its draws against); `propose` is empty or has one
/// count per segment, the drafts the last stage's EAGLE3 head should
/// propose after the step (0: none; the first stage would not use them).
pub fn message_step(kind: i64, segments: &[Segment], blocks: &[Vec<u32>], drafts: &[Vec<i64>], propose: &[i64], payload: &[u8]) -> Vec<u8> {
    let ids: usize = blocks.iter().map(Vec::len).sum::<usize>() + drafts.iter().map(Vec::len).sum::<usize>();
    let mut m = Vec::with_capacity(32 + 24 * segments.len() + 8 * (blocks.len() + drafts.len() + ids) + payload.len());
    m.extend(kind.to_le_bytes());
    m.extend((segments.len() as i64).to_le_bytes());
    for s in segments {
        for v in [s.seq as i64, s.pos0 as i64, s.rows as i64] {
            m.extend(v.to_le_bytes());
        }
    }
    m.extend((blocks.len() as i64).to_le_bytes());
    for b in blocks {
        m.extend((b.len() as i64).to_le_bytes());
        for &id in b {
            m.extend(i64::from(id).to_le_bytes());
        }
    }
    m.extend((drafts.len() as i64).to_le_bytes());
    for d in drafts {
        m.extend((d.len() as i64).to_le_bytes());
        for &id in d {
            m.extend(id.to_le_bytes());
        }
    }
    m.extend((propose.len() as i64).to_le_bytes());
    for &k in propose {
        m.extend(1i64.to_le_bytes());
        m.extend(k.to_le_bytes());
    }
    m.extend_from_slice(payload);
    m
}

pub struct Msg {
    pub kind: i64,
    pub segments: Vec<Segment>,
    /// Empty, or per segment the pool blocks it takes for its next positions.
    pub blocks: Vec<Vec<u32>>,
    /// Empty, or per segment the draft ids it verifies.
    pub drafts: Vec<Vec<i64>>,
    /// Empty, or per segment the drafts to propose after the step.
    pub propose: Vec<i64>,
    pub payload: Vec<u8>,
}

/// Parses a message; a malformed one (which only a damaged or foreign peer
/// could send) is an error, never an out-of-range read.
pub fn parse_msg(m: Vec<u8>) -> Result<Msg, StageError> {
    let bad = || StageError::Peer(format!("malformed message of {} bytes from the previous stage", m.len()));
    let h = |i: usize| -> Result<i64, StageError> {
        m.get(i * 8..i * 8 + 8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).ok_or_else(bad)
    };
    let kind = h(0)?;
    let n = usize::try_from(h(1)?).ok().filter(|&n| n <= MAX_SEGMENTS).ok_or_else(bad)?;
    let mut segments = Vec::with_capacity(n.min(1024));
    for i in 0..n {
        let field = |k: usize| -> Result<usize, StageError> { usize::try_from(h(2 + 3 * i + k)?).map_err(|_| bad()) };
        segments.push(Segment { seq: field(0)?, pos0: field(1)?, rows: field(2)? });
    }
    let mut at = 2 + 3 * n;
    // Per-segment lists of ids: none, or one per segment.
    let lists = |at: &mut usize| -> Result<Vec<Vec<i64>>, StageError> {
        let count = usize::try_from(h(*at)?).ok().filter(|&k| k == 0 || k == n).ok_or_else(bad)?;
        *at += 1;
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            let len = usize::try_from(h(*at)?).ok().filter(|&k| k <= m.len() / 8).ok_or_else(bad)?;
            out.push((*at + 1..*at + 1 + len).map(&h).collect::<Result<Vec<i64>, StageError>>()?);
            *at += 1 + len;
        }
        Ok(out)
    };
    let blocks = lists(&mut at)?
        .into_iter()
        .map(|b| b.into_iter().map(|v| u32::try_from(v).map_err(|_| bad())).collect::<Result<Vec<u32>, StageError>>())
        .collect::<Result<Vec<_>, _>>()?;
    let drafts = lists(&mut at)?;
    let propose = lists(&mut at)?.into_iter().map(|k| if let [k] = k[..] { Ok(k) } else { Err(bad()) }).collect::<Result<Vec<i64>, _>>()?;
    if drafts.iter().zip(&segments).any(|(d, s)| d.len() >= s.rows.max(1)) {
        return Err(bad());
    }
    let payload = m.get(at * 8..).ok_or_else(bad)?.to_vec();
    Ok(Msg { kind, segments, blocks, drafts, propose, payload })
}

/// Receives the next message with `tag` from rank `from`. Fails only when
/// `from` has been silent (no message, no heartbeat) for the peers' timeout:
/// a neighbour that is busy computing keeps waiting.
pub fn recv(world: &SimpleCommunicator, peers: &mut Peers, from: usize, tag: i32) -> Result<Msg, StageError> {
    let p = world.process_at_rank(from as i32);
    let mut spins = 0u32;
    let waited_from = crate::trace::now_us();
    loop {
        if let Some(m) = p.immediate_matched_probe_with_tag(tag) {
            let (v, _) = m.matched_receive_vec::<u8>();
            crate::trace::received(waited_from, from, tag, v.len());
            peers.heard(from);
            return parse_msg(v);
        }
        peers.drain(world);
        if peers.silent([from]).is_some() {
            return Err(StageError::Peer(liveness::silent_message(from, peers.timeout)));
        }
        spins += 1;
        if spins < 2000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// The next message with `tag` from rank `from`, if one has arrived.
pub fn try_recv(world: &SimpleCommunicator, peers: &mut Peers, from: usize, tag: i32) -> Option<Result<Msg, StageError>> {
    let m = world.process_at_rank(from as i32).immediate_matched_probe_with_tag(tag)?;
    let (v, _) = m.matched_receive_vec::<u8>();
    crate::trace::received(crate::trace::now_us(), from, tag, v.len());
    peers.heard(from);
    Some(parse_msg(v))
}

/// A send in flight and the leaked buffer it reads.
type Pending = (mpi::request::Request<'static, [u8], mpi::request::StaticScope>, *mut [u8]);

/// Sends in flight. A stage hands a message to MPI and goes on computing;
/// the buffer lives until MPI reports the send complete (a blocking send
/// would wait for the next stage to finish its own step first).
#[derive(Default)]
pub struct Outbox {
    pending: Vec<Pending>,
}

impl Outbox {
    pub fn send(&mut self, world: &SimpleCommunicator, to: usize, tag: i32, data: Vec<u8>) {
        let (t0, bytes) = (crate::trace::now_us(), data.len());
        self.poll();
        let buf: &'static mut [u8] = Box::leak(data.into_boxed_slice());
        let ptr: *mut [u8] = buf;
        // SAFETY: the leaked buffer stays alive until the request completes
        // (`poll`/`drain` free it only then) and is never written meanwhile.
        let req = world.process_at_rank(to as i32).immediate_send_with_tag(mpi::request::StaticScope, unsafe { &*ptr }, tag);
        self.pending.push((req, ptr));
        crate::trace::sent(t0, to, tag, bytes);
    }

    /// Frees the buffers of completed sends.
    pub fn poll(&mut self) {
        let mut still = Vec::with_capacity(self.pending.len());
        for (req, ptr) in self.pending.drain(..) {
            match req.test() {
                // SAFETY: the send is complete; the buffer came from Box::leak.
                Ok(_) => drop(unsafe { Box::from_raw(ptr) }),
                Err(req) => still.push((req, ptr)),
            }
        }
        self.pending = still;
    }

    /// Waits for every send (before the stage finishes), while the receiver
    /// is alive.
    pub fn drain(&mut self, world: &SimpleCommunicator, peers: &mut Peers) -> Result<(), StageError> {
        while !self.pending.is_empty() {
            self.poll();
            peers.drain(world);
            if let Some(r) = peers.silent(0..world.size() as usize) {
                return Err(StageError::Peer(liveness::silent_message(r, peers.timeout)));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }
}

impl Drop for Outbox {
    /// Only reached with sends pending when a step failed and the job is about
    /// to be aborted: forget them rather than panic in rsmpi's request drop.
    fn drop(&mut self) {
        for (req, _) in self.pending.drain(..) {
            std::mem::forget(req);
        }
    }
}

/// A plan as the step message and the last stage's books carry it: per
/// segment the blocks taken, the drafts verified and the draft head's ask
/// (each list empty when no segment has any).
pub struct StepLists {
    pub blocks: Vec<Vec<u32>>,
    pub drafts: Vec<Vec<i64>>,
    pub asks: Vec<i64>,
}

impl StepLists {
    pub fn of(p: &m3c_engine::StepPlan) -> StepLists {
        StepLists {
            blocks: if p.grows() { p.seqs.iter().map(|s| s.blocks.clone()).collect() } else { Vec::new() },
            drafts: if p.verifies() { p.seqs.iter().map(|s| s.drafts.clone()).collect() } else { Vec::new() },
            asks: if p.asks() { p.seqs.iter().map(|s| s.ask.word()).collect() } else { Vec::new() },
        }
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
