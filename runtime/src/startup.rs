//! Start-up: the checks every rank makes before any work, each ending in a
//! verdict that every rank shares, so the whole job goes on or stops
//! together (no rank is left waiting for a peer that has already exited).
//!
//! Every collective here waits only while its peers are alive (heartbeats,
//! `liveness`): a peer that crashed or hangs before joining makes the
//! waiting ranks end the whole job after `--timeout-s`.

use crate::error::StageError;
use crate::liveness::{self, Peers};
use mpi::collective::{CommunicatorCollectives, Root};
use mpi::topology::{Communicator, SimpleCommunicator};
use std::time::Duration;

/// Bytes each rank contributes to the identity gather.
pub const ID_BYTES: usize = 1 + 64 + 8 + 32;

/// Ends the job: prints nothing more, every rank is killed by mpirun.
pub fn abort_job(world: &SimpleCommunicator, who: &str, message: &str) -> ! {
    say!("{who}: error: {message}");
    // MPI_Abort asks the launcher to end the job. A launcher this host can
    // no longer reach (a cut link) never answers: the stage then ends
    // itself.
    end_daemon_later();
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_secs(3));
        // SAFETY: _exit ends the process at once; nothing is left to unwind.
        unsafe { libc::_exit(1) }
    });
    world.abort(1)
}

/// For a stage leaving a failed job: when its parent is this job's Open MPI
/// daemon on a remote host, a helper that outlives the stage ends that
/// daemon in 5 s unless the launcher did first. A daemon cut off from the
/// launcher otherwise waits on it for as long as TCP retransmits (over 45 s
/// seen in CI), holding the host; a reachable launcher ends it sooner.
pub fn end_daemon_later() {
    // SAFETY: getppid has no preconditions and cannot fail.
    let parent = unsafe { libc::getppid() };
    let is_daemon = |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "orted");
    if is_daemon(parent) {
        // The helper checks the name again: the pid may be reused by then.
        let script = format!("sleep 5; [ \"$(cat /proc/{parent}/comm 2>/dev/null)\" = orted ] && kill -9 {parent} 2>/dev/null");
        let _ = std::process::Command::new("sh")
            .args(["-c", &script])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
    }
}

/// The least time MPI's start-up gets, whatever `--timeout-s` says: the
/// wire-up of every rank through the Open MPI daemons takes seconds on a
/// loaded machine.
pub const MIN_INIT_DEADLINE: Duration = Duration::from_secs(20);

/// A deadline for `MPI_Init`. Its wire-up (every rank's address exchanged
/// through the Open MPI daemons) waits with no deadline of its own, before
/// any heartbeat exists: a host cut off mid-start leaves its stage there,
/// and its daemon, whose unacknowledged messages keep TCP retransmitting
/// (keepalives only probe an idle link), waits with it for many minutes.
/// A stage not through the start-up by the deadline ends itself and its
/// daemon; the launcher's side ends the job as for any lost host.
pub struct InitWatch(std::sync::mpsc::Sender<()>);

impl InitWatch {
    pub fn start(who: String, deadline: Duration) -> InitWatch {
        let (done, watch) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            // Told (or the watch dropped, as when MPI failed to start and
            // the stage returns): nothing to do.
            if watch.recv_timeout(deadline) != Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                return;
            }
            say!(
                "{who}: error: MPI's start-up did not finish within {:.0} s (--timeout-s, {} s at least): a host of this job is unreachable or its stage never started",
                deadline.as_secs_f64(),
                MIN_INIT_DEADLINE.as_secs()
            );
            end_daemon_later();
            // SAFETY: _exit ends the process at once; MPI is not usable
            // (its start-up never finished), so nothing is left to close.
            unsafe { libc::_exit(1) }
        });
        InitWatch(done)
    }

    /// MPI is up: the watch ends.
    pub fn done(self) {
        let _ = self.0.send(());
    }
}

/// `all_gather` of equal-sized byte records, waiting while every peer is alive.
pub fn gather(world: &SimpleCommunicator, peers: &mut Peers, who: &str, mine: &[u8]) -> Vec<u8> {
    let size = world.size() as usize;
    let mut all = vec![0u8; mine.len() * size];
    mpi::request::scope(|scope| {
        let req = world.immediate_all_gather_into(scope, mine, &mut all[..]);
        wait_alive(world, peers, who, req);
    });
    all
}

