//! Writing output folders and files atomically: everything goes into a
//! uniquely named temporary sibling that is renamed into place only when
//! complete, so a failed or interrupted run leaves nothing half written,
//! and nothing but an earlier output of the same kind is ever replaced.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The folder `p` lives in (`.` for a bare name).
fn parent_of(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Whether process `pid` is alive on this machine.
fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes `.NAME.partial-PID` and `.NAME.old-PID` siblings of `out` whose
/// process is gone: what an earlier compile killed by SIGKILL (which no
/// handler can catch) left behind.
pub fn sweep_stale(out: &Path) {
    let Some(name) = out.file_name().map(|n| n.to_string_lossy().into_owned()) else { return };
    let Ok(entries) = std::fs::read_dir(parent_of(out)) else { return };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let pid =
            [".partial-", ".old-"].iter().find_map(|tag| file.strip_prefix(&format!(".{name}{tag}")).and_then(|p| p.parse::<u32>().ok()));
        if let Some(pid) = pid {
            if pid != std::process::id() && !pid_alive(pid) {
                std::fs::remove_dir_all(e.path()).or_else(|_| std::fs::remove_file(e.path())).ok();
            }
        }
    }
}

/// Builds `out` by calling `fill` on an empty temporary folder beside it.
/// `out` must not exist or be an empty folder, unless `replaceable` says
/// the folder there may be replaced (it is checked before `fill` runs).
/// An interruption (SIGINT, SIGTERM) removes the temporary folder.
pub fn write_dir_atomically(out: &Path, replaceable: impl Fn(&Path) -> Result<()>, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    match std::fs::symlink_metadata(out) {
        Ok(m) if m.is_dir() => {
            let empty = std::fs::read_dir(out).map(|mut d| d.next().is_none()).unwrap_or(false);
            if !empty {
                replaceable(out)?;
            }
        }
        Ok(_) => bail!("{}: exists and is not a folder", out.display()),
        Err(_) => {}
    }
    let parent = parent_of(out);
    std::fs::create_dir_all(&parent).with_context(|| format!("cannot create {}", parent.display()))?;
    sweep_stale(out);
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).context("the output folder needs a name")?;
    let pid = std::process::id();
    let tmp = parent.join(format!(".{name}.partial-{pid}"));
    if std::fs::symlink_metadata(&tmp).is_ok() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("cannot remove {}", tmp.display()))?;
    }
    std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let _registered = m3c_signals::TempRegistration::new(&tmp);
    let result = fill(&tmp).and_then(|()| {
        // Swap: the old folder steps aside, the new one moves in, the old
        // one goes. A failure in between puts the old one back.
        let old = parent.join(format!(".{name}.old-{pid}"));
        let had_old = std::fs::symlink_metadata(out).is_ok();
        if had_old {
            std::fs::rename(out, &old).with_context(|| format!("cannot replace {}", out.display()))?;
        }
        if let Err(e) = std::fs::rename(&tmp, out) {
            if had_old {
                std::fs::rename(&old, out).ok();
            }
            return Err(e).with_context(|| format!("cannot move {} into place", out.display()));
        }
        if had_old {
            std::fs::remove_dir_all(&old).with_context(|| format!("cannot remove the previous output {}", old.display()))?;
        }
        Ok(())
    });
    if result.is_err() {
        std::fs::remove_dir_all(&tmp).ok();
    }
    result
}

/// Writes a file atomically: a uniquely named temporary sibling, then a
/// rename. Only a regular file (or nothing) may be at `path`: a folder,
/// device, socket or symbolic link there is refused, never replaced.
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    check_replaceable_file(path)?;
    let parent = parent_of(path);
    std::fs::create_dir_all(&parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).context("the output file needs a name")?;
    let tmp = unique_sibling(&parent, &name);
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        std::fs::remove_file(&tmp).ok();
        return Err(e).with_context(|| format!("cannot write {}", path.display()));
    }
    Ok(())
}

/// Refuses a path whose current occupant is not a regular file.
pub fn check_replaceable_file(path: &Path) -> Result<()> {
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_file() {
            let kind = if m.file_type().is_symlink() { "a symbolic link" } else { m3c_contract::input::kind_of(&m) };
            bail!("{}: is {kind}; m3c only replaces regular files (choose another path)", path.display());
        }
    }
    Ok(())
}

/// `.NAME.PID-N.partial` in `dir`, a name no other writer uses.
fn unique_sibling(dir: &Path, name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    dir.join(format!(".{name}.{}-{n}.partial", std::process::id()))
}
