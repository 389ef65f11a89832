//! Starting a compiled OUT folder's stages under mpirun, for `m3c run` and
//! `m3c serve`: the manifest read and every executable checked against it,
//! then one rank per stage on the plan's hosts, every stage with the same
//! arguments.

use anyhow::{bail, Context, Result};
use m3c_contract::manifest::{sha256_hex, Manifest};
use m3c_contract::stage_args::StageArgs;
use std::path::{Path, PathBuf};

/// How mpirun places and connects the ranks beyond the plan's hosts: a
/// hostfile (Open MPI's format) and extra mpirun options, from
/// `M3C_MPIRUN_ARGS` (split at whitespace) and then each `--mpirun-arg`.
/// `OMPI_MCA_*` variables in the environment reach mpirun as they are.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Launch {
    pub hostfile: Option<PathBuf>,
    pub mpirun_args: Vec<String>,
    /// The network interface (or subnet, `10.0.0.0/24`) the stages talk
    /// over: Open MPI's TCP traffic and NCCL's sockets.
    pub iface: Option<String>,
}

impl Launch {
    /// The launch of `--hostfile` and `--mpirun-arg`s, with
    /// `M3C_MPIRUN_ARGS` first; a hostfile that cannot be read is an error
    /// naming it.
    pub fn new(hostfile: Option<PathBuf>, mpirun_args: &[String], iface: Option<String>) -> Result<Launch> {
        if let Some(f) = &hostfile {
            std::fs::File::open(f).with_context(|| format!("--hostfile {}: cannot be read", f.display()))?;
        }
        let env = std::env::var("M3C_MPIRUN_ARGS").unwrap_or_default();
        let mpirun_args = env.split_ascii_whitespace().map(str::to_string).chain(mpirun_args.iter().cloned()).collect();
        if let Some(i) = &iface {
            if i.is_empty() || !i.chars().all(|c| c.is_ascii_alphanumeric() || ".-_:/@".contains(c)) {
                bail!("--iface `{i}`: expected a network interface name (eth0) or a subnet (10.0.0.0/24)");
            }
        }
        Ok(Launch { hostfile, mpirun_args, iface })
    }
}

/// A compiled OUT folder whose executables are the ones its manifest lists.
pub struct Compiled {
    pub out: PathBuf,
    pub manifest: Manifest,
    pub stages: usize,
}

impl Compiled {
    /// Reads OUT's manifest and checks each stage's sha256 against it, and
    /// that `model` is a folder.
    pub fn open(out: &Path, model: &Path) -> Result<Compiled> {
        let file = out.join("manifest.json");
        let text = m3c_contract::read_user_file(&file, "manifest", 64 << 20).with_context(|| {
            format!("{}: not an m3c output folder (no readable manifest.json); make one with `m3c compile`", out.display())
        })?;
        let manifest = Manifest::parse(&text).with_context(|| format!("{}: cannot be used", file.display()))?;
        if !model.is_dir() {
            bail!("--model {}: not a folder (expected the checkpoint folder with config.json and safetensors)", model.display());
        }
        // Each executable must be the one compiled: a damaged or swapped file
        // would otherwise surface as a crash ("exit status 139") mid-job.
        for (k, entry) in manifest.stages.iter().enumerate() {
            let exe = out.join(format!("stage-{k}"));
            let bytes = m3c_contract::input::read_bytes(&exe, "stage executable", 16 << 30)
                .with_context(|| format!("{}: missing or unreadable; recompile {}", exe.display(), out.display()))?;
            if sha256_hex(&bytes) != entry.sha256 {
                bail!(
                    "{}: is not the executable manifest.json lists (its sha256 differs: damaged or replaced); recompile {}",
                    exe.display(),
                    out.display()
                );
            }
        }
        let stages = manifest.stages.len();
        Ok(Compiled { out: out.to_path_buf(), manifest, stages })
    }

    /// Whether the first stage encodes images (it holds the vision tower).
    pub fn encodes_images(&self) -> bool {
        self.manifest.encodes_images()
    }

    /// Cache bytes per position of each stage (every cache row of a
    /// sequence), from the manifest's cache slots.
    pub fn cache_bytes_per_position(&self) -> Vec<u64> {
        self.manifest.cache_bytes_per_position()
    }

    /// `mpirun` over the stages, each given `stage`'s arguments; mpirun
    /// dies with this process (even by SIGKILL) and takes its ranks with
    /// it. A job that spans hosts has them checked first
    /// ([`Compiled::preflight`], within the stages' `--timeout-s`).
    pub fn mpirun(&self, stage: &StageArgs, launch: &Launch) -> Result<std::process::Command> {
        if let (true, Some(model)) = (self.spans_hosts(launch), stage.weights.checkpoint()) {
            self.preflight(model, launch, std::time::Duration::from_secs_f64(stage.timeout_s))?;
        }
        let args = stage.to_args();
        Ok(self.mpirun_each(launch, |k, cmd| {
            cmd.arg(self.out.join(format!("stage-{k}"))).args(&args);
        }))
    }

