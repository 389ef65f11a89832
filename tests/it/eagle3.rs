//! EAGLE3 speculative decoding (the draft head compiled into the last
//! stage, `tests/fixtures/eagle3-tiny` for tiny-m3): its proposals equal
//! the torch reference's goldens, and it changes no bit of a run's output
//! at pp 1, 2 and 4, f32 and bf16, greedy and sampled, under preemption and
//! prefix hits. Bad combinations are errors that say what to do. (The
//! served path is `serve::speculative_streams_get_the_answers_of_plain_decoding`.)

use m3c_tests::{fixture, ids_arg, m3c, m3c_env, read_tensor_i64, stderr, stdout};
use std::path::{Path, PathBuf};

pub(crate) fn config(k: usize) -> String {
    let d = fixture("eagle3-tiny");
    format!(r#"{{"method": "eagle3", "model": "{}", "num_speculative_tokens": {k}}}"#, d.display())
}

/// tiny-m3 compiled with the draft head at `pp` (shared by the tests).
pub(crate) fn out(pp: usize, extra: &[&str]) -> PathBuf {
    let spec = config(3);
    let mut flags = vec!["--speculative-config", spec.as_str()];
    flags.extend_from_slice(extra);
    crate::shared::out_with("tiny-m3", pp, &flags)
}

/// A run's stdout and its `m3c spec:` counts (verify steps, drafted, accepted).
fn run(out: &Path, args: &[&str], spec: Option<&str>, env: &[(&str, &str)]) -> (String, Vec<u64>, String) {
    let model = fixture("tiny-m3");
    let mut a = vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap()];
    a.extend_from_slice(args);
    if let Some(c) = spec {
        a.extend_from_slice(&["--speculative-config", c]);
    }
    let r = m3c_env(&a, env);
    assert!(r.status.success(), "{a:?}: {}", stderr(&r));
    let counts = stderr(&r)
        .lines()
        .find_map(|l| l.strip_prefix("m3c spec: "))
        .map(|l| l.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).take(3).collect())
        .unwrap_or_default();
    (stdout(&r), counts, stderr(&r))
}

#[test]
fn eagle3_proposals_are_the_reference_s() {
    // The golden's held-out greedy path; at frontier t the reference's head
    // has read the target's aux states at 0..=t with tokens 1..=t+1 and
    // proposes three. A prompt of ids[..=t] makes m3c's target draw
    // ids[t + 1] (greedy, as the path was made), then its head proposes.
    let golden = fixture("eagle3-tiny").join("golden.safetensors");
    let ids = read_tensor_i64(&golden, "ids");
    let frontiers = read_tensor_i64(&golden, "frontiers");
    let proposals = read_tensor_i64(&golden, "proposals");
    let out = out(1, &[]);
    let spec = config(3);
    let mut checked = 0;
    for (k, &t) in frontiers.iter().enumerate() {
        let t = t as usize;
        if t < 15 {
            // Inside the golden's 16-token prompt: its next id is not the
            // target's draw there.
            continue;
        }
        let prompt = ids_arg(&ids[..=t]);
        let args = ["--prompt-ids", prompt.as_str(), "--max-new-tokens", "8", "--ignore-eos"];
        let (text, _, err) = run(&out, &args, Some(&spec), &[("M3C_TEST_LOG_DRAFTS", "1"), ("M3C_SPEC_FIXED_K", "3")]);
        assert!(text.contains(&ids_arg(&ids[t + 1..t + 3])), "frontier {t}: the target left the golden path: {text}");
        let first = err.lines().find_map(|l| l.strip_prefix("m3c-draft 0 ")).unwrap_or_else(|| panic!("no proposal logged: {err}"));
        assert_eq!(first, ids_arg(&proposals[3 * k..3 * k + 3]), "frontier {t}");
        checked += 1;
    }
    assert_eq!(checked, 2);
}

