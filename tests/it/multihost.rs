//! Pipelines across hosts: stages on separate network-namespace hosts
//! (`crate::netns`), each with its own address, hostname and temporary
//! folder, give the bytes of one host. Skipped (with a message) where namespaces cannot
//! be made; CI runs as root.

use crate::netns::Hosts;
use m3c_tests::{fixture, ids_arg, m3c, m3c_run, read_tensor_i64, stderr};
use std::time::Duration;

/// A pp 2 plan of the tiny fixture with each stage on the given host.
fn plan_on(model: &std::path::Path, hosts: [&str; 2]) -> String {
    format!(
        "version: 1\nmodel: \"{}\"\ntarget: host\nstages:\n  - layers: \"0-2\"\n    embedding: true\n    host: \"{}\"\n  - layers: \"3-7\"\n    final_norm: true\n    lm_head: true\n    host: \"{}\"\n",
        model.display(),
        hosts[0],
        hosts[1]
    )
}

/// A pp 2 plan of the tiny fixture with stage 0 on host 1, away from the
/// front (which runs on host 0), compiled into the hosts' shared folder
/// (a hostfile cannot put rank 0 away from mpirun's own host: Open MPI
/// maps its own node first).
fn remote_first_stage(hosts: &Hosts, name: &str) -> std::path::PathBuf {
    let plan = hosts.shared().join(format!("{name}.yaml"));
    std::fs::write(&plan, plan_on(&fixture("tiny-m3"), [hosts.addr(1).as_str(), hosts.addr(0).as_str()])).unwrap();
    let out = hosts.shared().join(name);
    let c = m3c(&["compile", "--pp", "2", plan.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(c.status.success(), "{}", stderr(&c));
    out
}

/// An Open MPI hostfile in the hosts' shared folder that puts stage k on
/// host `order[k]` (one slot each, filled in order), for the tests' shared
/// compiles (`crate::shared::out`), whose plans name no host: no test
/// compiles a pipeline only to place it.
fn hostfile(hosts: &Hosts, order: &[usize]) -> String {
    let name = order.iter().map(|i| i.to_string()).collect::<String>();
    let f = hosts.shared().join(format!("hosts-{name}"));
    std::fs::write(&f, order.iter().map(|&i| format!("{} slots=1\n", hosts.addr(i))).collect::<String>()).unwrap();
    f.to_str().unwrap().to_string()
}

#[test]
fn a_pipeline_across_two_hosts_gives_the_one_host_bytes() {
    let Some(hosts) = Hosts::new(2) else { return };
    let model = fixture("tiny-m3");
    let prompt = ids_arg(&read_tensor_i64(&model.join("golden.safetensors"), "prompt_ids"));
    let args = |dump: &std::path::Path| -> Vec<String> {
        ["--prompt-ids", &prompt, "--max-new-tokens", "4", "--dump", dump.to_str().unwrap()].map(String::from).to_vec()
    };
    // The reference: pp 1 on this machine.
    let want = hosts.shared().join("pp1.safetensors");
    let a = args(&want);
    let o = m3c_run(&crate::shared::out("tiny-m3", 1), &model, &a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", stderr(&o));
    let want = std::fs::read(&want).unwrap();
    // The plan's hosts place the stages.
    let plan = hosts.shared().join("p.yaml");
    std::fs::write(&plan, plan_on(&model, [hosts.addr(0).as_str(), hosts.addr(1).as_str()])).unwrap();
    let out = hosts.shared().join("planned");
    let c = m3c(&["compile", "--pp", "2", plan.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(c.status.success(), "{}", stderr(&c));
    let dump = hosts.shared().join("planned.safetensors");
    let bin = m3c_tests::m3c_bin();
    let mut cmd = vec![bin.to_str().unwrap(), "run", out.to_str().unwrap(), "--model", model.to_str().unwrap()];
    let a = args(&dump);
    cmd.extend(a.iter().map(String::as_str));
    let o = hosts.run(0, &cmd, Duration::from_secs(120));
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    // Each stage says where it ran: the hosts the plan names.
    let e = stderr(&o);
    for k in 0..2 {
        let banner = e.lines().find(|l| l.starts_with(&format!("m3c stage {k}/2:")) && l.contains("kernel thread(s)"));
        assert!(banner.is_some_and(|l| l.ends_with(&format!("on host {}", hosts.ns(k)))), "stage {k} not on host {k}:\n{e}");
    }
    assert!(std::fs::read(&dump).unwrap() == want, "the planned hosts' dump differs from one host's");
    // A plan without hosts, placed by a hostfile, with extra mpirun
    // options from the environment and the flags (TCP only, here).
    let placed = hostfile(&hosts, &[1, 0]);
    let out = crate::shared::out("tiny-m3", 2);
    let dump = hosts.shared().join("hostfile.safetensors");
    let (out_s, model_s, hostfile_s) = (out.to_str().unwrap(), model.to_str().unwrap(), placed.as_str());
    let a = args(&dump);
    let cmd = |iface: &str| {
        let mut cmd = vec![bin.to_str().unwrap(), "run", out_s, "--model", model_s, "--hostfile", hostfile_s, "--iface", iface];
        cmd.extend(["--mpirun-arg=--mca", "--mpirun-arg=btl", "--mpirun-arg=tcp,self"]);
        cmd.extend(a.iter().map(String::as_str));
        hosts.run_env(0, &cmd, &[("M3C_MPIRUN_ARGS", "--report-bindings")], Duration::from_secs(120))
    };
    let o = cmd("eth0");
    assert!(o.status.success(), "hostfile: {}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains(&format!("on host {}", hosts.ns(1))) && e.contains(&format!("on host {}", hosts.ns(0))), "{e}");
    assert!(e.contains("MCW rank"), "M3C_MPIRUN_ARGS' --report-bindings reached mpirun: {e}");
    assert!(std::fs::read(&dump).unwrap() == want, "hostfile: the dump differs from one host's");
    // An interface the hosts lack: the pre-flight check says so, at once.
    let t0 = std::time::Instant::now();
    let o = cmd("nosuch0");
    let e = stderr(&o);
    assert!(!o.status.success() && t0.elapsed() < Duration::from_secs(20), "{e}");
    assert!(e.contains("the hosts are not ready for this job") && e.contains("nosuch0"), "--iface reached mpirun: {e}");
}

/// pp 4 on 4 hosts, stage 0 on the front's: the one-host bytes.
#[test]
fn a_pipeline_across_four_hosts_gives_the_one_host_bytes() {
    let Some(hosts) = Hosts::new(4) else { return };
    let model = fixture("tiny-m3");
    let prompt = ids_arg(&read_tensor_i64(&model.join("golden.safetensors"), "prompt_ids"));
    let run_args =
        |dump: &std::path::Path| ["--prompt-ids", &prompt, "--max-new-tokens", "4", "--dump", dump.to_str().unwrap()].map(String::from);
    let want = hosts.shared().join("pp1.safetensors");
    let o = m3c_run(&crate::shared::out("tiny-m3", 1), &model, &run_args(&want).each_ref().map(String::as_str));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = crate::shared::out("tiny-m3", 4);
    let dump = hosts.shared().join("pp4.safetensors");
    let bin = m3c_tests::m3c_bin();
    let placed = hostfile(&hosts, &[0, 1, 2, 3]);
    let mut cmd = vec![bin.to_str().unwrap(), "run", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--hostfile", &placed];
    let a = run_args(&dump);
    cmd.extend(a.iter().map(String::as_str));
    let o = hosts.run(0, &cmd, Duration::from_secs(120));
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    for k in 0..4 {
        let banner = e.lines().find(|l| l.starts_with(&format!("m3c stage {k}/4:")) && l.contains("kernel thread(s)"));
        assert!(banner.is_some_and(|l| l.ends_with(&format!("on host {}", hosts.ns(k)))), "stage {k} not on host {k}:\n{e}");
    }
    assert!(std::fs::read(&dump).unwrap() == std::fs::read(&want).unwrap(), "pp 4 on 4 hosts differs from pp 1 on one");
}

/// A hostfile that cannot be read is named before mpirun starts.
#[test]
fn a_missing_hostfile_is_named() {
    let (out, model) = crate::shared::tiny(2);
    let o = m3c_run(&out, &model, &["--prompt-ids", "1,2", "--max-new-tokens", "1", "--hostfile", "/nonexistent/hosts"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--hostfile /nonexistent/hosts: cannot be read"), "{}", stderr(&o));
}

/// Faults across hosts, each mid-run: a remote stage killed, a remote
/// host's Open MPI daemon killed, and a link cut. The job ends with a clear error within the timeout (and the
/// launcher's grace after it), and no process is left on either host.
#[test]
fn a_cut_link_or_a_killed_remote_stage_ends_the_job_on_every_host() {
    let Some(hosts) = Hosts::new(2) else { return };
    let (out, model) = crate::shared::tiny(2);
    let bin = m3c_tests::m3c_bin();
    let (out_s, model_s, placed) = (out.to_str().unwrap(), model.to_str().unwrap(), hostfile(&hosts, &[0, 1]));
    let cmd = [bin.to_str().unwrap(), "run", out_s, "--model", model_s, "--hostfile", &placed, "--prompt-ids", "1,2,3"];
    // No restarts: each fault ends the run (tests/it/healing.rs has runs
    // that go on).
    let cmd = [&cmd[..], &["--max-new-tokens", "4090", "--ignore-eos", "--timeout-s", "3", "--max-restarts", "0"]].concat();
    // Stage 1's process on host 1, once the job runs (the pre-flight
    // check's ranks come and go first; a loaded machine starts slowly).
    let stage1 = || -> String {
        let t0 = std::time::Instant::now();
        loop {
            let found = hosts.pids(1).into_iter().find(|p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| c.split(|&b| b == 0).next().is_some_and(|a| a.ends_with(b"/stage-1")))
            });
            if let Some(p) = found {
                return p;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "stage 1 never started on host 1");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let kill = |pid: &str| {
        let _ = std::process::Command::new("kill").args(["-9", pid]).status();
    };
    // Its parent is the job's Open MPI daemon there.
    let parent = |pid: &str| -> String {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit(')').next().and_then(|r| r.split_whitespace().nth(1)).unwrap_or("0").to_string()
    };
    // A fault, given stage 1's pid, and how long after stage 1 started it
    // comes. The kills first: a cut leaves the link down. A cut at once
    // finds stage 1 inside MPI's start-up (`MPI_Init`'s wire-up, which has
    // no deadline of its own), a cut later, decoding.
    type Fault<'a> = &'a dyn Fn(&str);
    let (at_once, decoding) = (Duration::ZERO, Duration::from_millis(500));
    let faults: [(&str, Duration, Fault); 4] = [
        ("killed remote stage", decoding, &|p| kill(p)),
        ("killed remote daemon", decoding, &|p| kill(&parent(p))),
        ("link cut during start-up", at_once, &|_| hosts.cut(1)),
        ("cut link", decoding, &|_| hosts.cut(1)),
    ];
    for (name, after, fault) in faults {
        hosts.mend(1);
        let mut child = hosts.spawn(0, &cmd, Duration::from_secs(90));
        // The run's log as it comes: stage 1's start-up report (its weights
        // and KV pool) says MPI's start-up is over on every rank.
        let log = child.stderr.take().expect("piped");
        let (up_tx, up) = std::sync::mpsc::channel::<()>();
        let reader = std::thread::spawn(move || {
            use std::io::BufRead;
            let mut all = String::new();
            for line in std::io::BufReader::new(log).lines().map_while(Result::ok) {
                if line.contains("m3c stage 1/2") && line.contains("KV pool") {
                    let _ = up_tx.send(());
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        let pid = stage1();
        if !after.is_zero() {
            // A fault while decoding: after the start-up (a loaded machine
            // once took more than the wait alone), then the wait.
            assert!(up.recv_timeout(Duration::from_secs(60)).is_ok(), "{name}: stage 1 never reported its start-up");
        }
        std::thread::sleep(after);
        let t0 = std::time::Instant::now();
        fault(&pid);
        let o = child.wait_with_output().unwrap();
        let took = t0.elapsed();
        let e = reader.join().unwrap();
        eprintln!("{name}: the job ended {:.1} s after the fault", took.as_secs_f64());
        assert!(!o.status.success() && took < Duration::from_secs(25), "{name}: {:?} after {took:?}:\n{e}", o.status);
        assert!(e.contains("stage 1") || e.contains("stage-1"), "{name}: the lost stage is named:\n{e}");
        // A cut-off host learns of the cut from Open MPI's TCP keepalives
        // (5 s idle, then 3 probes 2 s apart: 11 s) after its stage's own
        // timeout; once, in a full run on two loaded cores, that took over
        // 20 s, so allow twice that.
        let took = hosts.assert_quiet(name, Duration::from_secs(45));
        eprintln!("{name}: every host was quiet {:.1} s after the job ended", took.as_secs_f64());
    }
}

/// Stage 0 on another host than the front: an image chat's pixels and a
/// prompts file of ids reach it over mpirun's input. Both files sit in
/// the front's private temporary folder, which no other host sees; the
/// answers are one host's.
#[test]
fn prompts_and_images_reach_a_remote_first_stage_over_the_wire() {
    let Some(hosts) = Hosts::new(2) else { return };
    let model = fixture("tiny-m3");
    let png = fixture("vision/A_rgb_56x84_noresize.png");
    let (png_s, model_s) = (png.to_str().unwrap(), model.to_str().unwrap());
    let chat =
        ["--chat", "What is in this picture?", "--thinking", "disabled", "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos"];
    let one_host = crate::shared::out("tiny-m3", 2);
    let o = m3c_run(&one_host, &model, &[&chat[..], &["--image", png_s]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let want_chat = m3c_tests::stdout(&o);
    let ids = ["--max-new-tokens", "3", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5"];
    let o = m3c_run(&one_host, &model, &ids);
    assert!(o.status.success(), "{}", stderr(&o));
    let want_ids = m3c_tests::stdout(&o);

    let out = remote_first_stage(&hosts, "wire");
    let bin = m3c_tests::m3c_bin();
    let run = [bin.to_str().unwrap(), "run", out.to_str().unwrap(), "--model", model_s];
    // `sh -c SCRIPT sh FILE COMMAND...`: the file copied into this host's
    // private TMPDIR, then the command run with it.
    let with_private = |script: &str, file: &str, rest: &[&str]| {
        let cmd = [&["sh", "-c", script, "sh", file][..], &run[..], rest].concat();
        let o = hosts.run(0, &cmd, Duration::from_secs(120));
        assert!(o.status.success(), "{script}: {}", stderr(&o));
        let e = stderr(&o);
        let banner = e.lines().find(|l| l.starts_with("m3c stage 0/2:") && l.contains("kernel thread(s)"));
        assert!(banner.is_some_and(|l| l.ends_with(&format!("on host {}", hosts.ns(1)))), "stage 0 is not on host 1:\n{e}");
        m3c_tests::stdout(&o)
    };
    let got = with_private(r#"cp "$1" "$TMPDIR/a.png" && shift && exec "$@" --image "$TMPDIR/a.png""#, png_s, &chat);
    assert_eq!(got, want_chat, "an image chat with stage 0 on another host");
    let got = with_private(r#"printf '%s\n' "$1" 4,5 > "$TMPDIR/ids" && shift && exec "$@" --prompts "$TMPDIR/ids""#, "1,2,3", &ids[..2]);
    assert_eq!(got, want_ids, "a prompts file with stage 0 on another host");
}

/// A running `m3c serve` on host 0 of `hosts`: its process, its log and
/// its port, once `/health` answers 200.
struct RemoteServer {
    child: std::process::Child,
    log: std::sync::Arc<std::sync::Mutex<String>>,
    port: String,
    /// The host it runs on.
    on: usize,
}

/// `m3c serve OUT --model MODEL` on an ephemeral port as `tiny`, with the
/// stages' timeout at 3 s, then `extra`.
fn serve_line(out: &std::path::Path, model: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let bin = m3c_tests::m3c_bin();
    let (bin, out, model) = (bin.to_str().unwrap(), out.to_str().unwrap(), model.to_str().unwrap());
    let base = [bin, "serve", out, "--model", model, "--port", "0", "--served-model-name", "tiny", "--timeout-s", "3"];
    base.iter().chain(extra).map(|a| a.to_string()).collect()
}

impl RemoteServer {
    /// The log's account of each recovery (for the issue's table).
    fn recoveries(&self) -> Vec<String> {
        let parts = ["taken as lost", "restart:", "up again", "after the restart", "now run on"];
        self.log().lines().filter(|l| parts.iter().any(|p| l.contains(p))).map(str::to_string).collect()
    }

    fn start(hosts: &Hosts, args: &[String]) -> RemoteServer {
        RemoteServer::start_on(hosts, 0, args)
    }

    /// `args` (an `m3c serve` command line, `--port 0`) on host `on`.
    fn start_on(hosts: &Hosts, on: usize, args: &[String]) -> RemoteServer {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut child = hosts.spawn(on, &args, Duration::from_secs(300));
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let (err, l) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                // `m3c serve: http://ADDR:PORT/v1 serves ...`
                if let Some(rest) = line.strip_prefix("m3c serve: http://") {
                    let port = rest.split('/').next().and_then(|a| a.rsplit(':').next()).unwrap_or("");
                    let _ = tx.send(port.to_string());
                }
                l.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let port = rx.recv_timeout(Duration::from_secs(90)).unwrap_or_else(|_| panic!("serve did not start:\n{}", log.lock().unwrap()));
        let s = RemoteServer { child, log, port, on };
        let t0 = std::time::Instant::now();
        while s.health(hosts) != 200 {
            assert!(t0.elapsed() < Duration::from_secs(90), "/health never answered 200:\n{}", s.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        s
    }

    /// SIGTERM to the server itself. Its `timeout` wrapper would pass a
    /// signal on to it and then to its whole process group, so the server
    /// got two, and a second SIGTERM means "stop now", not "drain".
    fn terminate(&self, hosts: &Hosts) {
        let is_serve = |p: &String| {
            let c = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            c.split(|&b| b == 0).nth(1) == Some(b"serve".as_slice())
        };
        let pid = hosts.pids(self.on).into_iter().find(is_serve).and_then(|p| p.parse::<i32>().ok());
        let pid = pid.unwrap_or_else(|| panic!("no m3c serve process on host {}: {}", self.on, hosts.left()));
        // SAFETY: kill(2) on the server this test started, found by its command line.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// `/health`'s status, asked from the server's host (0: no answer).
    fn health(&self, hosts: &Hosts) -> u16 {
        let url = format!("http://127.0.0.1:{}/health", self.port);
        let o = hosts.run(self.on, &["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", "5", &url], Duration::from_secs(10));
        String::from_utf8_lossy(&o.stdout).trim().parse::<u16>().unwrap_or(0)
    }

    /// Runs `fault` under a client's stream: `/health` must answer 503,
    /// the server exit with an error naming the lost pipeline within the
    /// timeout and a grace, and no process be left on any host.
    fn fails_cleanly(mut self, hosts: &Hosts, name: &str, fault: impl FnOnce()) {
        let (python, client) = (crate::serve::python(), m3c_tests::root().join("tests/serve/client.py"));
        let base = self.base();
        let cmd = [python.to_str().unwrap(), client.to_str().unwrap(), &base, "tiny", "stream"];
        let mut stream = hosts.spawn(0, &cmd, Duration::from_secs(120));
        let mut first = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stream.stdout.as_mut().unwrap()), &mut first).unwrap();
        fault();
        let t0 = std::time::Instant::now();
        let mut saw_503 = false;
        while t0.elapsed() < Duration::from_secs(20) && self.child.try_wait().unwrap().is_none() {
            if self.health(hosts) == 503 {
                saw_503 = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let status = self.child.wait().unwrap();
        let took = t0.elapsed();
        eprintln!("serve, {name}: the server ended {:.1} s after the fault", took.as_secs_f64());
        let _ = stream.wait();
        let l = self.log();
        assert!(saw_503, "{name}: /health should answer 503 once the pipeline is lost:\n{l}");
        assert!(!status.success() && took < Duration::from_secs(25), "{name}: {status:?} after {took:?}:\n{l}");
        assert!(l.contains("pipeline stopped") && l.contains("stage 0"), "{name}: {l}");
        hosts.assert_quiet(name, Duration::from_secs(20));
    }
}

/// `m3c serve` with its first stage on another host, driven by OpenAI's
/// client on the front's host: a text completion and an image chat give
/// `m3c run`'s answers. Then, under a stream, the remote stage is killed,
/// and (a second server) the remote host's link is cut: each time
/// `/health` answers 503, the server exits with an error, and no process
/// is left on either host.
#[test]
fn serve_across_hosts_answers_as_one_host_and_fails_cleanly() {
    let Some(hosts) = Hosts::new(2) else { return };
    let model = fixture("tiny-m3");
    let png = fixture("vision/A_rgb_56x84_noresize.png");
    let one_host = crate::shared::out("tiny-m3", 2);
    let prompt = "The capital of France is";
    let o =
        m3c_run(&one_host, &model, &["--prompt", prompt, "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "5", "--ignore-eos"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want_text = m3c_tests::stdout(&o).strip_suffix('\n').unwrap_or_default().to_string();
    let user = "What is in this picture?";
    let chat = ["--chat", user, "--thinking", "disabled", "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos"];
    let o = m3c_run(&one_host, &model, &[&chat[..], &["--image", png.to_str().unwrap()]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let want_image = m3c_tests::stdout(&o).strip_suffix('\n').unwrap_or_default().to_string();

    let out = remote_first_stage(&hosts, "serve");
    let serve = serve_line(&out, &model, &["--max-restarts", "0"]);
    let server = RemoteServer::start(&hosts, &serve);
    let (python, client) = (crate::serve::python(), m3c_tests::root().join("tests/serve/client.py"));
    let base = server.base();
    let call = |args: &[&str]| -> serde_json::Value {
        let cmd = [&[python.to_str().unwrap(), client.to_str().unwrap(), &base, "tiny"][..], args].concat();
        let o = hosts.run(0, &cmd, Duration::from_secs(120));
        assert!(o.status.success(), "client {args:?}: {}\n{}", stderr(&o), server.log());
        serde_json::from_str(m3c_tests::stdout(&o).lines().last().unwrap_or("")).unwrap()
    };
    let got = call(&["complete", prompt, r#"{"max_tokens": 8, "temperature": 0.8, "seed": 5, "extra_body": {"ignore_eos": true}}"#]);
    assert_eq!((got["whole"].as_str(), got["streamed"].as_str()), (Some(want_text.as_str()), Some(want_text.as_str())), "completion");
    let got = call(&["image_chat", png.to_str().unwrap(), user]);
    assert_eq!(got["text"].as_str(), Some(want_image.trim_start_matches('\n')), "image chat");
    let l = server.log();
    let banner = l.lines().find(|l| l.starts_with("m3c stage 0/2:") && l.contains("kernel thread(s)"));
    assert!(banner.is_some_and(|b| b.ends_with(&format!("on host {}", hosts.ns(1)))), "stage 0 is not on host 1:\n{l}");

    server.fails_cleanly(&hosts, "killed remote stage", || {
        for p in hosts.pids(1) {
            if std::fs::read_to_string(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.contains("stage-0")) {
                let _ = std::process::Command::new("kill").args(["-9", &p]).status();
            }
        }
    });
    // The cut last: it leaves the link down.
    RemoteServer::start(&hosts, &serve).fails_cleanly(&hosts, "cut link", || hosts.cut(1));
}

/// Before the job starts every host is checked, through mpirun with the
/// job's placement: a host without the model folder, one without the
/// executables, and one that never answers (its link down from the
/// start) are each a clear error naming the stage, the host and what is
/// missing, within --timeout-s, with no process left on either host.
#[test]
fn hosts_that_are_not_ready_are_named_before_the_job_starts() {
    let Some(hosts) = Hosts::new(2) else { return };
    let (out, model) = crate::shared::tiny(2);
    let bin = m3c_tests::m3c_bin();
    let (bin_s, out_s, model_s) = (bin.to_str().unwrap(), out.to_str().unwrap(), model.to_str().unwrap());
    let placed = hostfile(&hosts, &[0, 1]);
    let job = ["--hostfile", &placed, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--timeout-s", "3"];
    let check = |name: &str, cmd: &[&str], want: &[String]| {
        let t0 = std::time::Instant::now();
        let o = hosts.run(0, cmd, Duration::from_secs(60));
        let (took, e) = (t0.elapsed(), stderr(&o));
        eprintln!("{name}: refused after {:.1} s", took.as_secs_f64());
        assert!(!o.status.success() && took < Duration::from_secs(15), "{name}: {:?} after {took:?}:\n{e}", o.status);
        for w in want {
            assert!(e.contains(w.as_str()), "{name}: no `{w}` in:\n{e}");
        }
        assert!(!e.contains("m3c stage 0/2") && !e.contains("m3c stage 1/2"), "{name}: the stages started:\n{e}");
        hosts.assert_quiet(name, Duration::from_secs(20));
    };
    let stage1 = format!("stage 1 on host {}", hosts.ns(1));
    // The model only in the front host's private TMPDIR.
    let cmd = [
        &["sh", "-c", r#"cp -r "$1" "$TMPDIR/m" && shift && exec "$@" --model "$TMPDIR/m""#, "sh", model_s, bin_s, "run", out_s][..],
        &job,
    ]
    .concat();
    check("no model folder", &cmd, &[stage1.clone(), "/m (its config.json) is missing there".into()]);
    // The executables only there.
    let cmd =
        [&["sh", "-c", r#"cp -r "$1" "$TMPDIR/o" && shift && exec "$@" "$TMPDIR/o" --model "$0""#, model_s, out_s, bin_s, "run"][..], &job]
            .concat();
    check("no executables", &cmd, &[stage1, "/o/stage-1 is missing there".into()]);
    // Host 1 cut off before the job.
    hosts.cut(1);
    let cmd = [&[bin_s, "run", out_s, "--model", model_s][..], &job].concat();
    check("a host that never answers", &cmd, &[format!("stage 1 (hostfile host `{}`): its host did not answer within 3 s", hosts.addr(1))]);
}

/// `m3c serve --data-parallel-size 2 --hostfile` over four hosts: replica
/// 0's stages on hosts 0 and 1, replica 1's on hosts 2 and 3 (the
/// hostfile's slots in turn), both behind the front on host 0. The routers'
/// workload gives one host's text; then replica 1's stage on host 3 is
/// killed: replica 0 serves on with the same text, nothing of replica 1 is
/// left on hosts 2 and 3, and SIGTERM stops the rest with 0, every host empty.
#[test]
fn data_parallel_replicas_on_their_own_hosts_serve_and_outlive_a_lost_one() {
    let Some(hosts) = Hosts::new(4) else { return };
    let (out, model) = crate::shared::tiny(2);
    let one = crate::serve::Server::start(&out, &model, &[]);
    let want = crate::routers::workload(&one.base());
    drop(one);
    let placed = hostfile(&hosts, &[0, 1, 2, 3]);
    let serve = serve_line(&out, &model, &["--data-parallel-size", "2", "--hostfile", &placed, "--max-restarts", "0"]);
    let mut server = RemoteServer::start(&hosts, &serve);
    let health = |server: &RemoteServer| -> serde_json::Value {
        let url = format!("http://127.0.0.1:{}/health", server.port);
        let o = hosts.run(0, &["curl", "-s", "-m", "5", &url], Duration::from_secs(10));
        serde_json::from_slice(&o.stdout).unwrap_or_default()
    };
    let wait = |server: &RemoteServer, what: &str, ok: [&str; 2]| {
        let t0 = std::time::Instant::now();
        while health(server)["replicas"].as_array().is_none_or(|r| r.iter().zip(ok).any(|(r, s)| r["status"] != s)) {
            assert!(t0.elapsed() < Duration::from_secs(60), "{what}: {}\n{}", health(server), server.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait(&server, "both replicas up", ["ok", "ok"]);
    let l = server.log();
    for (r, k, host) in [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)] {
        let banner = format!("replica {r}: m3c stage {k}/2:");
        let line = l.lines().find(|line| line.starts_with(&banner) && line.contains("kernel thread(s)"));
        assert!(line.is_some_and(|b| b.ends_with(&format!("on host {}", hosts.ns(host)))), "{banner} not on host {host}:\n{l}");
    }
    let (python, client) = (crate::serve::python(), m3c_tests::root().join("tests/serve/router_client.py"));
    let workload = |server: &RemoteServer| {
        let cmd = [python.to_str().unwrap(), client.to_str().unwrap(), &server.base(), "tiny"];
        let o = hosts.run(0, &cmd, Duration::from_secs(120));
        assert!(o.status.success(), "{}\n{}", stderr(&o), server.log());
        m3c_tests::stdout(&o)
    };
    assert_eq!(workload(&server), want, "two replicas on four hosts give one host's text");
    for p in hosts.pids(3) {
        if std::fs::read_to_string(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.contains("stage-1")) {
            let _ = std::process::Command::new("kill").args(["-9", &p]).status();
        }
    }
    wait(&server, "replica 1 out", ["ok", "unavailable"]);
    assert_eq!(workload(&server), want, "replica 0 alone gives the same text");
    let t0 = std::time::Instant::now();
    while !(hosts.pids(2).is_empty() && hosts.pids(3).is_empty()) {
        assert!(t0.elapsed() < Duration::from_secs(20), "replica 1 left processes: {}", hosts.left());
        std::thread::sleep(Duration::from_millis(100));
    }
    server.terminate(&hosts);
    let status = server.child.wait().unwrap();
    assert!(status.success(), "{status:?}\n{}", server.log());
    hosts.assert_quiet("after SIGTERM", Duration::from_secs(20));
}

/// vllm-router (cache-aware) and SGLang's gateway in front of two m3c
/// replicas (pp 2 each) on hosts 1 and 2, the router and the client on
/// host 0: the router reaches the replicas over the network, and every
/// answer is the text one replica on this machine gives.
#[test]
fn routers_reach_replicas_on_their_own_hosts_and_answer_as_one_replica() {
    let Some(hosts) = Hosts::new(3) else { return };
    let (out, model) = crate::shared::tiny(2);
    let one = crate::serve::Server::start(&out, &model, &[]);
    let want = crate::routers::workload(&one.base());
    drop(one);
    let serve = serve_line(&out, &model, &["--host", "0.0.0.0"]);
    let replicas = [RemoteServer::start_on(&hosts, 1, &serve), RemoteServer::start_on(&hosts, 2, &serve)];
    let workers: Vec<String> = replicas.iter().map(|r| format!("http://{}:{}", hosts.addr(r.on), r.port)).collect();
    let venv = |b: &str| m3c_tests::root().join(".venv-router/bin").join(b);
    let (python, client) = (crate::serve::python(), m3c_tests::root().join("tests/serve/router_client.py"));
    for (program, policy) in [("vllm-router", "cache_aware"), ("smg", "cache_aware")] {
        let port = "30123";
        let prog = venv(program);
        let mut args = vec![prog.to_str().unwrap()];
        if program == "smg" {
            args.push("launch");
        }
        args.push("--worker-urls");
        args.extend(workers.iter().map(String::as_str));
        args.extend(["--policy", policy, "--host", "127.0.0.1", "--port", port, "--prometheus-port", "30124"]);
        let mut router = hosts.spawn(0, &args, Duration::from_secs(200));
        let base = format!("http://127.0.0.1:{port}/v1");
        let t0 = std::time::Instant::now();
        while !hosts.run(0, &["curl", "-sf", "-m", "2", &format!("{base}/models")], Duration::from_secs(5)).status.success() {
            assert!(t0.elapsed() < Duration::from_secs(60) && router.try_wait().unwrap().is_none(), "{program} did not come up");
            std::thread::sleep(Duration::from_millis(200));
        }
        let o = hosts.run(0, &[python.to_str().unwrap(), client.to_str().unwrap(), &base, "tiny"], Duration::from_secs(120));
        assert!(o.status.success(), "{program}: {}", stderr(&o));
        assert_eq!(m3c_tests::stdout(&o), want, "{program} --policy {policy}: the texts differ from one replica's");
        terminate(&mut router);
    }
    for mut r in replicas {
        terminate(&mut r.child);
    }
    hosts.assert_quiet("after the replicas", Duration::from_secs(20));
}

/// SIGTERM to a process started on a host (its `timeout` wrapper passes
/// it on), and its end.
fn terminate(child: &mut std::process::Child) {
    // SAFETY: kill(2) on a child of this test, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
}

/// A pipeline across two hosts heals: its first stage, on host 1, is
/// SIGKILLed under the streams; the job is ended on both hosts, the hosts
/// are checked again, the pipeline starts again across them, and every
/// stream ends as without the fault.
#[test]
fn a_pipeline_across_hosts_heals_a_killed_remote_stage() {
    let Some(hosts) = Hosts::new(2) else { return };
    let model = fixture("tiny-m3");
    let out = remote_first_stage(&hosts, "heal");
    let serve = serve_line(&out, &model, &[]);
    let mut server = RemoteServer::start(&hosts, &serve);
    let want = fault_streams(&hosts, &server, None);
    let got = fault_streams(
        &hosts,
        &server,
        Some(&|| {
            for p in hosts.pids(1) {
                if std::fs::read_to_string(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.contains("stage-0")) {
                    let _ = std::process::Command::new("kill").args(["-9", &p]).status();
                }
            }
        }),
    );
    assert_eq!(got["answers"], want["answers"], "the streams differ after the remote stage was killed");
    assert_eq!(server.health(&hosts), 200);
    let l = server.log();
    eprintln!("{}", server.recoveries().join("\n"));
    // (Which stage mpirun names first depends on timing: the killed one,
    // or its peer that then found it gone.) Streams were under way.
    let resumed = l.lines().find_map(|l| l.split("s after it was lost; ").nth(1)?.split(' ').next()?.parse::<usize>().ok());
    assert!(resumed.is_some_and(|n| n > 0), "no stream went on after the restart:\n{l}");
    terminate(&mut server.child);
    hosts.assert_quiet("after SIGTERM", Duration::from_secs(20));
}

/// tests/serve/client.py's fault workload (6 completions and a chat) from
/// host 0 through `server`, harmed by `fault` once under way; its answers.
fn fault_streams(hosts: &Hosts, server: &RemoteServer, fault: Option<&dyn Fn()>) -> serde_json::Value {
    let (python, client) = (crate::serve::python(), m3c_tests::root().join("tests/serve/client.py"));
    let after = if fault.is_some() { "40" } else { "1000000" };
    let base = server.base();
    // 120 tokens a stream: the fault must land while the streams still
    // run (40 chunks in, a fast machine has the rest of 30 tokens a stream
    // done before a kill lands).
    let cmd = [python.to_str().unwrap(), client.to_str().unwrap(), &base, "tiny", "fault_streams", "6", "120", after];
    let mut c = hosts.spawn(0, &cmd, Duration::from_secs(120));
    let mut out = std::io::BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    if let Some(f) = fault {
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(line.trim(), "fault", "{}", server.log());
        f();
        line.clear();
    }
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert!(c.wait().unwrap().success(), "the streams failed:\n{}", server.log());
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}\n{}", server.log()))
}

/// A host cut off under the streams, with a spare listed in the hostfile
/// (hosts 0 and 1 hold the stages, host 2 is the spare): the stage on
/// host 0 finds its peer silent within --timeout-s, the pipeline starts
/// again on hosts 0 and 2, and every stream ends as without the fault.
#[test]
fn a_cut_host_is_replaced_by_a_spare_and_no_stream_changes() {
    let Some(hosts) = Hosts::new(3) else { return };
    let (out, model) = crate::shared::tiny(2);
    let placed = hostfile(&hosts, &[0, 1, 2]);
    let serve = serve_line(&out, &model, &["--hostfile", &placed]);
    let mut server = RemoteServer::start(&hosts, &serve);
    let want = fault_streams(&hosts, &server, None);
    let got = fault_streams(&hosts, &server, Some(&|| hosts.cut(1)));
    assert_eq!(got["answers"], want["answers"], "the streams differ after host 1 was cut off");
    assert_eq!(server.health(&hosts), 200);
    let l = server.log();
    eprintln!("{}", server.recoveries().join("\n"));
    assert!(l.contains(&format!("host {} is taken as lost", hosts.addr(1))), "{l}");
    assert!(l.contains(&format!("the stages now run on {}, {}", hosts.addr(0), hosts.addr(2))), "{l}");
    let banner = l.lines().rev().find(|line| line.starts_with("m3c stage 1/2:") && line.contains("kernel thread(s)"));
    assert!(banner.is_some_and(|b| b.ends_with(&format!("on host {}", hosts.ns(2)))), "stage 1 is not on the spare:\n{l}");
    terminate(&mut server.child);
}

/// `--data-parallel-size 2` over five hosts: replica 0 on hosts 0 and 1,
/// replica 1 on hosts 2 and 3, host 4 a spare. Host 3 is cut off under
/// the streams: replica 1 starts again on hosts 2 and 4 (never on replica
/// 0's), replica 0 is untouched, and every stream ends as without the fault.
#[test]
fn a_data_parallel_replica_that_loses_a_host_takes_the_spare() {
    let Some(hosts) = Hosts::new(5) else { return };
    let (out, model) = crate::shared::tiny(2);
    let placed = hostfile(&hosts, &[0, 1, 2, 3, 4]);
    let serve = serve_line(&out, &model, &["--data-parallel-size", "2", "--hostfile", &placed]);
    let mut server = RemoteServer::start(&hosts, &serve);
    let want = fault_streams(&hosts, &server, None);
    let got = fault_streams(&hosts, &server, Some(&|| hosts.cut(3)));
    assert_eq!(got["answers"], want["answers"], "the streams differ after host 3 was cut off");
    // The streams may all have gone to replica 0 (routing follows load and
    // cache): replica 1 then learns of the cut by its own stages' timeout.
    let t0 = std::time::Instant::now();
    while !server.log().contains("replica 1: the pipeline is up again") {
        assert!(t0.elapsed() < Duration::from_secs(90), "replica 1 never came back:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(server.health(&hosts), 200);
    let l = server.log();
    eprintln!("{}", server.recoveries().join("\n"));
    assert!(l.contains(&format!("replica 1: host {} is taken as lost", hosts.addr(3))), "{l}");
    assert!(l.contains(&format!("replica 1: the stages now run on {}, {}", hosts.addr(2), hosts.addr(4))), "{l}");
    assert!(!l.contains("replica 0: the stages now run on"), "replica 0 moved:\n{l}");
    let banner = l.lines().rev().find(|line| line.starts_with("replica 1: m3c stage 1/2:") && line.contains("kernel thread(s)"));
    assert!(banner.is_some_and(|b| b.ends_with(&format!("on host {}", hosts.ns(4)))), "replica 1's stage 1 is not on the spare:\n{l}");
    terminate(&mut server.child);
}