    /// The stages placed on `node` (a plan host, or by the launch's
    /// hostfile filled in order, slot by slot).
    pub fn stages_on(&self, node: &str, launch: &Launch) -> Vec<usize> {
        let by_file = launch.hostfile.as_deref().and_then(hostfile_slots).unwrap_or_default();
        (0..self.stages)
            .filter(|&k| match &self.manifest.stages[k].host {
                Some(h) => h == node,
                None => by_file.get(k).is_some_and(|h| h == node),
            })
            .collect()
    }

    /// Whether the job may leave this machine: a stage names a host, or
    /// the launch places ranks (a hostfile, or mpirun's own host options).
    pub fn spans_hosts(&self, launch: &Launch) -> bool {
        self.manifest.stages.iter().any(|s| s.host.is_some())
            || launch.hostfile.is_some()
            || launch
                .mpirun_args
                .iter()
                .any(|a| ["--host", "-H", "--hostfile", "--machinefile", "--default-hostfile"].contains(&a.as_str()))
    }

    /// Checks every stage's host before the job starts, through mpirun with
    /// the job's own placement: that it answers within `deadline`, that
    /// it has this OUT's executable (the same bytes: an OUT compiled
    /// elsewhere is refused) and the model folder's `config.json`. A job
    /// that would fail at start-up on a host fails here instead, naming
    /// the host and the path, and a host that never answers cannot hang
    /// the launch.
    pub fn preflight(&self, model: &Path, launch: &Launch, deadline: std::time::Duration) -> Result<()> {
        use std::io::Read;
        let mut cmd = self.mpirun_each(launch, |k, cmd| {
            cmd.args(["/bin/sh", "-c", PREFLIGHT, "m3c-preflight", &k.to_string()])
                .arg(self.out.join(format!("stage-{k}")))
                .arg(model)
                .arg(&self.manifest.stages[k].sha256);
        });
        // A group of its own, so that a launch stuck on a host ends whole:
        // mpirun and the agents it started (ssh, or whatever reaches the host).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        cmd.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().map_err(spawn_error)?;
        let mut pipes = [child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>), child.stderr.take().map(|p| Box::new(p) as _)];
        let readers = pipes.each_mut().map(|p| {
            let p = p.take();
            std::thread::spawn(move || {
                let mut text = String::new();
                if let Some(mut p) = p {
                    let _ = p.read_to_string(&mut text);
                }
                text
            })
        });
        let t0 = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().context("waiting for mpirun's pre-flight check")? {
                break Some(s);
            }
            if t0.elapsed() > deadline {
                // SAFETY: kill has no memory-safety preconditions; the group
                // is the child's own (process_group(0)), not yet reaped.
                unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let [out, err] = readers.map(|r| r.join().unwrap_or_default());
        let mut heard: Vec<Option<(String, String)>> = vec![None; self.stages];
        for line in out.lines() {
            let w: Vec<&str> = line.split_whitespace().collect();
            if let ["m3c-preflight", k, host, verdict] = w[..] {
                if let Some(slot) = k.parse::<usize>().ok().and_then(|k| heard.get_mut(k)) {
                    *slot = Some((host.to_string(), verdict.to_string()));
                }
            }
        }
        let mut problems = Vec::new();
        let by_file = launch.hostfile.as_deref().and_then(hostfile_slots).unwrap_or_default();
        for (k, h) in heard.iter().enumerate() {
            let exe = self.out.join(format!("stage-{k}"));
            let placed = match (&self.manifest.stages[k].host, by_file.get(k)) {
                (Some(h), _) => format!("plan host `{h}`"),
                (None, Some(h)) => format!("hostfile host `{h}`"),
                (None, None) => "placed by mpirun".to_string(),
            };
            match h {
                Some((_, v)) if v == "ok" => {}
                Some((host, v)) if v == "no-exe" => {
                    problems.push(format!("stage {k} on host {host}: {} is missing there (copy {} to the same path on every host)", exe.display(), self.out.display()))
                }
                Some((host, v)) if v == "other-exe" => problems.push(format!(
                    "stage {k} on host {host}: {} there is not the executable this manifest lists (an older or another compile); copy {} to every host again",
                    exe.display(),
                    self.out.display()
                )),
                Some((host, _)) => problems.push(format!(
                    "stage {k} on host {host}: the model folder {} (its config.json) is missing there; each host needs the checkpoint at the same path",
                    model.display()
                )),
                None if status.is_none() => problems.push(format!(
                    "stage {k} ({placed}): its host did not answer within {:.0} s; check that mpirun reaches it (ssh, a firewall, the network interface: --iface)",
                    deadline.as_secs_f64()
                )),
                None => problems.push(format!("stage {k} ({placed}): mpirun could not start it")),
            }
        }
        if problems.is_empty() {
            return Ok(());
        }
        let tail: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).take(12).collect();
        let mpirun_said = if tail.is_empty() || status.is_none() { String::new() } else { format!("\nmpirun said:\n{}", tail.join("\n")) };
        bail!("the hosts are not ready for this job:\n  {}{mpirun_said}", problems.join("\n  "))
    }

    /// `mpirun` with the launch's placement and options, one app context
    /// per stage that `program` fills in (the program and its arguments).
    fn mpirun_each(&self, launch: &Launch, program: impl Fn(usize, &mut std::process::Command)) -> std::process::Command {
        crate::stale_sessions::sweep_mine();
        let mut cmd = std::process::Command::new("mpirun");
        // No core binding: each rank runs its kernels on several threads (the
        // runtime shares the node's cores among its ranks).
        cmd.args(["--oversubscribe", "--bind-to", "none"]);
        if let Some(f) = &launch.hostfile {
            cmd.arg("--hostfile").arg(f);
        }
        if let Some(i) = &launch.iface {
            cmd.args(["--mca", "btl_tcp_if_include", i, "--mca", "oob_tcp_if_include", i]);
            // NCCL takes interface names, not subnets.
            if !i.contains('/') {
                cmd.args(["-x", &format!("NCCL_SOCKET_IFNAME={i}")]);
            }
        }
        cmd.args(&launch.mpirun_args);
        if is_root() {
            cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        }
        // Open MPI's daemons learn that a host is gone from TCP keepalives,
        // after 8 minutes by default: a host cut off would keep its daemon
        // (and the job) waiting that long. Seconds instead, unless the user
        // set them.
        for (k, v) in [
            ("OMPI_MCA_oob_tcp_keepalive_time", "5"),
            ("OMPI_MCA_oob_tcp_keepalive_intvl", "2"),
            ("OMPI_MCA_oob_tcp_keepalive_probes", "3"),
        ] {
            if std::env::var_os(k).is_none() {
                cmd.env(k, v);
            }
        }
        for (k, entry) in self.manifest.stages.iter().enumerate() {
            if k > 0 {
                cmd.arg(":");
            }
            cmd.args(["-np", "1"]);
            // Manifest::parse checked that the host is a host name.
            if let Some(host) = &entry.host {
                cmd.args(["--host", host]);
            }
            program(k, &mut cmd);
        }
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe, as a pre_exec hook requires.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                })
            };
        }
        cmd
    }
}

