//! Hostile input and faults, one test per defect the hardening issue found
//! (numbered as there). Each asserts the safe outcome: a clear error that
//! names the file, key or stage; the user's files untouched; no process and
//! no temporary file left behind; never a panic, a crash or a hang.

use m3c_tests::{compile, configs, fixture, ids_arg, m3c, mpirun, stderr, stdout};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The tiny fixture compiled once per test run (`crate::shared`).
fn shared_out(pp: usize) -> PathBuf {
    crate::shared::out("tiny-m3", pp)
}

/// A copy of the tiny fixture (config.json byte for byte, so compiled
/// stages accept it) whose model.safetensors `edit` may change.
pub(crate) fn model_copy(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>, &mut Vec<u8>)) -> PathBuf {
    let src = fixture("tiny-m3");
    let m = dir.join("model");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::copy(src.join("config.json"), m.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut data = bytes[8 + n..].to_vec();
    edit(&mut header, &mut data);
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(m.join("model.safetensors"), out).unwrap();
    m
}

/// The data range of `tensor` in a header.
pub(crate) fn range(header: &serde_json::Map<String, serde_json::Value>, tensor: &str) -> (usize, usize) {
    let o = &header[tensor]["data_offsets"];
    (o[0].as_u64().unwrap() as usize, o[1].as_u64().unwrap() as usize)
}

fn run_args<'a>(out: &'a Path, model: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap()];
    v.extend_from_slice(extra);
    v
}

/// Processes whose command line contains `needle`.
fn processes_with(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        if pid == me {
            continue;
        }
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            // Zombies have an empty command line: they hold nothing.
            if String::from_utf8_lossy(&cmd).replace('\0', " ").contains(needle) {
                found.push(pid);
            }
        }
    }
    found
}

