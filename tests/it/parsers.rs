//! Property tests of every parser of user input: plan YAML, config JSON,
//! safetensors headers, shard indexes, prompts files and the numbers of the
//! command line. Inputs are real files mutated at random (bytes flipped,
//! inserted, deleted, tokens such as huge numbers, brackets or a BOM
//! spliced in) and plain random text. Every parse must return a value or a
//! typed error, quickly, and a value must satisfy the parser's promises.
//! Inputs that once found a bug live in `tests/fixtures/hostile-corpus/`.

use m3c_contract::checkpoint::{is_plain_file_name, parse_header, parse_index};
use m3c_contract::prompts::{parse_count, parse_ids, parse_prompts_file, parse_timeout_s, MAX_TIMEOUT_S};
use m3c_tests::{configs, fixture, root};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::path::Path;
use std::time::{Duration, Instant};

/// Tokens that broke parsers elsewhere.
const TOKENS: &[&str] = &[
    "18446744073709551615",
    "18446744073709551616",
    "4611686018427387904",
    "-1",
    "1e309",
    "NaN",
    "inf",
    "[",
    "{",
    "]",
    "}",
    "\"",
    ":",
    ",",
    "\n",
    "\u{feff}",
    "- ",
    "&a ",
    "*a",
    "!!binary ",
    "\0",
    "0x10",
    "99999999999999999999999999",
];

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, u8),
    Delete(usize, usize),
    Token(usize, usize),
    Repeat(usize, usize, usize),
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    let one = prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Mutation::Flip(p, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Mutation::Insert(p, b)),
        (any::<usize>(), 1usize..64).prop_map(|(p, n)| Mutation::Delete(p, n)),
        (any::<usize>(), 0..TOKENS.len()).prop_map(|(p, t)| Mutation::Token(p, t)),
        (any::<usize>(), 1usize..32, 2usize..50).prop_map(|(p, n, k)| Mutation::Repeat(p, n, k)),
    ];
    proptest::collection::vec(one, 1..8)
}

fn mutate(seed: &[u8], ms: &[Mutation]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for m in ms {
        let at = |p: usize, v: &Vec<u8>| if v.is_empty() { 0 } else { p % (v.len() + 1) };
        match *m {
            Mutation::Flip(p, b) if !v.is_empty() => {
                let i = p % v.len();
                v[i] ^= b | 1;
            }
            Mutation::Flip(..) => {}
            Mutation::Insert(p, b) => {
                let i = at(p, &v);
                v.insert(i, b);
            }
            Mutation::Delete(p, n) => {
                let i = at(p, &v);
                let j = (i + n).min(v.len());
                v.drain(i..j);
            }
            Mutation::Token(p, t) => {
                let i = at(p, &v);
                v.splice(i..i, TOKENS[t].bytes());
            }
            Mutation::Repeat(p, n, k) => {
                let i = at(p, &v);
                let j = (i + n).min(v.len());
                let piece = v[i..j].to_vec();
                for _ in 0..k {
                    v.splice(i..i, piece.iter().copied());
                }
            }
        }
    }
    v
}

