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

/// The job's standard error as the user sees it: every stage's line as it
/// comes, and Open MPI's own reports (its dashed boxes, `mpirun noticed`
/// lines) held back once a stage has said why it failed, so that the
/// stage's error is the message and not one line among a dozen of
/// mpirun's. Without a stage's error they are shown: then they are all
/// the user has. `M3C_MPI_VERBOSE=1` shows everything.
#[derive(Debug, Default)]
pub struct StageLog {
    pub end: JobEnd,
    /// The first stage error, as `stage K/N: MESSAGE`.
    pub first_error: Option<String>,
    /// Lines of an Open MPI box being read (it shows once complete).
    boxed: Option<Vec<String>>,
    /// A complete box, shown with the next line unless that line is a
    /// stage's error: mpirun's report of an abort can reach us just before
    /// the aborting stage's own words, which then are the message.
    pending: Vec<String>,
    verbose: bool,
}

impl StageLog {
    pub fn new() -> StageLog {
        StageLog { verbose: std::env::var_os("M3C_MPI_VERBOSE").is_some_and(|v| v != "0"), ..StageLog::default() }
    }

    /// Takes one line; returns the lines to show now.
    pub fn line(&mut self, line: &str) -> Vec<String> {
        self.end.note(line);
        if self.first_error.is_none() && self.end.stage_error {
            self.first_error = stage_error(line);
        }
        if self.verbose {
            return vec![line.to_string()];
        }
        let mut shown = if self.end.stage_error { Vec::new() } else { std::mem::take(&mut self.pending) };
        self.pending.clear();
        shown.extend(self.take(line));
        shown
    }

    /// [`StageLog::line`] past the box held back.
    fn take(&mut self, line: &str) -> Vec<String> {
        // A stage's own line is never held in a box (Open MPI's boxes and
        // the stages' lines interleave).
        if line.starts_with("m3c ") {
            return vec![line.to_string()];
        }
        let border = line.len() >= 20 && line.bytes().all(|b| b == b'-');
        match (self.boxed.as_mut(), border) {
            (None, true) => {
                self.boxed = Some(vec![line.to_string()]);
                Vec::new()
            }
            (Some(b), false) => {
                b.push(line.to_string());
                Vec::new()
            }
            (Some(_), true) => {
                let mut b = self.boxed.take().unwrap_or_default();
                b.push(line.to_string());
                if !self.end.stage_error {
                    self.pending = b;
                }
                Vec::new()
            }
            (None, false) if self.end.stage_error && is_mpirun_note(line) => Vec::new(),
            (None, false) => vec![line.to_string()],
        }
    }

    /// The job's output ended: a box held back, or left open, is shown as
    /// it is (unless a stage said why the job failed).
    pub fn finish(&mut self) -> Vec<String> {
        let mut shown = std::mem::take(&mut self.pending);
        shown.extend(self.boxed.take().unwrap_or_default());
        if self.end.stage_error {
            shown.clear();
        }
        shown
    }
}

/// `m3c stage K/N: error: MESSAGE` as `stage K/N: MESSAGE`.
fn stage_error(line: &str) -> Option<String> {
    let rest = line.strip_prefix("m3c ")?;
    let (who, message) = rest.split_once(": error: ")?;
    Some(format!("{who}: {message}"))
}

/// mpirun's one-line notes about a job's end (outside its boxes).
fn is_mpirun_note(line: &str) -> bool {
    let t = line.trim_start();
    // (`mpirun noticed that process rank R … exited on signal S` stays:
    // a stage killed outright says nothing itself, and that line is how
    // the user learns of it.)
    t.starts_with("mpirun has exited")
        || t.starts_with("Primary job")
        || t.starts_with("prterun")
        // `[host:pid] …` lines of Open MPI's daemons.
        || (t.starts_with('[') && t.split_once(']').is_some_and(|(h, _)| h.contains(':')))
}

