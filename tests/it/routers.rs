//! m3c behind the routers vLLM's and SGLang's users put in front of their
//! replicas: `vllm-router` (round robin, cache-aware, power of two) and
//! SGLang's gateway (`smg`, cache-aware), the real ones from PyPI (in the
//! `.venv-router` that scripts/setup.sh makes), before two m3c replicas of
//! pp 2. Every chat and completion sent through them with OpenAI's client
//! (tests/serve/router_client.py), whole and streamed, greedy and seeded,
//! is answered, with the text one replica gives alone: the fields routers
//! add to each body (`no_stop_trim`, `separate_reasoning`, ...) are taken
//! with their meaning, the cache-aware routers get each replica's token ids
//! from its render endpoints, and the load and metrics they read are there.

use crate::serve::Server;
use m3c_tests::{fixture, root};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn venv(bin: &str) -> PathBuf {
    root().join(".venv-router/bin").join(bin)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A router process, killed when dropped.
struct Router {
    child: Child,
    port: u16,
    metrics_port: u16,
    log: PathBuf,
}

impl Router {
    /// `program ARGS --port P --prometheus-port Q`, up once its `/v1/models` answers.
    fn start(program: &str, args: &[&str], dir: &std::path::Path) -> Router {
        let (port, metrics_port) = (free_port(), free_port());
        let log = dir.join(format!("{program}-{port}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(venv(program))
            .args(args)
            .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--prometheus-port", &metrics_port.to_string()])
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("{program} from .venv-router starts (scripts/setup.sh installs it): {e}"));
        let mut r = Router { child, port, metrics_port, log };
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let o = Command::new("curl").args(["-sf", "-m", "2", &format!("http://127.0.0.1:{port}/v1/models")]).output().unwrap();
            if o.status.success() {
                return r;
            }
            let exited = r.child.try_wait().unwrap();
            assert!(exited.is_none() && Instant::now() < deadline, "{program} did not come up ({exited:?}):\n{}", r.log());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn metrics(&self) -> String {
        let url = format!("http://127.0.0.1:{}/metrics", self.metrics_port);
        String::from_utf8_lossy(&Command::new("curl").args(["-s", "-m", "5", &url]).output().unwrap().stdout).into_owned()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The workload's answers through `base` (a router's or a replica's /v1).
pub(crate) fn workload(base: &str) -> String {
    let o = Command::new(root().join(".venv-serve/bin/python"))
        .arg(root().join("tests/serve/router_client.py"))
        .args([base, "tiny"])
        .output()
        .unwrap();
    assert!(o.status.success(), "the workload through {base} failed:\n{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A counter's value in Prometheus text: the sum over the series of
/// `name` whose labels contain `with`.
pub(crate) fn counter(text: &str, name: &str, with: &str) -> f64 {
    text.lines().filter(|l| l.starts_with(name) && l.contains(with)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

#[test]
fn vllm_router_and_sglang_gateway_serve_m3c_replicas_as_one_replica_would() {
    let (out, model) = (crate::shared::out("tiny-m3", 2), fixture("tiny-m3"));
    let (a, b) = (Server::start(&out, &model, &[]), Server::start(&out, &model, &[]));
    let want = workload(&format!("{}/v1", a.root()));
    let dir = tempfile::tempdir().unwrap();
    let workers = [a.root(), b.root()];
    let workers: Vec<&str> = workers.iter().map(String::as_str).collect();
    for policy in ["round_robin", "cache_aware", "power_of_two"] {
        let args = [&["--worker-urls"][..], &workers, &["--policy", policy]].concat();
        let r = Router::start("vllm-router", &args, dir.path());
        let got = workload(&format!("http://127.0.0.1:{}/v1", r.port));
        assert_eq!(got, want, "vllm-router --policy {policy}: the texts differ from one replica's\n{}", r.log());
        if policy == "cache_aware" {
            // Each request was rendered on every replica: the routing had
            // token ids, not a fallback.
            let m = r.metrics();
            assert!(counter(&m, "vllm_router_kv_routing_inputs_total", "result=\"render\"") >= 12.0, "{m}");
            assert!(counter(&m, "vllm_router_prefix_routing_decisions_total", "outcome=\"prefix_hit\"") >= 1.0, "{m}");
        }
    }
    let args = [&["launch", "--worker-urls"][..], &workers, &["--policy", "cache_aware"]].concat();
    let r = Router::start("smg", &args, dir.path());
    let got = workload(&format!("http://127.0.0.1:{}/v1", r.port));
    assert_eq!(got, want, "smg --policy cache_aware: the texts differ from one replica's\n{}", r.log());
    drop(r);
    // The series routers and autoscalers read, under vLLM's names.
    let m =
        String::from_utf8_lossy(&Command::new("curl").args(["-s", &format!("{}/metrics", a.root())]).output().unwrap().stdout).into_owned();
    for series in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:time_to_first_token_seconds_bucket{",
    ] {
        assert!(m.contains(&format!("{series}model_name=\"tiny\"")), "{series}: {m}");
    }
    let (hits, queries) = (counter(&m, "vllm:prefix_cache_hits_total", ""), counter(&m, "vllm:prefix_cache_queries_total", ""));
    assert!(hits > 0.0 && queries >= hits, "the shared system prompt hit the prefix cache: {hits} of {queries}");
    assert_eq!(hits, counter(&m, "m3c:prefix_cache_hits_total", ""), "one series under two names");
}

/// A subscriber (tests/serve/kv_events_sub.py, pyzmq and msgpack) on a
/// replica's KV-cache events, until [`Subscriber::finish`].
struct Subscriber {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Subscriber {
    fn start(publish: &str, replay: &str) -> Subscriber {
        let mut child = Command::new(venv("python"))
            .arg(root().join("tests/serve/kv_events_sub.py"))
            .args([publish, replay])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python from .venv-router runs the subscriber");
        let (tx, lines) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let s = Subscriber { child, lines };
        let first = s.lines.recv_timeout(Duration::from_secs(30)).expect("the subscriber connects");
        assert!(first.contains("subscribed"), "{first}");
        s
    }

    /// The events received until now (waiting `settle` for stragglers).
    fn events(&self, settle: Duration) -> Vec<serde_json::Value> {
        std::thread::sleep(settle);
        self.lines.try_iter().map(|l| serde_json::from_str(&l).unwrap()).collect()
    }

    /// Stops listening; what the replay socket then gave from sequence 0.
    fn finish(mut self) -> serde_json::Value {
        drop(self.child.stdin.take());
        let v = self.lines.recv_timeout(Duration::from_secs(30)).expect("the replay's answer");
        let _ = self.child.wait();
        serde_json::from_str(&v).unwrap()
    }
}

pub(crate) fn complete(server: &str, prompt: &[u32]) {
    let body = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}).to_string();
    let o = Command::new("curl")
        .args(["-sf", "-m", "60", "-H", "Content-Type: application/json", "-d", &body, &format!("{server}/v1/completions")])
        .output()
        .unwrap();
    assert!(o.status.success(), "a completion from {server}");
}

/// vLLM's KV-cache events: every block the prefix cache stores comes out as
/// a `BlockStored` with its tokens and its parent, evictions as
/// `BlockRemoved` of hashes stored before, a late subscriber gets the
/// history from the replay socket, and vllm-router's `kv_aware` policy,
/// fed by the events of two replicas, finds the blocks where they are and
/// routes by them (the texts are one replica's).
#[test]
fn kv_cache_events_feed_a_subscriber_and_vllm_router_s_kv_aware_policy() {
    let (out, model) = (crate::shared::out("tiny-m3", 2), fixture("tiny-m3"));
    let ports: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let config = |publish: u16, replay: u16| {
        serde_json::json!({"enable_kv_cache_events": true, "publisher": "zmq", "topic": "",
            "endpoint": format!("tcp://127.0.0.1:{publish}"), "replay_endpoint": format!("tcp://127.0.0.1:{replay}")})
        .to_string()
    };
    let (ca, cb) = (config(ports[0], ports[1]), config(ports[2], ports[3]));
    // Events describe the prefix cache: without it they would be silence.
    let r = m3c_tests::m3c(&[
        "serve",
        out.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--port",
        "0",
        "--no-enable-prefix-caching",
        "--kv-events-config",
        &ca,
    ]);
    let e = m3c_tests::stderr(&r);
    assert!(!r.status.success() && e.contains("--kv-events-config") && e.contains("--no-enable-prefix-caching"), "{e}");
    // A pool of 64 blocks of 4 positions, so that prompts evict each other.
    let a = Server::start(&out, &model, &["--kv-events-config", &ca, "--kv-blocks", "64"]);
    let sub = Subscriber::start(&format!("tcp://127.0.0.1:{}", ports[0]), &format!("tcp://127.0.0.1:{}", ports[1]));
    let prompt: Vec<u32> = (1..=13).collect();
    complete(&a.root(), &prompt);
    let stored = sub.events(Duration::from_millis(500));
    let blocks: Vec<&serde_json::Value> = stored.iter().filter(|e| e["type"] == "BlockStored").take(3).collect();
    assert_eq!(blocks.len(), 3, "{stored:?}");
    for (i, b) in blocks.iter().enumerate() {
        let want: Vec<u32> = prompt[i * 4..i * 4 + 4].to_vec();
        assert_eq!(b["tokens"], serde_json::json!(want), "block {i}: {b}");
        assert_eq!(b["block_size"], 4);
        let parent = if i == 0 { serde_json::Value::Null } else { blocks[i - 1]["hashes"][0].clone() };
        assert_eq!(b["parent"], parent, "block {i} follows block {}", i.wrapping_sub(1));
    }
    for k in 0..3u32 {
        let long: Vec<u32> = (100 + 130 * k..220 + 130 * k).collect();
        complete(&a.root(), &long);
    }
    let later = sub.events(Duration::from_millis(500));
    let all_stored: std::collections::HashSet<String> = stored
        .iter()
        .chain(&later)
        .filter(|e| e["type"] == "BlockStored")
        .filter_map(|e| e["hashes"][0].as_str().map(str::to_string))
        .collect();
    let removed: Vec<&str> = later
        .iter()
        .filter(|e| e["type"] == "BlockRemoved")
        .flat_map(|e| e["hashes"].as_array().unwrap())
        .filter_map(|h| h.as_str())
        .collect();
    assert!(!removed.is_empty() && removed.iter().all(|h| all_stored.contains(*h)), "evictions of stored blocks: {removed:?}");
    let replay = sub.finish();
    let live = stored.iter().chain(&later).filter_map(|e| e["seq"].as_i64()).max().unwrap_or(0);
    assert!(replay["replayed"].as_i64() > Some(live), "every batch from 0, the start's too: {replay}");
    assert_eq!(replay["types"][0], "AllBlocksCleared", "{replay}");
    drop(a);

    // Two replicas, each publishing; vllm-router subscribes to both.
    // The router hears of blocks as they are stored: the replicas start
    // empty, and the workload's repeated chat finds its blocks through it.
    let (a, b) = (Server::start(&out, &model, &["--kv-events-config", &ca]), Server::start(&out, &model, &["--kv-events-config", &cb]));
    let dir = tempfile::tempdir().unwrap();
    let sources = [format!("{}=tcp://127.0.0.1:{}", a.root(), ports[0]), format!("{}=tcp://127.0.0.1:{}", b.root(), ports[2])];
    let (wa, wb) = (a.root(), b.root());
    let args = [
        "--worker-urls",
        &wa,
        &wb,
        "--policy",
        "kv_aware",
        "--kv-event-source",
        &sources[0],
        "--kv-event-source",
        &sources[1],
        "--kv-event-block-size",
        "4",
        "--kv-event-model",
        "tiny",
    ];
    let r = Router::start("vllm-router", &args, dir.path());
    let got = workload(&format!("http://127.0.0.1:{}/v1", r.port));
    let want = workload(&format!("{}/v1", a.root()));
    assert_eq!(got, want, "vllm-router --policy kv_aware: the texts differ from one replica's\n{}", r.log());
    let m = r.metrics();
    assert!(counter(&m, "vllm_router_kv_placement_lookups_total", "result=\"hit\"") >= 1.0, "the router found blocks by the events: {m}");
}
