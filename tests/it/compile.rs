//! `m3c compile`: the fused step list of each stage (tiny model, pp = 2),
//! byte-identical output folders, the compile id over every input, and
//! errors that leave nothing behind.

use m3c_compiler::backend::host::{run_pipeline, HOST_PIPELINE};
use m3c_compiler::plan::load_plan;
use m3c_compiler::source::ModelSource;
use m3c_tests::{compile, compile_to, configs, fixture, m3c, stderr};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[test]
fn tiny_pp2_stages_snapshots() {
    let src = ModelSource::open(&fixture("tiny-m3")).unwrap();
    let plan = load_plan(&configs("tiny-m3.pp2.yaml"), Some(&src.config)).unwrap();
    let programs = m3c_compiler::compile::lower_all(&src.config, &plan, Default::default(), None, "x86-64-v3").unwrap();
    assert_eq!(programs.len(), 2);
    for p in &programs {
        let k = p.index;
        // After fusion: the kernel calls of the stage entry, the whole
        // stage at a size a reviewer reads. Each kernel's own MLIR is pinned
        // in kernels/tests/snapshots/, one small file per kernel.
        insta::assert_snapshot!(format!("stage{k}_1_fused"), p.listing());
        // The module lowers to the LLVM dialect (what the back end does next).
        let lowered = run_pipeline(&p.mlir, HOST_PIPELINE).expect("lowering");
        assert!(lowered.contains("llvm.func @m3c_stage_step"), "stage {k}: no entry after lowering");
    }
    // Each kernel is generated once per shape: stage 1 has five MoE layers but one router kernel.
    let routers = programs[1].kernels.iter().filter(|k| k.symbol().starts_with("m3c_router")).count();
    assert_eq!(routers, 1);
    assert_eq!(programs[1].mlir.matches("func.func @m3c_router").count(), 1);
}

/// The real MiniMax-M3's vision tower compiles to one loop over its 32
/// encoder layers (layer l reading layer 0's slots + l·stride), so its host
/// code stays one layer long; the tower's weights count once each.
#[test]
fn the_real_vision_tower_is_one_loop_of_32_layers() {
    let src = ModelSource::open(&configs("minimax-m3-mxfp8.config.json")).unwrap();
    let plan = load_plan(&configs("minimax-m3-mxfp8.pp4.yaml"), Some(&src.config)).unwrap();
    let p = m3c_compiler::compile::lower_all(&src.config, &plan, Default::default(), None, "x86-64-v3").unwrap().remove(0);
    let v = p.vision.as_ref().expect("stage 0 holds the vision tower");
    let l = v.layers.as_ref().expect("the encoder layers are one loop");
    assert_eq!(
        (l.count, l.stride),
        (32, 16),
        "32 layers of 16 tensors (2 LayerNorms, 4 attention and 2 MLP linears, weight and bias each)"
    );
    assert_eq!(p.mlir.matches("scf.for %vl = ").count(), 1);
    for (layer, slot) in [(0usize, l.first_slot), (31, l.first_slot + 31 * l.stride)] {
        assert!(p.tensors[slot].name.contains(&format!(".layers.{layer}.")), "slot {slot}: {}", p.tensors[slot].name);
    }
    let vision_tensors = p.tensors.iter().filter(|t| t.name.starts_with("vision_tower") || !t.name.starts_with("language_model")).count();
    assert_eq!(vision_tensors, 1 + 2 + 32 * 16 + 8, "patch, pre-LayerNorm, 32 layers, projector and merge");
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())
        })
        .collect()
}

fn compile_id(out: &Path) -> String {
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    m["compile_id"].as_str().unwrap().to_string()
}

/// `(units, from the cache)` from `m3c compile`'s summary line.
fn unit_counts(o: &std::process::Output) -> (usize, usize) {
    let text = m3c_tests::stdout(o);
    let at = text.find(" units, ").unwrap_or_else(|| panic!("no unit counts in:\n{text}"));
    let units = text[..at].rsplit('(').next().unwrap().parse().unwrap();
    let cached = text[at + 8..].split(' ').next().unwrap().parse().unwrap();
    (units, cached)
}

/// `m3c compile` of tiny-m3 at `pp` into `out` with `flags`.
fn compile_tiny(out: &Path, pp: usize, flags: &[&str]) -> std::process::Output {
    let pp = pp.to_string();
    let model = fixture("tiny-m3");
    let mut args = vec!["compile", "--model", model.to_str().unwrap(), "--pp", &pp, "-o", out.to_str().unwrap()];
    args.extend_from_slice(flags);
    m3c(&args)
}

/// Compiles tiny-m3 at `pp` into `dir/out` with `flags`; the output folder and the unit counts.
fn compile_counted(dir: &Path, pp: usize, flags: &[&str]) -> (PathBuf, (usize, usize)) {
    let out = dir.join("out");
    let o = compile_tiny(&out, pp, flags);
    assert!(o.status.success(), "{flags:?}: {}", stderr(&o));
    (out, unit_counts(&o))
}