/// Forwards a job's standard error (piped) to ours, line by line, and ends
/// mpirun (SIGKILL) when it has not ended `grace` after a stage reported a
/// fatal error: a launcher that lost a host can wait on it for minutes
/// after the stages have given up. The caller waits for the child as
/// usual, then joins the returned thread, which returns what the stages and
/// mpirun said about the job's end ([`StageLog`]).
pub fn reap_after_error(child: &mut std::process::Child, grace: std::time::Duration) -> std::thread::JoinHandle<StageLog> {
    use std::io::{BufRead, Write};
    use std::sync::{Arc, Mutex};
    let pid = child.id() as libc::pid_t;
    let stderr = child.stderr.take();
    let failed_at: Arc<Mutex<Option<std::time::Instant>>> = Arc::default();
    let seen = failed_at.clone();
    let reader = std::thread::spawn(move || {
        let mut log = StageLog::new();
        let Some(e) = stderr else { return log };
        for line in std::io::BufReader::new(e).lines().map_while(Result::ok) {
            for shown in log.line(&line) {
                let _ = writeln!(std::io::stderr(), "{shown}");
            }
            if log.end.stage_error {
                seen.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(std::time::Instant::now);
            }
        }
        for shown in log.finish() {
            let _ = writeln!(std::io::stderr(), "{shown}");
        }
        log
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
    fn a_stages_error_is_shown_and_open_mpis_report_after_it_is_not() {
        let border = "-".repeat(74);
        let abort =
            [border.as_str(), "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD", "with errorcode 1.", border.as_str()];
        let mut log = super::StageLog::default();
        let mut shown = Vec::new();
        shown.extend(log.line("m3c stage 0/2: embed + layers 0-3: 100 tensors mapped"));
        // A box before any stage error is all the user has: shown whole,
        // with the next line that is not a stage's error.
        for l in abort {
            shown.extend(log.line(l));
        }
        assert_eq!(shown.len(), 1, "a complete box waits for the next line: {shown:?}");
        shown.extend(log.line("m3c stage 1/2: layers 4-7 + norm + lm_head: 207 tensors mapped"));
        assert_eq!(shown.len(), 6, "{shown:?}");
        assert!(shown[1] == border && shown[5].starts_with("m3c stage 1/2: layers"), "{shown:?}");
        shown.extend(log.line("m3c stage 1/2: error: prompt 0: token id 9 is outside the vocabulary (0..4)"));
        for l in abort {
            shown.extend(log.line(l));
        }
        shown.extend(log.line("[vm:01234] 1 more process has sent help message help-mpi-api.txt / mpi-abort"));
        shown.extend(log.line("mpirun noticed that process rank 1 with PID 7 on node h exited on signal 9 (Killed)."));
        shown.extend(log.line("m3c stage 0/2: error: no sign of life from stage 1"));
        shown.extend(log.finish());
        assert_eq!(shown.len(), 9, "after the stage's error the stages' lines and the kill show: {shown:?}");
        assert!(shown[6].starts_with("m3c stage 1/2: error:") && shown[7].starts_with("mpirun noticed"), "{shown:?}");
        assert!(shown[8].starts_with("m3c stage 0/2: error:"), "{shown:?}");
        // mpirun's report of an abort that reaches us just before the
        // aborting stage's own words: the words are the message.
        let mut raced = super::StageLog::default();
        for l in abort {
            assert!(raced.line(l).is_empty());
        }
        let error = "m3c stage 0/2: error: prompt 0: token id 900 is outside the vocabulary (0..512)";
        assert_eq!(raced.line(error), [error]);
        assert!(raced.finish().is_empty());
        assert_eq!(log.first_error.as_deref(), Some("stage 1/2: prompt 0: token id 9 is outside the vocabulary (0..4)"));
        assert_eq!(log.end.killed.as_ref().map(|k| k.0), Some(1), "what is hidden is still read");
        // A stage's line inside a box is shown at once, not dropped with it.
        let mut mixed = super::StageLog::default();
        assert!(mixed.line(&border).is_empty());
        assert_eq!(mixed.line("m3c stage 0/1: error: out of memory").len(), 1);
        assert!(mixed.line("with errorcode 1.").is_empty() && mixed.line(&border).is_empty());
        // A box cut off by the job's end is shown as it is.
        let mut cut = super::StageLog::default();
        assert!(cut.line(&border).is_empty() && cut.line("ORTE was unable to start").is_empty());
        assert_eq!(cut.finish().len(), 2);
    }

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
