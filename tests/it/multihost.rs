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
    // Stage 0 on the front's host, then on the other one.
    for (name, order) in [("front_first", [0, 1]), ("stage0_remote", [1, 0])] {
        let plan = hosts.shared().join(format!("{name}.yaml"));
        std::fs::write(&plan, plan_on(&model, order.map(|i| hosts.addr(i)).each_ref().map(String::as_str))).unwrap();
        let out = hosts.shared().join(name);
        let c = m3c(&["compile", "--pp", "2", plan.to_str().unwrap(), "-o", out.to_str().unwrap()]);
        assert!(c.status.success(), "{}", stderr(&c));
        let dump = hosts.shared().join(format!("{name}.safetensors"));
        let bin = m3c_tests::m3c_bin();
        let mut cmd = vec![bin.to_str().unwrap(), "run", out.to_str().unwrap(), "--model", model.to_str().unwrap()];
        let a = args(&dump);
        cmd.extend(a.iter().map(String::as_str));
        let o = hosts.run(0, &cmd, Duration::from_secs(120));
        assert!(o.status.success(), "{name}: {}\n{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
        // Each stage says where it ran: the hosts the plan names.
        let e = stderr(&o);
        for (k, &h) in order.iter().enumerate() {
            let banner = e.lines().find(|l| l.starts_with(&format!("m3c stage {k}/2:")) && l.contains("kernel thread(s)"));
            assert!(banner.is_some_and(|l| l.ends_with(&format!("on host {}", hosts.ns(h)))), "{name}: stage {k} not on host {h}:\n{e}");
        }
        assert!(std::fs::read(&dump).unwrap() == want, "{name}: the dump differs from one host's");
    }
    // A plan without hosts, placed by a hostfile, with extra mpirun
    // options from the environment and the flags (TCP only, here).
    let hostfile = hosts.shared().join("hosts");
    std::fs::write(&hostfile, format!("{} slots=1\n{} slots=1\n", hosts.addr(1), hosts.addr(0))).unwrap();
    let out = crate::shared::out("tiny-m3", 2);
    let dump = hosts.shared().join("hostfile.safetensors");
    let bin = m3c_tests::m3c_bin();
    let (out_s, model_s, hostfile_s) = (out.to_str().unwrap(), model.to_str().unwrap(), hostfile.to_str().unwrap());
    let mut cmd = vec![bin.to_str().unwrap(), "run", out_s, "--model", model_s, "--hostfile", hostfile_s];
    cmd.extend(["--mpirun-arg=--mca", "--mpirun-arg=btl", "--mpirun-arg=tcp,self"]);
    let a = args(&dump);
    cmd.extend(a.iter().map(String::as_str));
    let o = hosts.run_env(0, &cmd, &[("M3C_MPIRUN_ARGS", "--report-bindings")], Duration::from_secs(120));
    assert!(o.status.success(), "hostfile: {}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains(&format!("on host {}", hosts.ns(1))) && e.contains(&format!("on host {}", hosts.ns(0))), "{e}");
    assert!(e.contains("MCW rank"), "M3C_MPIRUN_ARGS' --report-bindings reached mpirun: {e}");
    assert!(std::fs::read(&dump).unwrap() == want, "hostfile: the dump differs from one host's");
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
    let layers = ["0-1", "2-3", "4-5", "6-7"];
    let mut plan = format!("version: 1\nmodel: \"{}\"\ntarget: host\nstages:\n", model.display());
    for (k, l) in layers.iter().enumerate() {
        plan += &format!("  - layers: \"{l}\"\n    host: \"{}\"\n", hosts.addr(k));
        plan += if k == 0 {
            "    embedding: true\n"
        } else if k == 3 {
            "    final_norm: true\n    lm_head: true\n"
        } else {
            ""
        };
    }
    let (plan_file, out) = (hosts.shared().join("pp4.yaml"), hosts.shared().join("pp4"));
    std::fs::write(&plan_file, plan).unwrap();
    let c = m3c(&["compile", "--pp", "4", plan_file.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(c.status.success(), "{}", stderr(&c));
    let dump = hosts.shared().join("pp4.safetensors");
    let bin = m3c_tests::m3c_bin();
    let mut cmd = vec![bin.to_str().unwrap(), "run", out.to_str().unwrap(), "--model", model.to_str().unwrap()];
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
    let out = crate::shared::out("tiny-m3", 2);
    let model = fixture("tiny-m3");
    let o = m3c_run(&out, &model, &["--prompt-ids", "1,2", "--max-new-tokens", "1", "--hostfile", "/nonexistent/hosts"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--hostfile /nonexistent/hosts: cannot be read"), "{}", stderr(&o));
}

/// Faults across hosts, each mid-run: a link cut, and a remote stage
/// killed. The job ends with a clear error within the timeout (and the
/// launcher's grace after it), and no process is left on either host.
#[test]
fn a_cut_link_or_a_killed_remote_stage_ends_the_job_on_every_host() {
    let Some(hosts) = Hosts::new(2) else { return };
    let model = fixture("tiny-m3");
    let plan = hosts.shared().join("p.yaml");
    std::fs::write(&plan, plan_on(&model, [hosts.addr(0).as_str(), hosts.addr(1).as_str()])).unwrap();
    let out = hosts.shared().join("out");
    let c = m3c(&["compile", "--pp", "2", plan.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(c.status.success(), "{}", stderr(&c));
    let bin = m3c_tests::m3c_bin();
    let (out_s, model_s) = (out.to_str().unwrap(), model.to_str().unwrap());
    let cmd = [bin.to_str().unwrap(), "run", out_s, "--model", model_s, "--prompt-ids", "1,2,3"];
    let cmd = [&cmd[..], &["--max-new-tokens", "4090", "--ignore-eos", "--timeout-s", "3"]].concat();
    // The kill first: the cut leaves the link down.
    let faults: [(&str, &dyn Fn()); 2] = [
        ("killed remote stage", &|| {
            for p in hosts.pids(1) {
                if std::fs::read_to_string(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.contains("stage-1")) {
                    let _ = std::process::Command::new("kill").args(["-9", &p]).status();
                }
            }
        }),
        ("cut link", &|| hosts.cut(1)),
    ];
    for (name, fault) in faults {
        let t0 = std::time::Instant::now();
        let child = hosts.spawn(0, &cmd, Duration::from_secs(90));
        std::thread::sleep(Duration::from_millis(2500));
        fault();
        let o = child.wait_with_output().unwrap();
        let (took, e) = (t0.elapsed(), stderr(&o));
        eprintln!("{name}: the job ended {:.1} s after the fault", took.as_secs_f64() - 2.5);
        assert!(!o.status.success() && took < Duration::from_secs(25), "{name}: {:?} after {took:?}:\n{e}", o.status);
        assert!(e.contains("stage 1") || e.contains("stage-1"), "{name}: the lost stage is named:\n{e}");
        let clean = (0..20).any(|_| {
            let left = hosts.pids(0).len() + hosts.pids(1).len();
            std::thread::sleep(Duration::from_millis(500));
            left == 0
        });
        assert!(clean, "{name}: processes left: {:?} {:?}", hosts.pids(0), hosts.pids(1));
    }
}