/// Waits until no process mentions `needle`; false after `secs`.
fn all_gone(needle: &str, secs: u64) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(secs) {
        if processes_with(needle).is_empty() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// One rank of an mpirun command line: a stage executable and its arguments.
fn stage_app(exe: &Path, model: &Path, extra: &[&str]) -> Vec<String> {
    let mut v = vec![exe.display().to_string(), "--model".into(), model.display().to_string()];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// The command's standard error says `what`.
fn says(o: &Output, what: &str) {
    let e = stderr(o);
    assert!(e.contains(what), "expected `{what}` in:\n{e}");
}

fn assert_clean_failure(o: &Output, what: &str) {
    let e = stderr(o);
    assert!(!o.status.success(), "{what}: succeeded:\n{e}");
    assert_ne!(o.status.code(), Some(101), "{what}: panicked:\n{e}");
    for bad in ["panicked", "free(): ", "double free", "Segmentation", "LLVM ERROR", "core dumped", "signal 11", "signal 6"] {
        assert!(!e.contains(bad), "{what}: `{bad}` in:\n{e}");
    }
}

fn m3c_in(dir: &Path, args: &[&str]) -> Output {
    m3c_tests::m3c_command().args(args).current_dir(dir).output().unwrap()
}

fn tree(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = walk(dir).into_iter().map(|p| p.strip_prefix(dir).unwrap().display().to_string()).collect();
    v.sort();
    v
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        v.push(e.path());
        if e.file_type().unwrap().is_dir() {
            v.extend(walk(&e.path()));
        }
    }
    v
}

/// Defect 1: `compile -o` replaces only a provable m3c output: never a folder that
/// merely holds a `manifest.json`, never the model's folder, never `.`.
#[test]
fn d01_compile_never_deletes_what_it_did_not_write() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tiny-m3");
    // A web app with its own manifest.json.
    let app = dir.path().join("app");
    std::fs::create_dir_all(app.join("src")).unwrap();
    std::fs::write(app.join("manifest.json"), r#"{"name": "my app"}"#).unwrap();
    std::fs::write(app.join("notes.txt"), "mine").unwrap();
    std::fs::write(app.join("src/main.js"), "x").unwrap();
    let app_before = tree(&app);
    let before = app_before.clone();
    let o = m3c(&["compile", "--model", model.to_str().unwrap(), "--pp", "1", "-o", app.to_str().unwrap()]);
    assert_clean_failure(&o, "-o app");
    says(&o, "not m3c's");
    assert_eq!(tree(&app), before);
    // The model folder itself.
    let copy = model_copy(dir.path(), |_, _| {});
    let before = tree(&copy);
    let o = m3c(&["compile", "--model", copy.to_str().unwrap(), "--pp", "1", "-o", copy.to_str().unwrap()]);
    assert_clean_failure(&o, "-o MODEL");
    says(&o, "holds the model");
    assert_eq!(tree(&copy), before);
    // A folder above the model.
    let o = m3c(&["compile", "--model", copy.to_str().unwrap(), "--pp", "1", "-o", dir.path().to_str().unwrap()]);
    assert_clean_failure(&o, "-o PARENT");
    assert_eq!(tree(&copy), before);
    // `-o .` in a folder with a manifest.json.
    let o = m3c_in(&app, &["compile", "--model", model.to_str().unwrap(), "--pp", "1", "-o", "."]);
    assert_clean_failure(&o, "-o .");
    says(&o, "current folder");
    assert_eq!(tree(&app), app_before);
    // An earlier m3c output is replaced; one with a file added is not.
    let out = dir.path().join("out");
    for _ in 0..2 {
        let o = m3c(&["compile", "--model", model.to_str().unwrap(), "--pp", "1", "-o", out.to_str().unwrap()]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    std::fs::write(out.join("results.csv"), "precious").unwrap();
    let o = m3c(&["compile", "--model", model.to_str().unwrap(), "--pp", "1", "-o", out.to_str().unwrap()]);
    assert_clean_failure(&o, "-o out with a user file");
    says(&o, "results.csv");
    assert_eq!(std::fs::read_to_string(out.join("results.csv")).unwrap(), "precious");
    let left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(left.iter().all(|n| !n.contains("partial") && !n.contains(".old-")), "{left:?}");
}

/// Defect 2: NaN or Inf in weights: the run ends with a message naming the stage
/// and position (no heap corruption), and `inspect --check-values` names the
/// tensors.
#[test]
fn d02_non_finite_weights_end_the_run_cleanly() {
    let out = shared_out(2);
    let cases: [(&str, &str, [u8; 4]); 3] = [
        ("router", "language_model.model.layers.3.block_sparse_moe.gate.weight", f32::NAN.to_le_bytes()),
        ("q_proj", "language_model.model.layers.1.self_attn.q_proj.weight", [0xC0, 0x7F, 0xC0, 0x7F]), // bf16 NaN, twice
        ("embedding", "language_model.model.embed_tokens.weight", [0x80, 0x7F, 0x80, 0x7F]),           // bf16 +Inf, twice
    ];
    for (what, tensor, bits) in cases {
        let dir = tempfile::tempdir().unwrap();
        let model = model_copy(dir.path(), |h, data| {
            let (a, b) = range(h, tensor);
            // Every element of the first rows, so the prompt reaches them.
            for c in data[a..b.min(a + 4096)].chunks_exact_mut(4) {
                c.copy_from_slice(&bits);
            }
        });
        let o = m3c(&run_args(&out, &model, &["--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "3"]));
        assert_clean_failure(&o, what);
        let e = stderr(&o);
        assert!(e.contains("non-finite logits") && e.contains("stage 1") && e.contains("--check-values"), "{what}: {e}");
        let o = m3c(&["inspect", model.to_str().unwrap(), "--check-values"]);
        assert_clean_failure(&o, "inspect --check-values");
        assert!(stderr(&o).contains(tensor) && stderr(&o).contains("model.safetensors"), "{}", stderr(&o));
    }
    let o = m3c(&["inspect", fixture("tiny-m3").to_str().unwrap(), "--check-values"]);
    assert!(o.status.success() && stdout(&o).contains("tensors finite"), "{}", stderr(&o));
}

/// Defect 3: A plan's `host:` can never run shell code: it is validated when the
/// plan is read (file, line, column), and quoted in run.sh anyway.
#[test]
fn d03_plan_hosts_cannot_inject_shell_code() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tiny-m3");
    for host in ["\"$(touch PWNED)localhost\"", "\"node a\"", "\"a;b\"", "\"node:4\"", "\"-x\""] {
        let plan = dir.path().join("plan.yaml");
        std::fs::write(&plan, format!("version: 1\nstages:\n  - layers: \"0-7\"\n    host: {host}\n")).unwrap();
        let out = dir.path().join("out");
        let o = m3c_in(
            dir.path(),
            &["compile", "--model", model.to_str().unwrap(), "--pp", "1", plan.to_str().unwrap(), "-o", out.to_str().unwrap()],
        );
        assert_clean_failure(&o, host);
        assert!(stderr(&o).contains("plan.yaml:4:11") && stderr(&o).contains("`host` must be a host name"), "{host}: {}", stderr(&o));
        assert!(!out.exists() && !dir.path().join("PWNED").exists());
    }
    // What quoting makes of any string is that string, for the shell.
    for s in ["it's", "$(touch PWNED)", "a b", "'\"`\\"] {
        let q = m3c_compiler::compile::sh_quote(s);
        let o = Command::new("sh").arg("-c").arg(format!("printf %s {q}")).current_dir(dir.path()).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&o.stdout), s);
    }
    assert!(!dir.path().join("PWNED").exists());
}

/// Defect 4: `--dump` is checked before any work and replaces only a regular file,
/// through a temporary name no one else uses.
#[test]
fn d04_dump_replaces_only_regular_files() {
    let out = shared_out(1);
    let model = fixture("tiny-m3");
    let dir = tempfile::tempdir().unwrap();
    let run =
        |dump: &Path| m3c(&run_args(&out, &model, &["--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--dump", dump.to_str().unwrap()]));
    // A device (as root this would have become a regular file).
    let o = run(Path::new("/dev/full"));
    assert_clean_failure(&o, "/dev/full");
    says(&o, "/dev/full: is a character device");
    assert!(std::fs::metadata("/dev/full").unwrap().file_type().is_char_device());
    // The stage itself checks too, before generating (started by hand).
    let o = mpirun(&[stage_app(&out.join("stage-0"), &model, &["--prompt-ids", "1,2", "--max-new-tokens", "2", "--dump", "/dev/full"])]);
    assert!(!o.status.success());
    says(&o, "--dump /dev/full: is a character device");
    assert!(!stdout(&o).contains("prompt 0:"), "refused only after generating");
    assert!(std::fs::metadata("/dev/full").unwrap().file_type().is_char_device());
    // A symbolic link, left as it is.
    let target = dir.path().join("target.txt");
    std::fs::write(&target, "keep").unwrap();
    let link = dir.path().join("link.safetensors");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let o = run(&link);
    assert_clean_failure(&o, "symlink");
    says(&o, "symbolic link");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    // A folder: refused, nothing left beside it.
    let folder = dir.path().join("x");
    std::fs::create_dir(&folder).unwrap();
    let o = run(&folder);
    assert_clean_failure(&o, "folder");
    says(&o, "a folder");
    // A missing folder is named.
    let o = run(&dir.path().join("nowhere/x.safetensors"));
    assert_clean_failure(&o, "missing folder");
    says(&o, "does not exist");
    // An unrelated file with the old temporary name survives a good dump.
    let good = dir.path().join("d.safetensors");
    std::fs::write(dir.path().join("d.safetensors.partial"), "unrelated").unwrap();
    std::fs::write(dir.path().join("d.partial"), "unrelated").unwrap();
    let o = run(&good);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::metadata(&good).unwrap().len() > 100);
    assert_eq!(std::fs::read_to_string(dir.path().join("d.safetensors.partial")).unwrap(), "unrelated");
    assert_eq!(std::fs::read_to_string(dir.path().join("d.partial")).unwrap(), "unrelated");
    let mut names: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["d.partial", "d.safetensors", "d.safetensors.partial", "link.safetensors", "target.txt", "x"]);
}

/// Defect 5: The stages reject exactly what `m3c inspect` rejects: wrapped or
/// overlapping offsets, shard paths outside the folder, non-string,
/// missing and duplicate index entries.
#[test]
fn d05_stages_reject_what_inspect_rejects() {
    let out = shared_out(1);
    let dir = tempfile::tempdir().unwrap();
    let norm = "language_model.model.norm.weight";
    let other = "language_model.model.layers.0.input_layernorm.weight";
    type Edit = Box<dyn Fn(&mut serde_json::Map<String, serde_json::Value>, &mut Vec<u8>)>;
    let cases: Vec<(&str, Edit, Option<&str>, &str)> = vec![
        (
            "wrapping offsets",
            Box::new(|h, _| h[norm]["data_offsets"] = serde_json::json!([u64::MAX - 3, 252u64])),
            None,
            "does not fit its shape",
        ),
        (
            "overlapping ranges",
            Box::new(move |h, _| {
                let r = h[other]["data_offsets"].clone();
                h[norm]["data_offsets"] = r;
            }),
            None,
            "overlaps",
        ),
        (
            "a shard outside the folder",
            Box::new(|_, _| {}),
            Some(r#"{"weight_map": {"W": "../outside/evil.safetensors"}}"#),
            "inside the checkpoint folder",
        ),
        ("an absolute shard path", Box::new(|_, _| {}), Some(r#"{"weight_map": {"W": "/etc/passwd"}}"#), "inside the checkpoint folder"),
        ("a non-string entry", Box::new(|_, _| {}), Some(r#"{"weight_map": {"W": 7}}"#), "expected a shard file name"),
        (
            "a duplicate entry",
            Box::new(|_, _| {}),
            Some(r#"{"weight_map": {"W": "model.safetensors", "W": "model.safetensors"}}"#),
            "twice",
        ),
        ("no weight_map", Box::new(|_, _| {}), Some(r#"{"metadata": {}}"#), "weight_map"),
    ];
    for (i, (what, edit, index, expect)) in cases.into_iter().enumerate() {
        let d = dir.path().join(format!("c{i}"));
        let model = model_copy(&d, |h, data| edit(h, data));
        if let Some(index) = index {
            std::fs::write(model.join("model.safetensors.index.json"), index.replace('W', norm)).unwrap();
        }
        let o = m3c(&["inspect", model.to_str().unwrap()]);
        assert_clean_failure(&o, what);
        assert!(stderr(&o).contains(expect), "inspect, {what}: {}", stderr(&o));
        let o = m3c(&run_args(&out, &model, &["--prompt-ids", "1,2", "--max-new-tokens", "1"]));
        assert_clean_failure(&o, what);
        assert!(stderr(&o).contains(expect), "run, {what}: {}", stderr(&o));
    }
}

/// Defect 6: A rank from another compile in the job: every rank stops within
/// seconds (no start-up deadlock) and mpirun is not left behind.
#[test]
fn d06_a_foreign_rank_ends_the_job() {
    let (out1, out2) = (shared_out(1), shared_out(2));
    let model = fixture("tiny-m3");
    let t0 = Instant::now();
    let o = {
        let extra = ["--prompt-ids", "1,2", "--max-new-tokens", "1"];
        mpirun(&[stage_app(&out2.join("stage-0"), &model, &extra), stage_app(&out1.join("stage-0"), &model, &extra)])
    };
    assert!(!o.status.success());
    says(&o, "this pipeline has 1 stages but MPI started 2 rank(s)");
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
}

/// Defect 7: Killing `m3c run` (as a supervisor does) ends mpirun and every stage.
#[test]
fn d07_killing_m3c_run_leaves_no_process() {
    let dir = tempfile::tempdir().unwrap();
    // A private copy, so that its path identifies this job's processes.
    let out = crate::shared::copy("tiny-m3", 2, dir.path());
    let model = fixture("tiny-m3");
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGKILL] {
        let mut args = run_args(&out, &model, &["--max-new-tokens", "4000", "--ignore-eos"]);
        let p = "1,2,3";
        for _ in 0..8 {
            args.extend(["--prompt-ids", p]);
        }
        let mut child = m3c_tests::m3c_command().args(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let needle = out.join("stage-1").display().to_string();
        // Wait until the stages run.
        let t0 = Instant::now();
        while processes_with(&needle).len() < 2 && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(500));
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(child.id() as i32, sig) };
        let status = child.wait().unwrap();
        assert!(!status.success(), "signal {sig}");
        assert!(all_gone(&out.display().to_string(), 15), "signal {sig}: left {:?}", processes_with(&out.display().to_string()));
    }
}

/// Defect 8: An interrupted compile leaves no temporary folder; stale ones of dead
/// processes are swept; a bad `--cpu` is refused before LLVM can abort.
#[test]
fn d08_interrupted_compiles_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // A stale folder of a process that no longer exists.
    let stale = dir.path().join(".out.partial-4000000");
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("stage-0"), vec![0u8; 1000]).unwrap();
    let real = configs("minimax-m3.config.json");
    let mut child = m3c_tests::m3c_command()
        .args(["compile", "--model", real.to_str().unwrap(), "--pp", "4", "-o", out.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let partial = dir.path().join(format!(".out.partial-{}", child.id()));
    while !partial.exists() && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(partial.exists(), "the compile never started writing");
    assert!(!stale.exists(), "the stale folder of a dead process was not swept");
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "{left:?}");
    // --cpu that LLVM would abort on (`native` is this machine's CPU by
    // name: tests/it/pipeline.rs).
    for cpu in ["bogus9000", "i686"] {
        let o = m3c(&["compile", "--model", fixture("tiny-m3").to_str().unwrap(), "--pp", "1", "--cpu", cpu, "-o", out.to_str().unwrap()]);
        assert_clean_failure(&o, cpu);
        says(&o, &format!("--cpu {cpu}: not an x86-64 CPU"));
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Defect 9: Numbers and closed outputs that used to panic.
#[test]
fn d09_no_panics_on_numbers_or_closed_outputs() {
    let out = shared_out(1);
    let model = fixture("tiny-m3");
    for t in ["inf", "1e300", "-1", "NaN", "0"] {
        let flag = format!("--timeout-s={t}");
        let o = m3c(&run_args(&out, &model, &["--prompt-ids", "1", "--max-new-tokens", "1", &flag]));
        assert_eq!(o.status.code(), Some(2), "--timeout-s {t}: {}", stderr(&o));
        assert!(stderr(&o).contains("--timeout-s") && !stderr(&o).contains("panicked"), "{}", stderr(&o));
    }
    // A closed pipe: ends like `cat` (SIGPIPE), not with a panic (101).
    let mut child = m3c_tests::m3c_command()
        .args(["inspect", fixture("tiny-m3").to_str().unwrap(), "--graph"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first).unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert_ne!(o.status.code(), Some(101), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    // A full disk is an error that says so.
    let full = std::fs::File::create("/dev/full").unwrap();
    let o = m3c_tests::m3c_command().args(["inspect", fixture("tiny-m3").to_str().unwrap(), "--graph"]).stdout(full).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    says(&o, "cannot write to standard output");
    // hidden_size 2^62 used to divide by zero in the kernel generator.
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_with(dir.path(), |t| t["hidden_size"] = serde_json::json!(1u64 << 62));
    let o = m3c(&["compile", "--model", cfg.to_str().unwrap(), "--pp", "1", "-o", dir.path().join("o").to_str().unwrap()]);
    assert_clean_failure(&o, "hidden 2^62");
    assert!(stderr(&o).contains("text_config.hidden_size") && stderr(&o).contains("at most 65536"), "{}", stderr(&o));
}

/// The tiny fixture's config with `edit` applied to its text_config, written as DIR/config.json.
fn config_with(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture("tiny-m3").join("config.json")).unwrap()).unwrap();
    edit(&mut v["text_config"]);
    let p = dir.join("config.json");
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    p
}

/// Defect 10: Numbers that used to wrap past validation.
#[test]
fn d10_overflowing_numbers_are_refused() {
    let out = shared_out(1);
    let model = fixture("tiny-m3");
    let o = m3c(&run_args(&out, &model, &["--prompt-ids", "1,2", "--max-new-tokens", "18446744073709551615"]));
    assert_clean_failure(&o, "max-new-tokens");
    says(&o, "exceed the model's 4096 positions");
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_with(dir.path(), |t| {
        t["sparse_attention_config"]["sparse_local_block"] = serde_json::json!(u64::MAX);
        t["sparse_attention_config"]["sparse_init_block"] = serde_json::json!(1);
    });
    let o = m3c(&["inspect", cfg.to_str().unwrap()]);
    assert_clean_failure(&o, "sparse blocks");
    says(&o, "sparse_local_block");
    // The largest config the bounds admit has a parameter count that fits.
    let cfg = config_with(dir.path(), |t| {
        t["num_local_experts"] = serde_json::json!(64);
        t["intermediate_size"] = serde_json::json!(1 << 18);
        t["num_hidden_layers"] = serde_json::json!(1024);
        t["moe_layer_freq"] = serde_json::json!(vec![1; 1024]);
        t["sparse_attention_config"]["sparse_attention_freq"] = serde_json::json!(vec![1; 1024]);
        t["sparse_attention_config"]["sparse_disable_index_value"] = serde_json::json!(vec![1; 1024]);
    });
    let o = m3c(&["inspect", cfg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("parameters"), "{}", stdout(&o));
}

/// Defect 11: Sizes that took unbounded memory or time.
#[test]
fn d11_unbounded_inputs_are_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let cfg = config_with(dir.path(), |t| t["num_local_experts"] = serde_json::json!(1u64 << 40));
    let o = m3c(&["inspect", cfg.to_str().unwrap()]);
    assert_clean_failure(&o, "2^40 experts");
    says(&o, "num_local_experts");
    let model = fixture("tiny-m3");
    for (what, o) in [
        ("plan", m3c(&["plan", "--check", "/dev/zero", "--model", model.to_str().unwrap()])),
        ("config", m3c(&["inspect", "/dev/zero"])),
        ("prompts", m3c(&run_args(&shared_out(1), &model, &["--prompts", "/dev/zero", "--max-new-tokens", "1"]))),
    ] {
        assert_clean_failure(&o, what);
        assert!(stderr(&o).contains("/dev/zero") && stderr(&o).contains("character device"), "{what}: {}", stderr(&o));
    }
    let o = m3c(&["init-tiny", dir.path().join("big").to_str().unwrap(), "--hidden", "65536"]);
    assert_clean_failure(&o, "init-tiny --hidden 65536");
    says(&o, "--hidden must be at most");
    let o = m3c(&["init-tiny", dir.path().join("big").to_str().unwrap(), "--hidden", "8192", "--layers", "64"]);
    assert_clean_failure(&o, "init-tiny of 100 GB");
    says(&o, "GB checkpoint");
    // 400 KB of nested flow sequences.
    let plan = dir.path().join("deep.yaml");
    std::fs::write(&plan, format!("stages: {}{}", "[".repeat(200_000), "]".repeat(200_000))).unwrap();
    let o = m3c(&["plan", "--check", plan.to_str().unwrap(), "--model", model.to_str().unwrap()]);
    assert_clean_failure(&o, "deep plan");
    says(&o, "nested deeper than");
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
}

/// Defect 12: A UTF-8 byte-order mark, as Windows editors write, is accepted in
/// plans, configs and prompts files.
#[test]
fn d12_byte_order_marks_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.yaml");
    let text = std::fs::read_to_string(configs("tiny-m3.pp2.yaml")).unwrap();
    std::fs::write(&plan, format!("\u{feff}{text}")).unwrap();
    let model = fixture("tiny-m3");
    let o = m3c(&["plan", "--check", plan.to_str().unwrap(), "--model", model.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cfg = dir.path().join("config.json");
    let text = std::fs::read_to_string(model.join("config.json")).unwrap();
    std::fs::write(&cfg, format!("\u{feff}{text}")).unwrap();
    let o = m3c(&["inspect", cfg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "\u{feff}1,2,3\n4,5\n").unwrap();
    let o = m3c(&run_args(&shared_out(1), &model, &["--prompts", prompts.to_str().unwrap(), "--max-new-tokens", "1"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("prompt 1: "), "{}", stdout(&o));
}

/// Defect 13: Configs that inspect accepted but compile failed on with raw MLIR
/// errors are refused up front, naming the key.
#[test]
fn d13_config_bounds_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (key, edit) in [
        (
            "hidden_size",
            Box::new(|t: &mut serde_json::Value| t["hidden_size"] = serde_json::json!(u64::MAX)) as Box<dyn Fn(&mut serde_json::Value)>,
        ),
        (
            "sparse_topk_blocks",
            Box::new(|t: &mut serde_json::Value| t["sparse_attention_config"]["sparse_topk_blocks"] = serde_json::json!(u64::MAX)),
        ),
        ("vocab_size", Box::new(|t: &mut serde_json::Value| t["vocab_size"] = serde_json::json!(1u64 << 40))),
        ("eos_token_id", Box::new(|t: &mut serde_json::Value| t["eos_token_id"] = serde_json::json!(100_000))),
    ] {
        let cfg = config_with(dir.path(), edit);
        let o = m3c(&["inspect", cfg.to_str().unwrap()]);
        assert_clean_failure(&o, key);
        assert!(stderr(&o).contains(key), "{key}: {}", stderr(&o));
    }
}

/// Defect 14: model.safetensors that is a folder, a dangling link or a device.
#[test]
fn d14_weights_that_are_not_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = shared_out(1);
    for (what, make) in [
        ("a folder", Box::new(|p: &Path| std::fs::create_dir(p).unwrap()) as Box<dyn Fn(&Path)>),
        ("a dangling symbolic link", Box::new(|p: &Path| std::os::unix::fs::symlink("/nonexistent/x", p).unwrap())),
        ("a character device", Box::new(|p: &Path| std::os::unix::fs::symlink("/dev/zero", p).unwrap())),
    ] {
        let m = dir.path().join(what.replace(' ', "_"));
        std::fs::create_dir(&m).unwrap();
        std::fs::copy(fixture("tiny-m3").join("config.json"), m.join("config.json")).unwrap();
        make(&m.join("model.safetensors"));
        let o = m3c(&["inspect", m.to_str().unwrap()]);
        assert_clean_failure(&o, what);
        assert!(stderr(&o).contains("model.safetensors") && stderr(&o).contains(what), "{what}: {}", stderr(&o));
        let o = m3c(&run_args(&out, &m, &["--prompt-ids", "1", "--max-new-tokens", "1"]));
        assert_clean_failure(&o, what);
        assert!(stderr(&o).contains(what), "run, {what}: {}", stderr(&o));
    }
}

/// Defect 15: A damaged stage executable is caught by its sha256 before launch.
#[test]
fn d15_a_damaged_stage_is_caught_before_launch() {
    let dir = tempfile::tempdir().unwrap();
    let out = crate::shared::copy("tiny-m3", 2, dir.path());
    let exe = out.join("stage-1");
    let len = std::fs::metadata(&exe).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&exe).unwrap().set_len(len / 2).unwrap();
    let o = m3c(&run_args(&out, &fixture("tiny-m3"), &["--prompt-ids", "1", "--max-new-tokens", "1"]));
    assert_clean_failure(&o, "truncated stage");
    says(&o, "stage-1: is not the executable manifest.json lists");
    assert!(!stderr(&o).contains("139"), "{}", stderr(&o));
}

/// Defect 16: Ranks started by hand with different arguments refuse to run.
#[test]
fn d16_ranks_with_different_arguments_refuse() {
    let out = shared_out(2);
    let model = fixture("tiny-m3");
    let app = |exe: &str, ids: &str, n: &str| stage_app(&out.join(exe), &model, &["--prompt-ids", ids, "--max-new-tokens", n]);
    for (a, b) in
        [(app("stage-0", "1,2,3", "2"), app("stage-1", "1,2,4", "2")), (app("stage-0", "1,2,3", "2"), app("stage-1", "1,2,3", "5"))]
    {
        let o = mpirun(&[a, b]);
        assert!(!o.status.success());
        says(&o, "started with different arguments");
        assert!(!stdout(&o).contains("prompt 0:"), "{}", stdout(&o));
    }
}

/// Defect 17: A stage busy with a long step counts as alive (its heartbeats keep
/// coming); a stopped one is declared lost within seconds.
#[test]
fn d17_busy_stages_are_alive_and_stopped_ones_are_lost() {
    let dir = tempfile::tempdir().unwrap();
    // Big enough that one prefill step takes well over a second on one
    // thread (2500 tokens took 0.95 s once the host kernels got faster).
    let model = dir.path().join("m");
    let o = m3c(&["init-tiny", model.to_str().unwrap(), "--hidden", "512", "--layers", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = compile(&model, 2, dir.path(), &[]);
    let prompt = ids_arg(&(0..4000).map(|i| i % 500).collect::<Vec<i64>>());
    let t0 = Instant::now();
    let o = m3c_tests::m3c_env(
        &run_args(&out, &model, &["--prompt-ids", &prompt, "--max-new-tokens", "2", "--timeout-s", "1"]),
        &[("OMP_NUM_THREADS", "1")],
    );
    assert!(o.status.success(), "a busy stage was declared dead:\n{}", stderr(&o));
    let step_ms: f64 = stderr(&o)
        .lines()
        .filter_map(|l| l.split("prefill 1 step(s), mean ").nth(1)?.split(" ms").next()?.parse().ok())
        .fold(0.0, f64::max);
    eprintln!("the busy stage's prefill step: {step_ms:.0} ms against a 1 s timeout");
    assert!(
        step_ms > 1000.0,
        "the prefill step took only {step_ms} ms, which proves nothing about a 1 s timeout ({:?} in all)",
        t0.elapsed()
    );
    // SIGSTOP a stage mid-run: the others end the job within the timeout
    // (and, with no restarts allowed, the run: tests/it/healing.rs has
    // runs that go on).
    // --ignore-eos: a random model may emit its EOS id early, ending the run before the stop.
    let mut args = run_args(&out, &model, &["--max-new-tokens", "3000", "--timeout-s", "2", "--ignore-eos", "--max-restarts", "0"]);
    args.extend(["--prompt-ids", "1,2,3"]);
    let child = m3c_tests::m3c_command().args(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let needle = out.join("stage-1").display().to_string();
    let t1 = Instant::now();
    let stage1 = loop {
        let found: Vec<u32> = processes_with(&needle)
            .into_iter()
            .filter(|&p| std::fs::read_link(format!("/proc/{p}/exe")).map(|e| e.ends_with("stage-1")).unwrap_or(false))
            .collect();
        if let Some(&p) = found.first() {
            break p;
        }
        assert!(t1.elapsed() < Duration::from_secs(20), "stage 1 never started");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(1500));
    let stopped = Instant::now();
    // SAFETY: stops a process of this test's own job.
    unsafe { libc::kill(stage1 as i32, libc::SIGSTOP) };
    let o = child.wait_with_output().unwrap();
    let waited = stopped.elapsed();
    assert!(!o.status.success());
    says(&o, "no sign of life from stage 1 for 2 s");
    assert!(waited < Duration::from_secs(15), "took {waited:?} to notice");
    assert!(all_gone(&out.display().to_string(), 15), "left {:?}", processes_with(&out.display().to_string()));
}

/// Defect 18: `max_position_embeddings: 0` is a config error, not a compile whose
/// every run is refused.
#[test]
fn d18_zero_positions_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_with(dir.path(), |t| t["max_position_embeddings"] = serde_json::json!(0));
    let o = m3c(&["compile", "--model", cfg.to_str().unwrap(), "--pp", "1", "-o", dir.path().join("o").to_str().unwrap()]);
    assert_clean_failure(&o, "0 positions");
    says(&o, "max_position_embeddings");
    assert!(!dir.path().join("o").exists());
}

/// Defect 19: `m3c plan --arch` is validated before anything is printed or written.
#[test]
fn d19_plan_arch_is_checked_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("p.yaml");
    for out in [None, Some(&plan)] {
        let mut args = vec!["plan", "--model", "FIXTURE", "--pp", "2", "--target", "cuda", "--arch", "sm_xx; rm -rf /"];
        let model = fixture("tiny-m3");
        args[2] = model.to_str().unwrap();
        if let Some(p) = out {
            args.extend(["-o", p.to_str().unwrap()]);
        }
        let o = m3c(&args);
        assert_clean_failure(&o, "--arch");
        assert!(stderr(&o).contains("--arch") && stdout(&o).is_empty(), "{}", stderr(&o));
        assert!(!plan.exists());
    }
}

/// Defect 20: A failing `--expect` ends the job promptly with its verdict shared,
/// leaving no mpirun behind (it once hung after MPI_Abort).
#[test]
fn d20_a_failing_expect_ends_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let out = crate::shared::copy("tiny-m3", 2, dir.path());
    let model = fixture("tiny-m3");
    let golden = fixture("tiny-m3-mxfp8").join("golden.safetensors");
    let prompt = ids_arg(&m3c_tests::read_tensor_i64(&golden, "prompt_ids"));
    for _ in 0..5 {
        let t0 = Instant::now();
        let o = m3c(&run_args(&out, &model, &["--prompt-ids", &prompt, "--max-new-tokens", "2", "--expect", golden.to_str().unwrap()]));
        assert_clean_failure(&o, "--expect");
        says(&o, "m3c check against");
        assert!(!stderr(&o).contains("MPI_ABORT"), "a closing failure aborts nobody:\n{}", stderr(&o));
        assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
        assert!(all_gone(&out.display().to_string(), 10));
    }
}

/// Defect 21: A model file truncated during a run: the stage names it instead of
/// dying of a bare SIGBUS.
#[test]
fn d21_a_model_truncated_during_a_run_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_copy(dir.path(), |_, _| {});
    let out = shared_out(1);
    let mut args = run_args(&out, &model, &["--max-new-tokens", "4000", "--ignore-eos"]);
    for _ in 0..4 {
        args.extend(["--prompt-ids", "1,2,3"]);
    }
    let child = m3c_tests::m3c_command().args(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let needle = model.display().to_string();
    let t0 = Instant::now();
    while processes_with(&needle).len() < 3 && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(700));
    std::fs::OpenOptions::new().write(true).open(model.join("model.safetensors")).unwrap().set_len(8).unwrap();
    let o = child.wait_with_output().unwrap();
    m3c_tests::fails_with(&o, &["model.safetensors changed during the run"]);
}

/// Defect 22: Open MPI's session folders (about 8 MB each) of launchers that
/// were killed stayed in the temporary folder for good; one full test run
/// left 15. A launch removes those of dead launchers, and a run that ends
/// normally leaves none of its own. Each launch keeps its session folder
/// in a base of its own (the CI failure of stop 64: a job starting while
/// another ended failed in orte_init, "mkdir … File exists").
#[test]
fn d22_killed_launchers_session_folders_are_swept() {
    let tmp = tempfile::tempdir().unwrap();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let top = tmp.path().join(format!("ompi.another-host.{uid}"));
    // pid_max is at most 2^22: this launcher never exists.
    let stale = top.join("pid.4194305");
    std::fs::create_dir_all(stale.join("0")).unwrap();
    std::fs::write(stale.join("hwloc.sm"), vec![0u8; 4096]).unwrap();
    let out = shared_out(1);
    let model = fixture("tiny-m3");
    let args = run_args(&out, &model, &["--prompt-ids", "1,2,3", "--max-new-tokens", "2"]);
    let o = m3c_tests::m3c_env(&args, &[("TMPDIR", tmp.path().to_str().unwrap())]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stale.exists(), "the dead launcher's session folder is still there");
    let left: Vec<PathBuf> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .filter(|t| t.file_name().to_string_lossy().starts_with("ompi."))
        .flat_map(|t| std::fs::read_dir(t.path()).into_iter().flatten().flatten().map(|j| j.path()))
        .filter(|j| j.file_name().is_some_and(|n| n.to_string_lossy().starts_with("pid.")))
        .collect();
    assert!(left.is_empty(), "session folders left after a normal run: {left:?}");
    // The run's mpirun kept its session folder in a BASE of its own (so
    // that no other job's end could remove it while it started), which
    // Open MPI emptied at the end; the next launch removes it, as its m3c
    // is gone.
    let bases = tmp.path().join(format!("m3c-mpi.{uid}"));
    let mine: Vec<PathBuf> = std::fs::read_dir(&bases).unwrap().flatten().map(|b| b.path()).collect();
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert_eq!(std::fs::read_dir(&mine[0]).unwrap().count(), 0, "{} is not empty", mine[0].display());
    let o = m3c_tests::m3c_env(&args, &[("TMPDIR", tmp.path().to_str().unwrap())]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!mine[0].exists(), "the first run's session base is still there");
}

/// Defect 23: `m3c compile` on a full disk said `linking …/stage-0: mpicc
/// failed: ` and nothing more (the linker crashed, or said nothing). The
/// error now names the cause, the folder and the figures, and the compile
/// leaves nothing behind. The full disk is an 8 MB tmpfs (root only; CI
/// runs as root).
#[test]
fn d23_a_full_disk_is_named_when_linking_fails() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: mounting a small tmpfs needs root; CI runs as root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full");
    std::fs::create_dir(&full).unwrap();
    let mounted = std::process::Command::new("mount").args(["-t", "tmpfs", "-o", "size=8m", "tmpfs", full.to_str().unwrap()]).status();
    if !mounted.is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: could not mount a tmpfs here");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(full.clone());
    let out = full.join("out");
    let o = m3c(&["compile", "--model", fixture("tiny-m3").to_str().unwrap(), "--pp", "1", "-o", out.to_str().unwrap(), "--no-cache"]);
    m3c_tests::fails_with(&o, &["mpicc failed", "no space left on device", full.to_str().unwrap(), "MB free"]);
    assert!(tree(&full).is_empty(), "a failed compile left {:?}", tree(&full));
}
