//! The paged KV pool end to end through `m3c run`: prompts that share a
//! long prefix, with prefix caching on and off, and a pool too small for
//! them all at once (so sequences are preempted and resume), give every
//! prompt the same tokens and logprobs (an f64 log-softmax of the drawing
//! rows' logits, so equal logprobs mean equal logits there) at pp 1, 2
//! and 4, in f32 and with bf16 caches and activations.

use m3c_tests::{fixture, m3c, read_tensor_i64, stderr, stdout};
use std::path::Path;

/// Six prompts: a shared prefix of 36 tokens (nine blocks of the
/// fixture's 4), then each its own tail of 1 to 6 tokens.
fn prompts() -> Vec<String> {
    let p = read_tensor_i64(&fixture("tiny-m3").join("golden.safetensors"), "prompt_ids");
    (0..6)
        .map(|i| {
            let tail = p.iter().rev().skip(i).take(i + 1).copied();
            p[..36].iter().copied().chain(tail).map(|x| x.to_string()).collect::<Vec<_>>().join(",")
        })
        .collect()
}

/// (every `prompt K:` and `logprobs K:` line, the `m3c kv:` line).
fn run(out: &Path, extra: &[&str]) -> (Vec<String>, String) {
    let model = fixture("tiny-m3");
    let prompts = prompts();
    let mut args = vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap()];
    for p in &prompts {
        args.extend(["--prompt-ids", p.as_str()]);
    }
    // Sampled, so every draw's key (the sequence's own step) is exercised.
    args.extend(["--max-new-tokens", "8", "--logprobs", "2", "--temperature", "0.9", "--seed", "7"]);
    if !extra.contains(&"--micro-batch") {
        args.extend(["--micro-batch", "3"]);
    }
    args.extend(extra);
    let o = m3c(&args);
    assert!(o.status.success(), "m3c {extra:?} failed:\n{}", stderr(&o));
    let lines: Vec<String> =
        stdout(&o).lines().filter(|l| l.starts_with("prompt ") || l.starts_with("logprobs ")).map(str::to_string).collect();
    assert_eq!(lines.len(), 12, "{}", stdout(&o));
    let kv = stderr(&o).lines().find(|l| l.starts_with("m3c kv: ")).unwrap_or_else(|| panic!("no kv line:\n{}", stderr(&o))).to_string();
    (lines, kv)
}

/// (prompt tokens from the cache, preemptions) of an `m3c kv:` line.
fn kv_counts(line: &str) -> (usize, usize) {
    let words: Vec<&str> = line.split_whitespace().collect();
    let hit = words[2].parse().unwrap();
    let pre = words[words.len() - 2].parse().unwrap();
    (hit, pre)
}

/// A cache hit and a preemption change nothing: the same tokens and
/// logprobs as computing every prompt in full, at every pp; and the hits
/// and preemptions did happen (each later prompt finds the shared nine
/// blocks the first computed; a pool of 14 blocks, for six sequences of
/// up to 13, makes them take turns).
#[test]
fn prefix_cache_hits_and_preemptions_give_the_cold_runs_tokens_and_logprobs() {
    let cold_pp1 = run(&crate::shared::out("tiny-m3", 1), &["--no-enable-prefix-caching"]);
    assert_eq!(kv_counts(&cold_pp1.1), (0, 0), "{}", cold_pp1.1);
    for pp in [1, 2, 4] {
        let out = crate::shared::out("tiny-m3", pp);
        let warm = run(&out, &[]);
        assert_eq!(warm.0, cold_pp1.0, "pp {pp}: prefix caching changed the output");
        let (hit, _) = kv_counts(&warm.1);
        assert!(hit >= 5 * 36, "pp {pp}: the later prompts should find the shared prefix: {}", warm.1);
        let tight = run(&out, &["--kv-blocks", "14"]);
        assert_eq!(tight.0, cold_pp1.0, "pp {pp}: preemption changed the output");
        assert!(kv_counts(&tight.1).1 > 0, "pp {pp}: a pool of 14 blocks should preempt: {}", tight.1);
        if pp == 2 {
            let tight_cold = run(&out, &["--kv-blocks", "14", "--no-enable-prefix-caching"]);
            assert_eq!(tight_cold.0, cold_pp1.0, "pp {pp}: preemption without the cache changed the output");
        }
    }
}

