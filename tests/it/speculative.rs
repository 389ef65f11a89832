//! Speculative decoding (`--speculative-config`, n-gram prompt lookup)
//! changes no bit of a run's output: the same ids and logprobs with and
//! without it, at pp 1, 2 and 4, with f32 and bf16 activations and caches,
//! greedy and sampled (penalties included), in micro-batches, under
//! preemption and prefix-cache hits, with stop strings and grammars; and a
//! bad config is an error that names the key. (The served path, OpenAI's
//! client on sixteen streams, is `serve::speculative_streams_get_the_answers_of_plain_decoding`.)

use m3c_tests::{fixture, m3c, stderr, stdout};
use std::path::Path;

const SPEC: &str = r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#;

/// Verify steps, draft tokens and accepted drafts of a run (its `m3c spec:` line).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Counts {
    steps: u64,
    drafted: u64,
    accepted: u64,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Counts) {
        (self.steps, self.drafted, self.accepted) = (self.steps + o.steps, self.drafted + o.drafted, self.accepted + o.accepted);
    }
}

/// A run's output (each prompt's ids and logprobs lines, or its text),
/// and its speculation counts.
fn run(out: &Path, args: &[&str], spec: bool) -> (String, Counts) {
    run_with(out, args, spec.then_some(SPEC))
}

/// [`run`] with a config of its own (`None`: without speculation).
fn run_with(out: &Path, args: &[&str], spec: Option<&str>) -> (String, Counts) {
    let model = fixture("tiny-m3");
    let mut a = vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap()];
    a.extend_from_slice(args);
    if let Some(config) = spec {
        a.extend_from_slice(&["--speculative-config", config]);
    }
    let r = m3c(&a);
    assert!(r.status.success(), "{a:?}: {}", stderr(&r));
    let counts = stderr(&r).lines().find_map(|l| l.strip_prefix("m3c spec: ")).map_or(Counts::default(), |l| {
        let n: Vec<u64> = l.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
        Counts { steps: n[0], drafted: n[1], accepted: n[2] }
    });
    (stdout(&r), counts)
}

/// Three prompts (one repeats itself, so prompt lookup finds drafts early).
const PROMPTS: [&str; 6] = ["--prompt-ids", "1,2,3", "--prompt-ids", "100,200,300,100,200,300", "--prompt-ids", "7,7,7,7"];

#[test]
fn speculation_changes_no_bit_at_any_pp_batch_or_precision() {
    let sampled = ["--temperature", "0.5", "--top-k", "3", "--seed", "3", "--presence-penalty", "0.2", "--frequency-penalty", "0.1"];
    let mut total = Counts::default();
    for (pp, extra) in [1, 2, 4].into_iter().flat_map(|pp| [(pp, &[][..]), (pp, &["--activations", "bf16", "--kv-cache", "bf16"][..])]) {
        let out = crate::shared::out_with("tiny-m3", pp, extra);
        for (flags, batch) in [(&["--logprobs", "3"][..], "3"), (&sampled[..], "3"), (&sampled[..], "1")] {
            let mut args = vec!["--max-new-tokens", "60", "--ignore-eos", "--micro-batch", batch];
            args.extend_from_slice(flags);
            args.extend_from_slice(&PROMPTS);
            let (plain, none) = run(&out, &args, false);
            let (drafted, counts) = run(&out, &args, true);
            assert_eq!(none, Counts::default());
            assert_eq!(drafted, plain, "pp {pp} {extra:?} {flags:?} micro-batch {batch}: speculation changed the output");
            assert!(counts.steps > 0 && counts.drafted >= counts.steps, "pp {pp} {extra:?} {flags:?}: {counts:?}");
            total += counts;
        }
    }
    // Both outcomes happened: drafts accepted (the draws that follow them
    // are then made in the same step) and drafts rejected (rolled back).
    assert!(total.accepted > 0 && total.accepted < total.drafted, "{total:?}");
}

#[test]
fn speculation_keeps_preemption_prefix_hits_stops_and_grammars_exact() {
    let out = crate::shared::out("tiny-m3", 2);
    // Four prompts sharing a prefix, in a pool too small for all of them:
    // sequences are preempted and resume from cache hits.
    let shared = "9,8,7,6,5,4,3,2,1,9,8,7,6,5,4,3";
    let prompts: Vec<String> = (0..4).map(|i| format!("{shared},{},{}", 20 + i, 40 + i)).collect();
    let mut args = vec!["--max-new-tokens", "48", "--ignore-eos", "--kv-blocks", "40", "--micro-batch", "2"];
    for p in &prompts {
        args.extend_from_slice(&["--prompt-ids", p]);
    }
    let (plain, _) = run(&out, &args, false);
    let model = fixture("tiny-m3");
    let mut a = vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--speculative-config", SPEC];
    a.extend_from_slice(&args);
    let r = m3c(&a);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(stdout(&r), plain, "speculation under preemption changed the output");
    let kv = stderr(&r).lines().find(|l| l.starts_with("m3c kv: ")).unwrap_or_default().to_string();
    assert!(!kv.contains(" 0 preemption(s)") && !kv.contains(": 0 of"), "no preemption or no hit: {kv}");
    // Text with a stop string from the middle of the plain output.
    let text = ["--prompt", "Hello there, hello there", "--max-new-tokens", "40", "--ignore-eos"];
    let (whole, _) = run(&out, &text, false);
    let stop: String = whole.chars().skip(12).take(3).collect();
    let mut stopped = text.to_vec();
    stopped.extend_from_slice(&["--stop", &stop]);
    let (plain, _) = run(&out, &stopped, false);
    assert!(plain.len() < whole.len(), "the stop string {stop:?} should cut {whole:?}");
    assert_eq!(run(&out, &stopped, true).0, plain, "speculation changed a stopped output");
    // A grammar: drafts are followed through the matcher and rolled back.
    let digits = ["--prompt", "Count: 1 1 1 1", "--max-new-tokens", "40", "--regex", "[0-9 ]{8,60}"];
    let (plain, _) = run(&out, &digits, false);
    let (drafted, counts) = run(&out, &digits, true);
    assert_eq!(drafted, plain, "speculation changed a constrained output");
    assert!(counts.steps > 0, "{counts:?}");
}