#[test]
fn eagle3_changes_no_bit_at_any_pp_batch_or_precision() {
    let golden = fixture("eagle3-tiny").join("golden.safetensors");
    let path = ids_arg(&read_tensor_i64(&golden, "ids")[..24]);
    let prompts = ["--prompt-ids", "1,2,3", "--prompt-ids", path.as_str(), "--prompt-ids", "7,7,7,7"];
    let sampled = ["--temperature", "0.5", "--top-k", "3", "--seed", "3", "--presence-penalty", "0.2", "--frequency-penalty", "0.1"];
    let spec = config(3);
    let (mut drafted, mut accepted) = (0, 0);
    let mut greedy_texts = Vec::new();
    for (pp, extra) in [1, 2, 4].into_iter().flat_map(|pp| [(pp, &[][..]), (pp, &["--activations", "bf16", "--kv-cache", "bf16"][..])]) {
        let out = out(pp, extra);
        for (flags, batch) in [(&["--logprobs", "3"][..], "3"), (&sampled[..], "1")] {
            let mut args = vec!["--max-new-tokens", "40", "--ignore-eos", "--micro-batch", batch];
            args.extend_from_slice(flags);
            args.extend_from_slice(&prompts);
            let (plain, none, _) = run(&out, &args, None, &[]);
            let (text, counts, _) = run(&out, &args, Some(&spec), &[]);
            assert!(none.is_empty(), "no speculation without the config");
            assert_eq!(text, plain, "pp {pp} {extra:?} {flags:?}: EAGLE3 changed the output");
            assert!(counts[0] > 0, "pp {pp} {extra:?} {flags:?}: no verify step");
            drafted += counts[1];
            accepted += counts[2];
            if batch == "3" && extra.is_empty() {
                greedy_texts.push(text);
            }
        }
    }
    // Both outcomes happened, and the split changed nothing either.
    assert!(accepted > 0 && accepted < drafted, "{accepted} of {drafted}");
    assert!(greedy_texts.windows(2).all(|w| w[0] == w[1]), "pp changed the greedy output");
}

#[test]
fn eagle3_keeps_preemption_and_prefix_hits_exact() {
    let out = out(2, &[]);
    // 24 blocks of 4 positions hold one sequence whole (prompt, 40 tokens
    // and the drafts ahead) but not two of them beside the shared prefix:
    // two running together must preempt, however the machine's load
    // interleaves the micro-batches (with 44, a loaded run once kept every
    // sequence).
    let shared = "9,8,7,6,5,4,3,2,1,9,8,7,6,5,4,3";
    let prompts: Vec<String> = (0..4).map(|i| format!("{shared},{},{}", 20 + i, 40 + i)).collect();
    let mut args = vec!["--max-new-tokens", "40", "--ignore-eos", "--kv-blocks", "24", "--micro-batch", "2"];
    for p in &prompts {
        args.extend_from_slice(&["--prompt-ids", p]);
    }
    let (plain, _, _) = run(&out, &args, None, &[]);
    // A fixed K: the online cost model's choice depends on the machine's
    // load, and with fewer drafts the pool may hold every sequence (no
    // preemption to check).
    let (text, counts, err) = run(&out, &args, Some(&config(3)), &[("M3C_SPEC_FIXED_K", "3")]);
    assert_eq!(text, plain, "EAGLE3 under preemption changed the output");
    assert!(counts[0] > 0, "{err}");
    let kv = err.lines().find(|l| l.starts_with("m3c kv: ")).unwrap_or_default().to_string();
    eprintln!("{kv}");
    assert!(!kv.contains(" 0 preemption(s)") && !kv.contains(": 0 of"), "no preemption or no hit: {kv}");
}

