//! Compiled fixtures shared by the tests of this binary: each (fixture, pp)
//! is compiled once per run, under target/tmp, for the tests that only run
//! its stages. A test that edits, removes or recompiles an output compiles
//! its own, and one that finds or signals its stages by their path runs a
//! private copy ([`copy`]): other tests run the shared one at the same time.

use m3c_tests::{compile, fixture};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// The output of `m3c compile --model tests/fixtures/NAME --pp PP`, compiled
/// on first use (an earlier run's output there is replaced).
pub fn out(name: &str, pp: usize) -> PathBuf {
    out_with(name, pp, &[])
}

/// The tiny fixture compiled at `pp` ([`out`]), and its model folder: what
/// most runs take.
pub fn tiny(pp: usize) -> (PathBuf, PathBuf) {
    (out("tiny-m3", pp), fixture("tiny-m3"))
}

/// The same with more compile flags (`--activations bf16`, ...).
pub fn out_with(name: &str, pp: usize, extra: &[&str]) -> PathBuf {
    /// One cell per (fixture, pp, flags): a test waits only for its own compile.
    type Cells = HashMap<(String, usize, String), Arc<OnceLock<PathBuf>>>;
    static OUTS: OnceLock<Mutex<Cells>> = OnceLock::new();
    let flags = extra.join(" ");
    let cell = {
        let mut map = OUTS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        map.entry((name.to_string(), pp, flags.clone())).or_default().clone()
    };
    cell.get_or_init(|| {
        let tag: String = flags.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("shared").join(format!("{}-pp{pp}{tag}", name.replace('/', "_")));
        std::fs::create_dir_all(&d).unwrap();
        compile(&fixture(name), pp, &d, extra)
    })
    .clone()
}

/// A private copy of [`out`] in `dir` (its own path, so its processes are
/// told apart from other tests').
pub fn copy(name: &str, pp: usize, dir: &Path) -> PathBuf {
    let to = dir.join(format!("{}-pp{pp}", name.replace('/', "_")));
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(out(name, pp)).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    to
}

/// tiny-m3 at pp 3 (layers 0-2 | 3-5 | 6-7) with the vision tower on the
/// last stage (`vision: true` there): the first stage sends it the images
/// and takes the features back.
pub fn tiny_tower_on_last() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("shared");
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("tower-on-last.yaml");
    // Written whole under another name, then renamed: a test reading it
    // while another writes never sees half a file.
    let tmp = dir.join(format!("tower-on-last.{}.{:?}.tmp", std::process::id(), std::thread::current().id()));
    std::fs::write(&tmp, "version: 1\nstages:\n  - layers: \"0-2\"\n  - layers: \"3-5\"\n  - layers: \"6-7\"\n    vision: true\n").unwrap();
    std::fs::rename(&tmp, &plan).unwrap();
    out_with("tiny-m3", 3, &[plan.to_str().unwrap()])
}

/// tiny-m3 at pp 2 (layers 0-3 | 4-7) with the vision tower on two encoder
/// ranks of their own (`vision: {ranks: 2}`), after the stages.
pub fn tiny_encoder_ranks() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("shared");
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("encoder-ranks.yaml");
    let tmp = dir.join(format!("encoder-ranks.{}.{:?}.tmp", std::process::id(), std::thread::current().id()));
    std::fs::write(&tmp, "version: 1\nvision:\n  ranks: 2\nstages:\n  - layers: \"0-3\"\n  - layers: \"4-7\"\n").unwrap();
    std::fs::rename(&tmp, &plan).unwrap();
    out_with("tiny-m3", 2, &[plan.to_str().unwrap()])
}
