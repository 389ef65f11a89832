//! Writing output folders atomically: everything goes into a temporary
//! sibling folder that is renamed into place only when complete, so a failed
//! run leaves nothing half written.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Builds `out` by calling `fill` on an empty temporary folder beside it.
/// `out` must not exist, or be an empty folder, unless `replace` is set.
pub fn write_dir_atomically(out: &Path, replace: bool, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    if out.exists() {
        let empty = out.is_dir() && std::fs::read_dir(out).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !empty && !replace {
            bail!("{}: already exists and is not empty (choose a new folder, or remove it first)", out.display());
        }
        if !out.is_dir() {
            bail!("{}: exists and is not a folder", out.display());
        }
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    let tmp = parent.join(format!(".{name}.partial-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).ok();
    }
    std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let result = fill(&tmp).and_then(|()| {
        if out.exists() {
            std::fs::remove_dir_all(out).with_context(|| format!("cannot replace {}", out.display()))?;
        }
        std::fs::rename(&tmp, out).with_context(|| format!("cannot move {} into place", out.display()))
    });
    if result.is_err() {
        std::fs::remove_dir_all(&tmp).ok();
    }
    result
}

/// Writes a file atomically (temporary sibling, then rename).
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| {
        std::fs::remove_file(&tmp).ok();
        format!("cannot write {}", path.display())
    })
}
