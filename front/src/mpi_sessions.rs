//! Open MPI's session folders: each launch keeps its own, and those that
//! launchers left behind are removed.
//!
//! Every mpirun keeps a session folder, `BASE/ompi.<host>.<uid>/pid.<its
//! pid>` (shared-memory backing files: about 8 MB), where BASE is
//! `orte_tmpdir_base`, by default `$TMPDIR`.
//!
//! **Each launch its own BASE.** Open MPI removes `ompi.<host>.<uid>` when
//! the last job in it ends, and creates it with a `mkdir` then a `stat`: a
//! job that starts while another ends can see the folder exist, then
//! vanish, and fail with "A call to mkdir was unable to create the desired
//! directory … File exists" (`orte_session_dir failed`). On a loaded
//! machine 1 job in 1,200 and 1 in 1,800 did (`scripts/mpi-session-race.sh
//! default`), so several `m3c run`s side by side, or a server's replicas
//! restarting, would fail now and then. With `BASE = $TMPDIR/m3c-mpi.<uid>/
//! <m3c pid>.<n>` per launch no two jobs share that folder, and none of
//! 1,200 and 1,800 failed (`… own`). A user's own `orte_tmpdir_base` is
//! left as it is, and a job that spans hosts keeps Open MPI's default (the
//! path is this machine's temporary folder; another host's may differ).
//!
//! **Sweeping.** A launcher that is killed (the front ends one that
//! outlives a stage's fatal error; a user's kill -9; a crash) leaves its
//! `pid.N` folder behind for good, and one that ends normally leaves its
//! empty BASE. A long-running serve would fill `/tmp` that way, so each
//! launch first removes, as Open MPI's own `orte-clean` does, the folders
//! of launchers that no longer exist, in `$TMPDIR` (jobs started without
//! m3c's BASE) and in each BASE. Folders of live processes, and anything
//! not named as above, are left alone.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The session folder base for a new launch: a folder no other job uses.
/// It is not created here: mpirun creates it, on every host it starts a
/// daemon on.
pub fn launch_base() -> PathBuf {
    static LAUNCHES: AtomicU64 = AtomicU64::new(0);
    let n = LAUNCHES.fetch_add(1, Ordering::Relaxed);
    bases_dir(&std::env::temp_dir(), uid()).join(format!("{}.{n}", std::process::id()))
}

/// Where this user's launch bases live under `tmp`.
fn bases_dir(tmp: &Path, uid: u32) -> PathBuf {
    tmp.join(format!("m3c-mpi.{uid}"))
}

/// How long an empty BASE is kept: mpirun creates BASE, then its
/// `ompi.*` folder in it at once, so an empty one older than this is a
/// finished job's.
const EMPTY_BASE_AGE: Duration = Duration::from_secs(60);