/// Each pre-flight rank's check (`sh -c PREFLIGHT m3c-preflight K EXE
/// MODEL SHA256`): one line, `m3c-preflight K HOST ok|no-exe|no-model|other-exe`,
/// and exit 0 whatever it found, so that mpirun runs every rank.
const PREFLIGHT: &str = r#"k=$1; exe=$2; model=$3; sum=$4; h=$(hostname)
if [ ! -x "$exe" ]; then v=no-exe
elif [ ! -r "$model/config.json" ]; then v=no-model
elif command -v sha256sum >/dev/null 2>&1 && [ "$(sha256sum < "$exe" | cut -d ' ' -f 1)" != "$sum" ]; then v=other-exe
else v=ok; fi
echo "m3c-preflight $k $h $v""#;

/// What a failed job's standard error said about its end, beyond the
/// stages' own messages (which it forwards as they come).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct JobEnd {
    /// The node whose Open MPI daemon mpirun lost, if it said so.
    pub lost_node: Option<String>,
    /// Whether a stage printed its own fatal error.
    pub stage_error: bool,
    /// The rank, node and signal of a process that mpirun saw die by a
    /// signal (`mpirun noticed that process rank 1 with PID 7 on node h
    /// exited on signal 9 (Killed).`): a stage that could not say why.
    pub killed: Option<(usize, String, String)>,
}