/// The object cache holds each kernel once for every split, and changes no
/// byte: a cold compile, a split that shares its kernels and a compile
/// wholly from the cache give what compiling everything gives; a damaged
/// entry is compiled again, never used.
#[test]
fn the_object_cache_compiles_a_kernel_once_and_changes_no_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let with_cache = ["--cache-dir", cache.to_str().unwrap()];
    let dir = |name: &str| {
        let d = tmp.path().join(name);
        std::fs::create_dir(&d).unwrap();
        d
    };
    // Cold, with `--emit llvm` (which compiles every unit, as the cache
    // keeps no IR, and still fills it): each unit's IR in the stage's file.
    let (cold, (units, cached)) = compile_counted(&dir("cold"), 2, &[&with_cache[..], &["--emit", "llvm"]].concat());
    assert!(units > 2 && cached == 0, "an empty cache: {units} units, {cached} cached");
    let ll = std::fs::read_to_string(cold.join("stage-1.ll")).unwrap();
    for unit in ["entry", "metadata", "m3c_rms_norm_w128_eps1em6_bf16"] {
        assert!(ll.contains(&format!("; ---- unit {unit} ----")), "stage-1.ll has no unit {unit}");
    }
    assert!(std::fs::read_to_string(cold.join("stage-1.llvm.mlir")).unwrap().contains("// ---- unit entry ----"));
    // pp 4 cuts the same layers finer: every kernel is pp 2's; only the
    // four entries are new.
    let (_, (units4, cached4)) = compile_counted(&dir("pp4"), 4, &with_cache);
    assert_eq!(units4 - cached4, 4, "pp 4 after pp 2: {units4} units, {cached4} cached");
    let (warm, (units_w, cached_w)) = compile_counted(&dir("warm"), 2, &with_cache);
    assert_eq!((units_w, cached_w), (units, units), "everything from the cache");
    let same = |a: &Path, b: &Path, what: &str| {
        for f in ["stage-0", "stage-1", "manifest.json", "run.sh"] {
            assert!(std::fs::read(a.join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(), "{what}: {f} differs");
        }
    };
    same(&cold, &warm, "cold and warm cache");
    // Damage every entry: each is a miss, compiled again and rewritten.
    let mut entries = Vec::new();
    for sub in std::fs::read_dir(cache.join("objects")).unwrap() {
        for e in std::fs::read_dir(sub.unwrap().path()).unwrap() {
            entries.push(e.unwrap().path());
        }
    }
    assert!(entries.len() >= units4, "{} entries", entries.len());
    for e in &entries {
        let mut bytes = std::fs::read(e).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        std::fs::write(e, bytes).unwrap();
    }
    let (damaged, counts) = compile_counted(&dir("damaged"), 2, &with_cache);
    assert_eq!(counts, (units, 0), "damaged entries are never used");
    same(&cold, &damaged, "after damage");
    assert_eq!(compile_counted(&dir("mended"), 2, &with_cache).1, (units, units), "the damaged entries were rewritten");
    // An explicit cache folder that cannot be made is an error, naming it.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let o = compile_tiny(&tmp.path().join("x"), 1, &["--cache-dir", file.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("a-file") && stderr(&o).contains("object cache"), "{}", stderr(&o));
    assert!(!tmp.path().join("x").exists(), "nothing written on failure");
}

