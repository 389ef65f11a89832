//! The text front against the reference (transformers 5.24 over tokenizers
//! 0.23.3, `tokenizer_golden.json`): every golden string's ids, tokens and
//! decodes, every golden conversation's rendered prompt and ids; streaming
//! decode; errors that name the file.

use m3c_front::text::{ChatTemplate, IncrementalDecoder, TextTokenizer};
use m3c_tests::fixture;
use minijinja::Value;

/// The golden file as a template value (map keys in file order, as the
/// reference's Python dicts keep them).
fn golden() -> Value {
    let text = std::fs::read_to_string(fixture("tiny-m3").join("tokenizer_golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.try_iter().unwrap().map(|x| x.as_i64().unwrap() as u32).collect()
}

fn string(v: &Value, key: &str) -> String {
    v.get_attr(key).unwrap().as_str().unwrap_or_else(|| panic!("{key}: not a string")).to_string()
}

#[test]
fn every_golden_string_encodes_and_decodes_as_the_reference() {
    let tk = TextTokenizer::from_dir(&fixture("tiny-m3")).unwrap();
    assert_eq!(tk.vocab_size(), 512);
    let g = golden();
    let cases = g.get_attr("encode").unwrap();
    let mut n = 0;
    for case in cases.try_iter().unwrap() {
        let text = string(&case, "text");
        let want = ids(&case.get_attr("ids").unwrap());
        assert_eq!(tk.encode(&text).unwrap(), want, "ids of {text:?}");
        let tokens: Vec<String> = case.get_attr("tokens").unwrap().try_iter().unwrap().map(|t| t.as_str().unwrap().to_string()).collect();
        assert_eq!(tk.tokens(&text).unwrap(), tokens, "tokens of {text:?}");
        assert_eq!(tk.decode(&want, false).unwrap(), string(&case, "decoded"), "decode of {text:?}");
        assert_eq!(tk.decode(&want, true).unwrap(), string(&case, "decoded_skip_special"), "decode without specials of {text:?}");
        n += 1;
    }
    assert_eq!(n, 22);
    // The control tokens of the real model are single tokens here too.
    for (tok, id) in [("]~!b[", 492), ("[e~[", 494), ("<mm:think>", 495), ("]<]image[>[", 500)] {
        assert_eq!(tk.token_id(tok), Some(id), "{tok}");
    }
    assert!(tk.is_special(494) && !tk.is_special(495), "[e~[ is special, <mm:think> is not");
}

#[test]
fn every_golden_conversation_renders_byte_identically() {
    let dir = fixture("tiny-m3");
    let tk = TextTokenizer::from_dir(&dir).unwrap();
    let tmpl = ChatTemplate::from_dir(&dir).unwrap().expect("the fixture has a chat template");
    let g = golden();
    let mut n = 0;
    for case in g.get_attr("chat").unwrap().try_iter().unwrap() {
        let name = string(&case, "name");
        let kwargs_v = case.get_attr("template_kwargs").unwrap();
        let keys: Vec<String> = kwargs_v.try_iter().unwrap().map(|k| k.as_str().unwrap().to_string()).collect();
        let kwargs: Vec<(&str, Value)> = keys.iter().map(|k| (k.as_str(), kwargs_v.get_attr(k).unwrap())).collect();
        let rendered = tmpl.render(&case.get_attr("messages").unwrap(), &kwargs).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = string(&case, "rendered");
        assert_eq!(rendered, want, "{name}: rendered prompt");
        assert_eq!(tk.encode(&rendered).unwrap(), ids(&case.get_attr("ids").unwrap()), "{name}: ids");
        n += 1;
    }
    assert_eq!(n, 6);
}

#[test]
fn streaming_decode_never_splits_a_character() {
    let tk = TextTokenizer::from_dir(&fixture("tiny-m3")).unwrap();
    for text in ["日本語のテキスト、中文文本。한국어", "emoji 😀👍🏽 family 👨\u{200d}👩\u{200d}👧 🚀", "héllo wörld — naïve café"]
    {
        let ids = tk.encode(text).unwrap();
        let mut dec = IncrementalDecoder::new(true);
        let mut streamed = String::new();
        let mut pieces = 0;
        for &id in &ids {
            let piece = dec.push(&tk, id).unwrap();
            assert!(!piece.contains('\u{FFFD}'), "{text:?}: a split character streamed as {piece:?}");
            pieces += !piece.is_empty() as usize;
            streamed.push_str(&piece);
        }
        assert_eq!(streamed, text, "the stream adds up to the text");
        assert!(
            pieces > 1 && pieces < ids.len(),
            "{text:?}: {pieces} pieces for {} tokens (byte-level tokens split characters)",
            ids.len()
        );
    }
}

/// The windowed stream adds up to the full decode for any ids: random ones
/// (special tokens, byte tokens that never complete a character, words)
/// over a long sequence, where the decoder looks at a few tokens at a time.
#[test]
fn streaming_decode_of_random_ids_adds_up_to_the_full_decode() {
    let tk = TextTokenizer::from_dir(&fixture("tiny-m3")).unwrap();
    let vocab = tk.vocab_size() as u64;
    for seed in 0..4u64 {
        let ids: Vec<u32> = (0..1500u64).map(|i| (m3c_sampler::draw_bits(seed, 0, i) % vocab) as u32).collect();
        let mut dec = IncrementalDecoder::new(true);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&dec.push(&tk, id).unwrap());
        }
        streamed.push_str(&dec.finish(&tk).unwrap());
        assert_eq!(streamed, tk.decode(&ids, true).unwrap(), "seed {seed}");
    }
}