/// The same with bf16 caches and bf16 activations, and with fp8 caches: a
/// hit and a resume reuse the very bits a cold run computes, and a
/// sequence alone in its micro-batch gets the bits it gets in company.
#[test]
fn bf16_and_fp8_prefix_cache_hits_and_preemptions_change_nothing() {
    for kv in ["bf16", "fp8"] {
        let out = crate::shared::out_with("tiny-m3", 2, &["--activations", "bf16", "--kv-cache", kv]);
        let cold = run(&out, &["--no-enable-prefix-caching"]);
        let warm = run(&out, &[]);
        assert!(kv_counts(&warm.1).0 >= 5 * 36, "{}", warm.1);
        assert_eq!(warm.0, cold.0, "{kv} caches: prefix caching changed the output");
        let tight = run(&out, &["--kv-blocks", "14"]);
        assert!(kv_counts(&tight.1).1 > 0, "{}", tight.1);
        assert_eq!(tight.0, cold.0, "{kv} caches: preemption changed the output");
        // Nor does the batch a sequence runs in.
        let alone = run(&out, &["--no-enable-prefix-caching", "--micro-batch", "1"]);
        assert_eq!(alone.0, cold.0, "{kv} caches: batching changed the output");
    }
}

/// A pool smaller than one prompt needs is refused before anything runs.
#[test]
fn a_pool_too_small_for_one_prompt_is_refused_up_front() {
    let (out, model) = crate::shared::tiny(1);
    let o = m3c_tests::m3c_run(&out, &model, &["--prompt-ids", "1,2,3,4,5,6,7,8,9", "--max-new-tokens", "8", "--kv-blocks", "4"]);
    m3c_tests::fails_with(&o, &["--kv-blocks 4: prompt 0 and --max-new-tokens 8 need 5 blocks of 4 positions"]);
}

/// Image rows are keyed by the image's content: the same chat with another
/// image of the same size (the same placeholder ids) shares no image block
/// and gets its own answer, and the first image again hits the cache and
/// gets the first answer, bit for bit (ids and logprobs), as each alone.
#[test]
fn images_behind_the_same_placeholders_share_blocks_only_when_they_are_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let (out, model) = crate::shared::tiny(2);
    // Two images of the same size: the fixture's, and its negative.
    let a = dir.path().join("a.png");
    std::fs::copy(fixture("vision/A_rgb_56x84_noresize.png"), &a).unwrap();
    let mut neg = image::open(&a).unwrap().to_rgb8();
    neg.pixels_mut().for_each(|p| p.0 = p.0.map(|c| 255 - c));
    neg.save(dir.path().join("b.png")).unwrap();
    let line = |png: &str| {
        format!(
            r#"{{"messages": [{{"role": "user", "content": [{{"type": "image_url", "image_url": {{"url": "{png}"}}}}, {{"type": "text", "text": "What is this?"}}]}}], "thinking": "disabled"}}"#
        )
    };
    let run = |pngs: &[&str], extra: &[&str]| -> (Vec<String>, String) {
        let jsonl = dir.path().join(format!("{}.jsonl", pngs.join("-")));
        std::fs::write(&jsonl, pngs.iter().map(|p| line(p)).collect::<Vec<_>>().join("\n")).unwrap();
        let mut args = vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--prompts", jsonl.to_str().unwrap()];
        args.extend(["--max-new-tokens", "6", "--logprobs", "2", "--micro-batch", "1"]);
        args.extend(extra);
        let o = m3c(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let lines = stdout(&o).lines().filter(|l| l.starts_with("logprobs ")).map(|l| l.split_once(": ").unwrap().1.to_string()).collect();
        let kv = stderr(&o).lines().find(|l| l.starts_with("m3c kv: ")).unwrap().to_string();
        (lines, kv)
    };
    let (both, kv) = run(&["a.png", "b.png", "a.png"], &[]);
    let (alone_a, _) = run(&["a.png"], &["--no-enable-prefix-caching"]);
    let (alone_b, _) = run(&["b.png"], &["--no-enable-prefix-caching"]);
    assert_ne!(alone_a, alone_b, "the two images should give different answers");
    assert_eq!(both, [alone_a[0].clone(), alone_b[0].clone(), alone_a[0].clone()], "{kv}");
    // The template's text before the image is shared by all three; the
    // third prompt also finds the first one's image blocks.
    let (hit, _) = kv_counts(&kv);
    assert!(hit > 0, "{kv}");
}
