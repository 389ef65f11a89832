//! A pipeline that heals (`m3c serve --max-restarts`): a stage killed
//! mid-stream costs a restart, not the requests. Under 16 concurrent
//! streams (greedy and seeded completions with logprobs, a reasoning chat
//! and an image chat), each stage of a pp 4 pipeline in turn is SIGKILLed: every stream ends
//! with the text, logprobs and finish reason of a run without the fault,
//! and the server is healthy again; the same with EAGLE3 drafting, and for
//! one replica of two. A restart that fails again and again, with a client
//! gone meanwhile, still ends in the same streams for the others; a stage
//! that dies at every start exhausts the restarts: a non-zero exit naming
//! the limit, nothing left behind.

use crate::serve::{pid_of, python, Server};
use m3c_tests::{fixture, root};
use serde_json::Value;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The fault workload through `s` (14 completions, a reasoning chat and an
/// image chat: 16 streams), harmed by `fault` once it is under way (`None`: no fault);
/// its answers.
fn streams(s: &Server, fault: Option<&dyn Fn()>) -> Value {
    let after = if fault.is_some() { "60" } else { "1000000" };
    let png = fixture("vision/A_rgb_56x84_noresize.png");
    let mut c = Command::new(python())
        .arg(root().join("tests/serve/client.py"))
        .args([&s.base(), "tiny", "fault_streams", "14", "40", after, png.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    if let Some(f) = fault {
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "fault", "the workload did not get under way:\n{}", s.log());
        f();
        line.clear();
    }
    out.read_line(&mut line).unwrap();
    let status = c.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut c.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "the streams failed: {err}\nserver log:\n{}", s.log());
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

fn metric(s: &Server, name: &str) -> f64 {
    let o = Command::new("curl").args(["-s", "-m", "5", &format!("{}/metrics", s.root())]).output().unwrap();
    crate::routers::counter(&String::from_utf8_lossy(&o.stdout), name, "")
}

#[test]
fn each_stage_killed_mid_stream_costs_a_restart_and_no_stream_changes() {
    let dir = tempfile::tempdir().unwrap();
    let out = crate::shared::copy("tiny-m3", 4, dir.path());
    let s = Server::start(&out, &fixture("tiny-m3"), &["--timeout-s", "5", "--max-restarts", "4"]);
    let want = streams(&s, None);
    assert_eq!(want["answers"].as_array().map(Vec::len), Some(16));
    for k in 0..4 {
        let exe = out.join(format!("stage-{k}"));
        let kill = || {
            let pid = pid_of(&exe).expect("the stage runs");
            // SAFETY: kill(2) on a stage process of this test's own server.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        };
        let got = streams(&s, Some(&kill));
        assert_eq!(got["answers"], want["answers"], "stage {k} killed mid-stream: the streams differ from the run without it");
        assert_eq!(s.health(), 200, "healthy again after stage {k}:\n{}", s.log());
    }
    assert_eq!(metric(&s, "m3c:pipeline_restarts_total"), 4.0, "{}", s.log());
    assert!(metric(&s, "m3c:requests_resumed_total") >= 4.0, "{}", s.log());
    assert_eq!(metric(&s, "m3c:pipeline_restart_seconds_count"), 4.0);
    let log = s.log();
    // The recovery, as the log gives it (for the table).
    for l in log
        .lines()
        .filter(|l| l.contains("starting it again") || l.contains("again in") || l.contains("up again") || l.contains("after the loss"))
    {
        eprintln!("{l}");
    }
    assert_eq!(log.matches("the pipeline is up again").count(), 4, "{log}");
    assert!(log.contains("on host") && log.contains("killed by signal 9"), "the log names the stage, its host and the signal: {log}");
    assert!(log.contains("starting it again (1 of at most 4"), "{log}");
}

#[test]
fn a_stage_that_dies_at_every_start_ends_the_server_after_the_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let out = crate::shared::copy("tiny-m3", 2, dir.path());
    let mut s = Server::start(&out, &fixture("tiny-m3"), &["--timeout-s", "5", "--max-restarts", "2"]);
    // Stage 1's file goes bad: every start after this one fails there.
    let exe = out.join("stage-1");
    let pid = pid_of(&exe).expect("stage 1 runs");
    std::fs::remove_file(&exe).unwrap();
    std::fs::write(&exe, b"#!/bin/sh\nexit 3\n").unwrap();
    std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // SAFETY: kill(2) on a stage process of this test's own server.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let t0 = Instant::now();
    let status = s.wait(Duration::from_secs(60));
    assert!(!status.success(), "{}", s.log());
    let log = s.log();
    assert!(log.contains("the --max-restarts limit, so it stays down"), "{log}");
    assert_eq!(log.matches("starting it again (").count(), 2, "{log}");
    eprintln!("the server gave up {:.1} s after the fault", t0.elapsed().as_secs_f64());
    assert!(pid_of(&out.join("stage-0")).is_none() && pid_of(&exe).is_none(), "stages outlived the server");
}

/// Two replicas (`--data-parallel-size 2`): replica 1 loses a stage under
/// the streams; it is out of routing while it restarts, its streams go on
/// as without the fault, and both replicas serve again.
#[test]
fn a_replica_that_loses_a_stage_heals_while_the_other_serves() {
    let dir = tempfile::tempdir().unwrap();
    let out = crate::shared::copy("tiny-m3", 2, dir.path());
    let s = Server::start(&out, &fixture("tiny-m3"), &["--timeout-s", "5", "--data-parallel-size", "2"]);
    let both_up = || {
        let deadline = Instant::now() + Duration::from_secs(60);
        while metric(&s, "m3c:replica_up") != 2.0 {
            assert!(Instant::now() < deadline, "both replicas up:\n{}", s.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    both_up();
    let want = streams(&s, None);
    let kill = || {
        let pid = crate::data_parallel::pids_with(&out.join("stage-1"), "3/4");
        // SAFETY: kill(2) on a stage process of this test's own server.
        unsafe { libc::kill(pid[0], libc::SIGKILL) };
    };
    let got = streams(&s, Some(&kill));
    assert_eq!(got["answers"], want["answers"], "replica 1 lost a stage: the streams differ");
    both_up();
    assert_eq!(metric(&s, "m3c:pipeline_restarts_total"), 1.0, "{}", s.log());
    assert!(metric(&s, "m3c:requests_resumed_total") >= 1.0, "streams were on replica 1 when it was lost:\n{}", s.log());
    assert!(s.log().contains("replica 1: the pipeline is up again"), "{}", s.log());
}

/// EAGLE3 drafting (pp 2): stage 1, which holds the draft head, is killed
/// under the streams; they go on as without the fault (drafts change only
/// the speed).
#[test]
fn a_speculating_pipeline_heals_with_the_same_streams() {
    let dir = tempfile::tempdir().unwrap();
    let shared = crate::eagle3::out(2, &[]);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    for e in std::fs::read_dir(&shared).unwrap().flatten() {
        std::fs::copy(e.path(), out.join(e.file_name())).unwrap();
    }
    let spec = crate::eagle3::config(3);
    let s = Server::start(&out, &fixture("tiny-m3"), &["--timeout-s", "5", "--speculative-config", &spec]);
    let want = streams(&s, None);
    let kill = || {
        let pid = pid_of(&out.join("stage-1")).expect("stage 1 runs");
        // SAFETY: kill(2) on a stage process of this test's own server.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    };
    let got = streams(&s, Some(&kill));
    assert_eq!(got["answers"], want["answers"], "the streams differ after the fault");
    assert!(metric(&s, "m3c:requests_resumed_total") >= 1.0 && metric(&s, "m3c:spec_decode_num_drafts_total") > 0.0, "{}", s.log());
}

/// The restarted pipeline fails too (stage 1's file is bad for a while),
/// and a client goes away meanwhile: its request is not resumed, and once
/// the file is good again the pipeline comes up and serves.
#[test]
fn a_fault_during_the_restart_and_a_client_gone_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let out = crate::shared::copy("tiny-m3", 2, dir.path());
    let s = Server::start(&out, &fixture("tiny-m3"), &["--timeout-s", "5", "--max-restarts", "50"]);
    let body = serde_json::json!({"model": "tiny", "prompt": "A long story", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    let mut client = Command::new("curl")
        .args(["-sN", "-m", "120", "-H", "Content-Type: application/json", "-d", &body.to_string(), &format!("{}/completions", s.base())])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = std::io::BufReader::new(client.stdout.take().unwrap());
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    assert!(first.starts_with("data: "), "{first}");
    let exe = out.join("stage-1");
    let good = std::fs::read(&exe).unwrap();
    let pid = pid_of(&exe).expect("stage 1 runs");
    std::fs::remove_file(&exe).unwrap();
    std::fs::write(&exe, b"#!/bin/sh\nexit 3\n").unwrap();
    std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // SAFETY: kill(2) on a stage process of this test's own server.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    // Restarts fail while the file is bad: the server says so, and the
    // client leaves then.
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&s, "m3c:pipeline_restarts_total") < 2.0 {
        assert!(Instant::now() < deadline, "no second restart:\n{}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.health(), 503);
    drop(reader);
    let _ = client.kill();
    let _ = client.wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&s, "m3c:requests_cancelled_total") < 1.0 {
        assert!(Instant::now() < deadline, "the client's request was not cancelled:\n{}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::remove_file(&exe).unwrap();
    std::fs::write(&exe, &good).unwrap();
    std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.health() != 200 {
        assert!(Instant::now() < deadline, "never healthy again:\n{}", s.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(metric(&s, "m3c:requests_resumed_total"), 0.0, "the request of the client that left was resumed:\n{}", s.log());
    let want = streams(&s, None);
    assert_eq!(want["answers"].as_array().map(Vec::len), Some(16), "it serves again");
}

/// Both replicas lose a stage, and their restarts fail for a while (stage
/// 1's file is bad): a request sent meanwhile waits on a restarting
/// replica, as on a lone pipeline, instead of a 503, and is answered once
/// the file is good again.
#[test]
fn a_request_waits_while_every_replica_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let out = crate::shared::copy("tiny-m3", 2, dir.path());
    let s = Server::start(&out, &fixture("tiny-m3"), &["--timeout-s", "5", "--data-parallel-size", "2", "--max-restarts", "50"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(&s, "m3c:replica_up") != 2.0 {
        assert!(Instant::now() < deadline, "both replicas up:\n{}", s.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let exe = out.join("stage-1");
    let good = std::fs::read(&exe).unwrap();
    let pids = [crate::data_parallel::pids_with(&exe, "1/4"), crate::data_parallel::pids_with(&exe, "3/4")];
    std::fs::remove_file(&exe).unwrap();
    std::fs::write(&exe, b"#!/bin/sh\nexit 3\n").unwrap();
    std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    for p in pids.iter().flatten() {
        // SAFETY: kill(2) on a stage process of this test's own server.
        unsafe { libc::kill(*p, libc::SIGKILL) };
    }
    while metric(&s, "m3c:pipeline_restarts_total") < 4.0 {
        assert!(Instant::now() < deadline, "the restarts did not fail on:\n{}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let body = serde_json::json!({"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}).to_string();
    let request = Command::new("curl")
        .args([
            "-s",
            "-m",
            "60",
            "-w",
            "\n%{http_code}",
            "-H",
            "Content-Type: application/json",
            "-d",
            &body,
            &format!("{}/completions", s.base()),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    std::fs::remove_file(&exe).unwrap();
    std::fs::write(&exe, &good).unwrap();
    std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let o = request.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.ends_with("\n200") && text.contains("\"finish_reason\""),
        "the request was not answered once a replica was back: {text}\n{}",
        s.log()
    );
}

/// What a batch run's fault strikes: a stage, SIGKILLed (out of memory,
/// say), or the run's own mpirun, crashing (SIGSEGV, as Open MPI 4.1's
/// can: an image's bytes on its input once crashed it in CI).
#[derive(Clone, Copy)]
enum Victim {
    Stage(usize),
    Mpirun,
}

impl Victim {
    /// The process to signal, and the signal.
    fn pid_and_signal(self, out: &std::path::Path, run: u32) -> (i32, i32) {
        match self {
            Victim::Stage(k) => (pid_of(&out.join(format!("stage-{k}"))).expect("the stage runs"), libc::SIGKILL),
            Victim::Mpirun => (child_named(run, "mpirun").expect("the run's mpirun runs"), libc::SIGSEGV),
        }
    }
}

/// The child of `parent` whose command is `name`, from /proc.
fn child_named(parent: u32, name: &str) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.filter_map(Result::ok).find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        // `pid (comm) state ppid ...`; comm may hold spaces, so split after its `)`.
        let (head, rest) = stat.rsplit_once(')')?;
        let comm = head.split_once('(')?.1;
        let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
        (comm == name && ppid == parent).then_some(pid)
    })
}

/// `m3c run OUT --model tiny-m3 ARGS`, with `victim` signalled once
/// `under_way` says so of the output so far (stdout, stderr); the run's
/// output, and whether the signal came before the run ended.
fn run_killing(
    out: &std::path::Path,
    victim: Victim,
    args: &[&str],
    under_way: &dyn Fn(&str, &str) -> bool,
) -> (std::process::Output, bool) {
    use std::sync::{Arc, Mutex};
    let mut c = m3c_tests::m3c_command()
        .args(["run", out.to_str().unwrap(), "--model", fixture("tiny-m3").to_str().unwrap(), "--timeout-s", "5"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let read = |pipe: Box<dyn std::io::Read + Send>| {
        let got = Arc::new(Mutex::new(Vec::new()));
        let into = got.clone();
        let t = std::thread::spawn(move || {
            let mut pipe = pipe;
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = pipe.read(&mut buf) {
                into.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        (got, t)
    };
    let (out_got, out_t) = read(Box::new(c.stdout.take().unwrap()));
    let (err_got, err_t) = read(Box::new(c.stderr.take().unwrap()));
    let text = |b: &Arc<Mutex<Vec<u8>>>| String::from_utf8_lossy(&b.lock().unwrap()).into_owned();
    let (t0, mut killed) = (Instant::now(), false);
    while c.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(120), "the run did not end:\n{}", text(&err_got));
        if !killed && under_way(&text(&out_got), &text(&err_got)) {
            let (pid, signal) = victim.pid_and_signal(out, c.id());
            // SAFETY: kill(2) on a process of this test's own run.
            unsafe { libc::kill(pid, signal) };
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let status = c.wait().unwrap();
    let (_, _) = (out_t.join(), err_t.join());
    let (stdout, stderr) = (out_got.lock().unwrap().clone(), err_got.lock().unwrap().clone());
    (std::process::Output { status, stdout, stderr }, killed)
}

/// `m3c run` with a prompts file goes on after a fault too: stage 1 of
/// three is SIGKILLed mid-run; the run restarts its pipeline, the
/// unfinished prompts go on where they were, and its output (text with
/// greedy and seeded prompts; ids with logprobs) equals a run without the
/// fault; so does a run whose mpirun crashes (SIGSEGV). With
/// `--max-restarts 0` the fault ends the run, naming the stage.
#[test]
fn a_batch_run_that_loses_a_stage_prints_what_a_run_without_the_fault_prints() {
    let dir = tempfile::tempdir().unwrap();
    let out = crate::shared::copy("tiny-m3", 3, dir.path());
    let texts = dir.path().join("prompts.jsonl");
    std::fs::write(
        &texts,
        "{\"prompt\": \"The capital of France is\"}\n\
         {\"prompt\": \"Once upon a time\", \"temperature\": 0.8, \"seed\": 11}\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"Hi!\"}], \"thinking\": \"disabled\", \"temperature\": 1.0, \"top_p\": 0.9, \"seed\": 3}\n\
         {\"prompt\": \"1, 2, 3,\", \"temperature\": 0.7, \"top_k\": 20, \"seed\": 5}\n",
    )
    .unwrap();
    let ids = dir.path().join("prompts.txt");
    std::fs::write(&ids, "1,2,3\n4,5,6,7\n8\n9,10\n").unwrap();
    let (texts, ids) = (texts.to_str().unwrap(), ids.to_str().unwrap());
    let text_run = ["--prompts", texts, "--max-new-tokens", "300", "--ignore-eos"];
    let id_run = ["--prompts", ids, "--max-new-tokens", "1500", "--ignore-eos", "--logprobs", "2", "--temperature", "0.9", "--seed", "9"];
    let never = |_: &str, _: &str| false;
    // Text streams as it comes: the fault lands once some has.
    let streaming = |o: &str, _: &str| o.len() > 150;
    // Ids print at the end: the fault lands a moment after the last stage is up.
    let loaded = std::cell::Cell::new(None::<Instant>);
    let up = |_: &str, e: &str| {
        if e.contains("m3c stage 2/3") && e.contains("KV pool") {
            loaded.set(loaded.get().or(Some(Instant::now())));
        }
        loaded.get().is_some_and(|t| t.elapsed() > Duration::from_millis(300))
    };
    let mut wants = Vec::new();
    for (what, args, under_way) in
        [("text", &text_run[..], &streaming as &dyn Fn(&str, &str) -> bool), ("ids", &id_run[..], &up as &dyn Fn(&str, &str) -> bool)]
    {
        let (want, _) = run_killing(&out, Victim::Stage(1), args, &never);
        assert!(want.status.success(), "{what}: {}", m3c_tests::stderr(&want));
        loaded.set(None);
        let (got, killed) = run_killing(&out, Victim::Stage(1), args, under_way);
        let e = m3c_tests::stderr(&got);
        assert!(killed, "{what}: the run ended before the fault:\n{e}");
        assert!(got.status.success(), "{what}: {e}");
        assert!(e.contains("killed") && e.contains("starting the pipeline again (1 of at most 3)"), "{what}: {e}");
        assert_eq!(m3c_tests::stdout(&got), m3c_tests::stdout(&want), "{what}: the output differs from the run without the fault");
        eprintln!("{what}: {}", e.lines().find(|l| l.contains("starting the pipeline again")).unwrap_or_default());
        wants.push(want);
    }
    // mpirun itself crashing is healed the same way, and named as such.
    loaded.set(None);
    let (got, crashed) = run_killing(&out, Victim::Mpirun, &id_run, &up);
    let e = m3c_tests::stderr(&got);
    assert!(crashed && got.status.success(), "{e}");
    assert!(e.contains("mpirun itself crashed (signal 11 (SIGSEGV))") && e.contains("starting the pipeline again (1 of at most 3)"), "{e}");
    assert_eq!(m3c_tests::stdout(&got), m3c_tests::stdout(&wants[1]), "ids: the output differs after mpirun's crash");
    loaded.set(None);
    let (failed, killed) = run_killing(&out, Victim::Stage(1), &[&id_run[..], &["--max-restarts", "0"]].concat(), &up);
    let e = m3c_tests::stderr(&failed);
    assert!(killed && !failed.status.success(), "{e}");
    assert!(e.contains("stage 1") && !e.contains("starting the pipeline again"), "{e}");
    assert!(pid_of(&out.join("stage-0")).is_none(), "a stage outlived the run");
}
