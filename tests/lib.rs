//! Shared helpers of the end-to-end tests: where the fixtures are, and how to
//! run the `m3c` binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

pub fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures").join(name)
}

pub fn configs(name: &str) -> PathBuf {
    root().join("configs").join(name)
}

/// The `m3c` CLI built for these tests (cargo builds it before the tests run).
pub fn m3c_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/it-xxxx → target/<profile>/m3c-cli
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    dir.join(format!("m3c-cli{}", std::env::consts::EXE_SUFFIX))
}

/// Runs `m3c ARGS` and returns its output.
pub fn m3c(args: &[&str]) -> Output {
    let bin = m3c_bin();
    Command::new(&bin).args(args).output().unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
