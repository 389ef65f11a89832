//! A job's end as mpirun reports it: the stages' standard error passed on,
//! what it says about a lost host or a killed rank, and mpirun ended when it
//! outlives a stage's fatal error.

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