#[test]
fn eagle3_misuse_is_an_error_that_says_what_to_do() {
    let model = fixture("tiny-m3");
    let spec = config(3);
    // `m3c run OUT` with a speculative config: what the user types.
    let run_with = |out: &std::path::Path, spec: &str| {
        m3c(&[
            "run",
            out.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "4",
            "--speculative-config",
            spec,
        ])
    };
    // Stages compiled without the head.
    let plain = crate::shared::out("tiny-m3", 1);
    let r = run_with(&plain, &spec);
    // Said before mpirun starts (no stage line), as the last stage would.
    let e = stderr(&r);
    assert!(!r.status.success() && e.contains("compiled without a draft head") && !e.contains("m3c stage"), "{e}");
    // An n-gram config has nothing to compile.
    let dir = tempfile::tempdir().unwrap();
    let ngram = r#"{"method": "ngram", "num_speculative_tokens": 3}"#;
    let o = dir.path().join("o");
    let r = m3c(&["compile", "--pp", "1", "--model", model.to_str().unwrap(), "-o", o.to_str().unwrap(), "--speculative-config", ngram]);
    assert!(!r.status.success() && stderr(&r).contains("nothing to compile") && !o.exists(), "{}", stderr(&r));
    // A draft for another target, and a draft folder without a config.
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let text =
        std::fs::read_to_string(fixture("eagle3-tiny").join("config.json")).unwrap().replace("\"vocab_size\": 512", "\"vocab_size\": 1024");
    std::fs::write(other.join("config.json"), text).unwrap();
    let bad = format!(r#"{{"method": "eagle3", "model": "{}", "num_speculative_tokens": 3}}"#, other.display());
    let r = m3c(&["compile", "--pp", "1", "--model", model.to_str().unwrap(), "-o", o.to_str().unwrap(), "--speculative-config", &bad]);
    assert!(!r.status.success() && stderr(&r).contains("`vocab_size` is 1024, but the target's is 512") && !o.exists(), "{}", stderr(&r));
    let empty = format!(r#"{{"method": "eagle3", "model": "{}", "num_speculative_tokens": 3}}"#, dir.path().display());
    let compiled = out(1, &[]);
    let r = run_with(&compiled, &empty);
    assert!(!r.status.success() && stderr(&r).contains("has no config.json"), "{}", stderr(&r));
    // The stages run with the draft they were compiled with, not another one.
    let r = run_with(&compiled, &bad);
    let e = stderr(&r);
    assert!(!r.status.success() && e.contains("is not the draft these stages were compiled with") && !e.contains("m3c stage"), "{e}");
    // The compiled draft with its safetensors cut short: the headers are
    // read before mpirun starts, and the file named.
    let cut = dir.path().join("cut");
    std::fs::create_dir(&cut).unwrap();
    for f in std::fs::read_dir(fixture("eagle3-tiny")).unwrap().flatten() {
        std::fs::copy(f.path(), cut.join(f.file_name())).unwrap();
    }
    let st = cut.join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&st).unwrap().set_len(len - 1000).unwrap();
    let cut_spec = format!(r#"{{"method": "eagle3", "model": "{}", "num_speculative_tokens": 3}}"#, cut.display());
    let r = run_with(&compiled, &cut_spec);
    let e = stderr(&r);
    assert!(!r.status.success() && e.contains(st.to_str().unwrap()) && !e.contains("m3c stage"), "{e}");
    // Without a config the same stages decode plainly, as stages without the head do.
    let args = ["--prompt-ids", "5,6,7", "--max-new-tokens", "12", "--ignore-eos"];
    assert_eq!(run(&compiled, &args, None, &[]).0, run(&plain, &args, None, &[]).0);
}

#[test]
fn the_draft_head_compiles_for_cuda_and_rocm_from_the_same_units() {
    let dir = tempfile::tempdir().unwrap();
    let (model, spec) = (fixture("tiny-m3"), config(3));
    let root = crate::cuda::cuda_root();
    for target in ["cuda", "rocm"] {
        let o = dir.path().join(target);
        let args = ["compile", "--model", model.to_str().unwrap(), "--pp", "2", "--target", target, "-o", o.to_str().unwrap()];
        let r =
            m3c_env(&[&args[..], &["--emit", "mlir", "--speculative-config", &spec]].concat(), &[("CUDA_ROOT", root.to_str().unwrap())]);
        assert!(r.status.success(), "{target}: {}", stderr(&r));
        // The last stage holds both entries; every stage copies its aux states.
        let last = std::fs::read_to_string(o.join("stage-1.steps.txt")).unwrap();
        assert!(last.contains("EAGLE3 draft entry (first)") && last.contains("EAGLE3 draft entry (next)"), "{target}");
        for stage in ["stage-0", "stage-1"] {
            let mlir = std::fs::read_to_string(o.join(format!("{stage}.mlir"))).unwrap();
            assert!(mlir.contains("func.func @m3c_draft_first") && mlir.contains("func.func @m3c_draft_next"), "{target} {stage}");
        }
        let first = std::fs::read_to_string(o.join("stage-0.steps.txt")).unwrap();
        assert_eq!(first.matches("aux").count() + last.matches("  aux").count(), 3, "{target}: one copy per aux layer");
    }
}

#[test]
fn a_plan_made_with_a_draft_names_it_and_compiles_its_head_in() {
    let dir = tempfile::tempdir().unwrap();
    let (model, spec) = (fixture("tiny-m3"), config(3));
    let plan = dir.path().join("plan.yaml");
    let r = m3c(&["plan", "--model", model.to_str().unwrap(), "--pp", "2", "--speculative-config", &spec, "-o", plan.to_str().unwrap()]);
    assert!(r.status.success(), "{}", stderr(&r));
    let yaml = std::fs::read_to_string(&plan).unwrap();
    let line = yaml.lines().find(|l| l.starts_with("draft: ")).unwrap_or_else(|| panic!("no `draft:` in {yaml}"));
    // Relative to the plan's folder, as `model:` is.
    assert!(!line.contains(dir.path().to_str().unwrap()) && line.contains("eagle3-tiny"), "{line}");
    let out = dir.path().join("out");
    let r = m3c(&["compile", "--pp", "2", plan.to_str().unwrap(), "-o", out.to_str().unwrap(), "--emit", "mlir"]);
    assert!(r.status.success(), "{}", stderr(&r));
    let last = std::fs::read_to_string(out.join("stage-1.steps.txt")).unwrap();
    assert!(last.contains("EAGLE3 draft entry (first)"), "the plan's draft was not compiled in");
    // Its stages speculate with that draft, and the flag beside the plan's key is refused.
    let args = ["--prompt-ids", "4,5,6", "--max-new-tokens", "16", "--ignore-eos"];
    let (plain, _, _) = run(&out, &args, None, &[]);
    let (text, counts, _) = run(&out, &args, Some(&spec), &[]);
    assert_eq!(text, plain);
    assert!(counts[0] > 0, "{counts:?}");
    let again = dir.path().join("again");
    let r = m3c(&["compile", "--pp", "2", plan.to_str().unwrap(), "-o", again.to_str().unwrap(), "--speculative-config", &spec]);
    assert!(!r.status.success() && stderr(&r).contains("the plan names its draft") && !again.exists(), "{}", stderr(&r));
}

#[test]
fn a_draft_naming_its_aux_layers_in_another_order_proposes_the_same() {
    // The fixture reads layers [2, 4, 5]; the same head written for
    // [5, 2, 4] has fc's column blocks in that order. Its states travel in
    // layer order all the same, and its fc reads them back in its own.
    let dir = tempfile::tempdir().unwrap();
    let draft = dir.path().join("permuted");
    std::fs::create_dir(&draft).unwrap();
    let src = fixture("eagle3-tiny");
    let cfg = std::fs::read_to_string(src.join("config.json")).unwrap();
    let moved = cfg.replace("[\n      2,\n      4,\n      5\n    ]", "[5, 2, 4]");
    assert_ne!(moved, cfg, "the fixture's aux list was not found");
    std::fs::write(draft.join("config.json"), moved).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let fc = st.tensor("fc.weight").unwrap();
    let (rows, cols) = (fc.shape()[0], fc.shape()[1]);
    let (h, elem) = (cols / 3, 2);
    // New column block k holds old block [2, 0, 1][k] (layer 5, then 2, then 4).
    let mut permuted = Vec::with_capacity(fc.data().len());
    for r in 0..rows {
        let row = &fc.data()[r * cols * elem..(r + 1) * cols * elem];
        for old in [2, 0, 1] {
            permuted.extend_from_slice(&row[old * h * elem..(old + 1) * h * elem]);
        }
    }
    let view = safetensors::tensor::TensorView::new(fc.dtype(), fc.shape().to_vec(), &permuted).unwrap();
    let tensors: Vec<(String, safetensors::tensor::TensorView)> =
        st.tensors().into_iter().map(|(n, t)| if n == "fc.weight" { (n, view.clone()) } else { (n, t) }).collect();
    safetensors::serialize_to_file(tensors, None, &draft.join("model.safetensors")).unwrap();

    let spec = format!(r#"{{"method": "eagle3", "model": "{}", "num_speculative_tokens": 3}}"#, draft.display());
    let golden = fixture("eagle3-tiny").join("golden.safetensors");
    let prompt = ids_arg(&read_tensor_i64(&golden, "ids")[..=20]);
    let args = ["--prompt-ids", prompt.as_str(), "--max-new-tokens", "24", "--ignore-eos"];
    let drafts = |out: &Path, spec: &str| -> Vec<String> {
        // A fixed K, so every step's proposals are logged whatever the
        // steps cost (the cost model's choices follow the machine's timing).
        let (_, _, err) = run(out, &args, Some(spec), &[("M3C_TEST_LOG_DRAFTS", "1"), ("M3C_SPEC_FIXED_K", "3")]);
        err.lines().filter(|l| l.starts_with("m3c-draft ")).map(str::to_string).collect()
    };
    for pp in [1, 2] {
        let original = drafts(&out(pp, &[]), &config(3));
        let other = crate::shared::out_with("tiny-m3", pp, &["--speculative-config", spec.as_str()]);
        assert!(!original.is_empty());
        assert_eq!(drafts(&other, &spec), original, "pp {pp}: the permuted draft proposed otherwise");
    }
}