#[test]
fn a_batch_larger_than_disable_by_batch_size_takes_no_drafts() {
    let out = crate::shared::out("tiny-m3", 1);
    let config =
        r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "disable_by_batch_size": 2}"#;
    let mut args = vec!["--max-new-tokens", "60", "--ignore-eos"];
    args.extend_from_slice(&PROMPTS);
    // Three running sequences: more than 2, so no drafts, and the same output.
    let (plain, _) = run_with(&out, &args, None);
    assert_eq!(run_with(&out, &args, Some(config)), (plain, Counts::default()));
    // One prompt alone speculates.
    let one = ["--max-new-tokens", "60", "--ignore-eos", "--prompt-ids", "100,200,300,100,200,300"];
    let (plain, _) = run_with(&out, &one, None);
    let (drafted, counts) = run_with(&out, &one, Some(config));
    assert_eq!(drafted, plain);
    assert!(counts.steps > 0, "{counts:?}");
}

#[test]
fn bad_speculative_configs_are_errors_that_name_the_key() {
    let out = crate::shared::out("tiny-m3", 1);
    let model = fixture("tiny-m3");
    for (config, says) in [
        (r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_mx": 4}"#, "unknown key `prompt_lookup_mx`"),
        (r#"{"method": "medusa", "num_speculative_tokens": 3}"#, "unknown method `medusa`"),
        (r#"{"method": "ngram"}"#, "num_speculative_tokens"),
        (r#"{"method": "eagle3", "model": "d", "num_speculative_tokens": 3}"#, "`model` d has no config.json"),
        ("not json", "not JSON"),
    ] {
        let r =
            m3c(&["run", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--prompt-ids", "1,2", "--speculative-config", config]);
        assert!(!r.status.success(), "{config}");
        assert!(stderr(&r).contains(says), "{config}: {}", stderr(&r));
    }
}

/// `--dump` and `--expect` record the row of each emitted token: with
/// speculation (verified drafts among them) the file is the same bytes,
/// and `--expect` of a plain run's dump passes on a speculative one.
#[test]
fn a_dump_with_speculation_is_the_dump_without() {
    let model = fixture("tiny-m3");
    let dir = tempfile::tempdir().unwrap();
    for pp in [1, 2] {
        let out = crate::shared::out("tiny-m3", pp);
        let dump = |name: &str, spec: Option<&str>| {
            let file = dir.path().join(format!("{name}-{pp}.safetensors"));
            let mut a = vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--max-new-tokens", "24"];
            a.extend_from_slice(&PROMPTS);
            a.extend_from_slice(&["--dump", file.to_str().unwrap()]);
            if let Some(config) = spec {
                a.extend_from_slice(&["--speculative-config", config]);
            }
            let r = m3c(&a);
            assert!(r.status.success(), "{a:?}: {}", stderr(&r));
            let drafted = stderr(&r).lines().any(|l| l.starts_with("m3c spec: ") && !l.contains(" 0 verify"));
            // One file per prompt: FILE.pK.safetensors.
            let files: Vec<Vec<u8>> =
                (0..3).map(|k| std::fs::read(file.with_extension(format!("p{k}.safetensors"))).expect("a dump per prompt")).collect();
            (files, drafted)
        };
        let (plain, _) = dump("plain", None);
        let (spec, drafted) = dump("spec", Some(SPEC));
        assert!(drafted, "pp {pp}: drafts were verified");
        assert!(plain == spec, "pp {pp}: the dump changed with speculation");
        // `--expect` checks the first prompt against its plain dump.
        let golden = dir.path().join(format!("plain-{pp}.p0.safetensors"));
        let mut a = vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--max-new-tokens", "24"];
        a.extend_from_slice(&PROMPTS);
        a.extend_from_slice(&["--expect", golden.to_str().unwrap(), "--speculative-config", SPEC]);
        let r = m3c(&a);
        assert!(r.status.success(), "pp {pp}: --expect with speculation: {}", stderr(&r));
    }
}
