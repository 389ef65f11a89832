//! A pipeline that heals (`m3c serve --max-restarts`): a stage killed
//! mid-stream costs a restart, not the requests. Under 8 concurrent streams
//! (greedy and seeded, with logprobs) and a reasoning chat, each stage of a
//! pp 3 pipeline in turn is SIGKILLed: every stream ends with the text,
//! logprobs and finish reason of a run without the fault, and the server
//! is healthy again. A stage that dies at every start exhausts the
//! restarts: a non-zero exit naming the limit, nothing left behind.

use crate::serve::{pid_of, python, Server};
use m3c_tests::{fixture, root};
use serde_json::Value;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The fault workload through `s`, harmed by `fault` once it is under way
/// (`None`: no fault); its answers.
fn streams(s: &Server, fault: Option<&dyn Fn()>) -> Value {
    let after = if fault.is_some() { "60" } else { "1000000" };
    let mut c = Command::new(python())
        .arg(root().join("tests/serve/client.py"))
        .args([&s.base(), "tiny", "fault_streams", "8", "40", after])
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
    let out = crate::shared::copy("tiny-m3", 3, dir.path());
    let s = Server::start(&out, &fixture("tiny-m3"), &["--timeout-s", "5", "--max-restarts", "3"]);
    let want = streams(&s, None);
    assert_eq!(want["answers"].as_array().map(Vec::len), Some(9));
    for k in 0..3 {
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
    assert_eq!(metric(&s, "m3c:pipeline_restarts_total"), 3.0, "{}", s.log());
    assert!(metric(&s, "m3c:requests_resumed_total") >= 3.0, "{}", s.log());
    assert_eq!(metric(&s, "m3c:pipeline_restart_seconds_count"), 3.0);
    let log = s.log();
    // The recovery, as the log gives it (for the table).
    for l in log.lines().filter(|l| l.contains("starting it again") || l.contains("up again")) {
        eprintln!("{l}");
    }
    assert_eq!(log.matches("the pipeline is up again").count(), 3, "{log}");
    assert!(log.contains("on host") && log.contains("killed by signal 9"), "the log names the stage, its host and the signal: {log}");
    assert!(log.contains("starting it again (1 of at most 3"), "{log}");
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