#[test]
fn same_inputs_give_byte_identical_out_and_every_input_changes_the_compile_id() {
    let model = fixture("tiny-m3");
    let dirs: Vec<tempfile::TempDir> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    // One compiles every unit; the other takes what the tests' object cache has.
    let a = compile(&model, 2, dirs[0].path(), &["--emit", "mlir", "--no-cache"]);
    let b = compile(&model, 2, dirs[1].path(), &["--emit", "mlir"]);
    let (fa, fb) = (files(&a), files(&b));
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    for (name, bytes) in &fa {
        assert!(fb[name] == *bytes, "{name} differs between two compiles of the same inputs");
    }
    assert!(fa.contains_key("stage-0") && fa.contains_key("stage-1") && fa.contains_key("manifest.json") && fa.contains_key("run.sh"));
    assert!(fa.contains_key("stage-1.mlir") && fa.contains_key("stage-1.steps.txt"));
    // The step entry reads the contract's StepArgs as its field list lays
    // them out: field k, of its kind, at word k.
    let mlir = String::from_utf8(fa["stage-1.mlir"].clone()).unwrap();
    assert!(mlir.contains("func.func @m3c_stage_step(%args: !llvm.ptr)"), "one pointer argument");
    for (k, (name, word)) in m3c_contract::stage::abi::STEP_FIELDS.iter().enumerate() {
        let ty = match word {
            m3c_contract::stage::abi::Word::I64 => "i64",
            m3c_contract::stage::abi::Word::Ptr => "!llvm.ptr",
        };
        let load = format!("%args_{k} = llvm.getelementptr %args[{k}] : (!llvm.ptr) -> !llvm.ptr, i64\n");
        let at = mlir.find(&load).unwrap_or_else(|| panic!("field {k} (`{name}`) is not read at word {k}"));
        let next = mlir[at + load.len()..].lines().next().unwrap_or_default();
        assert!(
            next.trim_end().ends_with(&format!("llvm.load %args_{k} : !llvm.ptr -> {ty}")) && next.contains(name),
            "field {k} (`{name}`): {next}"
        );
    }
    let id = compile_id(&a);
    // Another CPU, another plan (pp), another config: each gives another compile id.
    let cpu = compile(&model, 2, dirs[2].path(), &["--cpu", "x86-64"]);
    assert_ne!(compile_id(&cpu), id, "the CPU is an input");
    // (pp 3 with every default is the run's shared compile.)
    let pp = crate::shared::out("tiny-m3", 3);
    assert_ne!(compile_id(&pp), id, "the plan is an input");
    let cfg_dir = dirs[3].path().join("model");
    std::fs::create_dir(&cfg_dir).unwrap();
    let text = std::fs::read_to_string(model.join("config.json")).unwrap().replace("\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": 1e-05");
    std::fs::write(cfg_dir.join("config.json"), text).unwrap();
    let cfg_out = compile(&cfg_dir, 2, dirs[2].path(), &[]);
    assert_ne!(compile_id(&cfg_out), id, "the config is an input");
}

#[test]
fn compile_errors_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = m3c(&["compile", "--pp", "3", configs("tiny-m3.pp2.yaml").to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("2 stages") || stderr(&o).contains("--pp 3"), "{}", stderr(&o));
    assert!(!out.exists());
    // An unrelated folder is never overwritten.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let o = m3c(&["compile", "--model", fixture("tiny-m3").to_str().unwrap(), "--pp", "1", "-o", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("already exists, is not empty and has no m3c manifest.json"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine");
    let o = compile_to(&fixture("tiny-m3"), 1, &dir.path().join("p"), &["--emit", "ptx"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--emit ptx needs a GPU target"), "{}", stderr(&o));
    // No partial folders are left beside it.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 1, "{left:?}");
}

#[test]
fn a_plan_that_names_its_model_compiles_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // `m3c compile --pp 2 plan.yaml`: the plan says which model.
    let o = m3c(&["compile", "--pp", "2", configs("tiny-m3.pp2.yaml").to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["stages"][0]["holds"], "embed + layers 0-2");
    assert_eq!(m["stages"][1]["holds"], "layers 3-7 + norm + lm_head");
    assert_eq!(m["stages"][1]["layers"], serde_json::json!([3, 7]));
}

/// A plan's `host:` per stage reaches the manifest, the launcher and `m3c run`
/// (here every stage on localhost, so it runs on this machine).
#[test]
fn plan_hosts_place_the_stages() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.yaml");
    let model = fixture("tiny-m3");
    std::fs::write(
        &plan,
        "version: 1\ntarget: host\nstages:\n  - layers: \"0-3\"\n    embedding: true\n    host: localhost\n  - layers: \"4-7\"\n    final_norm: true\n    lm_head: true\n    host: localhost\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let o = m3c(&["compile", "--model", model.to_str().unwrap(), "--pp", "2", plan.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["stages"][1]["host"], "localhost");
    let launcher = std::fs::read_to_string(out.join("run.sh")).unwrap();
    assert!(launcher.contains("-np 1 --host 'localhost' \"$here/stage-1\""), "{launcher}");
    let o = m3c_tests::m3c_run(&out, &model, &["--prompt-ids", "3,4,5", "--max-new-tokens", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(m3c_tests::stdout(&o).starts_with("prompt 0: "));
}

/// The README's by-hand launch (every stage given the same arguments) and
/// the launcher with extra mpirun options in `M3C_MPIRUN_ARGS` give what
/// `m3c run` gives.
#[test]
fn the_by_hand_mpirun_line_and_run_sh_run_as_the_readme_says() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tiny-m3");
    let out = dir.path().join("out");
    let o = m3c(&["compile", "--model", model.to_str().unwrap(), "--pp", "2", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let args = format!("--model {} --prompt-ids 1,2,3 --max-new-tokens 4", model.display());
    let by_hand = format!("A=\"{args}\"; mpirun --oversubscribe -np 1 {0}/stage-0 $A : -np 1 {0}/stage-1 $A", out.display());
    let sh = |script: &str, env: &[(&str, &str)]| {
        let o = std::process::Command::new("sh")
            .args(["-c", script])
            .envs(env.iter().copied())
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .output()
            .unwrap();
        assert!(o.status.success(), "{script}: {}", stderr(&o));
        m3c_tests::stdout(&o)
    };
    let hand = sh(&by_hand, &[]);
    let launcher = sh(&format!("{}/run.sh {args}", out.display()), &[("M3C_MPIRUN_ARGS", "-x M3C_README_CHECK=1")]);
    assert!(hand.starts_with("prompt 0: ") && hand == launcher, "{hand:?} / {launcher:?}");
    // The launcher hands M3C_MPIRUN_ARGS to mpirun (which refuses this one).
    let o = std::process::Command::new(out.join("run.sh"))
        .args(args.split(' '))
        .env("M3C_MPIRUN_ARGS", "--no-such-mpirun-option")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .unwrap();
    assert!(!o.status.success() && stderr(&o).contains("no-such-mpirun-option"), "{}", stderr(&o));
}