/// Removes the session folders of dead launchers under `tmp` for user
/// `uid`; returns how many it removed. Errors (a folder another process
/// removes at the same time, permissions) leave that folder alone.
pub fn sweep(tmp: &Path, uid: u32) -> usize {
    // Open MPI's own folders are shared by every job that uses them: only
    // dead launchers' `pid.N` go, never the `ompi.*` folder (removing it
    // is the race that each launch's own BASE avoids).
    let mut removed = jobs(tmp, uid).filter(|(pid, _)| !alive(*pid)).filter(|(_, job)| std::fs::remove_dir_all(job).is_ok()).count();
    let Ok(bases) = std::fs::read_dir(bases_dir(tmp, uid)) else { return removed };
    for base in bases.flatten() {
        let owner = base.file_name().to_str().and_then(|n| n.split_once('.')).and_then(|(p, _)| p.parse::<u32>().ok());
        let (Some(owner), true) = (owner, base.file_type().is_ok_and(|t| t.is_dir())) else { continue };
        let path = base.path();
        // One job per BASE: it is over when its m3c is gone, or its mpirun
        // (killed: its folder is there, its process is not), or when it
        // ended normally (Open MPI emptied BASE) long enough ago that no
        // mpirun is still about to fill it.
        let over = !alive(owner) || {
            let pids: Vec<u32> = jobs(&path, uid).map(|(pid, _)| pid).collect();
            let old = || base.metadata().and_then(|m| m.modified()).is_ok_and(|t| t.elapsed().unwrap_or_default() > EMPTY_BASE_AGE);
            !pids.iter().any(|&p| alive(p)) && (!pids.is_empty() || (is_empty(&path) && old()))
        };
        if over && std::fs::remove_dir_all(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Each `BASE/ompi.*.<uid>/pid.N` folder: N and the folder.
fn jobs(base: &Path, uid: u32) -> impl Iterator<Item = (u32, PathBuf)> {
    let suffix = format!(".{uid}");
    let tops = std::fs::read_dir(base).into_iter().flatten().flatten().filter(move |top| {
        let name = top.file_name();
        // Only this user's folders, and only real folders (no links).
        let name = name.to_string_lossy();
        name.starts_with("ompi.") && name.ends_with(&suffix) && top.file_type().is_ok_and(|t| t.is_dir())
    });
    tops.flat_map(|top| std::fs::read_dir(top.path()).into_iter().flatten().flatten()).filter_map(|job| {
        let pid = job.file_name().to_str()?.strip_prefix("pid.")?.parse::<u32>().ok()?;
        (pid != 0 && job.file_type().is_ok_and(|t| t.is_dir())).then(|| (pid, job.path()))
    })
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn is_empty(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none())
}

fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// [`sweep`] of this user's folders in the temporary folder Open MPI uses.
pub fn sweep_mine() -> usize {
    sweep(&std::env::temp_dir(), uid())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `BASE/ompi.host.UID/pid.PID` with a backing file, as mpirun leaves it.
    fn session(base: &Path, uid: u32, pid: u32) -> PathBuf {
        let d = base.join(format!("ompi.host.{uid}")).join(format!("pid.{pid}"));
        std::fs::create_dir_all(d.join("0")).unwrap();
        std::fs::write(d.join("hwloc.sm"), [0u8; 64]).unwrap();
        d
    }

    // pid_max is at most 2^22: this pid never exists.
    const DEAD: u32 = 4194305;

    #[test]
    fn removes_only_dead_launchers_folders_of_this_user() {
        let tmp = tempfile::tempdir().unwrap();
        let me = std::process::id();
        let dead = session(tmp.path(), 1000, DEAD);
        let live = session(tmp.path(), 1000, me);
        let other_user = session(tmp.path(), 1001, DEAD);
        let not_a_job = tmp.path().join("ompi.host.1000/contact.txt");
        std::fs::write(&not_a_job, "x").unwrap();
        assert_eq!(sweep(tmp.path(), 1000), 1);
        assert!(!dead.exists(), "a dead launcher's folder is removed");
        assert!(live.exists() && other_user.exists() && not_a_job.exists(), "nothing else is touched");
        assert_eq!(sweep(tmp.path(), 1000), 0, "a second sweep finds nothing");
    }

    #[test]
    fn launch_bases_are_removed_once_their_job_is_over() {
        let tmp = tempfile::tempdir().unwrap();
        let bases = bases_dir(tmp.path(), 1000);
        let me = std::process::id();
        // A dead m3c's base, with its killed mpirun's folder in it.
        let dead_owner = bases.join(format!("{DEAD}.0"));
        session(&dead_owner, 1000, DEAD);
        // This process's: a killed job's, a running job's, one that ended
        // normally (empty), and one just created by a starting mpirun.
        let killed = bases.join(format!("{me}.1"));
        let killed_job = session(&killed, 1000, DEAD);
        let running = session(&bases.join(format!("{me}.2")), 1000, me);
        let ended = bases.join(format!("{me}.3"));
        let starting = bases.join(format!("{me}.4"));
        for d in [&ended, &starting] {
            std::fs::create_dir_all(d).unwrap();
        }
        let old = std::time::SystemTime::now() - 2 * EMPTY_BASE_AGE;
        std::fs::File::open(&ended).unwrap().set_modified(old).unwrap();
        assert_eq!(sweep(tmp.path(), 1000), 3, "the dead owner's base, the killed job's base, the ended base");
        assert!(!dead_owner.exists() && !killed.exists() && !killed_job.exists() && !ended.exists());
        assert!(running.exists(), "a running job's folder is kept");
        assert!(starting.exists(), "a base just made, before mpirun fills it, is kept");
        // Once it is old, an empty base is a finished job's.
        std::fs::File::open(&starting).unwrap().set_modified(old).unwrap();
        assert_eq!(sweep(tmp.path(), 1000), 1);
        assert!(!starting.exists() && running.exists());
    }

    #[test]
    fn each_launch_has_its_own_base() {
        let (a, b) = (launch_base(), launch_base());
        assert_ne!(a, b);
        assert_eq!(a.parent(), b.parent());
        assert!(a.parent().unwrap().starts_with(std::env::temp_dir()));
    }
}
