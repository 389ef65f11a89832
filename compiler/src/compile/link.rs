//! Linking a stage object with the runtime, and the launcher script.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Environment variable naming the runtime static library explicitly.
pub const RUNTIME_LIB_ENV: &str = "M3C_RUNTIME_LIB";
const RUNTIME_LIB: &str = "libm3c_runtime.a";

/// The runtime library: `$M3C_RUNTIME_LIB`, else next to the m3c executable
/// (cargo puts `libm3c_runtime.a` beside `m3c` in target/<profile>/).
pub fn find_runtime_lib() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(RUNTIME_LIB_ENV) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{RUNTIME_LIB_ENV}={}: no such file", p.display());
        }
        return Ok(p);
    }
    let exe = std::env::current_exe().context("cannot locate the m3c executable")?;
    let mut tried = Vec::new();
    for dir in exe.ancestors().skip(1).take(2) {
        let p = dir.join(RUNTIME_LIB);
        if p.is_file() {
            return Ok(p);
        }
        tried.push(p.display().to_string());
    }
    bail!(
        "the stage runtime ({RUNTIME_LIB}) is not next to m3c (looked at {}); build it with `cargo build --release -p m3c-runtime` or set {RUNTIME_LIB_ENV}",
        tried.join(", ")
    )
}

/// Where Debian's libomp-22-dev puts libomp.
pub const OMP_DIR: &str = "/usr/lib/llvm-22/lib";

/// `mpicc` links: the stage's objects, the runtime (which has `main`), MPI
/// and what Rust's std needs from libc.
pub fn link(objects: &[PathBuf], runtime: &Path, exe: &Path) -> Result<()> {
    let mut cmd = Command::new("mpicc");
    cmd.args(linker_flags());
    let out = cmd
        .arg("-o")
        .arg(exe)
        .args(objects)
        .arg(runtime)
        // OpenMP runs the kernels' parallel loops (LLVM's libomp, as MLIR's
        // OpenMP lowering targets its ABI).
        .arg(format!("-L{OMP_DIR}"))
        .arg(format!("-Wl,-rpath,{OMP_DIR}"))
        .args(["-lomp", "-lm", "-ldl", "-lpthread", "-lrt", "-lutil", "-lgcc_s"])
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("`mpicc` not found: install Open MPI (`apt install openmpi-bin libopenmpi-dev`, or run scripts/setup.sh)")
        }
        Err(e) => return Err(e).context("cannot run mpicc"),
    };
    if !out.status.success() {
        let said = [&out.stderr, &out.stdout].iter().map(|b| String::from_utf8_lossy(b).trim().to_string()).collect::<Vec<_>>().join("\n");
        let said = if said.trim().is_empty() { "it printed nothing".to_string() } else { said.trim().to_string() };
        // A full disk often shows only as a crash or a silent failure of
        // the linker: say so, with the folder and the figures.
        let inputs: u64 = objects.iter().chain([&runtime.to_path_buf()]).filter_map(|p| p.metadata().ok()).map(|m| m.len()).sum();
        let folder = exe.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let space = [folder, std::env::temp_dir().as_path()].into_iter().find_map(|dir| short_of_space(dir, inputs));
        bail!("mpicc failed ({}){}:\n{said}", out.status, space.map(|s| format!("; {s}")).unwrap_or_default());
    }
    Ok(())
}

/// Where Debian's lld-22 puts `ld.lld` (the LLVM that m3c links).
const LLD_DIR: &str = "/usr/lib/llvm-22/bin";

/// The fastest linker present, as `mpicc` flags. Measured on one debug
/// stage (an 84 MB runtime archive) on 2 cores: lld 0.26 s, gold 0.9 s,
/// bfd 1.6 s. Every one of them writes the same bytes for the same inputs,
/// so a compile stays deterministic whichever is found; lld comes from the
/// LLVM release m3c already links, gold from binutils beside bfd.
fn linker_flags() -> Vec<String> {
    if Path::new(LLD_DIR).join("ld.lld").is_file() {
        // gcc looks for `ld.lld` in the -B folder first.
        return vec!["-fuse-ld=lld".into(), format!("-B{LLD_DIR}")];
    }
    let on_path = |name: &str| std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()));
    if on_path("ld.gold") {
        return vec!["-fuse-ld=gold".into()];
    }
    Vec::new()
}

/// `s` as one POSIX shell word: single-quoted, with each `'` written `'\''`.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `OUT/run.sh ARGS`: every stage under one mpirun, each with ARGS, on
/// the host its plan names (`hosts[k]`).
pub fn launcher(hosts: &[Option<String>], encoders: &[Option<String>]) -> String {
    let stages = hosts.len();
    let mut apps = Vec::new();
    // Plans only admit host names (`plan::valid_host`); quoted anyway, so
    // no value can ever be read by the shell as code.
    let host = |h: &Option<String>| h.as_ref().map(|h| format!("--host {} ", sh_quote(h))).unwrap_or_default();
    for (k, h) in hosts.iter().enumerate() {
        apps.push(format!("-np 1 {}\"$here/stage-{k}\" \"$@\"", host(h)));
    }
    // The encoder ranks (`vision: {ranks: N}`) after the stages.
    for h in encoders {
        apps.push(format!("-np 1 {}\"$here/encoder\" \"$@\"", host(h)));
    }
    format!(
        "#!/bin/sh\n\
         # Runs the {stages} stage(s) of this folder as one MPI job; arguments go to every stage:\n\
         #   ./run.sh --model DIR --prompt-ids 1,2,3 --max-new-tokens 16 [--dump FILE]\n\
         # Extra mpirun options (hosts, binding) come from M3C_MPIRUN_ARGS, as for m3c run and m3c serve.\n\
         here=$(cd \"$(dirname \"$0\")\" && pwd)\n\
         if [ \"$(id -u)\" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi\n\
         exec mpirun --oversubscribe --bind-to none $M3C_MPIRUN_ARGS {}\n",
        apps.join(" : ")
    )
}

/// "no space left on device" with the figures, when the file system of
/// `dir` has less room than `need` bytes (a stage executable is at most
/// its objects and the runtime library together).
fn short_of_space(dir: &Path, need: u64) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call, and
    // `st` is a plain C struct that statvfs fills (zeroed is a valid value).
    let free = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return None;
        }
        (st.f_bavail as u64).saturating_mul(st.f_frsize as u64)
    };
    (free < need).then(|| {
        let mb = |b: u64| b as f64 / (1u64 << 20) as f64;
        format!(
            "no space left on device: {} has {:.1} MB free, and linking a stage needs up to {:.1} MB",
            dir.display(),
            mb(free),
            mb(need)
        )
    })
}
