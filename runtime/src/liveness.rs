//! How a stage knows its peers are alive, and how it dies cleanly.
//!
//! - **Heartbeats.** A thread sends every other rank a one-byte message
//!   (`tag::BEAT`) every [`BEAT`], whatever the stage is computing. A rank
//!   that waits (for a neighbour's activations, or in a start-up gather)
//!   drains them and gives up on a peer only when that peer has been silent
//!   for `--timeout-s`: a stage busy with a long prefill counts as alive,
//!   a stopped or lost one is noticed within seconds.
//! - **Parent death.** A stage dies with the mpirun (or orted) that started
//!   it, so no rank is left computing when its job is killed.
//! - **SIGBUS.** A mapped checkpoint file truncated during the run makes a
//!   read fault; the handler names the file instead of dying silently.

use crate::tag;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How often a stage says it is alive.
pub const BEAT: Duration = Duration::from_millis(200);

static STOP: AtomicBool = AtomicBool::new(false);
/// The heartbeat thread has left its loop.
static STOPPED: AtomicBool = AtomicBool::new(false);
/// Test hook (`M3C_TEST_STALL_STAGE`): the stage falls silent like a hung
/// process, heartbeats included.
static SILENT: AtomicBool = AtomicBool::new(false);

/// Starts the heartbeat thread (MPI must allow calls from several threads).
pub fn start_heartbeats(size: usize, me: usize) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let world = SimpleCommunicator::world();
        let beat = [1u8];
        while !STOP.load(Ordering::Relaxed) {
            if !SILENT.load(Ordering::Relaxed) {
                for r in (0..size).filter(|&r| r != me) {
                    // A one-byte standard send completes eagerly.
                    world.process_at_rank(r as i32).send_with_tag(&beat[..], tag::BEAT);
                }
            }
            std::thread::sleep(BEAT);
        }
        STOPPED.store(true, Ordering::SeqCst);
    })
}

/// Stops the heartbeat thread (before MPI is finalised), waiting for it a
/// few beats at most: a send to a peer that was cut off can hold it inside
/// MPI, and a stage leaving a failed job must not wait on it for as long
/// as TCP takes to give up (its exit path has deadlines of its own).
pub fn stop_heartbeats(h: Option<std::thread::JoinHandle<()>>) {
    STOP.store(true, Ordering::Relaxed);
    let Some(h) = h else { return };
    let deadline = Instant::now() + 10 * BEAT;
    while !STOPPED.load(Ordering::SeqCst) && Instant::now() < deadline {
        std::thread::sleep(BEAT / 10);
    }
    if STOPPED.load(Ordering::SeqCst) {
        let _ = h.join();
    }
}

/// Makes this stage fall silent (the fault-injection test hook).
pub fn fall_silent() {
    SILENT.store(true, Ordering::Relaxed);
}

/// When each peer was last heard from.
pub struct Peers {
    seen: Vec<Instant>,
    me: usize,
    pub timeout: Duration,
}

impl Peers {
    pub fn new(size: usize, me: usize, timeout: Duration) -> Peers {
        Peers { seen: vec![Instant::now(); size], me, timeout }
    }

    /// Receives every heartbeat that has arrived.
    pub fn drain(&mut self, world: &SimpleCommunicator) {
        while let Some(m) = world.any_process().immediate_matched_probe_with_tag(tag::BEAT) {
            let (_, status) = m.matched_receive_vec::<u8>();
            let r = status.source_rank() as usize;
            if let Some(t) = self.seen.get_mut(r) {
                *t = Instant::now();
            }
        }
    }

    /// Notes that `rank` was heard from (any message counts).
    pub fn heard(&mut self, rank: usize) {
        if let Some(t) = self.seen.get_mut(rank) {
            *t = Instant::now();
        }
    }

    /// The first of `ranks` silent for longer than the timeout.
    pub fn silent(&self, ranks: impl IntoIterator<Item = usize>) -> Option<usize> {
        ranks.into_iter().find(|&r| r != self.me && self.seen.get(r).is_some_and(|t| t.elapsed() > self.timeout))
    }
}

/// The message for a peer that fell silent.
pub fn silent_message(rank: usize, timeout: Duration) -> String {
    m3c_contract::lost_peer::message(rank, timeout)
}

/// Ends this stage when its parent (mpirun or orted) dies.
pub fn die_with_parent() {
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a flag of this process.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) };
}

/// A mapped file region, for naming the file behind a SIGBUS.
pub struct Mapping {
    pub start: usize,
    pub len: usize,
    /// The message to print, prepared ahead (a signal handler cannot format).
    pub message: Vec<u8>,
}

static MAPPINGS: OnceLock<Vec<Mapping>> = OnceLock::new();
static FALLBACK: OnceLock<Vec<u8>> = OnceLock::new();

/// Installs the SIGBUS handler for the stage's mapped weights.
pub fn watch_mappings(who: &str, maps: Vec<Mapping>) {
    let _ = FALLBACK
        .set(format!("{who}: error: bus error (SIGBUS): a memory-mapped file changed or became unreadable during the run\n").into_bytes());
    let _ = MAPPINGS.set(maps);
    extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
        // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
        let addr = unsafe { (*info).si_addr() } as usize;
        let msg: &[u8] = MAPPINGS
            .get()
            .and_then(|m| m.iter().find(|m| addr >= m.start && addr < m.start + m.len))
            .map(|m| m.message.as_slice())
            .or(FALLBACK.get().map(|f| f.as_slice()))
            .unwrap_or(b"bus error\n");
        // SAFETY: write(2) and _exit(2) are async-signal-safe; the slice is
        // immutable static data.
        unsafe {
            libc::write(2, msg.as_ptr() as *const libc::c_void, msg.len());
            libc::_exit(1);
        }
    }
    // SAFETY: installs a handler that only reads immutable statics, writes
    // and exits; sigaction is filled completely before the call.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}