#[test]
fn a_template_error_and_damaged_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = TextTokenizer::from_dir(dir.path()).err().unwrap().to_string();
    assert!(e.contains("no tokenizer.json") && e.contains("--prompt-ids"), "{e}");
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let e = TextTokenizer::from_dir(dir.path()).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json: not a tokenizer"), "{e}");
    std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"chat_template": "{% for m in messages %}{{ m.content "}"#).unwrap();
    let e = ChatTemplate::from_dir(dir.path()).err().unwrap().to_string();
    assert!(e.contains("tokenizer_config.json: the chat template does not compile"), "{e}");
    // The template's own error (a tool turn with no call before it).
    let tmpl = ChatTemplate::from_dir(&fixture("tiny-m3")).unwrap().unwrap();
    let messages: Value = serde_json::from_str(r#"[{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]"#).unwrap();
    let e = tmpl.render(&messages, &[]).err().unwrap().to_string();
    assert!(e.contains("tool role, but there was no previous assistant message with a tool call"), "{e}");
}

/// The ids the first stage prints for prompt `k` (`prompt K: 1,2,3`).
fn printed<T: std::str::FromStr>(stdout: &str, k: usize) -> Vec<T> {
    let tag = format!("prompt {k}: ");
    let line = stdout.lines().find_map(|l| l.strip_prefix(tag.as_str())).unwrap_or_else(|| panic!("no ids for prompt {k} in {stdout}"));
    line.split(',').map(|x| x.parse().ok().unwrap_or_else(|| panic!("{x}: not an id"))).collect()
}

/// tiny-m3 compiled at pp 2 into a temporary folder that lives as long as this.
struct Tiny {
    model: std::path::PathBuf,
    out: std::path::PathBuf,
    dir: tempfile::TempDir,
}

impl Tiny {
    fn compiled() -> Tiny {
        let model = fixture("tiny-m3");
        let dir = tempfile::tempdir().unwrap();
        let out = crate::shared::out("tiny-m3", 2);
        Tiny { model, out, dir }
    }
    fn model(&self) -> &str {
        self.model.to_str().unwrap()
    }
    fn out(&self) -> &str {
        self.out.to_str().unwrap()
    }
}

fn printed_ids(stdout: &str) -> Vec<u32> {
    printed(stdout, 0)
}

