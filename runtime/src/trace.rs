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

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

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
    Step {
        kind: &'static str,
        micro_batch: u64,
        seqs: Vec<usize>,
        rows: usize,
    },
    Send {
        to: usize,
        tag: i32,
        bytes: usize,
        n: u64,
    },
    Recv {
        from: usize,
        tag: i32,
        bytes: usize,
        n: u64,
    },
    Wait {
        from: usize,
    },
    /// An encode beside the step loop (its own track, under the stage's).
    Encode {
        seq: usize,
        rows: usize,
    },
}

/// The track of stage `k`'s encoder thread: clear of every stage's own.
pub const ENCODER_TRACK: usize = 1000;

struct Event {
    start_us: f64,
    /// The clock reading it ended on (kept as read, not as a duration: a
    /// wait and the receive after it share one reading, to the bit).
    end_us: f64,
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
/// aligned ([`crate::trace_exchange::align_clocks`]).
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

pub(crate) fn clock_us() -> f64 {
    with(|s| s.as_ref().map_or(0.0, |s| s.start.elapsed().as_secs_f64() * 1e6))
}

fn push(start_us: f64, what: What) {
    push_until(start_us, None, what);
}

/// An event from `start_us` to `end_us` (`None`: now).
fn push_until(start_us: f64, end_us: Option<f64>, what: What) {
    with(|s| {
        if let Some(s) = s.as_mut() {
            let end = end_us.unwrap_or_else(|| s.start.elapsed().as_secs_f64() * 1e6);
            s.events.push(Event { start_us, end_us: end.max(start_us), what });
        }
    })
}

/// A step that began at `start_us`: prefill when a segment starts its
/// sequence or carries several rows, else decode.
/// Each segment is (sequence, first position, rows).
pub fn step(start_us: f64, segments: &[(usize, usize, usize)], verify: bool) {
    if !on() {
        return;
    }
    let kind = if verify {
        "verify"
    } else if segments.iter().any(|&(_, pos0, rows)| pos0 == 0 || rows > 1) {
        "prefill"
    } else {
        "decode"
    };
    let micro_batch = with(|s| {
        s.as_mut().map_or(0, |s| {
            s.steps += 1;
            s.steps - 1
        })
    });
    let seqs = segments.iter().map(|s| s.0).collect();
    push(start_us, What::Step { kind, micro_batch, seqs, rows: segments.iter().map(|s| s.2).sum() });
}

/// A vision encode of sequence `seq` that began at `start_us`.
pub fn vision(start_us: f64, seq: usize, rows: usize) {
    if on() {
        push(start_us, What::Step { kind: "vision", micro_batch: u64::MAX, seqs: vec![seq], rows });
    }
}

/// A vision encode of sequence `seq` that ran beside the loop, on another
/// thread, from `started` to `finished` (placed on this thread's clock).
pub fn vision_beside(started: std::time::Instant, finished: std::time::Instant, seq: usize, rows: usize) {
    if on() {
        let now = clock_us();
        let at = |t: std::time::Instant| now - t.elapsed().as_secs_f64() * 1e6;
        push_until(at(started), Some(at(finished)), What::Encode { seq, rows });
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
    // The wait ends where the receive starts: one clock reading for both,
    // so the two never overlap on the stage's track.
    if on() && now - waited_from_us > 1.0 {
        push_until(waited_from_us, Some(now), What::Wait { from });
    }
    let n = count(from, tag, false);
    if on() {
        push(now, What::Recv { from, tag, bytes, n });
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
    if s.events.iter().any(|e| matches!(e.what, What::Encode { .. })) {
        let t = ENCODER_TRACK + k;
        out.push(
            json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": format!("stage {k} encoder ({host})")}})
                .to_string(),
        );
        out.push(json!({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": t, "args": {"sort_index": k}}).to_string());
    }
    let flow = |from: usize, to: usize, tag: i32, n: u64| format!("{from}-{to}-{tag}-{n}");
    for e in &s.events {
        // The end rounded as the start is, so that an event that ends where
        // the next starts (a wait and its receive) still does in the file.
        let (start, end) = (ts(e.start_us), ts(e.end_us));
        let dur = ((end - start) * 1000.0).round() / 1000.0;
        match &e.what {
            What::Encode { seq, rows } => out.push(
                json!({"name": "vision", "cat": "encode", "ph": "X", "ts": start, "dur": dur, "pid": 1, "tid": ENCODER_TRACK + k, "args": {"seqs": [seq], "rows": rows}})
                    .to_string(),
            ),
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

/// Counts messages from now on, and records them too when `record`; the
/// largest uncertainty of the other stages' clock offsets is `clock_error_us`
/// (the first stage's figure).
pub(crate) fn arm(record: bool, clock_error_us: f64) {
    with(|s| {
        if let Some(s) = s.as_mut() {
            s.clock_error_us = clock_error_us;
        }
    });
    ARMED.store(true, Ordering::Relaxed);
    ON.store(record, Ordering::Relaxed);
}

/// This stage's clock minus the first stage's, in microseconds.
pub(crate) fn set_offset(offset_us: f64) {
    with(|s| {
        if let Some(s) = s.as_mut() {
            s.offset_us = offset_us;
        }
    });
}

/// Stops recording and takes this stage's events as Chrome trace lines,
/// with the clock uncertainty.
pub(crate) fn take_lines(host: &str) -> (Vec<String>, f64) {
    ON.store(false, Ordering::Relaxed);
    let lines = chrome_lines(host);
    let clock_error_us = with(|s| {
        s.as_mut().map_or(0.0, |s| {
            s.events.clear();
            s.clock_error_us
        })
    });
    (lines, clock_error_us)
}
