//! The check of every stage's host before a job that spans hosts starts:
//! one `sh` per stage through mpirun with the job's own placement, killed
//! as a process group at the deadline.

use super::{hostfile_slots, mpirun::spawn_error, Compiled, Launch, Placement};
use anyhow::{bail, Context, Result};
use std::path::Path;

impl Compiled {
    /// Checks every stage's host before the job starts, through mpirun with
    /// the job's own placement: that it answers within `deadline`, that
    /// it has this OUT's executable (the same bytes: an OUT compiled
    /// elsewhere is refused) and the model folder's `config.json`. A job
    /// that would fail at start-up on a host fails here instead, naming
    /// the host and the path, and a host that never answers cannot hang
    /// the launch.
    pub fn preflight(&self, model: &Path, launch: &Launch, placement: &Placement, deadline: std::time::Duration) -> Result<()> {
        use std::io::Read;
        let mut cmd = self.mpirun_each(launch, placement, |k, cmd| {
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
            let placed = match (&self.manifest.stages[k].host, placement.hosts.get(k).and_then(Option::as_ref), by_file.get(k)) {
                (Some(h), _, _) => format!("plan host `{h}`"),
                (None, Some(h), _) => format!("replica host `{h}`"),
                (None, None, Some(h)) => format!("hostfile host `{h}`"),
                (None, None, None) => "placed by mpirun".to_string(),
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
