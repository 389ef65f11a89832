//! `m3c serve` on the tiny fixture (with its tokenizer), driven by OpenAI's
//! official Python client (tests/serve/client.py, in the .venv-serve that
//! scripts/setup.sh makes) and by curl, against real mpirun stages: the
//! same text as `m3c run`, 32 concurrent streams each as if alone, a client
//! that disconnects, a tool-call round trip, every error case, SIGTERM, and
//! a stage killed mid-stream.

use m3c_tests::{compile, fixture, m3c, m3c_bin, root, stderr, stdout};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub(crate) fn python() -> PathBuf {
    let p = root().join(".venv-serve/bin/python");
    assert!(p.is_file(), "{}: missing; run scripts/setup.sh (it installs the openai client for these tests)", p.display());
    p
}

/// A running `m3c serve`, killed (with its stages) when dropped.
pub(crate) struct Server {
    child: Child,
    base: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    pub(crate) fn start(out: &Path, model: &Path, extra: &[&str]) -> Server {
        let mut args = vec![out.to_str().unwrap(), "--model", model.to_str().unwrap()];
        args.extend_from_slice(extra);
        Server::start_with(&args, &[])
    }

    /// `m3c serve ARGS --port 0 --served-model-name tiny` with `env` set.
    fn start_with(args: &[&str], env: &[(&str, &Path)]) -> Server {
        let mut child = Command::new(m3c_bin())
            .arg("serve")
            .args(args)
            .args(["--port", "0", "--served-model-name", "tiny"])
            .envs(env.iter().map(|(k, v)| (*k, *v)))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("m3c serve starts");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let err = child.stderr.take().unwrap();
        let l = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Some(i) = line.find("http://127.0.0.1:") {
                    let port: String = line[i + 17..].chars().take_while(char::is_ascii_digit).collect();
                    let _ = tx.send(port);
                }
                l.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let port = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("m3c serve did not start:\n{}", log.lock().unwrap()));
        let s = Server { child, base: format!("http://127.0.0.1:{port}/v1"), log };
        let deadline = Instant::now() + Duration::from_secs(60);
        while s.health() != 200 {
            assert!(Instant::now() < deadline, "/health never answered 200:\n{}", s.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    pub(crate) fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The API's base URL (`http://127.0.0.1:PORT/v1`).
    pub(crate) fn base(&self) -> String {
        self.base.clone()
    }

    pub(crate) fn root(&self) -> String {
        self.base.trim_end_matches("/v1").to_string()
    }

    /// `GET /health`'s status (0: no answer).
    pub(crate) fn health(&self) -> u16 {
        let o = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", "5"])
            .arg(format!("{}/health", self.root()))
            .output();
        o.ok().and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok()).unwrap_or(0)
    }

    /// The client script's subcommand; its JSON answer (it must succeed).
    fn client(&self, args: &[&str]) -> Value {
        self.script("client.py", args)
    }

    /// A subcommand of `tests/serve/SCRIPT` against this server; its JSON
    /// answer (it must succeed).
    pub(crate) fn script(&self, script: &str, args: &[&str]) -> Value {
        let o =
            Command::new(python()).arg(root().join("tests/serve").join(script)).arg(&self.base).arg("tiny").args(args).output().unwrap();
        assert!(o.status.success(), "{script} {args:?} failed:\n{}\n{}\nserver log:\n{}", stdout(&o), stderr(&o), self.log());
        let out = stdout(&o);
        serde_json::from_str(out.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("{script} {args:?}: {e}: {out}"))
    }

    /// The client script's subcommand, started; with its output's reader.
    fn client_spawn(&self, args: &[&str]) -> (Child, BufReader<std::process::ChildStdout>) {
        let mut c = Command::new(python())
            .arg(root().join("tests/serve/client.py"))
            .arg(&self.base)
            .arg("tiny")
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(c.stdout.take().unwrap());
        (c, out)
    }

    /// The client's long streaming request, once its first text arrived.
    fn stream(&self) -> Stream {
        let (client, mut out) = self.client_spawn(&["stream"]);
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "streaming", "the stream did not start:\n{}", self.log());
        Stream { client, out }
    }