/// Waits for a collective while every peer is alive; a silent peer ends the job.
fn wait_alive<'a, D: ?Sized, S: mpi::request::Scope<'a>>(
    world: &SimpleCommunicator,
    peers: &mut Peers,
    who: &str,
    mut req: mpi::request::Request<'a, D, S>,
) {
    let size = world.size() as usize;
    loop {
        match req.test() {
            Ok(_) => return,
            Err(r) => req = r,
        }
        peers.drain(world);
        if let Some(r) = peers.silent(0..size) {
            abort_job(world, who, &liveness::silent_message(r, peers.timeout));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// `broadcast` from rank 0, waiting while every peer is alive.
pub fn broadcast(world: &SimpleCommunicator, peers: &mut Peers, who: &str, buf: &mut [u8]) {
    mpi::request::scope(|scope| {
        let req = world.process_at_rank(0).immediate_broadcast_into(scope, buf);
        wait_alive(world, peers, who, req);
    });
}

/// A barrier that gives up after `deadline` (used once heartbeats have
/// stopped, before MPI is finalised, so that no rank's last heartbeat can
/// reach a peer that has already left MPI). Returns whether every rank came.
pub fn barrier_within(world: &SimpleCommunicator, deadline: Duration) -> bool {
    let t0 = std::time::Instant::now();
    let mut req = world.immediate_barrier();
    loop {
        match req.test() {
            Ok(_) => return true,
            Err(r) => req = r,
        }
        if t0.elapsed() > deadline {
            // The request cannot be dropped unfinished; the process is about to exit anyway.
            std::mem::forget(req);
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// A local result shared with every rank: `Ok` everywhere, or `Err` on
/// every rank, with the message printed once (by the lowest failing rank).
pub fn agree<T>(world: &SimpleCommunicator, peers: &mut Peers, who: &str, local: Result<T, StageError>) -> Result<T, ()> {
    let ok = [local.is_ok() as u8];
    let all = gather(world, peers, who, &ok);
    let first_bad = all.iter().position(|&b| b == 0);
    match (local, first_bad) {
        (Ok(v), None) => Ok(v),
        (Err(e), Some(r)) => {
            if r == world.rank() as usize {
                say!("{who}: error: {e}");
            }
            Err(())
        }
        (Ok(_), Some(_)) => Err(()),
        (Err(e), None) => {
            say!("{who}: error: {e}");
            Err(())
        }
    }
}

/// This rank's identity record: ok flag, compile id, stage, arguments hash.
pub fn identity(ok: bool, compile_id: &str, stage: usize, args_hash: &[u8; 32]) -> [u8; ID_BYTES] {
    let mut rec = [0u8; ID_BYTES];
    rec[0] = ok as u8;
    let b = compile_id.as_bytes();
    rec[1..1 + b.len().min(64)].copy_from_slice(&b[..b.len().min(64)]);
    rec[65..73].copy_from_slice(&(stage as u64).to_le_bytes());
    rec[73..105].copy_from_slice(args_hash);
    rec
}

/// What every rank concludes from the gathered identities (the same on
/// every rank): `None` when the ranks belong together.
pub fn judge_identities(all: &[u8]) -> Option<String> {
    let recs: Vec<&[u8]> = all.chunks(ID_BYTES).collect();
    if recs.iter().any(|r| r[0] == 0) {
        return Some(String::new()); // a rank failed locally and says why itself
    }
    let id = |r: &[u8]| String::from_utf8_lossy(&r[1..65]).trim_end_matches('\0').to_string();
    if recs.iter().any(|r| r[1..65] != recs[0][1..65]) {
        let list: Vec<String> =
            recs.iter().enumerate().map(|(k, r)| format!("rank {k}: {}", id(r).chars().take(12).collect::<String>())).collect();
        return Some(format!(
            "the ranks come from different compiles (compile ids {}); start the stage executables of one OUT folder",
            list.join(", ")
        ));
    }
    let stages: Vec<u64> = recs.iter().map(|r| u64::from_le_bytes(r[65..73].try_into().unwrap_or([0; 8]))).collect();
    if stages.iter().enumerate().any(|(k, &s)| k as u64 != s) {
        return Some(format!("stages started out of order (rank r must run stage-r; ranks run stages {stages:?})"));
    }
    if let Some(k) = recs.iter().position(|r| r[73..105] != recs[0][73..105]) {
        return Some(format!(
            "the ranks were started with different arguments (rank {k} differs from rank 0); every stage needs the same prompts and options"
        ));
    }
    None
}

/// sha256 of the stage arguments, NUL-separated, but for `--node-share`.
pub fn args_hash(argv: &[String]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut skip = false;
    for a in argv {
        // `--node-share` is each rank's own (its place on its machine).
        if std::mem::take(&mut skip) {
            continue;
        }
        if a == "--node-share" {
            skip = true;
            continue;
        }
        h.update(a.as_bytes());
        h.update([0u8]);
    }
    h.finalize().into()
}
