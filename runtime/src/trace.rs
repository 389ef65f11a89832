//! Timeline tracing (`--trace`, off by default): each stage records its
//! steps (prefill, decode, vision encode), every message it sends and
//! receives with its bytes, and the time it waits for one. The first stage
//! then gathers every stage's events and prints them as Chrome trace
//! events (`m3c-trace JSON` lines on its standard output, which the front
//! collects into a file; Perfetto and chrome://tracing open it): at the end
//! of a run, or, serving, when the front ends a window (`trace on`, then
//! `trace off`; every stage turns with the `KIND_TRACE` message that passes
//! down the pipeline in order with the steps).
//!
//! Clocks: each stage keeps its own monotonic clock; at start-up the first
//! stage measures every other stage's offset by ping-pong over MPI (the
//! round trip of least delay of several), tells each its offset, and
//! reports the largest uncertainty (half that round trip) in the trace's
//! metadata. Every event is written on the first stage's clock.
//!
//! With tracing off, each hook is one relaxed atomic load. With it on, an
//! event is a push onto the stage thread's own list (every hook runs on
//! the thread that runs the pipeline loop): no lock, no allocation but the
//! list's growth.

use crate::error::StageError;
use crate::liveness::Peers;
use crate::wire::{self, message, Outbox};
use mpi::point_to_point::Destination;
use mpi::topology::{Communicator, SimpleCommunicator};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

// Tags of their own: 7 and 8 carry steps and ids, 9 the heartbeats.
pub const TAG_CLOCK: i32 = 20;
pub const TAG_TRACE: i32 = 21;
const KIND_CLOCK: i64 = 20;
const KIND_TRACE: i64 = 21;
/// Ping-pongs per stage for the clock offset.
const CLOCK_ROUNDS: usize = 16;

/// Recording events now.
static ON: AtomicBool = AtomicBool::new(false);
/// Counting messages (from the clock alignment on, recording or not), so
/// that the n-th message between two stages is the same one on both sides
/// whenever a window starts.
static ARMED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static STATE: RefCell<Option<State>> = const { RefCell::new(None) };
}

struct State {
    rank: usize,
    start: Instant,
    /// This stage's clock minus the first stage's, in microseconds.
    offset_us: f64,
    /// The first stage: the largest uncertainty of the offsets.
    clock_error_us: f64,
    events: Vec<Event>,
    /// Messages so far per (from, to, tag): pairs a send with its receive
    /// (a stage talks to a handful of peers: a short list).
    counts: Vec<((usize, usize, i32), u64)>,
    /// Steps so far: the n-th step of every stage is the same micro-batch
    /// (they pass down the pipeline in order).
    steps: u64,
}