    /// Sends the server process `signal`.
    pub(crate) fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Waits for the server to exit; its status.
    pub(crate) fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "m3c serve did not exit within {limit:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A streaming request in flight (see [`Server::stream`]).
struct Stream {
    client: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Stream {
    /// How the stream ended, as the client reports it once it exits:
    /// its exit status and its last line (`finish`, `error`, `chars`).
    fn end(mut self) -> (std::process::ExitStatus, Value) {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.out, &mut rest).unwrap();
        let status = self.client.wait().unwrap();
        (status, serde_json::from_str(rest.lines().last().unwrap()).unwrap())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.client.kill();
        let _ = self.client.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The tiny fixture compiled at pp = 2 (host, f32: batch-invariant
/// logits), and the model.
fn compiled() -> (PathBuf, PathBuf) {
    crate::shared::tiny(2)
}

/// [`compiled`], copied into a folder of its own (the first value; the
/// copy goes with it): its stage processes are then this test's alone,
/// found by their path.
pub(crate) fn private_copy() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = crate::shared::copy("tiny-m3", 2, dir.path());
    (dir, out, fixture("tiny-m3"))
}

/// `m3c run`'s printed text for a prompt (its trailing newline dropped).
fn run_text(out: &Path, model: &Path, args: &[&str]) -> (String, String) {
    let mut all = vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap()];
    all.extend_from_slice(args);
    let r = m3c(&all);
    assert!(r.status.success(), "{}", stderr(&r));
    (stdout(&r).strip_suffix('\n').unwrap_or_default().to_string(), stderr(&r))
}

/// Errors a stage would find at start come first and alone: a model
/// folder whose config is not the one compiled, or whose safetensors is
/// truncated, is refused by `m3c run` and `m3c serve` before mpirun
/// starts (no stage's line, none of Open MPI's), naming the file; so are
/// GPU flags given for host stages.
#[test]
fn a_wrong_config_or_a_truncated_checkpoint_is_one_error_before_mpirun() {
    let (out, fixture_model) = compiled();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    std::fs::create_dir(&model).unwrap();
    for f in std::fs::read_dir(&fixture_model).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_file()) {
        std::fs::copy(&f, model.join(f.file_name().unwrap())).unwrap();
    }
    let refused = |says: &str| {
        for cmd in [
            &["run", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--prompt", "x"][..],
            &["serve", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--port", "0"],
        ] {
            let r = m3c(cmd);
            let err = stderr(&r);
            assert!(!r.status.success() && err.contains(says), "{cmd:?}: {err}");
            for noise in ["m3c stage", "mpirun", "MPI_ABORT", "prterun"] {
                assert!(!err.contains(noise), "{cmd:?}: `{noise}` before the error:\n{err}");
            }
        }
    };
    let weights = model.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() - 1000]).unwrap();
    refused("model.safetensors");
    std::fs::write(&weights, &bytes).unwrap();
    let config = model.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{text}\n")).unwrap();
    refused("is not the config these stages were compiled from");
    std::fs::write(&config, &text).unwrap();
    // Flags against the build: GPU modes asked of host stages.
    for flags in [&["--prefill-gemm", "vendor"][..], &["--graphs", "off"]] {
        for cmd in [
            &["run", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--prompt", "x"][..],
            &["serve", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--port", "0"],
        ] {
            let r = m3c(&[cmd, flags].concat());
            let err = stderr(&r);
            assert!(
                !r.status.success() && err.contains(&format!("{}: ", flags.join(" "))) && err.contains("compiled for the host"),
                "{cmd:?} {flags:?}: {err}"
            );
            assert!(!err.contains("m3c stage"), "{err}");
        }
    }
}

/// `m3c run` in a script: a default token limit, a JSON schema given
/// inline, and speculation said at the start and accounted at the end even
/// when no draft was taken.
#[test]
fn m3c_run_takes_an_inline_schema_a_default_limit_and_says_what_speculation_did() {
    let (out, model) = compiled();
    let (_, err) = run_text(&out, &model, &["--prompt", "Paris", "--ignore-eos"]);
    assert!(err.contains("decode 256 tokens"), "256 new tokens by default: {err}");
    let schema = r#"{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}"#;
    // Sampled, over several seeds: the schema holds whatever is drawn.
    for seed in ["1", "2", "3", "4", "5", "6"] {
        let args = ["--prompt", "Answer:", "--max-new-tokens", "40", "--temperature", "1", "--seed", seed, "--json-schema", schema];
        let (text, _) = run_text(&out, &model, &args);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text:?}"));
        assert!(v["ok"].is_boolean(), "seed {seed}: {v}");
    }
    let spec = r#"{"method": "ngram", "num_speculative_tokens": 2}"#;
    let (_, err) = run_text(&out, &model, &["--prompt", "Paris", "--max-new-tokens", "8", "--speculative-config", spec]);
    assert!(err.contains("m3c run: speculative decoding (ngram): up to 2 draft tokens") && err.contains("m3c spec: "), "{err}");
}

#[test]
fn completions_and_chat_give_the_text_m3c_run_gives() {
    let (out, model) = compiled();
    let prompt = "The capital of France is";
    let (want, _) = run_text(
        &out,
        &model,
        &["--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9", "--seed", "5", "--ignore-eos"],
    );
    let (want_stop, _) = run_text(
        &out,
        &model,
        &["--prompt", prompt, "--max-new-tokens", "24", "--temperature", "1", "--seed", "2", "--stop", "e", "--ignore-eos"],
    );
    let user = "What is the capital of France?";
    let (want_chat, log) = run_text(
        &out,
        &model,
        &["--chat", user, "--thinking", "disabled", "--max-new-tokens", "10", "--temperature", "0.7", "--seed", "9", "--ignore-eos"],
    );
    let chat_tokens: usize = log.split("prompt 0: ").nth(1).and_then(|s| s.split(' ').next()).and_then(|n| n.parse().ok()).unwrap();
    let s = Server::start(&out, &model, &[]);
    let got = s.client(&[
        "complete",
        prompt,
        r#"{"max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 5, "extra_body": {"ignore_eos": true}}"#,
    ]);
    assert_eq!(got["whole"], want, "completion vs m3c run");
    assert_eq!(got["streamed"], want, "streamed completion vs m3c run");
    assert_eq!((got["finish"].as_str(), got["completion_tokens"].as_u64()), (Some("length"), Some(12)));
    let got = s.client(&[
        "complete",
        prompt,
        r#"{"max_tokens": 24, "temperature": 1, "seed": 2, "stop": "e", "extra_body": {"ignore_eos": true}}"#,
    ]);
    assert_eq!((&got["whole"], &got["streamed"]), (&Value::from(want_stop.clone()), &Value::from(want_stop)), "a stop string");
    assert_eq!(got["finish"], "stop");
    let got = s.client(&[
        "chat",
        user,
        r#"{"max_tokens": 10, "temperature": 0.7, "seed": 9, "extra_body": {"ignore_eos": true, "chat_template_kwargs": {"thinking_mode": "disabled"}}}"#,
    ]);
    assert_eq!(got["prompt_tokens"].as_u64(), Some(chat_tokens as u64), "the chat template renders as m3c run's --chat");
    // With no tag in the text, the content is the text (as the parser reads it).
    assert!(!["<mm:think>", "</mm:think>", "<tool_call>"].iter().any(|t| want_chat.contains(t)), "pick another seed: {want_chat:?}");
    let want_chat = want_chat.trim_start_matches('\n');
    assert_eq!((got["whole"].as_str(), got["streamed"].as_str()), (Some(want_chat), Some(want_chat)), "chat vs m3c run --chat");
}

/// `n` choices (each its seed's), `stop_token_ids`,
/// `include_stop_str_in_output`, `skip_special_tokens`, the /tokenize,
/// /detokenize and /version routes, against `m3c run`'s ids; logprobs
/// against the log-softmax of its dumped logits; and the Responses API
/// against the chat route.
#[test]
fn choices_logprobs_stop_ids_token_routes_and_responses() {
    let dir = tempfile::tempdir().unwrap();
    let (out, model) = compiled();
    let dump = dir.path().join("d.safetensors");
    let (printed, _) = run_text(
        &out,
        &model,
        &["--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos", "--dump", dump.to_str().unwrap()],
    );
    let ids: Vec<u32> = printed.trim_start_matches("prompt 0: ").split(',').map(|t| t.trim().parse().unwrap()).collect();
    assert_eq!(ids.len(), 6, "{printed}");
    assert!(!ids[..2].contains(&ids[2]), "the stop id must first come third: {ids:?}");
    let s = Server::start(&out, &model, &[]);
    let got = s.client(&["choices", &serde_json::to_string(&ids).unwrap(), &ids[2].to_string()]);
    assert_eq!(got["version"], env!("CARGO_PKG_VERSION"));
    assert!(got["n_distinct"].as_u64() > Some(1), "three seeds gave one text: {got}");
    // Each token's logprob is the log-softmax of the logits it was drawn
    // from: the prompt's last row, then each decode row.
    let (shape, prefill) = m3c_tests::read_tensor_f32(&dump, "prefill_logits");
    let (_, decode) = m3c_tests::read_tensor_f32(&dump, "decode_logits");
    let vocab = shape[1];
    let rows: Vec<&[f32]> = std::iter::once(&prefill[prefill.len() - vocab..]).chain(decode.chunks(vocab)).take(6).collect();
    let lp = s.client(&["logprobs"]);
    let served: Vec<f64> = lp["logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(served.len(), 6, "{lp}");
    for (j, (row, got)) in rows.iter().zip(&served).enumerate() {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        let want = row[ids[j] as usize] as f64 - lse;
        assert!((got - want).abs() < 1e-5, "token {j}: served logprob {got}, log-softmax of the dumped logits {want}");
    }
    // m3c run -n: choice C of a prompt is the run with seed + C.
    let sampled = ["--prompt", "Hello", "--max-new-tokens", "5", "--temperature", "1", "--ignore-eos"];
    let (three, err) = run_text(&out, &model, &[&sampled[..], &["-n", "3", "--seed", "40"]].concat());
    let texts: Vec<&str> = three.split("### prompt 0 choice ").skip(1).map(|t| t.split_once('\n').unwrap().1.trim_end()).collect();
    assert_eq!(texts.len(), 3, "{three}");
    assert!(err.contains("prompt 0 choice 2: "), "{err}");
    for (c, text) in texts.iter().enumerate() {
        let (alone, _) = run_text(&out, &model, &[&sampled[..], &["--seed", &(40 + c).to_string()]].concat());
        assert_eq!(*text, alone, "choice {c} is the run with seed {}", 40 + c);
    }
    // Prompt logprobs (echo with logprobs, and prompt_logprobs): row p of
    // the prefill logits gives prompt token p + 1's, with its rank.
    let pl = s.client(&["prompt_logprobs"]);
    let prompt = [5usize, 6, 7];
    for p in 1..prompt.len() {
        let row = &prefill[(p - 1) * vocab..p * vocab];
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        let want = row[prompt[p]] as f64 - lse;
        let echo = pl["echo"][p].as_f64().unwrap();
        let (got, rank) = (pl["prompt"][p - 1][prompt[p].to_string()][0].as_f64().unwrap(), &pl["prompt"][p - 1][prompt[p].to_string()][1]);
        assert!((echo - want).abs() < 1e-5 && (got - want).abs() < 1e-5, "prompt token {p}: {echo} and {got}, log-softmax {want}");
        assert_eq!(rank.as_u64(), Some(1 + row.iter().filter(|&&v| v > row[prompt[p]]).count() as u64), "prompt token {p}'s rank");
    }
    assert!(pl["echo"][0].is_null(), "{pl}");
    // Presence and frequency penalties, as OpenAI defines them: m3c run's
    // greedy path under them is, step by step, the first maximum of the
    // dumped raw logits less `frequency × count + presence` for every token
    // generated so far. (Negative ones, which favour repeats, show on random
    // weights, whose greedy path seldom repeats within 8 tokens.)
    let pdump = dir.path().join("p.safetensors");
    let (printed, _) = run_text(
        &out,
        &model,
        &[
            "--prompt-ids",
            "5,6,7",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
            "--ignore-eos",
            "--presence-penalty",
            "-2",
            "--frequency-penalty",
            "-0.75",
            "--dump",
            pdump.to_str().unwrap(),
        ],
    );
    let penal: Vec<u32> = printed.trim_start_matches("prompt 0: ").split(',').map(|t| t.trim().parse().unwrap()).collect();
    let (_, prefill) = m3c_tests::read_tensor_f32(&pdump, "prefill_logits");
    let (_, decode) = m3c_tests::read_tensor_f32(&pdump, "decode_logits");
    let rows: Vec<&[f32]> = std::iter::once(&prefill[prefill.len() - vocab..]).chain(decode.chunks(vocab)).take(8).collect();
    assert_eq!((rows.len(), penal.len()), (8, 8), "{printed}");
    let mut counts: std::collections::HashMap<u32, u32> = Default::default();
    for (j, row) in rows.iter().enumerate() {
        let adjusted: Vec<f32> =
            (0..vocab as u32).map(|i| row[i as usize] + counts.get(&i).map_or(0.0, |&c| -(-0.75 * c as f32 + -2.0))).collect();
        let max = adjusted.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let first = adjusted.iter().position(|&v| v == max).unwrap() as u32;
        assert_eq!(penal[j], first, "step {j}: the penalised greedy token");
        *counts.entry(penal[j]).or_default() += 1;
    }
    assert_ne!(&penal[..6], &ids[..], "the penalties changed nothing");
    // The server gives the same tokens for the same request, and honours
    // logit_bias.
    s.client(&["penalties", &serde_json::to_string(&ids).unwrap(), &serde_json::to_string(&penal).unwrap()]);
    // At pp 1 the same requests give the same logprobs, bit for bit, and
    // the same penalised and forced tokens.
    let one = Server::start(&crate::shared::out("tiny-m3", 1), &model, &[]);
    assert_eq!(one.client(&["logprobs"]), lp, "logprobs at pp 1 and pp 2");
    assert_eq!(one.client(&["prompt_logprobs"]), pl, "prompt logprobs at pp 1 and pp 2");
    one.client(&["penalties", &serde_json::to_string(&ids).unwrap(), &serde_json::to_string(&penal).unwrap()]);
    // OpenAI's Responses API gives the chat route's text, whole and streamed.
    let r = s.client(&[
        "responses",
        "What is the capital of France?",
        r#"{"max_output_tokens": 8, "temperature": 0.7, "extra_body": {"seed": 9, "ignore_eos": true, "chat_template_kwargs": {"thinking_mode": "disabled"}}}"#,
    ]);
    assert_eq!(r["status"], "incomplete", "8 tokens, EOS ignored: {r}");
}

/// `[A-Z]{2}-[0-9]{3}`, checked by hand (the tests take no regex crate).
fn regex_like(t: &str) -> bool {
    let b = t.as_bytes();
    b.len() == 6 && b[..2].iter().all(u8::is_ascii_uppercase) && b[2] == b'-' && b[3..].iter().all(u8::is_ascii_digit)
}

/// Structured outputs: on random weights the grammar alone makes every
/// answer valid (a Pydantic model through `parse()`, a JSON object, a
/// regex, a choice, a Lark grammar, n constrained choices), at pp 2.
#[test]
fn structured_outputs_hold_on_random_weights() {
    let (out, model) = compiled();
    // m3c run takes the same grammar and sampling: the same text.
    let (run, _) = run_text(
        &out,
        &model,
        &[
            "--prompt",
            "Code:",
            "--max-new-tokens",
            "12",
            "--temperature",
            "1",
            "--seed",
            "2",
            "--regex",
            "[A-Z]{2}-[0-9]{3}",
            "--logprobs",
            "2",
        ],
    );
    let (text, lps) = run.split_once("\nlogprobs 0: ").unwrap_or_else(|| panic!("a logprobs line: {run:?}"));
    let lps: Value = serde_json::from_str(lps).unwrap();
    assert!(regex_like(text), "m3c run --regex: {text:?}");
    assert!(lps.as_array().is_some_and(|a| a.len() >= 6 && a.iter().all(|t| t["top"].as_array().map(Vec::len) == Some(2))), "{lps}");
    let s = Server::start(&out, &model, &[]);
    let served = s.client(&[
        "complete",
        "Code:",
        r#"{"max_tokens": 12, "temperature": 1, "seed": 2, "extra_body": {"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}}}"#,
    ]);
    assert_eq!((served["whole"].as_str(), served["streamed"].as_str()), (Some(text), Some(text)), "serve and m3c run");
    let got = s.client(&["structured"]);
    assert_eq!(got["pets"].as_array().map(Vec::len), Some(3), "{got}");
    assert_eq!(got["regex_ok"], true);
    // Forced tool calls: MiniMax-M3's call format, arguments valid under
    // each tool's schema.
    let got = s.client(&["forced_tools"]);
    assert!(got["calls"].as_u64() >= Some(4), "{got}");
}

/// Chat constraints under MiniMax-M3's three thinking modes (the real
/// template's `adaptive` default, `enabled`, `disabled`), through OpenAI's
/// client on random weights, with the model steered to reason without
/// end: json_schema and tool_choice required, whole and streamed; the
/// reasoning budget closes the reasoning and what comes back as content or
/// tool calls satisfies the constraint; a budget past max_tokens ends in
/// "length" with no content (`tests/it/agents.rs` samples the constraints
/// unsteered). `m3c run --chat` reads its constraint by the same rule.
#[test]
fn chat_constraints_hold_in_every_thinking_mode() {
    let (out, model) = compiled();
    let s = Server::start(&out, &model, &[]);
    for mode in ["adaptive", "enabled", "disabled"] {
        let got = s.client(&["chat_constraints", mode]);
        let outcomes = got["outcomes"].as_array().unwrap_or_else(|| panic!("{got}"));
        assert_eq!(outcomes.len(), 4, "{got}");
        for o in outcomes {
            eprintln!(
                "{mode:9} {:13} {:13} stream={:5} finish={:10} reasoning={:4} chars, content {}",
                o["constraint"].as_str().unwrap_or(""),
                o["steer"].as_str().unwrap_or(""),
                o["stream"],
                o["finish"].as_str().unwrap_or(""),
                o["reasoning_chars"],
                o["content"]
            );
        }
        if mode != "disabled" {
            assert_eq!(got["capped"]["finish"], "length", "{got}");
        }
    }
    // m3c run: the default (adaptive) chat, constrained; stdout is the
    // answer alone, one of the choices (so it pipes into `jq`), and the
    // reasoning before it went to stderr.
    let mut reasoned = 0;
    for seed in ["1", "2", "3", "5", "6", "7"] {
        let (text, err) = run_text(
            &out,
            &model,
            &["--chat", "Yes or no?", "--max-new-tokens", "40", "--temperature", "1", "--seed", seed, "--choice", "yes", "--choice", "no"],
        );
        assert!(text == "yes" || text == "no", "m3c run --chat --choice, seed {seed}: stdout {text:?}, stderr {err}");
        assert!(!err.contains("</mm:think>"), "the reasoning's tags are not shown: {err}");
        reasoned += usize::from(err.lines().any(|l| !l.is_empty() && !l.starts_with("m3c") && !l.starts_with("prompt 0:")));
    }
    assert!(reasoned > 0, "some seed reasoned first (on stderr)");
    // m3c run's budget: thinking enabled, at most 3 reasoning tokens, then
    // `</mm:think>` (id 496 of the fixture's tokenizer) and the choice.
    let (text, _) = run_text(
        &out,
        &model,
        &[
            "--chat",
            "Yes or no?",
            "--thinking",
            "enabled",
            "--thinking-token-budget",
            "3",
            "--max-new-tokens",
            "40",
            "--temperature",
            "1",
            "--seed",
            "4",
            "--choice",
            "yes",
            "--choice",
            "no",
            "--logprobs",
            "0",
        ],
    );
    let (shown, lps) = text.split_once("\nlogprobs 0: ").unwrap_or_else(|| panic!("a logprobs line: {text:?}"));
    let ids: Vec<u64> = serde_json::from_str::<Value>(lps).unwrap().as_array().unwrap().iter().filter_map(|t| t["id"].as_u64()).collect();
    let close = ids.iter().position(|&i| i == 496).unwrap_or_else(|| panic!("no </mm:think> in {ids:?}"));
    assert!(close <= 3, "the reasoning closed after {close} tokens: {ids:?}");
    assert!(shown == "yes" || shown == "no", "{shown:?}");
}

/// A media server (tests/serve/media_server.py) on `host`, in the network
/// namespace `ns` when given; killed when dropped.
struct MediaServer {
    child: Child,
    url: String,
}

impl MediaServer {
    fn start(ns: Option<&str>, host: &str, png: &Path) -> MediaServer {
        let script = m3c_tests::root().join("tests/serve/media_server.py");
        let mut cmd = match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "python3"]);
                c
            }
            None => Command::new("python3"),
        };
        let mut child = cmd
            // Its own port in a namespace of its own; any free one here.
            .args([script.to_str().unwrap(), host, if ns.is_some() { "8080" } else { "0" }, png.to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 runs the media server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(line.starts_with("http://"), "the media server did not start: {line:?}");
        MediaServer { child, url: line.trim().to_string() }
    }

    /// Requests it has served (its /count, which itself is not counted).
    fn count(&self) -> u64 {
        use std::io::{Read, Write};
        let addr = self.url.trim_start_matches("http://");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "GET /count HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        r.rsplit("\r\n\r\n").next().and_then(|b| b.trim().parse().ok()).unwrap_or_else(|| panic!("a count: {r:?}"))
    }
}

impl Drop for MediaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A network namespace that stands for a public web host: 198.51.100.2
/// (a documentation range: public to the fetch rules, routed nowhere),
/// wired to this namespace's 198.51.100.1 by a veth pair; removed when
/// dropped. `None` (and a SKIPPED line) without root or iproute2.
struct PublicHost {
    ns: String,
}

impl PublicHost {
    fn new() -> Option<PublicHost> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 || Command::new("ip").arg("-V").output().map(|o| !o.status.success()).unwrap_or(true) {
            eprintln!("SKIPPED: the public-host part needs root and iproute2 (network namespaces); CI has both");
            return None;
        }
        let pid = std::process::id();
        let h = PublicHost { ns: format!("m3cweb{pid}") };
        let root_end = format!("m3cw{pid}");
        for args in [
            vec!["netns", "add", &h.ns],
            vec!["link", "add", &root_end, "type", "veth", "peer", "name", "eth0", "netns", &h.ns],
            vec!["addr", "add", "198.51.100.1/24", "dev", &root_end],
            vec!["link", "set", &root_end, "up"],
            vec!["-n", &h.ns, "addr", "add", "198.51.100.2/24", "dev", "eth0"],
            vec!["-n", &h.ns, "link", "set", "eth0", "up"],
            vec!["-n", &h.ns, "link", "set", "lo", "up"],
        ] {
            let o = Command::new("ip").args(&args).output().unwrap();
            assert!(o.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        }
        Some(h)
    }
}

impl Drop for PublicHost {
    fn drop(&mut self) {
        // Deleting the namespace deletes its veth end, and with it ours.
        let _ = Command::new("ip").args(["netns", "pids", &self.ns]).output().map(|o| {
            for pid in String::from_utf8_lossy(&o.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        });
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

/// Image URLs never reach this machine's or its network's own services by
/// default: loopback, private, link-local and unspecified addresses are
/// refused before any connection (a server on 127.0.0.1 counts no
/// request), by address or by a name that resolves to one, and so is a
/// redirect from a public host to loopback; a public host is fetched.
/// `--allow-private-media-urls` and `--allowed-media-domains` (every hop
/// checked) work as documented. Every refusal is a 400 naming the part and
/// the rule.
#[test]
fn media_fetches_never_reach_private_addresses_unless_allowed() {
    let (out, model) = compiled();
    let png = fixture("vision/A_rgb_56x84_noresize.png");
    let local = MediaServer::start(None, "127.0.0.1", &png);
    let port = local.url.rsplit(':').next().unwrap().to_string();
    let img = |host: &str| format!("http://{host}:{port}/image.png");
    let fetch = |s: &Server, urls: &[String]| -> Vec<Value> {
        let mut args = vec!["media_fetch"];
        args.extend(urls.iter().map(String::as_str));
        s.client(&args).as_array().cloned().unwrap_or_default()
    };
    let refused = |r: &Value, rule: &str| {
        assert_eq!(r["status"], 400, "{r}");
        assert!(r["param"].as_str().is_some_and(|p| p.starts_with("messages[0].content[0]")), "the part is named: {r}");
        assert!(r["message"].as_str().is_some_and(|m| m.contains(rule)), "{rule}: {r}");
    };
    let public = PublicHost::new();
    let web = public.as_ref().map(|h| MediaServer::start(Some(&h.ns), "198.51.100.2", &png));

    let s = Server::start(&out, &model, &["--media-timeout-s", "5"]);
    let mut urls = vec![
        img("127.0.0.1"),
        img("localhost"),
        img("[::1]"),
        img("0.0.0.0"),
        "http://169.254.169.254/latest/meta-data/".to_string(),
        "http://10.255.255.1/image.png".to_string(),
        "http://[::ffff:127.0.0.1]:1/image.png".to_string(),
    ];
    if let Some(w) = &web {
        urls.push(format!("{}/image.png", w.url));
        urls.push(format!("{}/redirect?to={}", w.url, img("127.0.0.1")));
    }
    let got = fetch(&s, &urls);
    assert_eq!(got.len(), urls.len());
    refused(&got[0], "127.0.0.1 is a loopback address");
    refused(&got[0], "--allow-private-media-urls");
    refused(&got[1], "`localhost` resolves to");
    refused(&got[2], "loopback");
    refused(&got[3], "unspecified");
    refused(&got[4], "link-local");
    refused(&got[5], "private");
    refused(&got[6], "loopback");
    if let Some(w) = &web {
        assert_eq!(got[7]["status"], 200, "a public host is fetched: {}", got[7]);
        refused(&got[8], "redirect 1 of");
        refused(&got[8], "loopback");
        assert_eq!(w.count(), 2, "the public host served the image and the redirect");
    }
    assert_eq!(local.count(), 0, "nothing reached the server on 127.0.0.1");
    drop(s);

    // The operator's own network, on purpose.
    let s = Server::start(&out, &model, &["--allow-private-media-urls"]);
    let got = fetch(&s, &[img("127.0.0.1")]);
    assert_eq!(got[0]["status"], 200, "{}", got[0]);
    assert_eq!(local.count(), 1);
    drop(s);

    // A list of hosts: other hosts are refused, on every hop.
    let s = Server::start(&out, &model, &["--allowed-media-domains", "localhost", "--allow-private-media-urls"]);
    let got = fetch(&s, &[img("localhost"), img("127.0.0.1"), format!("http://localhost:{port}/redirect?to={}", img("127.0.0.1"))]);
    assert_eq!(got[0]["status"], 200, "{}", got[0]);
    refused(&got[1], "its host `127.0.0.1` is not among --allowed-media-domains (localhost)");
    refused(&got[2], "redirect 1 of");
    refused(&got[2], "not among --allowed-media-domains");
    assert_eq!(local.count(), 3, "the allowed image and the redirect; never the refused host");
}

/// Sixteen chats with a shared system prompt of well over eight blocks,
/// all at once, get the same texts and logprobs from a server with prefix
/// caching, one without, and one whose pool is too small for them all at
/// once (so sequences are preempted and resume); the hits and preemptions
/// are counted, and every block is given back afterwards (with caching,
/// blocks stay cached, held by no sequence).
#[test]
fn a_shared_system_prompt_is_computed_once_and_changes_nothing() {
    let (out, model) = compiled();
    let serve = |extra: &[&str]| Server::start(&out, &model, extra).client(&["shared_prefix", "16"]);
    let cold = serve(&["--no-enable-prefix-caching"]);
    let warm = serve(&[]);
    let tight = serve(&["--kv-blocks", "180"]);
    let prompt_tokens = cold["answers"][0]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens >= 500, "the shared system prompt should span well over 8 blocks: {prompt_tokens} tokens");
    assert_eq!(warm["answers"], cold["answers"], "prefix caching changed an answer");
    assert_eq!(tight["answers"], cold["answers"], "preemption changed an answer");
    let m = |v: &Value, k: &str| v["metrics"][k].as_f64().unwrap();
    assert_eq!(m(&cold, "prefix_cache_hits_total"), 0.0);
    assert!(m(&cold, "prefix_cache_queries_total") >= 16.0 * 500.0);
    // Each request after the first finds the system prompt's full blocks.
    assert!(m(&warm, "prefix_cache_hits_total") >= 15.0 * 480.0, "{}", warm["metrics"]);
    assert!(m(&warm, "kv_cache_blocks_cached") > 0.0, "{}", warm["metrics"]);
    assert!(m(&tight, "num_preemptions_total") > 0.0, "{}", tight["metrics"]);
    assert_eq!(m(&tight, "kv_cache_blocks_total"), 180.0);
    for v in [&cold, &warm, &tight] {
        assert_eq!(m(v, "cache_bytes_used"), 0.0, "{}", v["metrics"]);
    }
}

/// Speculative decoding changes no answer: sixteen streams at once
/// (greedy, sampled, penalised, stop strings, min_tokens, logprobs) get the
/// same texts, logprobs and finish reasons from a server without it, one
/// with n-gram drafts, and one with drafts and a pool small enough to
/// preempt, with prefix caching on; drafts are proposed and some accepted.
#[test]
fn speculative_streams_get_the_answers_of_plain_decoding() {
    let (out, model) = compiled();
    let spec = r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#;
    // Every decode step drafts (a fixed K): whether drafts pay on this
    // machine is the engine's tests' subject; here, that they change nothing.
    let fixed = [("M3C_SPEC_FIXED_K", Path::new("3"))];
    let start = |out: &Path, extra: &[&str]| {
        let mut args = vec![out.to_str().unwrap(), "--model", model.to_str().unwrap()];
        args.extend_from_slice(extra);
        Server::start_with(&args, &fixed)
    };
    let serve = |extra: &[&str]| start(&out, extra).client(&["spec_streams", "16", "32"]);
    let plain = serve(&[]);
    let drafted = serve(&["--speculative-config", spec]);
    let tight = serve(&["--speculative-config", spec, "--kv-blocks", "90"]);
    // EAGLE3: the stages with the draft head compiled in, preempting too.
    let e3 = crate::eagle3::config(3);
    let eagle =
        start(&crate::eagle3::out(2, &[]), &["--speculative-config", &e3, "--kv-blocks", "90"]).client(&["spec_streams", "16", "32"]);
    assert_eq!(drafted["answers"], plain["answers"], "speculation changed an answer");
    assert_eq!(tight["answers"], plain["answers"], "speculation under preemption changed an answer");
    assert_eq!(eagle["answers"], plain["answers"], "EAGLE3 changed an answer");
    let m = |v: &Value, k: &str| v["metrics"][k].as_f64().unwrap();
    assert_eq!(m(&plain, "spec_decode_num_drafts_total"), 0.0);
    for v in [&drafted, &tight, &eagle] {
        assert!(m(v, "spec_decode_num_drafts_total") > 0.0, "{}", v["metrics"]);
        let (proposed, accepted) = (m(v, "spec_decode_num_draft_tokens_total"), m(v, "spec_decode_num_accepted_tokens_total"));
        assert!(accepted > 0.0 && accepted < proposed, "some drafts accepted, some not: {}", v["metrics"]);
    }
    assert!(m(&tight, "num_preemptions_total") > 0.0, "{}", tight["metrics"]);
    assert!(m(&eagle, "num_preemptions_total") > 0.0, "{}", eagle["metrics"]);
    let finishes: std::collections::BTreeSet<String> =
        plain["answers"].as_array().unwrap().iter().map(|a| a["finish"].as_str().unwrap_or("").to_string()).collect();
    assert!(finishes.len() >= 2, "the streams should end in different ways: {finishes:?}");
}

#[test]
fn thirty_two_concurrent_streams_each_get_their_solo_result_whenever_they_arrive() {
    let (out, model) = compiled();
    // Prompts of about 12 tokens prefill in two chunks, beside the others' decodes.
    let s = Server::start(&out, &model, &["--prefill-chunk", "8"]);
    let got = s.client(&["concurrent", "32", "24"]);
    assert_eq!(got["identical"], 32);
}

#[test]
fn a_client_that_disconnects_frees_its_cache_and_tools_round_trip() {
    // One stage too: there a step runs to its end on the first stage itself,
    // and commands (the join, the cancel) must still get in between steps.
    let pp1 = crate::shared::out("tiny-m3", 1);
    let s = Server::start(&pp1, &fixture("tiny-m3"), &[]);
    assert_eq!(s.client(&["disconnect"])["freed"], true);
    drop(s);
    let (out, model) = compiled();
    // Pools sized by the stages from their free memory: every stage
    // allocates the least any offers, and /metrics learns the count.
    let s = Server::start(&out, &model, &["--kv-fraction", "0.02"]);
    let got = s.client(&["disconnect"]);
    assert_eq!(got["freed"], true);
    let log = s.log();
    let pools: Vec<&str> =
        log.lines().filter_map(|l| l.split_once("KV pool of ")).map(|(_, r)| r.split_whitespace().next().unwrap()).collect();
    assert!(pools.len() == 2 && pools[0] == pools[1] && pools[0] != "0", "{log}");
    let metrics = Command::new("curl").args(["-s", "-m", "5"]).arg(format!("{}/metrics", s.root())).output().unwrap();
    let total = format!("m3c:kv_cache_blocks_total {}", pools[0]);
    assert!(String::from_utf8_lossy(&metrics.stdout).lines().any(|l| l == total), "/metrics lacks `{total}`");
    let got = s.client(&["tools"]);
    assert!(got["round_trip"].as_u64() > got["with_tools"].as_u64(), "{got}");
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_stays_up() {
    let (out, model) = compiled();
    let s = Server::start(&out, &model, &[]);
    let got = s.client(&["errors"]);
    for (case, status) in [
        ("malformed", 400),
        ("not_object", 400),
        ("wrong_type", 400),
        ("unknown_model", 404),
        ("no_messages", 400),
        ("bad_role", 400),
        ("too_long", 400),
        ("n", 400),
        ("huge_max", 400),
        ("tiny_temperature", 400),
        ("top_p", 400),
        ("bad_id", 400),
        ("route", 404),
        ("get_on_post", 405),
    ] {
        assert_eq!(got[case].as_u64(), Some(status), "{case}: {got}");
    }
    for (case, param) in [
        ("bad_schema", "response_format"),
        ("bad_regex", "structured_outputs"),
        ("backend", "guided_decoding_backend"),
        ("tool_required", "tool_choice"),
        ("tool_named", "tool_choice"),
        ("tool_unenforceable", "tools"),
        ("unknown", "frobnicate"),
    ] {
        assert_eq!(got[format!("refused_{case}")], param, "{case}: {got}");
    }
    assert_eq!(got["after"], 2);
    drop(s);
    // --api-key, and a full queue.
    let s = Server::start(&out, &model, &["--api-key", "sesame"]);
    let got = s.client(&["auth", "sesame"]);
    assert_eq!((got["health"].as_u64(), got["wrong_key"].as_u64()), (Some(200), Some(401)));
    assert_eq!(got["models"], serde_json::json!(["tiny"]));
    drop(s);
    let s = Server::start(&out, &model, &["--max-batch", "1", "--max-queue", "0"]);
    let got = s.client(&["busy"]);
    assert_eq!(got["second"], 503);
    // Bad flags never start a server.
    let r = m3c(&["serve", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--kv-budget=0"]);
    assert!(!r.status.success() && stderr(&r).contains("--kv-budget"), "{}", stderr(&r));
}

#[test]
fn sigterm_lets_running_requests_finish_then_exits_0() {
    let (_dir, out, model) = private_copy();
    // Within the grace period the stream ends normally (a grace the
    // 3000-token stream fits even on a loaded machine: the default 30 s
    // did not, once, with four tests running beside it).
    let mut s = Server::start(&out, &model, &["--grace-s", "300"]);
    let stream = s.stream();
    s.signal(libc::SIGTERM);
    let (client, got) = stream.end();
    assert!(client.success());
    assert_eq!((got["finish"].as_str(), &got["error"]), (Some("length"), &Value::Null), "{got}");
    assert!(s.wait(Duration::from_secs(30)).success(), "{}", s.log());
    assert!(s.log().contains("draining: no new requests; 1 running") && s.log().contains("Ctrl-C again stops now"), "{}", s.log());
    // Past the grace period the stream ends with an error; still exit 0.
    let mut s = Server::start(&out, &model, &["--grace-s", "0.05"]);
    let stream = s.stream();
    s.signal(libc::SIGTERM);
    let (_, got) = stream.end();
    assert!(got["error"].as_str().is_some_and(|e| e.contains("shut down")), "{got}");
    assert!(s.wait(Duration::from_secs(30)).success(), "{}", s.log());
    // A second signal stops at once, and takes mpirun and the stages along.
    let mut s = Server::start(&out, &model, &[]);
    let _stream = s.stream();
    for _ in 0..2 {
        s.signal(libc::SIGTERM);
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = s.wait(Duration::from_secs(10));
    assert_eq!(std::os::unix::process::ExitStatusExt::into_raw(status) >> 8, 128 + libc::SIGTERM, "{}", s.log());
    let deadline = Instant::now() + Duration::from_secs(10);
    while pid_of(&out.join("stage-0")).is_some() || pid_of(&out.join("stage-1")).is_some() {
        assert!(Instant::now() < deadline, "stages outlived the server");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The pid of the process whose command line names `exe`.
pub(crate) fn pid_of(exe: &Path) -> Option<i32> {
    let want = exe.to_str()?;
    std::fs::read_dir("/proc").ok()?.filter_map(Result::ok).find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        (cmd.split(|&b| b == 0).next()? == want.as_bytes()).then_some(pid)
    })
}

#[test]
fn a_stage_killed_mid_stream_fails_the_request_and_the_server_exits_non_zero() {
    let (_dir, out, model) = private_copy();
    // Without restarts (--max-restarts 0): tests/it/healing.rs has them.
    let mut s = Server::start(&out, &model, &["--timeout-s", "5", "--max-restarts", "0"]);
    let stream = s.stream();
    let stage = pid_of(&out.join("stage-1")).expect("stage 1 runs");
    // SAFETY: kill(2) on a stage process of this test's own server.
    unsafe { libc::kill(stage, libc::SIGKILL) };
    let t0 = Instant::now();
    let mut saw_503 = false;
    while t0.elapsed() < Duration::from_secs(10) && s.child.try_wait().unwrap().is_none() {
        if s.health() == 503 {
            saw_503 = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(saw_503, "/health should answer 503 once a stage is lost:\n{}", s.log());
    let (_, got) = stream.end();
    assert!(got["error"].as_str().is_some_and(|e| e.contains("pipeline stopped")), "{got}");
    let status = s.wait(Duration::from_secs(15));
    assert!(!status.success(), "a lost stage must end the server with a failure");
    assert!(t0.elapsed() < Duration::from_secs(15), "it took {:?}", t0.elapsed());
    assert!(s.log().contains("pipeline stopped"), "{}", s.log());
}

#[test]
fn a_request_that_meets_non_finite_logits_fails_alone() {
    let dir = tempfile::tempdir().unwrap();
    // Inf in the embedding rows of ids 0-15: prompts with them go non-finite.
    let model = crate::hostile::model_copy(dir.path(), |h, data| {
        let (a, b) = crate::hostile::range(h, "language_model.model.embed_tokens.weight");
        for c in data[a..b.min(a + 4096)].chunks_exact_mut(4) {
            c.copy_from_slice(&[0x80, 0x7F, 0x80, 0x7F]);
        }
    });
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("tiny-m3").join(f), model.join(f)).unwrap();
    }
    let out = compile(&model, 2, &dir.path().join("c"), &[]);
    let s = Server::start(&out, &model, &[]);
    let got = s.client(&["poison"]);
    assert_eq!((got["failed"].as_u64(), got["after"].as_u64(), got["health"].as_u64()), (Some(503), Some(3), Some(200)), "{got}");
    assert_eq!(got["failed_total"].as_f64(), Some(1.0));
}

/// Chat images as OpenAI's client sends them: a data: URI, an http URL on a
/// local server and a file:// path under --allowed-local-media-path give
/// the same answer, whose prompt is `m3c run --chat --image`'s; the image
/// request and text-only requests share micro-batches and each gets its
/// solo answer; bad images (corrupt, not base64, 404, too slow, too big,
/// outside the allowed folder, an unknown scheme, in an assistant turn) are
/// 400s naming the content part.
#[test]
fn chat_images_by_data_uri_http_and_file_give_the_same_answer() {
    let dir = tempfile::tempdir().unwrap();
    let (out, model) = compiled();
    let media = dir.path().join("media");
    std::fs::create_dir(&media).unwrap();
    let png = media.join("a.png");
    std::fs::copy(fixture("vision/A_rgb_56x84_noresize.png"), &png).unwrap();
    let outside = dir.path().join("outside.png");
    std::fs::copy(&png, &outside).unwrap();
    let user = "What is in this picture?";
    let (want, log) = run_text(
        &out,
        &model,
        &[
            "--chat",
            user,
            "--thinking",
            "disabled",
            "--image",
            png.to_str().unwrap(),
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
            "--ignore-eos",
        ],
    );
    let tokens: u64 = log.split("prompt 0: ").nth(1).and_then(|s| s.split(' ').next()).and_then(|n| n.parse().ok()).unwrap();
    let s = Server::start(
        &out,
        &model,
        &[
            "--allowed-local-media-path",
            media.to_str().unwrap(),
            "--media-timeout-s",
            "2",
            "--max-image-mb",
            "1",
            "--allow-private-media-urls",
        ],
    );
    let got = s.client(&["images", png.to_str().unwrap(), png.to_str().unwrap(), outside.to_str().unwrap()]);
    assert_eq!(got["prompt_tokens"].as_u64(), Some(tokens), "the image chat's prompt is m3c run's");
    // With no tag in the text, the content is the text (as the parser reads it).
    assert!(!["<mm:think>", "</mm:think>", "<tool_call>"].iter().any(|t| want.contains(t)), "pick another image: {want:?}");
    assert_eq!(got["text"].as_str(), Some(want.trim_start_matches('\n')), "the image chat's answer is m3c run's");
}

/// A video chat through OpenAI's client at pp 1 and 3, at pp 3 with the
/// vision tower on the last stage, and at pp 2 with two encoder ranks of
/// their own: the answer, its prompt and its logprobs are `m3c run
/// --video`'s and the same at all four;
/// the same video again (by file:// this time) hits the prefix cache, video
/// rows included, and the encoder cache, and changes nothing; half a video
/// is a 400 naming its part.
#[test]
fn a_video_chat_answers_as_m3c_run_at_pp_1_and_3_and_hits_the_prefix_cache() {
    let dir = tempfile::tempdir().unwrap();
    let media = dir.path().join("media");
    std::fs::create_dir(&media).unwrap();
    let mp4 = media.join("clip.mp4");
    std::fs::copy(fixture("video/clip.mp4"), &mp4).unwrap();
    let mut answers = Vec::new();
    let model = fixture("tiny-m3");
    let builds = [
        ("1", crate::shared::tiny(1).0),
        ("3", crate::shared::tiny(3).0),
        ("3 (tower on stage 2)", crate::shared::tiny_tower_on_last()),
        ("2 (two encoder ranks)", crate::shared::tiny_encoder_ranks()),
    ];
    // `m3c run --video`'s answer, once: every build below must give it.
    let run_args = ["--chat", "What moves?", "--thinking", "disabled", "--video", mp4.to_str().unwrap()];
    let greedy = ["--max-new-tokens", "8", "--temperature", "0", "--ignore-eos"];
    let (want, log) = run_text(&builds[0].1, &model, &[&run_args[..], &greedy[..]].concat());
    let tokens: u64 = log.split("prompt 0: ").nth(1).and_then(|s| s.split(' ').next()).and_then(|n| n.parse().ok()).unwrap();
    for (pp, out) in builds {
        let s = Server::start(&out, &model, &["--allowed-local-media-path", media.to_str().unwrap()]);
        let got = s.client(&["video", mp4.to_str().unwrap(), mp4.to_str().unwrap()]);
        assert_eq!(got["prompt_tokens"].as_u64(), Some(tokens), "pp={pp}: the video chat's prompt is m3c run's");
        assert_eq!(got["text"].as_str(), Some(want.trim_start_matches('\n')), "pp={pp}: the video chat's answer is m3c run's");
        assert_eq!(got["cold_hits"].as_f64(), Some(0.0), "pp={pp}: a fresh server has nothing cached");
        let warm = got["warm_hits"].as_f64().unwrap();
        assert!(warm >= (tokens - 4) as f64, "pp={pp}: the second asking found only {warm} of {tokens} prompt tokens cached");
        assert_eq!(got["broken_status"].as_u64(), Some(400), "pp={pp}: {got}");
        assert!(got["broken_message"].as_str().unwrap().contains("messages[0].content[0].video_url"), "{got}");
        // The video's two chunks: encoded once, then found by content.
        let enc = &got["encoder"];
        assert_eq!((enc["cache_misses_total"].as_f64(), enc["cache_hits_total"].as_f64()), (Some(2.0), Some(2.0)), "pp={pp}: {enc}");
        assert_eq!((enc["cache_entries"].as_f64(), enc["grids_total"].as_f64()), (Some(2.0), Some(2.0)), "pp={pp}: {enc}");
        answers.push((got["text"].clone(), got["logprobs"].clone()));
    }
    assert_eq!(answers[0], answers[1], "pp=3's answer and logprobs differ from pp=1's");
    assert_eq!(answers[0], answers[2], "the tower on stage 2 changed the answer or logprobs");
    assert_eq!(answers[0], answers[3], "encoder ranks of their own changed the answer or logprobs");
}

/// Each stage's `m3c:stage_busy_seconds_total` from `/metrics`.
fn busy_seconds(s: &Server) -> Vec<f64> {
    let o = Command::new("curl").args(["-s", "-m", "5"]).arg(format!("{}/metrics", s.root())).output().unwrap();
    stdout(&o)
        .lines()
        .filter(|l| l.starts_with("m3c:stage_busy_seconds_total{"))
        .map(|l| l.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap())
        .collect()
}

/// [`busy_seconds`] just after the first stage's next report (they come
/// once a second), and when: a reading that is not a second stale.
fn fresh_busy_seconds(s: &Server) -> (Vec<f64>, Instant) {
    let old = busy_seconds(s);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = busy_seconds(s);
        if now != old || Instant::now() > deadline {
            return (now, Instant::now());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `POST /debug/trace` with `body`: (status, answer).
fn post_trace(s: &Server, body: &str) -> (u16, Value) {
    post_raw(s, "/debug/trace", body)
}

/// `POST {root}{path}` with `body`: (status, answer).
fn post_raw(s: &Server, path: &str, body: &str) -> (u16, Value) {
    let o = Command::new("curl")
        .args(["-s", "-m", "120", "-w", "\n%{http_code}", "-H", "content-type: application/json", "-d", body])
        .arg(format!("{}{path}", s.root()))
        .output()
        .unwrap();
    let text = stdout(&o);
    let (json, code) = text.rsplit_once('\n').unwrap();
    (code.trim().parse().unwrap(), serde_json::from_str(json).unwrap_or(Value::Null))
}

/// A serving pipeline's timeline: `POST /debug/trace {"seconds": N}`
/// writes every stage's steps over the next N seconds under load into
/// `--trace-dir`, and each stage's busy share there agrees with
/// `/metrics`' busy seconds over the same window within 5 points (plus
/// the longest step at each edge: /metrics counts a step when it ends). Bad
/// windows are 400s; a server without `--trace-dir` answers 404.
#[test]
fn a_serving_window_is_traced_and_its_busy_share_agrees_with_metrics() {
    let (out, model) = compiled();
    let trace_dir = tempfile::tempdir().unwrap();
    let traces = trace_dir.path();
    let s = Server::start(&out, &model, &["--trace-dir", traces.to_str().unwrap(), "--max-batch", "16"]);
    for bad in [r#"{"seconds": 0}"#, r#"{"seconds": 1e9}"#, r#"{"secs": 1}"#, "nope"] {
        assert_eq!(post_trace(&s, bad).0, 400, "{bad}");
    }
    let (mut load, _) = s.client_spawn(&["load", "16", "3000"]);
    std::thread::sleep(Duration::from_millis(2500));
    let (b0, t0) = fresh_busy_seconds(&s);
    let (code, got) = post_trace(&s, r#"{"seconds": 4}"#);
    let (b1, t1) = fresh_busy_seconds(&s);
    let _ = load.kill();
    let _ = load.wait();
    assert_eq!(code, 200, "{got}\n{}", s.log());
    let file = PathBuf::from(got["trace"].as_str().unwrap());
    assert!(file.starts_with(traces) && got["events"].as_u64().unwrap() > 100, "{got}");
    let t = m3c_front::trace::Timeline::parse(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(t.stages.len(), 2, "one track per stage");
    let (a, b) = t.window();
    assert!(b - a > 3.0e6, "the window covers the N seconds: {} us", b - a);
    let span = t1.duration_since(t0).as_secs_f64();
    for (k, (busy, _)) in t.busy() {
        let traced = busy / (b - a);
        let metered = (b1[k] - b0[k]) / span;
        // /metrics counts a step when it ends, so each edge of its window
        // can be off by up to the longest step; and the metered window also
        // holds the request's own round trip around the traced one (seconds
        // on a loaded machine), whose busy share may be anything.
        let longest = t.stages[&k].iter().filter(|s| s.name != "wait").map(|s| s.dur).fold(0.0, f64::max) / 1e6;
        let outside = (span - (b - a) / 1e6).max(0.0);
        let allowed = 0.05 + (2.0 * longest + outside) / span;
        eprintln!(
            "stage {k}: busy {:.1}% in the trace, {:.1}% by /metrics (allowed {:.1} points)",
            traced * 100.0,
            metered * 100.0,
            allowed * 100.0
        );
        assert!((traced - metered).abs() <= allowed, "stage {k}: {traced} traced vs {metered} metered, {allowed} allowed");
    }
    drop(s);
    // Without --trace-dir there is no such window.
    let plain = Server::start(&out, &model, &[]);
    assert_eq!(post_trace(&plain, r#"{"seconds": 1}"#).0, 404);
}

/// `POST {root}{path}` with a JSON body: (status, answer).
fn post_json(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    post_raw(s, path, &body.to_string())
}

/// vLLM's MiniMax-M3 recipe, as users type it, adjusted only for the
/// fixture's path, pp and block size: `m3c serve MODEL_DIR` compiles on
/// first start into the build cache and reuses the build after; every flag
/// has vLLM's meaning or is refused by name.
#[test]
fn the_vllm_recipe_command_line_serves_a_model_folder() {
    let cache = tempfile::tempdir().unwrap();
    let env = [("M3C_CACHE_DIR", cache.path())];
    let model = fixture("tiny-m3");
    let m = model.to_str().unwrap();
    let recipe = [
        m,
        "--pipeline-parallel-size",
        "2",
        "--block-size",
        "4",
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.80",
        "--no-enable-prefix-caching",
        "--mm-encoder-tp-mode",
        "data",
        "--tool-call-parser",
        "minimax_m3",
        "--reasoning-parser",
        "minimax_m3",
        "--enable-auto-tool-choice",
        "--kv-cache-dtype",
        "fp8",
        "--default-chat-template-kwargs",
        r#"{"thinking_mode": "enabled"}"#,
    ];
    let args: Vec<&str> = recipe.to_vec();
    let first = Server::start_with(&args, &env);
    assert!(first.log().contains("is not built yet; compiling it into"), "{}", first.log());
    assert!(first.log().contains("KV pool: 0.8 of each stage's free memory"), "{}", first.log());
    for said in ["--mm-encoder-tp-mode data: m3c does not shard", "--enable-auto-tool-choice:"] {
        assert!(first.log().contains(said), "`{said}` not said:\n{}", first.log());
    }
    // The default kwargs under a request's own: thinking enabled unless the request says otherwise.
    let chat = |kwargs: Option<Value>| {
        let mut b = serde_json::json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]});
        if let Some(k) = kwargs {
            b["chat_template_kwargs"] = k;
        }
        let (code, v) = post_json(&first, "/tokenize", &b);
        assert_eq!(code, 200, "{v}");
        v["tokens"].clone()
    };
    let (by_default, enabled) = (chat(None), chat(Some(serde_json::json!({"thinking_mode": "enabled"}))));
    assert_eq!(by_default, enabled);
    assert_ne!(by_default, chat(Some(serde_json::json!({"thinking_mode": "disabled"}))));
    // vLLM's `continue_final_message`: the prompt ends with the final
    // assistant message's text (no end of turn, no new turn), and the
    // render route a router calls gives the same ids.
    let partial = serde_json::json!({"model": "tiny", "continue_final_message": true, "add_generation_prompt": false,
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The sky is"}]});
    let (code, v) = post_json(&first, "/tokenize", &partial);
    assert_eq!(code, 200, "{v}");
    let (code, text) = post_json(&first, "/detokenize", &serde_json::json!({"tokens": v["tokens"]}));
    assert!(code == 200 && text["prompt"].as_str().is_some_and(|t| t.ends_with("The sky is")), "{text}");
    let (code, r) = post_json(&first, "/v1/chat/completions/render", &partial);
    assert_eq!((code, &r["token_ids"]), (200, &v["tokens"]), "{r}");
    // `include_reasoning: false` (vLLM): the same answer without its reasoning.
    let reasoned = |include: bool| {
        let b = serde_json::json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24,
            "temperature": 0, "include_reasoning": include});
        let (code, v) = post_json(&first, "/v1/chat/completions", &b);
        assert_eq!(code, 200, "{v}");
        v["choices"][0]["message"].clone()
    };
    let (with, without) = (reasoned(true), reasoned(false));
    assert!(with["reasoning"].as_str().is_some_and(|r| !r.is_empty()), "thinking is enabled: {with}");
    assert!(without.get("reasoning").is_none() && without["content"] == with["content"], "{with} / {without}");
    // An answer, and --max-model-len bounds a request.
    let ask = |max_tokens: u64| {
        let b = serde_json::json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens, "temperature": 0});
        post_json(&first, "/v1/chat/completions", &b)
    };
    let (code, v) = ask(8);
    assert_eq!(code, 200, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");
    let (code, v) = ask(600);
    assert_eq!(code, 400, "a request past --max-model-len 1024 (the template's prompt is about 470 tokens): {v}");
    drop(first);
    // The second start reuses the build.
    let again = Server::start_with(&args, &env);
    assert!(again.log().contains("is current (compile id"), "{}", again.log());
    drop(again);
    // fp8 caches hold twice bf16's blocks at one budget (and four times f32's).
    let blocks = |kv: &str| {
        let s = Server::start_with(&[m, "--pp", "2", "--kv-cache-dtype", kv, "--kv-budget", "0.002"], &env);
        let line = s.log().lines().find(|l| l.contains("KV pool: ")).unwrap_or_default().to_string();
        let n: usize = line.split("KV pool: ").nth(1).and_then(|r| r.split(' ').next()?.parse().ok()).unwrap_or(0);
        assert!(n > 0, "{line}");
        n
    };
    let (f32_blocks, bf16_blocks, fp8_blocks) = (blocks("auto"), blocks("bf16"), blocks("fp8"));
    assert!(fp8_blocks as f64 >= 1.9 * bf16_blocks as f64 && bf16_blocks >= 2 * f32_blocks - 1, "{f32_blocks} {bf16_blocks} {fp8_blocks}");
    // A port in use is said before compiling too.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let empty = tempfile::tempdir().unwrap();
    let r = Command::new(m3c_bin()).arg("serve").args(&args).args(["--port", &port]).env("M3C_CACHE_DIR", empty.path()).output().unwrap();
    assert!(!r.status.success() && stderr(&r).contains("cannot listen on") && !stderr(&r).contains("compiling"), "{}", stderr(&r));
    // Flags m3c cannot honour are errors that name them.
    for (flag, value, says) in [
        ("--block-size", "16", "--block-size 16: "),
        ("--tool-call-parser", "hermes", "--tool-call-parser hermes: m3c's parsers are"),
        ("--max-model-len", "99999999", "--max-model-len 99999999: "),
    ] {
        let mut bad: Vec<&str> = args.clone();
        let at = bad.iter().position(|&a| a == flag).unwrap();
        bad[at + 1] = value;
        // Said before any first-start compile (an empty build cache here).
        let empty = tempfile::tempdir().unwrap();
        let r = Command::new(m3c_bin()).arg("serve").args(&bad).args(["--port", "0"]).env("M3C_CACHE_DIR", empty.path()).output().unwrap();
        assert!(!r.status.success() && stderr(&r).contains(says) && !stderr(&r).contains("compiling"), "{flag} {value}: {}", stderr(&r));
    }
}

/// vLLM's other `serve` flags: taken with their meaning (prefix caching
/// on, the block count, the running sequences, `--dtype auto`, one tensor
/// shard, `--seed`, the logging switches), or refused with the m3c flag
/// that does what the user wants. A request may leave `model` out, or
/// name any served name; and a stats line appears while requests run.
#[test]
fn vllm_s_serve_flags_have_their_meaning_or_name_m3c_s() {
    let (out, model) = compiled();
    let extra = [
        "--enable-prefix-caching",
        "--num-gpu-blocks-override",
        "96",
        "--max-num-seqs",
        "3",
        "--dtype",
        "auto",
        "--tensor-parallel-size",
        "1",
        "--seed",
        "7",
        "--disable-log-requests",
        "--uvicorn-log-level",
        "info",
        "--served-model-name",
        "MiniMax-M3",
    ];
    let mut args = vec![out.to_str().unwrap(), "--model", model.to_str().unwrap()];
    args.extend_from_slice(&extra);
    let start = |args: &[&str]| Server::start_with(args, &[("M3C_STATS_INTERVAL_S", Path::new("0.5"))]);
    let s = start(&args);
    let log = s.log();
    assert!(log.contains("KV pool: 96 blocks") && log.contains("up to 3 running"), "{log}");
    // No `model`, the first served name, and the test's own name all reach it.
    let sample = |s: &Server, body: Value| {
        let (code, v) = post_json(s, "/v1/completions", &body);
        assert_eq!(code, 200, "{body}: {v}");
        v["choices"][0]["text"].as_str().unwrap_or_default().to_string()
    };
    let unseeded = serde_json::json!({"prompt": "Paris is", "max_tokens": 12, "temperature": 1.0});
    let first = [sample(&s, unseeded.clone()), sample(&s, unseeded.clone())];
    assert_ne!(first[0], first[1], "two unseeded requests draw differently");
    for name in ["MiniMax-M3", "tiny"] {
        sample(&s, serde_json::json!({"model": name, "prompt": "x", "max_tokens": 1}));
    }
    let (code, v) = post_json(&s, "/v1/completions", &serde_json::json!({"model": "gpt-4", "prompt": "x"}));
    assert!(code == 404 && v.to_string().contains("`MiniMax-M3` or `tiny`"), "{code} {v}");
    let listed = Command::new("curl").args(["-s", "-m", "10"]).arg(format!("{}/models", s.base)).output().unwrap();
    let listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
    let ids: Vec<&str> = listed["data"].as_array().unwrap().iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, ["MiniMax-M3", "tiny"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !s.log().contains("m3c serve: prompt throughput") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let stats = s.log().lines().find(|l| l.starts_with("m3c serve: prompt throughput")).map(str::to_string);
    let stats = stats.unwrap_or_else(|| panic!("no stats line:\n{}", s.log()));
    assert!(
        stats.contains("generation throughput") && stats.contains("KV cache usage") && stats.contains("prefix cache hit rate"),
        "{stats}"
    );
    drop(s);
    // --seed: a restarted server draws the same for the same unseeded requests.
    let again = start(&args);
    assert_eq!([sample(&again, unseeded.clone()), sample(&again, unseeded)], first);
    drop(again);
    // --disable-log-stats: no stats line.
    args.push("--disable-log-stats");
    let quiet = start(&args);
    sample(&quiet, serde_json::json!({"prompt": "x", "max_tokens": 4}));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!quiet.log().contains("prompt throughput"), "{}", quiet.log());
    drop(quiet);
    // What m3c does otherwise, named.
    let base = [out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--port", "0"];
    for (flags, says) in [
        (&["--tensor-parallel-size", "2"][..], "give --pipeline-parallel-size 2"),
        (&["--max-num-batched-tokens", "8192"][..], "--prefill-chunk TOKENS"),
        (&["--dtype", "float16"][..], "--dtype float16: m3c stores activations in float32 or bfloat16"),
    ] {
        let r = Command::new(m3c_bin()).arg("serve").args(base).args(flags).output().unwrap();
        assert!(!r.status.success() && stderr(&r).contains(says), "{flags:?}: {}", stderr(&r));
    }
}

/// Anthropic's Messages API through Anthropic's own Python client: the
/// chat route's text for the same conversation and seed, whole and
/// streamed; stop sequences, thinking blocks, a forced tool use valid
/// against its schema and its result sent back, an image turn and its
/// token count; errors in Anthropic's shape (`tests/serve/anthropic_client.py`).
#[test]
fn anthropic_s_client_gets_the_chat_route_s_answers_from_v1_messages() {
    let (out, model) = compiled();
    let s = Server::start(&out, &model, &[]);
    let png = fixture("vision/A_rgb_56x84_noresize.png");
    let o = Command::new(python())
        .arg(root().join("tests/serve/anthropic_client.py"))
        .args([s.base.as_str(), "tiny", png.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}\n{}\nserver log:\n{}", stdout(&o), stderr(&o), s.log());
    let got: Value = serde_json::from_str(stdout(&o).lines().last().unwrap_or("")).unwrap();
    assert!(!got["text"].as_str().unwrap_or("").is_empty(), "{got}");
    assert!(got["image_input_tokens"].as_u64().unwrap() > 0, "{got}");
    assert!(got["tool_input"]["city"].is_string(), "{got}");
}