#[test]
fn text_prompts_run_through_the_stages_and_stream_back_as_text() {
    use m3c_front::text::ThinkingMode;
    use m3c_tests::{m3c, stderr, stdout};
    let tiny = Tiny::compiled();
    let (model, m, o) = (tiny.model.as_path(), tiny.model(), tiny.out());
    let tk = TextTokenizer::from_dir(model).unwrap();
    // The same run given ids: its greedy ids, decoded, are what --prompt prints.
    let reference = |ids: &[u32]| {
        let arg = ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
        let r = m3c(&["run", o, "--model", m, "--prompt-ids", &arg, "--max-new-tokens", "12"]);
        assert!(r.status.success(), "{}", stderr(&r));
        printed_ids(&stdout(&r))
    };

    let text = "The capital of France is";
    let want = reference(&tk.encode(text).unwrap());
    assert_eq!(want.len(), 12);
    let r = m3c(&["run", o, "--model", m, "--prompt", text, "--max-new-tokens", "12"]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(stdout(&r), format!("{}\n", tk.decode(&want, true).unwrap()), "--prompt prints the decoded continuation only");
    let prompt_tokens = tk.encode(text).unwrap().len();
    assert!(stderr(&r).contains(&format!("prompt 0: {prompt_tokens} prompt tokens, 12 generated, finish: length")), "{}", stderr(&r));

    // --chat goes through the template, with the system turn and thinking mode.
    let tmpl = ChatTemplate::from_dir(model).unwrap().unwrap();
    let messages: Value =
        serde_json::from_str(r#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]"#).unwrap();
    let kwargs = [("add_generation_prompt", Value::from(true)), ("thinking_mode", Value::from(ThinkingMode::Disabled.name()))];
    let rendered = tk.encode(&tmpl.render(&messages, &kwargs).unwrap()).unwrap();
    let want_chat = reference(&rendered);
    let r = m3c(&[
        "run",
        o,
        "--model",
        m,
        "--prompt",
        text,
        "--chat",
        "Hi!",
        "--system",
        "Be brief.",
        "--thinking",
        "disabled",
        "--max-new-tokens",
        "12",
    ]);
    assert!(r.status.success(), "{}", stderr(&r));
    let both = format!("### prompt 0\n{}\n### prompt 1\n{}\n", tk.decode(&want, true).unwrap(), tk.decode(&want_chat, true).unwrap());
    assert_eq!(stdout(&r), both, "two prompts: each under its heading, in order, whatever order their tokens came in");
    assert!(stderr(&r).contains(&format!("prompt 1: {} prompt tokens", rendered.len())), "{}", stderr(&r));
}

#[test]
fn text_prompts_on_a_checkpoint_without_a_tokenizer_point_to_prompt_ids() {
    use m3c_tests::stderr;
    let model = fixture("tiny-m3-mxfp8");
    let out = crate::shared::out("tiny-m3-mxfp8", 1);
    let r = m3c_tests::m3c_run(&out, &model, &["--prompt", "Hello", "--max-new-tokens", "2"]);
    assert!(!r.status.success());
    let e = stderr(&r);
    assert!(e.contains("no tokenizer.json") && e.contains("--prompt-ids"), "{e}");
    // --system without --chat is a usage error, before anything runs.
    let r = m3c_tests::m3c_run(&out, &model, &["--prompt", "Hi", "--system", "x", "--max-new-tokens", "2"]);
    assert!(!r.status.success());
    assert!(stderr(&r).contains("--chat"), "{}", stderr(&r));
}

/// A copy of the tiny fixture's checkpoint with `generation_config.json`
/// set to `gen` (none when empty).
fn fixture_with_generation_config(dir: &std::path::Path, gen: &str) -> std::path::PathBuf {
    let model = dir.join("model");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("tiny-m3").join(f), model.join(f)).unwrap();
    }
    if !gen.is_empty() {
        std::fs::write(model.join("generation_config.json"), gen).unwrap();
    }
    model
}

