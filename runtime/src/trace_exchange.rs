//! Timelines between stages over MPI (`--trace`): the clock alignment at
//! start-up, and the gather of every stage's events to the first stage,
//! which prints them. What is recorded, and how, is [`crate::trace`]'s;
//! this module is only its transport, so recording needs no MPI and the
//! message layer it records ([`crate::wire`]) never depends on it.

use crate::error::StageError;
use crate::liveness::Peers;
use crate::tag;
use crate::trace;
use crate::wire::{self, message, Outbox};
use mpi::point_to_point::Destination;
use mpi::topology::{Communicator, SimpleCommunicator};

const KIND_CLOCK: i64 = 20;
const KIND_TRACE: i64 = 21;
/// Ping-pongs per stage for the clock offset.
const CLOCK_ROUNDS: usize = 16;

/// Measures every stage's clock against the first stage's (run by every
/// rank at the same point, after [`enable`]), then counts messages from
/// here on, and records them too when `record` (a run; serving waits for
/// `trace on`).
pub fn align_clocks(world: &SimpleCommunicator, peers: &mut Peers, record: bool) -> Result<(), StageError> {
    let worst = measure_offsets(world, peers)?;
    trace::arm(record, worst);
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
                let t1 = trace::clock_us();
                world.process_at_rank(k as i32).send_with_tag(&message(KIND_CLOCK, &[], &[])[..], tag::CLOCK);
                let reply = wire::recv(world, peers, k, tag::CLOCK)?;
                let t2 = trace::clock_us();
                let rtt = t2 - t1;
                if rtt < best.0 {
                    best = (rtt, word(&reply, 0) - (t1 + t2) / 2.0);
                }
            }
            let (rtt, offset) = best;
            let payload: Vec<u8> = [offset, rtt / 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
            world.process_at_rank(k as i32).send_with_tag(&message(KIND_CLOCK, &[], &payload)[..], tag::CLOCK);
            worst = worst.max(rtt / 2.0);
        }
        Ok(worst)
    } else {
        for _ in 0..CLOCK_ROUNDS {
            wire::recv(world, peers, 0, tag::CLOCK)?;
            let t = trace::clock_us().to_le_bytes();
            world.process_at_rank(0).send_with_tag(&message(KIND_CLOCK, &[], &t)[..], tag::CLOCK);
        }
        let m = wire::recv(world, peers, 0, tag::CLOCK)?;
        trace::set_offset(word(&m, 0));
        Ok(0.0)
    }
}

/// Every stage's events to the first, which prints them (`m3c-trace`
/// lines, then `m3c-trace-meta` with the clock uncertainty); each stage's
/// list is emptied. Called by every rank once it has stopped recording:
/// after a run's loop, or on a serving window's `KIND_TRACE` off.
pub fn gather(world: &SimpleCommunicator, peers: &mut Peers, host: &str) -> Result<(), StageError> {
    if !trace::armed() {
        return Ok(());
    }
    // The gather's own messages are not part of the timeline.
    let (lines, clock_error_us) = trace::take_lines(host);
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    if rank > 0 {
        let mut outbox = Outbox::default();
        outbox.send(world, 0, tag::TRACE, message(KIND_TRACE, &[], lines.join("\n").as_bytes()));
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
        let m = wire::recv(world, peers, k, tag::TRACE)?;
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

/// A timeline window starts or ends (`m3c serve`'s `trace on|off`): every
/// stage (`stages`) and encoder rank (`encoders`, after them) turns as the
/// `KIND_TRACE` message reaches it, in order with the steps; at the end
/// each sends its events here, and they are printed. `Ok(Err)`: refused,
/// the pipeline was started without `--trace`.
pub(crate) fn turn(
    world: &SimpleCommunicator,
    peers: &mut Peers,
    outbox: &mut Outbox,
    (stages, encoders): (usize, usize),
    on: bool,
) -> Result<Result<(), String>, StageError> {
    if !trace::armed() {
        return Ok(Err("tracing is off: the pipeline was started without --trace (m3c serve --trace-dir DIR)".into()));
    }
    if stages > 1 {
        outbox.send(world, 1, tag::ACT, message(wire::KIND_TRACE, &[], &[u8::from(on)]));
    }
    for k in stages..stages + encoders {
        outbox.send(world, k, tag::ENCODE, message(wire::KIND_TRACE, &[], &[u8::from(on)]));
    }
    trace::set_recording(on);
    if !on {
        gather(world, peers, &crate::host_name())?;
    }
    Ok(Ok(()))
}