enum What {
    Step { kind: &'static str, micro_batch: u64, seqs: Vec<usize>, rows: usize },
    Send { to: usize, tag: i32, bytes: usize, n: u64 },
    Recv { from: usize, tag: i32, bytes: usize, n: u64 },
    Wait { from: usize },
}

struct Event {
    start_us: f64,
    dur_us: f64,
    what: What,
}

/// Whether this stage records its timeline.
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Runs `f` on this thread's trace state.
fn with<R>(f: impl FnOnce(&mut Option<State>) -> R) -> R {
    STATE.with(|s| f(&mut s.borrow_mut()))
}

/// Prepares stage `rank`'s clock; recording starts once the clocks are
/// aligned ([`align_clocks`]).
pub fn enable(rank: usize) {
    with(|s| {
        *s = Some(State {
            rank,
            start: Instant::now(),
            offset_us: 0.0,
            clock_error_us: 0.0,
            events: Vec::with_capacity(1 << 16),
            counts: Vec::new(),
            steps: 0,
        })
    });
}

/// Microseconds on this stage's clock (0 without tracing).
pub fn now_us() -> f64 {
    if !on() {
        return 0.0;
    }
    clock_us()
}

fn clock_us() -> f64 {
    with(|s| s.as_ref().map_or(0.0, |s| s.start.elapsed().as_secs_f64() * 1e6))
}

fn push(start_us: f64, what: What) {
    with(|s| {
        if let Some(s) = s.as_mut() {
            let end = s.start.elapsed().as_secs_f64() * 1e6;
            s.events.push(Event { start_us, dur_us: (end - start_us).max(0.0), what });
        }
    })
}

/// A step that began at `start_us`: prefill when a segment starts its
/// sequence or carries several rows, else decode.
pub fn step(start_us: f64, segments: &[crate::stage::Segment]) {
    if !on() {
        return;
    }
    let kind = if segments.iter().any(|s| s.pos0 == 0 || s.rows > 1) { "prefill" } else { "decode" };
    let micro_batch = with(|s| {
        s.as_mut().map_or(0, |s| {
            s.steps += 1;
            s.steps - 1
        })
    });
    let seqs = segments.iter().map(|s| s.seq).collect();
    push(start_us, What::Step { kind, micro_batch, seqs, rows: segments.iter().map(|s| s.rows).sum() });
}

/// A vision encode of sequence `seq` that began at `start_us`.
pub fn vision(start_us: f64, seq: usize, rows: usize) {
    if on() {
        push(start_us, What::Step { kind: "vision", micro_batch: u64::MAX, seqs: vec![seq], rows });
    }
}

/// The next message number between this stage and `peer` on `tag`, sent
/// (`outgoing`) or received.
fn count(peer: usize, tag: i32, outgoing: bool) -> u64 {
    with(|s| {
        s.as_mut().map_or(0, |s| {
            let key = if outgoing { (s.rank, peer, tag) } else { (peer, s.rank, tag) };
            count_in(s, key)
        })
    })
}

fn count_in(s: &mut State, key: (usize, usize, i32)) -> u64 {
    match s.counts.iter_mut().find(|(k, _)| *k == key) {
        Some((_, c)) => {
            *c += 1;
            *c - 1
        }
        None => {
            s.counts.push((key, 1));
            0
        }
    }
}

/// Whether tracing was set up (a window may start).
pub fn armed() -> bool {
    ARMED.load(Ordering::Relaxed)
}

/// Starts or stops recording (the window of `m3c serve`'s `trace on|off`).
pub fn set_recording(on: bool) {
    ON.store(on && armed(), Ordering::Relaxed);
}

/// A message of `bytes` handed to MPI for rank `to`, from `start_us`.
pub fn sent(start_us: f64, to: usize, tag: i32, bytes: usize) {
    if !armed() {
        return;
    }
    let n = count(to, tag, true);
    if on() {
        push(start_us, What::Send { to, tag, bytes, n });
    }
}

/// A message of `bytes` from rank `from`, received after waiting since
/// `waited_from_us` (equal to now when it was already there).
pub fn received(waited_from_us: f64, from: usize, tag: i32, bytes: usize) {
    if !armed() {
        return;
    }
    let now = clock_us();
    if on() && now - waited_from_us > 1.0 {
        push(waited_from_us, What::Wait { from });
    }
    let n = count(from, tag, false);
    if on() {
        push(now, What::Recv { from, tag, bytes, n });
    }
}

/// Measures every stage's clock against the first stage's (run by every
/// rank at the same point, after [`enable`]), then counts messages from
/// here on, and records them too when `record` (a run; serving waits for
/// `trace on`).
pub fn align_clocks(world: &SimpleCommunicator, peers: &mut Peers, record: bool) -> Result<(), StageError> {
    let worst = measure_offsets(world, peers)?;
    with(|s| {
        if let Some(s) = s.as_mut() {
            s.clock_error_us = worst;
        }
    });
    ARMED.store(true, Ordering::Relaxed);
    ON.store(record, Ordering::Relaxed);
    Ok(())
}

fn measure_offsets(world: &SimpleCommunicator, peers: &mut Peers) -> Result<f64, StageError> {
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let word = |m: &wire::Msg, i: usize| -> f64 {
        m.payload.get(i * 8..i * 8 + 8).map_or(f64::NAN, |b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    };
    if rank == 0 {
        let mut worst: f64 = 0.0;
        for k in 1..size {
            let mut best = (f64::INFINITY, 0.0);
            for _ in 0..CLOCK_ROUNDS {
                let t1 = clock_us();
                world.process_at_rank(k as i32).send_with_tag(&message(KIND_CLOCK, &[], &[])[..], TAG_CLOCK);
                let reply = wire::recv(world, peers, k, TAG_CLOCK)?;
                let t2 = clock_us();
                let rtt = t2 - t1;
                if rtt < best.0 {
                    best = (rtt, word(&reply, 0) - (t1 + t2) / 2.0);
                }
            }
            let (rtt, offset) = best;
            let payload: Vec<u8> = [offset, rtt / 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
            world.process_at_rank(k as i32).send_with_tag(&message(KIND_CLOCK, &[], &payload)[..], TAG_CLOCK);
            worst = worst.max(rtt / 2.0);
        }
        Ok(worst)
    } else {
        for _ in 0..CLOCK_ROUNDS {
            wire::recv(world, peers, 0, TAG_CLOCK)?;
            let t = clock_us().to_le_bytes();
            world.process_at_rank(0).send_with_tag(&message(KIND_CLOCK, &[], &t)[..], TAG_CLOCK);
        }
        let m = wire::recv(world, peers, 0, TAG_CLOCK)?;
        with(|s| {
            if let Some(s) = s.as_mut() {
                s.offset_us = word(&m, 0);
            }
        });
        Ok(0.0)
    }
}

/// This stage's events as Chrome trace events, one JSON object a line, on
/// the first stage's clock: one track (`tid`) per stage, each message a
/// short slice with a flow arrow from its send to its receive.
fn chrome_lines(host: &str) -> Vec<String> {
    with(|s| s.as_ref().map(|s| chrome_lines_of(s, host)).unwrap_or_default())
}

fn chrome_lines_of(s: &State, host: &str) -> Vec<String> {
    use serde_json::json;
    let k = s.rank;
    let ts = |t: f64| ((t - s.offset_us) * 1000.0).round() / 1000.0;
    let mut out =
        vec![json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": k, "args": {"name": format!("stage {k} ({host})")}}).to_string()];
    out.push(json!({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": k, "args": {"sort_index": k}}).to_string());
    let flow = |from: usize, to: usize, tag: i32, n: u64| format!("{from}-{to}-{tag}-{n}");
    for e in &s.events {
        let (start, dur) = (ts(e.start_us), (e.dur_us * 1000.0).round() / 1000.0);
        match &e.what {
            What::Step { kind, micro_batch, seqs, rows } => {
                let mut args = json!({"seqs": seqs, "rows": rows});
                if *micro_batch != u64::MAX {
                    args["micro_batch"] = json!(micro_batch);
                }
                out.push(
                    json!({"name": kind, "cat": "step", "ph": "X", "ts": start, "dur": dur, "pid": 1, "tid": k, "args": args}).to_string(),
                );
            }
            What::Wait { from } => out.push(
                json!({"name": "wait", "cat": "wait", "ph": "X", "ts": start, "dur": dur, "pid": 1, "tid": k, "args": {"from": from}})
                    .to_string(),
            ),
            What::Send { to, tag, bytes, n } => {
                let id = flow(k, *to, *tag, *n);
                out.push(
                    json!({"name": "send", "cat": "msg", "ph": "X", "ts": start, "dur": dur, "pid": 1, "tid": k, "args": {"to": to, "bytes": bytes, "id": id}})
                        .to_string(),
                );
                out.push(json!({"name": "msg", "cat": "flow", "ph": "s", "id": id, "ts": start, "pid": 1, "tid": k}).to_string());
            }
            What::Recv { from, tag, bytes, n } => {
                let id = flow(*from, k, *tag, *n);
                out.push(
                    json!({"name": "recv", "cat": "msg", "ph": "X", "ts": start, "dur": dur.max(0.001), "pid": 1, "tid": k, "args": {"from": from, "bytes": bytes, "id": id}})
                        .to_string(),
                );
                out.push(
                    json!({"name": "msg", "cat": "flow", "ph": "f", "bp": "e", "id": id, "ts": start, "pid": 1, "tid": k}).to_string(),
                );
            }
        }
    }
    out
}

/// Every stage's events to the first, which prints them (`m3c-trace`
/// lines, then `m3c-trace-meta` with the clock uncertainty); each stage's
/// list is emptied. Called by every rank once it has stopped recording:
/// after a run's loop, or on a serving window's `KIND_TRACE` off.
pub fn gather(world: &SimpleCommunicator, peers: &mut Peers, host: &str) -> Result<(), StageError> {
    if !armed() {
        return Ok(());
    }
    // The gather's own messages are not part of the timeline.
    ON.store(false, Ordering::Relaxed);
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let lines = chrome_lines(host);
    let clock_error_us = with(|s| {
        s.as_mut().map_or(0.0, |s| {
            s.events.clear();
            s.clock_error_us
        })
    });
    if rank > 0 {
        let mut outbox = Outbox::default();
        outbox.send(world, 0, TAG_TRACE, message(KIND_TRACE, &[], lines.join("\n").as_bytes()));
        return outbox.drain(world, peers);
    }
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let mut say = |l: &str| out.write_all(format!("m3c-trace {l}\n").as_bytes());
    let mut events = lines.len();
    for l in &lines {
        let _ = say(l);
    }
    for k in 1..size {
        let m = wire::recv(world, peers, k, TAG_TRACE)?;
        let text = String::from_utf8_lossy(&m.payload).into_owned();
        for l in text.lines().filter(|l| !l.is_empty()) {
            events += 1;
            let _ = say(l);
        }
    }
    let meta = serde_json::json!({"stages": size, "events": events, "clock_error_us": clock_error_us});
    let _ = out.write_all(format!("m3c-trace-meta {meta}\n").as_bytes());
    let _ = out.flush();
    Ok(())
}
