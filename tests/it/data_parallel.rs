//! `m3c serve --data-parallel-size 2`: two pp 2 pipelines of one build
//! behind one front. Through it, the routers' workload (chat, completions,
//! streams, greedy and seeded) gives one replica's text; a prompt goes
//! back to the replica whose prefix cache holds its start; `/health` and
//! `/metrics` speak per replica; and when one replica's stage is killed,
//! the other serves on with the same text, the lost one's processes are
//! gone, and SIGTERM still drains and stops everything with 0.

use crate::routers::{complete, counter, workload};
use crate::serve::{private_copy, Server};
use m3c_tests::fixture;
use serde_json::Value;
use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn get(url: &str) -> String {
    String::from_utf8_lossy(&Command::new("curl").args(["-s", "-m", "5", url]).output().unwrap().stdout).into_owned()
}

/// `/health`'s body, parsed.
fn health(s: &Server) -> Value {
    serde_json::from_str(&get(&format!("{}/health", s.root()))).unwrap_or(Value::Null)
}

/// Waits until `/health` says what `want` accepts of each replica's status.
fn wait_health(s: &Server, what: &str, want: impl Fn(&[Value]) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let h = health(s);
        if h["replicas"].as_array().is_some_and(|r| want(r)) {
            return h;
        }
        assert!(Instant::now() < deadline, "{what}: /health says {h}\n{}", s.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Pids of processes running `exe` with `arg` among their arguments.
pub(crate) fn pids_with(exe: &Path, arg: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(Result::ok)
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let words: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
            (words.first() == Some(&exe.to_str()?.as_bytes()) && words.contains(&arg.as_bytes())).then_some(pid)
        })
        .collect()
}

