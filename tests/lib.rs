//! Shared helpers of the end-to-end tests: where the fixtures are, and how to
//! run the `m3c` binary.

/// The SIMT interpreter of the GPU kernels (its own crate, compiled optimised).
pub use m3c_simt as simt;

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

/// The object cache every test compile shares (under target/tmp, never the
/// user's ~/.cache): a kernel is compiled once per test run, whichever
/// tests, splits and stages use it. Tests that check the cache itself pass
/// `--cache-dir` or `--no-cache`.
pub fn cache_dir() -> PathBuf {
    // target/<profile>/m3c-cli → target/tmp/m3c-cache (where cargo puts
    // integration tests' CARGO_TARGET_TMPDIR).
    let target = m3c_bin().parent().and_then(Path::parent).expect("target dir").to_path_buf();
    target.join("tmp/m3c-cache")
}

/// `m3c` as the tests run it: with the tests' object cache.
pub fn m3c_command() -> Command {
    let mut cmd = Command::new(m3c_bin());
    cmd.env("M3C_CACHE_DIR", cache_dir());
    cmd
}

/// Runs `m3c ARGS` and returns its output.
pub fn m3c(args: &[&str]) -> Output {
    m3c_command().args(args).output().unwrap_or_else(|e| panic!("cannot run {}: {e}", m3c_bin().display()))
}

/// Runs `m3c run OUT --model MODEL ARGS`: a compiled pipeline on a model's folder.
pub fn m3c_run(out: &Path, model: &Path, args: &[&str]) -> Output {
    let mut all = vec!["run", out.to_str().expect("a UTF-8 path"), "--model", model.to_str().expect("a UTF-8 path")];
    all.extend_from_slice(args);
    m3c(&all)
}

/// Runs `m3c ARGS` with extra environment variables.
pub fn m3c_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = m3c_command();
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap_or_else(|e| panic!("cannot run {}: {e}", m3c_bin().display()))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts that the command failed and that its stderr says each of
/// `parts`; the stderr.
pub fn fails_with(out: &Output, parts: &[&str]) -> String {
    let e = stderr(out);
    assert!(!out.status.success(), "succeeded:\n{e}");
    for p in parts {
        assert!(e.contains(p), "expected `{p}` in:\n{e}");
    }
    e
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A tensor of a safetensors file as f32 or i64 values.
pub fn read_tensor_f32(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap_or_else(|_| panic!("{}: no tensor {name}", path.display()));
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    (t.shape().to_vec(), t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
}

pub fn read_tensor_i64(path: &Path, name: &str) -> Vec<i64> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap_or_else(|_| panic!("{}: no tensor {name}", path.display()));
    assert_eq!(t.dtype(), safetensors::Dtype::I64, "{name}");
    t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// `m3c compile --model MODEL --pp N [extra] -o DIR/out`; panics with m3c's message on failure.
pub fn compile(model: &Path, pp: usize, dir: &Path, extra: &[&str]) -> PathBuf {
    let out = dir.join("out");
    let o = compile_to(model, pp, &out, extra);
    assert!(o.status.success(), "m3c compile {} {extra:?} failed:\n{}", model.display(), stderr(&o));
    out
}

/// `m3c compile --model MODEL --pp N [extra] -o OUT`, whatever it gives.
pub fn compile_to(model: &Path, pp: usize, out: &Path, extra: &[&str]) -> Output {
    let pp = pp.to_string();
    let mut args = vec!["compile", "--model", model.to_str().unwrap(), "--pp", &pp, "-o", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    m3c(&args)
}

/// Comma-separated ids, as `--prompt-ids` takes them.
pub fn ids_arg(ids: &[i64]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// `mpirun -np 1 APP : -np 1 APP ...` over stage executables started by
/// hand (each app a command line), as root if need be.
pub fn mpirun(apps: &[Vec<String>]) -> Output {
    let mut cmd = Command::new("mpirun");
    cmd.arg("--oversubscribe").env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    for (i, app) in apps.iter().enumerate() {
        if i > 0 {
            cmd.arg(":");
        }
        cmd.args(["-np", "1"]).args(app);
    }
    cmd.output().expect("mpirun")
}