impl JobEnd {
    /// Takes in one line of the job's standard error.
    fn note(&mut self, line: &str) {
        if line.starts_with("m3c stage ") && line.contains(": error: ") {
            self.stage_error = true;
        }
        // Open MPI's "  Remote daemon: [[J,0],K] on node HOST".
        if let Some(node) = line.trim_start().strip_prefix("Remote daemon:").and_then(|r| r.split(" on node ").nth(1)) {
            self.lost_node = Some(node.trim().to_string());
        }
        let Some(rest) = line.trim_start().strip_prefix("mpirun noticed that process rank ") else { return };
        let rank = rest.split_whitespace().next().and_then(|r| r.parse().ok());
        let node = rest.split(" on node ").nth(1).and_then(|r| r.split_whitespace().next());
        let signal = rest.split(" exited on signal ").nth(1).map(|s| s.trim().trim_end_matches('.').to_string());
        if let (Some(rank), Some(node), Some(signal)) = (rank, node, signal) {
            self.killed.get_or_insert((rank, node.to_string(), signal));
        }
    }
}

/// Forwards a job's standard error (piped) to ours, line by line, and ends
/// mpirun (SIGKILL) when it has not ended `grace` after a stage reported a
/// fatal error: a launcher that lost a host can wait on it for minutes
/// after the stages have given up. The caller waits for the child as
/// usual, then joins the returned thread, which returns what mpirun said
/// about the job's end.
pub fn reap_after_error(child: &mut std::process::Child, grace: std::time::Duration) -> std::thread::JoinHandle<JobEnd> {
    use std::io::{BufRead, Write};
    use std::sync::{Arc, Mutex};
    let pid = child.id() as libc::pid_t;
    let stderr = child.stderr.take();
    let failed_at: Arc<Mutex<Option<std::time::Instant>>> = Arc::default();
    let seen = failed_at.clone();
    let reader = std::thread::spawn(move || {
        let mut end = JobEnd::default();
        let Some(e) = stderr else { return end };
        for line in std::io::BufReader::new(e).lines().map_while(Result::ok) {
            let _ = writeln!(std::io::stderr(), "{line}");
            end.note(&line);
            if end.stage_error {
                seen.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(std::time::Instant::now);
            }
        }
        end
    });
    std::thread::spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(200));
        if reader.is_finished() {
            // The pipe closed: mpirun (and every rank it started here) ended.
            return reader.join().unwrap_or_default();
        }
        let late = failed_at.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|t| t.elapsed() > grace);
        if late {
            let _ = writeln!(std::io::stderr(), "m3c: mpirun did not end the failed job within {} s; killing it", grace.as_secs());
            // SAFETY: kill has no memory-safety preconditions; the pid is
            // mpirun's, whose pipe is still open, so it has not been reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            return reader.join().unwrap_or_default();
        }
    })
}

/// What a failed `spawn` of mpirun means to a user.
pub fn spawn_error(e: std::io::Error) -> anyhow::Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        anyhow::anyhow!("`mpirun` not found: install Open MPI (`apt install openmpi-bin`, or run scripts/setup.sh)")
    } else {
        anyhow::Error::new(e).context("cannot start mpirun")
    }
}

/// The host of each slot of an Open MPI hostfile (`HOST slots=N` lines),
/// in the file's order: where its default mapping puts each rank when
/// mpirun's own node is listed first or not at all (it fills its own node
/// first); `None` when a line gives no slot count (mpirun would count the
/// host's cores).
fn hostfile_slots(file: &Path) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(file).ok()?;
    let mut out = Vec::new();
    for line in text.lines().map(|l| l.split('#').next().unwrap_or("").trim()).filter(|l| !l.is_empty()) {
        let mut words = line.split_whitespace();
        let host = words.next()?;
        let slots: usize = words.find_map(|w| w.strip_prefix("slots=")).and_then(|n| n.parse().ok())?;
        out.extend(std::iter::repeat_n(host.to_string(), slots.min(1 << 16)));
    }
    Some(out)
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::JobEnd;

    #[test]
    fn mpiruns_lines_about_a_jobs_end_are_read() {
        let mut end = JobEnd::default();
        for line in [
            "Primary job  terminated normally, but 1 process returned",
            "mpirun noticed that process rank 1 with PID 23968 on node 10.77.209.2 exited on signal 9 (Killed).",
            "mpirun noticed that process rank 0 with PID 1 on node h exited on signal 15 (Terminated).",
        ] {
            end.note(line);
        }
        assert_eq!(end.killed, Some((1, "10.77.209.2".into(), "9 (Killed)".into())), "the first one mpirun names");
        assert!(!end.stage_error && end.lost_node.is_none());
        end.note("m3c stage 0/2: error: no sign of life from stage 1 for 3 s (--timeout-s): that stage stopped or was lost");
        end.note("  Remote daemon: [[5,0],1] on node 10.0.0.2");
        assert!(end.stage_error);
        assert_eq!(end.lost_node.as_deref(), Some("10.0.0.2"));
        let mut odd = JobEnd::default();
        odd.note("mpirun noticed that process rank x with PID on node");
        assert_eq!(odd, JobEnd::default(), "a line of another shape is ignored");
    }
}