/// Runs `cases` random inputs through `check`, each within five seconds:
/// a parse that blows up on some input takes far longer, while a debug
/// build's parse of a few hundred bytes takes microseconds, so the bound
/// only has to outlast a test thread starved on two shared cores.
fn run(name: &str, cases: u32, strategy: impl Strategy<Value = Vec<u8>>, check: impl Fn(&[u8]) -> Result<(), String>) {
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let result = runner.run(&strategy, |input| {
        let t0 = Instant::now();
        let r = check(&input);
        let dt = t0.elapsed();
        prop_assert!(dt < Duration::from_secs(5), "{name}: {dt:?} for an input of {} bytes", input.len());
        r.map_err(|e| TestCaseError::fail(format!("{name}: {e}")))
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

fn seeded(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds.len();
    prop_oneof![
        4 => (0..n, mutations()).prop_map(move |(i, ms)| mutate(&seeds[i], &ms)),
        1 => proptest::collection::vec(any::<u8>(), 0..512),
    ]
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn tiny_config() -> m3c_compiler::config::ModelConfig {
    m3c_compiler::family::load_config(&fixture("tiny-m3").join("config.json")).unwrap()
}

#[test]
fn plan_yaml_never_panics_or_hangs() {
    let seeds: Vec<Vec<u8>> =
        ["tiny-m3.pp2.yaml", "tiny-m3.pp4.yaml", "minimax-m3-mxfp8.pp4.yaml"].iter().map(|f| std::fs::read(configs(f)).unwrap()).collect();
    let cfg = tiny_config();
    run("plan", 3000, seeded(seeds), |b| {
        if let Ok(p) = m3c_compiler::plan::parse_plan(Path::new("p.yaml"), &text(b), Some(&cfg)) {
            // A value keeps the plan's promises: every layer once, in order.
            let mut next = 0;
            for s in &p.stages {
                if let Some(r) = s.layers {
                    if r.first != next {
                        return Err(format!("layers start at {} after {next}", r.first));
                    }
                    next = r.last + 1;
                }
                if let Some(h) = &s.place.host {
                    if !m3c_compiler::plan::valid_host(h) {
                        return Err(format!("host {h:?} passed"));
                    }
                }
            }
            if next != cfg.text.num_layers {
                return Err(format!("{next} layers placed"));
            }
        }
        Ok(())
    });
}

#[test]
fn config_json_never_panics_or_hangs() {
    let seeds: Vec<Vec<u8>> = vec![
        std::fs::read(fixture("tiny-m3").join("config.json")).unwrap(),
        std::fs::read(configs("minimax-m3-mxfp8.config.json")).unwrap(),
    ];
    run("config", 2000, seeded(seeds), |b| {
        if let Ok(c) = m3c_compiler::family::parse_config(Path::new("config.json"), &text(b)) {
            let t = &c.text;
            let bounded = t.hidden_size <= 1 << 16 && t.vocab_size <= 1 << 22 && t.num_layers <= 1024 && t.max_position_embeddings >= 2;
            if !bounded || t.moe.experts_per_token > t.moe.num_experts {
                return Err(format!(
                    "out-of-bounds config passed: hidden {}, vocab {}, layers {}",
                    t.hidden_size, t.vocab_size, t.num_layers
                ));
            }
            // The parameter count of any accepted config fits.
            let _ = m3c_compiler::inspect::model_stats(&c);
        }
        Ok(())
    });
}

#[test]
fn safetensors_headers_never_panic_and_values_tile_the_data() {
    let bytes = std::fs::read(fixture("tiny-m3").join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = bytes[8..8 + n].to_vec();
    let data_len = (bytes.len() - 8 - n) as u64;
    let small = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,3],"data_offsets":[8,14]},"__metadata__":{"format":"pt"}}"#.to_vec();
    let strategy = (seeded(vec![header, small]), prop_oneof![Just(data_len), Just(14u64), any::<u64>()]).prop_map(|(mut h, len)| {
        h.extend(len.to_le_bytes());
        h
    });
    run("safetensors header", 5000, strategy, |b| {
        let (h, len) = b.split_at(b.len() - 8);
        let len = u64::from_le_bytes(len.try_into().unwrap());
        if let Ok(ts) = parse_header(h, len) {
            let mut ranges: Vec<(u64, u64, u64)> =
                ts.iter().map(|t| (t.start, t.end, t.shape.iter().product::<usize>() as u64 * t.dtype.size_bytes() as u64)).collect();
            ranges.sort();
            let mut at = 0;
            for (s, e, bytes) in ranges {
                if s != at || e - s != bytes {
                    return Err(format!("accepted a range {s}..{e} ({bytes} bytes) at {at}"));
                }
                at = e;
            }
            if at != len {
                return Err(format!("accepted tensors covering {at} of {len} bytes"));
            }
        }
        Ok(())
    });
}

#[test]
fn shard_indexes_never_panic_and_name_only_plain_files() {
    let seeds = vec![
        br#"{"metadata": {"total_size": 1}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}"#.to_vec(),
        br#"{"weight_map": {"x": "m.safetensors"}}"#.to_vec(),
    ];
    run("index", 3000, seeded(seeds), |b| {
        if let Ok(entries) = parse_index(&text(b)) {
            if let Some((t, f)) = entries.iter().find(|(_, f)| !is_plain_file_name(f)) {
                return Err(format!("accepted {t} → {f:?}"));
            }
        }
        Ok(())
    });
}

#[test]
fn prompts_files_never_panic() {
    let seeds = vec![b"1,2,3\n# c\n\n4, 5 6\n".to_vec(), b"200019,200020\n".to_vec()];
    run("prompts", 5000, seeded(seeds), |b| {
        if let Ok(ps) = parse_prompts_file(&text(b), "p.txt") {
            if ps.is_empty() || ps.iter().any(|p| p.is_empty()) {
                return Err("an empty prompt passed".into());
            }
        }
        Ok(())
    });
}

/// The front↔stage protocol: damaged commands (framed, with payloads) and
/// events are errors, never panics, and whatever parses re-encodes to
/// bytes that parse back to the same message.
#[test]
fn protocol_lines_never_panic_and_round_trip() {
    use m3c_contract::protocol::{read_command, Event};
    let seeds = vec![
        b"add seq=3 max_new=16 ignore_eos=1 prompt=1,2,3 images=4 temperature=0.7 top_k=40 top_p=0.95 min_p=0 repetition_penalty=1.1 seed=7\n\0\n\xffacancel 2\n"
            .to_vec(),
        b"cancel 12".to_vec(),
        b"m3c-id 3 200019".to_vec(),
        b"m3c-end 3 cancelled".to_vec(),
        b"m3c-stat 1 42 0.250000".to_vec(),
        b"m3c-bad 4 the sequence is already live".to_vec(),
    ];
    run("protocol", 5000, seeded(seeds), |b| {
        // As a stream of framed commands: every one that parses re-encodes
        // to bytes that read back the same.
        let mut stream = b;
        while let Some(got) = read_command(&mut stream, 1 << 16) {
            let Ok(c) = got else { continue };
            let bytes = c.to_bytes();
            if read_command(&mut &bytes[..], 1 << 16) != Some(Ok(c.clone())) {
                return Err(format!("{:?} parsed, but its encoding {:?} does not read back", text(b), c.encode()));
            }
        }
        let line = text(b);
        if let Some(Ok(e)) = Event::parse(&line) {
            if Event::parse(&e.encode()) != Some(Ok(e.clone())) {
                return Err(format!("{line:?} parsed, but its encoding {:?} does not parse back", e.encode()));
            }
        }
        Ok(())
    });
}

/// A stage's command line: any argument list parses or is an error, and
/// what parses re-encodes to the same arguments.
#[test]
fn stage_arguments_never_panic_and_round_trip() {
    use m3c_contract::stage_args::StageArgs;
    let seeds = vec![
        b"--model\0m\0--prompt-ids\x001,2\0--max-new-tokens\x004\0--top-k\x0040\0--seq-sampling\x000:seed=3,top_p=0.5\0--stop\x000a0a"
            .to_vec(),
        b"--model\0m\0--serve\0--micro-batch\x0032\0--timeout-s\x002.5\0--cuda-graphs\0off\0--eos-ids\x00200020".to_vec(),
    ];
    run("stage arguments", 3000, seeded(seeds), |b| {
        let args: Vec<String> = text(b).split('\0').map(str::to_string).collect();
        if let Ok(a) = StageArgs::parse(&args) {
            if !matches!(a.prompts, m3c_contract::stage_args::Prompts::File { .. }) && StageArgs::parse(&a.to_args()).as_ref() != Ok(&a) {
                return Err(format!("{args:?} parsed, but {:?} does not parse back to it", a.to_args()));
            }
        }
        Ok(())
    });
}

#[test]
fn command_line_numbers_never_panic() {
    let seeds: Vec<Vec<u8>> = ["300", "2.5", "1e3", "16", "0", "1,2,3"].iter().map(|s| s.as_bytes().to_vec()).collect();
    run("numbers", 10000, seeded(seeds), |b| {
        let s = text(b);
        if let Ok(t) = parse_timeout_s(&s) {
            if !(t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_S) {
                return Err(format!("timeout {t} passed"));
            }
            // What the runtime does with it must not panic.
            let _ = Duration::from_secs_f64(t);
        }
        if let Ok(n) = parse_count(&s, "--micro-batch", true) {
            if n == 0 {
                return Err("0 passed as a positive count".into());
            }
        }
        if let Ok(ids) = parse_ids(&s, "--prompt-ids") {
            if ids.is_empty() {
                return Err("no ids passed".into());
            }
        }
        Ok(())
    });
}

/// Inputs that found bugs, kept: `PARSER.EXPECT.NAME.EXT` where EXPECT is
/// `ok` or `err`.
#[test]
fn the_corpus_of_hostile_inputs_still_parses_as_expected() {
    let dir = root().join("tests/fixtures/hostile-corpus");
    let cfg = tiny_config();
    let mut seen = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut parts = name.splitn(3, '.');
        let (parser, expect) = (parts.next().unwrap(), parts.next().unwrap());
        let bytes = std::fs::read(&path).unwrap();
        let t = text(&bytes);
        let ok = match parser {
            "plan" => m3c_compiler::plan::parse_plan(&path, &t, Some(&cfg)).is_ok(),
            "config" => m3c_compiler::family::parse_config(&path, &t).is_ok(),
            "header" => {
                let (h, len) = bytes.split_at(bytes.len() - 8);
                parse_header(h, u64::from_le_bytes(len.try_into().unwrap())).is_ok()
            }
            "index" => parse_index(&t).is_ok(),
            "prompts" => parse_prompts_file(&t, "p").is_ok(),
            "timeout" => parse_timeout_s(t.trim_end_matches('\n')).is_ok(),
            other => panic!("{name}: unknown parser {other}"),
        };
        assert_eq!(ok, expect == "ok", "{name}");
        seen += 1;
    }
    assert!(seen >= 10, "only {seen} corpus files");
}