#[test]
fn sampled_tokens_depend_only_on_the_seed_not_on_pp_batch_or_threads() {
    use m3c_tests::{m3c_env, read_tensor_i64, stderr, stdout};
    let model = fixture("tiny-m3");
    let m = model.to_str().unwrap();
    let prompt = read_tensor_i64(&model.join("golden.safetensors"), "prompt_ids");
    let golden_greedy = read_tensor_i64(&model.join("golden.safetensors"), "generated_ids");
    let a = prompt.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let dir = tempfile::tempdir().unwrap();
    let outs: Vec<(usize, std::path::PathBuf)> = [1, 2, 4]
        .into_iter()
        .map(|pp| {
            let d = dir.path().join(format!("pp{pp}"));
            std::fs::create_dir(&d).unwrap();
            (pp, crate::shared::out("tiny-m3", pp))
        })
        .collect();
    // Prompt 0's ids from a run with these prompts and flags.
    let run = |out: &std::path::Path, prompts: &[&str], extra: &[&str], threads: &str| -> Vec<i64> {
        let mut args = vec!["run", out.to_str().unwrap(), "--model", m, "--max-new-tokens", "16", "--temperature", "0.9", "--top-k", "40"];
        args.extend_from_slice(&["--top-p", "0.95", "--repetition-penalty", "1.1"]);
        args.extend_from_slice(extra);
        for p in prompts {
            args.extend_from_slice(&["--prompt-ids", p]);
        }
        let r = m3c_env(&args, &[("OMP_NUM_THREADS", threads)]);
        assert!(r.status.success(), "{}", stderr(&r));
        printed(&stdout(&r), 0)
    };
    let base = run(&outs[0].1, &[&a], &["--seed", "7"], "1");
    assert_eq!(base.len(), 16);
    assert_ne!(base, golden_greedy, "sampling at T = 0.9 should leave the greedy path");
    assert_ne!(run(&outs[0].1, &[&a], &["--seed", "8"], "1"), base, "another seed, other tokens");
    for (pp, out) in &outs {
        assert_eq!(run(out, &[&a], &["--seed", "7"], "2"), base, "pp {pp}, 2 threads");
        // With other prompts beside it, in micro-batches of 3 or of 1.
        for mb in ["1", "3"] {
            assert_eq!(run(out, &[&a, "5,6,7", "400,3"], &["--seed", "7", "--micro-batch", mb], "1"), base, "pp {pp}, micro-batch {mb}");
        }
        assert_eq!(run(out, &[&a], &["--seed", "7", "--prefill-chunk", "3"], "1"), base, "pp {pp}, prefill in chunks of 3");
    }
}