#[test]
fn two_replicas_serve_one_replica_s_text_route_by_prefix_and_outlive_a_lost_one() {
    let (_dir, out, model) = private_copy();
    let one = Server::start(&crate::shared::out("tiny-m3", 2), &fixture("tiny-m3"), &[]);
    let want = workload(&format!("{}/v1", one.root()));
    drop(one);
    let mut s = Server::start(&out, &model, &["--data-parallel-size", "2", "--timeout-s", "5", "--max-restarts", "0"]);
    wait_health(&s, "both replicas up", |r| r.len() == 2 && r.iter().all(|r| r["status"] == "ok"));
    // Four ranks share this machine: each stage knows its place.
    for (k, share) in [(0, "0/4"), (1, "1/4"), (0, "2/4"), (1, "3/4")] {
        assert_eq!(pids_with(&out.join(format!("stage-{k}")), share).len(), 1, "stage-{k} with --node-share {share}");
    }
    assert_eq!(workload(&s.base()), want, "two replicas give one replica's text\n{}", s.log());

    // P1 runs (streaming) on one replica when P2 arrives, which goes to
    // the other, idle one. Alone later, each goes back to its own
    // replica's cache, though both are idle.
    let metric = |name: &str, r: usize| counter(&get(&format!("{}/metrics", s.root())), name, &format!("replica=\"{r}\""));
    let prompts = |r: usize| metric("m3c:prompt_tokens_total", r);
    let hits = |r: usize| metric("m3c:prefix_cache_hits_total", r);
    let before = [prompts(0), prompts(1)];
    let p1: Vec<u32> = (300..340).collect();
    let p2: Vec<u32> = (400..440).collect();
    let body = serde_json::json!({"model": "tiny", "prompt": p1, "max_tokens": 3000, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut long = Command::new("curl")
        .args(["-sN", "-m", "60", "-H", "Content-Type: application/json", "-d", &body.to_string(), &format!("{}/completions", s.base())])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    // The reader lives until P2 is in: its pipe closed would end P1.
    let mut reader = std::io::BufReader::new(long.stdout.take().unwrap());
    reader.read_line(&mut first).unwrap();
    assert!(first.starts_with("data: "), "P1 streams: {first}");
    let a = usize::from(prompts(1) > before[1]);
    let b = 1 - a;
    complete(&s.root(), &p2);
    assert_eq!(prompts(b), before[b] + 40.0, "P2 went to the replica P1 does not run on");
    drop(reader);
    let _ = long.kill();
    let _ = long.wait();
    let (ha, hb) = (hits(a), hits(b));
    complete(&s.root(), &p2);
    assert!(hits(b) >= hb + 36.0 && hits(a) == ha, "P2 went back to replica {b}: {ha}->{}, {hb}->{}", hits(a), hits(b));
    complete(&s.root(), &p1);
    assert!(hits(a) >= ha + 36.0, "P1 went back to replica {a}: {ha}->{}", hits(a));

    let m = get(&format!("{}/metrics", s.root()));
    for series in ["m3c:replica_up{replica=\"1\"} 1", "vllm:num_requests_running{model_name=\"tiny\",engine=\"1\"} 0"] {
        assert!(m.contains(series), "{series}: {m}");
    }

    // Replica 1 loses a stage: it leaves routing, replica 0 serves on.
    let lost = pids_with(&out.join("stage-1"), "3/4");
    // SAFETY: kill(2) on a stage process of this test's own server.
    unsafe { libc::kill(lost[0], libc::SIGKILL) };
    let h = wait_health(&s, "replica 1 out", |r| r.len() == 2 && r[0]["status"] == "ok" && r[1]["status"] == "unavailable");
    assert!(h["replicas"][1]["reason"].as_str().is_some_and(|w| w.starts_with("replica 1: the pipeline stopped")), "{h}");
    assert_eq!(s.health(), 200);
    assert_eq!(workload(&s.base()), want, "replica 0 alone gives the same text\n{}", s.log());
    assert!(get(&format!("{}/metrics", s.root())).contains("m3c:replica_up{replica=\"1\"} 0"));
    let deadline = Instant::now() + Duration::from_secs(15);
    while !(pids_with(&out.join("stage-0"), "2/4").is_empty() && pids_with(&out.join("stage-1"), "3/4").is_empty()) {
        assert!(Instant::now() < deadline, "replica 1's stages outlived it\n{}", s.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    s.signal(libc::SIGTERM);
    assert!(s.wait(Duration::from_secs(30)).success(), "SIGTERM drains and stops with 0\n{}", s.log());
    assert!(pids_with(&out.join("stage-0"), "0/4").is_empty() && pids_with(&out.join("stage-1"), "1/4").is_empty(), "{}", s.log());
}

/// Placements that cannot hold the replicas are refused before mpirun,
/// naming what to change: a hostfile with too few slots, or without slot
/// counts, and mpirun's own host options.
#[test]
fn replicas_that_do_not_fit_the_hosts_are_refused_by_name() {
    let (out, model) = crate::shared::tiny(2);
    let dir = tempfile::tempdir().unwrap();
    let (few, bare) = (dir.path().join("few"), dir.path().join("bare"));
    std::fs::write(&few, "127.0.0.1 slots=3\n").unwrap();
    std::fs::write(&bare, "127.0.0.1\n").unwrap();
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--port", "0"];
        args.extend_from_slice(extra);
        let r = m3c_tests::m3c(&args);
        assert!(!r.status.success(), "{extra:?} was taken");
        m3c_tests::stderr(&r)
    };
    let e = serve(&["--data-parallel-size", "2", "--hostfile", few.to_str().unwrap()]);
    assert!(e.contains("lists 3 slots; --data-parallel-size 2 needs 4 (2 replicas of 2 ranks)"), "{e}");
    let e = serve(&["--data-parallel-size", "2", "--hostfile", bare.to_str().unwrap()]);
    assert!(e.contains("every line needs `slots=N`"), "{e}");
    let e = serve(&["--data-parallel-size", "2", "--mpirun-arg", "--host", "--mpirun-arg", "127.0.0.1"]);
    assert!(e.contains("the mpirun option `--host`") && e.contains("--hostfile"), "{e}");
}
