//! Open MPI's session folders of jobs whose launcher is gone.
//!
//! Every mpirun keeps a session folder, `$TMPDIR/ompi.<host>.<uid>/pid.<its
//! pid>` (shared-memory backing files: about 8 MB), and removes it when it
//! ends normally. A launcher that is killed (the front ends one that
//! outlives a stage's fatal error; a user's kill -9; a crash) leaves it
//! behind for good. A long-running serve would fill `/tmp` that way, so
//! each launch first removes the folders of launchers that no longer exist,
//! as Open MPI's own `orte-clean` does. Folders of live processes, and
//! anything not named as above, are left alone.

use std::path::Path;

/// Removes the session folders of dead launchers under `tmp` for user
/// `uid`; returns how many it removed. Errors (a folder another process
/// removes at the same time, permissions) leave that folder alone.
pub fn sweep(tmp: &Path, uid: u32) -> usize {
    let suffix = format!(".{uid}");
    let Ok(tops) = std::fs::read_dir(tmp) else { return 0 };
    let mut removed = 0;
    for top in tops.flatten() {
        let name = top.file_name();
        let name = name.to_string_lossy();
        // Only this user's folders, and only real folders (no links).
        let ours = name.starts_with("ompi.") && name.ends_with(&suffix) && top.file_type().is_ok_and(|t| t.is_dir());
        if !ours {
            continue;
        }
        let Ok(jobs) = std::fs::read_dir(top.path()) else { continue };
        for job in jobs.flatten() {
            let Some(pid) = job.file_name().to_str().and_then(|n| n.strip_prefix("pid.")).and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if pid == 0 || !job.file_type().is_ok_and(|t| t.is_dir()) || Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            if std::fs::remove_dir_all(job.path()).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

/// [`sweep`] of this user's folders in the temporary folder Open MPI uses.
pub fn sweep_mine() -> usize {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    sweep(&std::env::temp_dir(), uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_only_dead_launchers_folders_of_this_user() {
        let tmp = tempfile::tempdir().unwrap();
        let mine = tmp.path().join("ompi.host.1000");
        // pid_max is at most 2^22: this pid never exists.
        let dead = mine.join("pid.4194305");
        let live = mine.join(format!("pid.{}", std::process::id()));
        let other_user = tmp.path().join("ompi.host.1001").join("pid.4194305");
        let not_a_job = mine.join("contact.txt");
        for d in [&dead, &live, &other_user] {
            std::fs::create_dir_all(d.join("0")).unwrap();
            std::fs::write(d.join("hwloc.sm"), [0u8; 64]).unwrap();
        }
        std::fs::write(&not_a_job, "x").unwrap();
        assert_eq!(sweep(tmp.path(), 1000), 1);
        assert!(!dead.exists(), "a dead launcher's folder is removed");
        assert!(live.exists() && other_user.exists() && not_a_job.exists(), "nothing else is touched");
        assert_eq!(sweep(tmp.path(), 1000), 0, "a second sweep finds nothing");
    }
}