#[test]
fn eos_ends_a_sequence_and_generation_config_sets_the_defaults() {
    use m3c_tests::{compile, m3c, read_tensor_i64, stderr, stdout};
    let golden = fixture("tiny-m3").join("golden.safetensors");
    let prompt = read_tensor_i64(&golden, "prompt_ids");
    let greedy = read_tensor_i64(&golden, "generated_ids");
    let a = prompt.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let dir = tempfile::tempdir().unwrap();
    // The third greedy token as the checkpoint's EOS.
    let model = fixture_with_generation_config(dir.path(), &format!(r#"{{"eos_token_id": [{}, 100000]}}"#, greedy[2]));
    let m = model.to_str().unwrap();
    let out = compile(&model, 2, dir.path(), &[]);
    let o = out.to_str().unwrap();
    let ids = |r: &std::process::Output| -> Vec<i64> {
        assert!(r.status.success(), "{}", stderr(r));
        printed(&stdout(r), 0)
    };
    let r = m3c(&["run", o, "--model", m, "--prompt-ids", &a, "--prompt-ids", "5,6,7", "--max-new-tokens", "16"]);
    assert_eq!(ids(&r), greedy[..3], "stops after the EOS id, which it keeps");
    assert!(stderr(&r).contains("stops on EOS id(s)") && stderr(&r).contains("generation_config.json"), "{}", stderr(&r));
    // The other prompt is not cut short by the first one's end.
    let other: Vec<i64> = printed(&stdout(&r), 1);
    let alone = m3c(&["run", o, "--model", m, "--prompt-ids", "5,6,7", "--max-new-tokens", "16"]);
    assert_eq!(other, ids(&alone));
    let r = m3c(&["run", o, "--model", m, "--prompt-ids", &a, "--max-new-tokens", "16", "--ignore-eos"]);
    assert_eq!(ids(&r), greedy, "--ignore-eos runs to --max-new-tokens");

    // Text: the finish reason is `stop`, and the EOS token (special) is not printed.
    let tk = TextTokenizer::from_dir(&model).unwrap();
    let text = "The capital of France is";
    let enc = tk.encode(text).unwrap().iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let cont = ids(&m3c(&["run", o, "--model", m, "--prompt-ids", &enc, "--max-new-tokens", "16", "--ignore-eos"]));
    let dir3 = tempfile::tempdir().unwrap();
    let model3 = fixture_with_generation_config(dir3.path(), &format!(r#"{{"eos_token_id": {}}}"#, cont[2]));
    let r = m3c(&["run", o, "--model", model3.to_str().unwrap(), "--prompt", text, "--max-new-tokens", "16"]);
    assert!(r.status.success(), "{}", stderr(&r));
    let stop_at = cont.iter().position(|&i| i == cont[2]).unwrap() + 1;
    assert!(stderr(&r).contains(&format!("{stop_at} generated, finish: stop")), "{}", stderr(&r));
    let shown: Vec<u32> = cont[..stop_at].iter().map(|&i| i as u32).collect();
    assert_eq!(stdout(&r), format!("{}\n", tk.decode(&shown, true).unwrap()));

    // Sampling defaults come from generation_config.json; a flag overrides them.
    let dir2 = tempfile::tempdir().unwrap();
    let model2 = fixture_with_generation_config(dir2.path(), r#"{"temperature": 0.7, "top_k": 20, "top_p": 0.9, "eos_token_id": 100000}"#);
    let m2 = model2.to_str().unwrap();
    let r = m3c(&["run", o, "--model", m2, "--prompt-ids", &a, "--max-new-tokens", "16", "--seed", "1"]);
    assert!(stderr(&r).contains("sampling at temperature 0.7, top-k 20, top-p 0.9"), "{}", stderr(&r));
    assert_ne!(ids(&r), greedy);
    let r = m3c(&["run", o, "--model", m2, "--prompt-ids", &a, "--max-new-tokens", "16", "--temperature", "0"]);
    assert_eq!(ids(&r), greedy, "--temperature 0 overrides the default: greedy, the golden tokens");
    // A bad value names the flag or the file.
    let r = m3c(&["run", o, "--model", m2, "--prompt-ids", &a, "--max-new-tokens", "4", "--top-p", "1.5"]);
    assert!(!r.status.success() && stderr(&r).contains("top_p 1.5"), "{}", stderr(&r));
    std::fs::write(model2.join("generation_config.json"), r#"{"temperature": "hot"}"#).unwrap();
    let r = m3c(&["run", o, "--model", m2, "--prompt-ids", &a, "--max-new-tokens", "4"]);
    assert!(!r.status.success() && stderr(&r).contains("generation_config.json") && stderr(&r).contains("temperature"), "{}", stderr(&r));
}

#[test]
fn a_stop_string_spanning_tokens_ends_the_sequence_and_is_not_printed() {
    use m3c_tests::{m3c, stderr, stdout};
    let tiny = Tiny::compiled();
    let (model, m, o) = (tiny.model.as_path(), tiny.model(), tiny.out());
    let tk = TextTokenizer::from_dir(model).unwrap();
    let text = "The capital of France is";
    let enc = tk.encode(text).unwrap().iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let r = m3c(&["run", o, "--model", m, "--prompt-ids", &enc, "--max-new-tokens", "24", "--ignore-eos"]);
    assert!(r.status.success(), "{}", stderr(&r));
    let cont: Vec<u32> = printed_ids(&stdout(&r));
    // A stop string made of the last character of one token and the first
    // of the next: it completes only with the second token.
    let piece = |id: u32| tk.decode(&[id], true).unwrap();
    let clean = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_graphic() || c == ' ');
    let i = (1..cont.len() - 1).find(|&i| clean(&piece(cont[i])) && clean(&piece(cont[i + 1]))).expect("two plain-text tokens in a row");
    let stop = format!("{}{}", piece(cont[i]).chars().last().unwrap(), piece(cont[i + 1]).chars().next().unwrap());
    let full = tk.decode(&cont, true).unwrap();
    let want_text = &full[..full.find(&stop).unwrap()];
    let want_count = (1..=cont.len()).find(|&k| tk.decode(&cont[..k], true).unwrap().contains(&stop)).unwrap();
    let r = m3c(&[
        "run",
        o,
        "--model",
        m,
        "--prompt",
        text,
        "--max-new-tokens",
        "24",
        "--ignore-eos",
        "--stop",
        &stop,
        "--stop",
        "never-there",
    ]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(stdout(&r), format!("{want_text}\n"), "stop string {stop:?}");
    assert!(stderr(&r).contains(&format!("{want_count} generated, finish: stop")), "want {want_count}: {}", stderr(&r));
    // Bad --stop values are refused before anything runs.
    let r = m3c(&["run", o, "--model", m, "--prompt", text, "--max-new-tokens", "4", "--stop", ""]);
    assert!(!r.status.success() && stderr(&r).contains("stop string cannot be empty"), "{}", stderr(&r));
}

#[test]
fn the_stages_token_byte_table_decodes_as_the_tokenizer_does() {
    let dir = fixture("tiny-m3");
    let tk = TextTokenizer::from_dir(&dir).unwrap();
    let table = m3c_contract::token_bytes::byte_level_table(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap()).unwrap();
    assert_eq!(table.len(), 512);
    let g = golden();
    let mut checked = 0;
    for case in g.get_attr("encode").unwrap().try_iter().unwrap() {
        let ids = ids(&case.get_attr("ids").unwrap());
        let bytes: Vec<u8> = ids.iter().flat_map(|&i| table[i as usize].clone()).collect();
        assert_eq!(String::from_utf8_lossy(&bytes), tk.decode(&ids, true).unwrap(), "{ids:?}");
        checked += 1;
    }
    assert_eq!(checked, 22);
    let e = m3c_contract::token_bytes::byte_level_table(r#"{"decoder": {"type": "WordPiece"}}"#).unwrap_err();
    assert!(e.contains("not ByteLevel"), "{e}");
}

#[test]
fn a_jsonl_prompts_file_takes_text_chats_and_per_line_sampling() {
    use m3c_tests::{m3c, stderr, stdout};
    let tiny = Tiny::compiled();
    let (m, o) = (tiny.model(), tiny.out());
    let text = "The capital of France is";
    let solo = |extra: &[&str]| {
        let mut args = vec!["run", o, "--model", m, "--max-new-tokens", "10", "--ignore-eos"];
        args.extend_from_slice(extra);
        let r = m3c(&args);
        assert!(r.status.success(), "{}", stderr(&r));
        stdout(&r)
    };
    let file = tiny.dir.path().join("p.jsonl");
    std::fs::write(
        &file,
        format!(
            "{{\"prompt\": \"{text}\"}}\n\n{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}], \"thinking\": \"disabled\"}}\n\
             {{\"prompt\": \"{text}\", \"temperature\": 0.9, \"seed\": 5}}\n"
        ),
    )
    .unwrap();
    let all = solo(&["--prompts", file.to_str().unwrap()]);
    let want = format!(
        "### prompt 0\n{}### prompt 1\n{}### prompt 2\n{}",
        solo(&["--prompt", text]),
        solo(&["--chat", "Hi!", "--thinking", "disabled"]),
        solo(&["--prompt", text, "--temperature", "0.9", "--seed", "5"])
    );
    assert_eq!(all, want, "each line as its own run, with its own sampling");
    assert_ne!(solo(&["--prompt", text]), solo(&["--prompt", text, "--temperature", "0.9", "--seed", "5"]));
    // A misspelt field names the file, the line and the field.
    std::fs::write(&file, format!("{{\"prompt\": \"a\"}}\n{{\"prompt\": \"{text}\", \"temprature\": 1}}\n")).unwrap();
    let r = m3c(&["run", o, "--model", m, "--max-new-tokens", "2", "--prompts", file.to_str().unwrap()]);
    let e = stderr(&r);
    assert!(!r.status.success() && e.contains("p.jsonl") && e.contains("line 2") && e.contains("temprature"), "{e}");
}

/// The harness `scripts/gpu-check.sh` checks the device sampler with, run
/// here on the host: a sampled run's dump replays exactly through the host
/// sampler (and a wrong seed would not).
#[test]
fn a_sampled_runs_dump_replays_through_the_host_sampler() {
    use m3c_contract::sampling::SamplingParams;
    use m3c_sampler::replay_mismatches;
    let dir = tempfile::tempdir().unwrap();
    let (out, model) = crate::shared::tiny(2);
    let dump = dir.path().join("s.safetensors");
    let r = m3c_tests::m3c_run(
        &out,
        &model,
        &[
            "--prompt-ids",
            "1,2,3,4,5",
            "--max-new-tokens",
            "16",
            "--temperature",
            "0.8",
            "--top-k",
            "40",
            "--top-p",
            "0.95",
            "--min-p",
            "0.02",
            "--repetition-penalty",
            "1.1",
            "--seed",
            "7",
            "--ignore-eos",
            "--dump",
            dump.to_str().unwrap(),
        ],
    );
    assert!(r.status.success(), "{}", m3c_tests::stderr(&r));
    let ids = |n: &str| m3c_tests::read_tensor_i64(&dump, n).into_iter().map(|i| i as u32).collect::<Vec<u32>>();
    let (shape, prefill) = m3c_tests::read_tensor_f32(&dump, "prefill_logits");
    let vocab = shape[1];
    let mut rows = prefill[(shape[0] - 1) * vocab..].to_vec();
    rows.extend(m3c_tests::read_tensor_f32(&dump, "decode_logits").1);
    let p = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.02,
        repetition_penalty: 1.1,
        seed: 7,
        ..SamplingParams::GREEDY
    };
    let generated = ids("generated_ids");
    assert_eq!(generated.len(), 16);
    assert!(replay_mismatches(&ids("prompt_ids"), &rows, vocab, &generated, &p).is_empty());
    assert!(!replay_mismatches(&ids("prompt_ids"), &rows, vocab, &generated, &SamplingParams { seed: 8, ..p }).is_empty());
}

/// One chat normaliser: OpenAI-shaped messages (a developer turn, text parts,
/// tool-call arguments as a JSON string) give `m3c run --prompts` the very
/// prompt ids that `m3c serve` renders for them, and the ids of their
/// canonical form.
#[test]
fn the_same_messages_give_the_same_prompt_through_run_and_serve() {
    use m3c_front::text::front::{encode, encode_jsonl, TextRequest};
    let model = fixture("tiny-m3");
    let dir = tempfile::tempdir().unwrap();
    let messages = serde_json::json!([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c"},
    ]);
    let canonical = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c"},
    ]);
    let run_ids = |m: &serde_json::Value| {
        let file = dir.path().join("p.jsonl");
        let text = format!("{}\n", serde_json::json!({"messages": m}));
        let req = TextRequest { prompts: &[], chats: &[], system: None, thinking: None, chat_images: 0, videos: &[] };
        let mut enc = encode(&model, &req).unwrap();
        encode_jsonl(&model, &file, &text, &mut enc).unwrap();
        enc.ids.pop().unwrap()
    };
    let body = serde_json::json!({"model": "tiny", "messages": messages});
    let chat =
        m3c_serve::openai::chat(body.as_object().unwrap(), &m3c_contract::chat_format::ChatFormat::of_family("minimax_m3").unwrap().tools)
            .unwrap();
    let template = ChatTemplate::from_dir(&model).unwrap().unwrap();
    let rendered =
        template.render(&serde_json::from_value(chat.messages).unwrap(), &[("add_generation_prompt", Value::from(true))]).unwrap();
    let serve_ids = TextTokenizer::from_dir(&model).unwrap().encode(&rendered).unwrap();
    let ids = run_ids(&messages);
    assert_eq!(ids, serve_ids, "m3c run --prompts and m3c serve");
    assert_eq!(ids, run_ids(&canonical), "OpenAI's shape and its canonical form");
    assert!(rendered.contains("Weather in Paris?") && rendered.contains("Be brief."), "{rendered}");
}
