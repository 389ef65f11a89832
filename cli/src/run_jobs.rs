//! The jobs of one `m3c run`: the first, and while `--max-restarts` allows,
//! one more each time the pipeline is lost (a stage killed, a host or link
//! lost, a peer silent). A restarted job runs only the unfinished prompts,
//! each going on where it was ([`Journal`]), on a spare host from the
//! hostfile where one is listed and a host was lost. A job that fails on
//! its own terms (bad input, a non-finite logit, a pipeline that never came
//! up) ends the run as before: running it again would fail the same way.

use crate::run_journal::Journal;
use anyhow::{bail, Context, Result};
use m3c_contract::images::SeqImages;
use m3c_contract::protocol::SeqRequest;
use m3c_contract::stage_args::{Prompts, StageArgs};
use m3c_front::launch::{Compiled, Launch, StageLog};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};

/// What every job of the run is made of.
pub(crate) struct RunJobs<'a> {
    pub compiled: &'a Compiled,
    pub launch: &'a Launch,
    /// The stage arguments (the prompt count is each job's own).
    pub stage: StageArgs,
    /// One request per prompt, in the run's numbering.
    pub requests: Vec<SeqRequest>,
    pub images: BTreeMap<usize, SeqImages>,
    /// Restarts allowed (0: a lost pipeline ends the run).
    pub max_restarts: usize,
    /// Whether the stages' output carries a timeline (`--trace`).
    pub trace: bool,
}

/// What the run's jobs left: the journal, the timeline, and whether the
/// output's reader went away (the run was stopped for it).
pub(crate) struct Ran {
    pub journal: Journal,
    pub collected: Option<m3c_front::trace::Collected>,
    pub reader_gone: bool,
}

impl RunJobs<'_> {
    /// Runs the jobs until the prompts are done or the run fails. Event
    /// lines go to `sink` in the run's numbering (`None`: the journal keeps
    /// them, and other lines go to standard output).
    pub(crate) fn run(mut self, mut sink: Option<impl Write>) -> Result<Ran> {
        let mut journal = Journal::new(self.requests.len());
        let (mut restarts, mut lost_hosts) = (0, Vec::<String>::new());
        let mut placement = self.compiled.placement();
        let mut collected = None;
        loop {
            let (requests, ends) = journal.next_job(&self.requests, &self.stage.eos_ids);
            // Ends the lost job's last words lost, as its tokens say them.
            if let Some(w) = sink.as_mut() {
                for l in &ends {
                    if writeln!(w, "{l}").and_then(|_| w.flush()).is_err() {
                        return Ok(Ran { journal, collected, reader_gone: true });
                    }
                }
            }
            if requests.is_empty() {
                // Lost after every prompt had its answer: nothing to run again.
                eprintln!("m3c run: every prompt had finished before the pipeline was lost; nothing is run again");
                return Ok(Ran { journal, collected, reader_gone: false });
            }
            self.stage.prompts = Prompts::Stdin(requests.len());
            let job = self.job(&placement, requests, &mut journal, sink.as_mut())?;
            collected = job.collected;
            if let Some(sig) = job.interrupted {
                bail!("interrupted (signal {sig}): the pipeline was stopped");
            }
            if job.reader_gone {
                return Ok(Ran { journal, collected, reader_gone: true });
            }
            if job.status.success() {
                if let Some(e) = job.unread {
                    bail!("reading the pipeline's output: {e}");
                }
                if journal.unfinished() > 0 {
                    bail!("the pipeline ended with {} prompt(s) unanswered; a stage's output was lost", journal.unfinished());
                }
                return Ok(Ran { journal, collected, reader_gone: false });
            }
            let hosts = self.compiled.rank_hosts(&placement, self.launch);
            let why = failure(self.compiled, &hosts, job.status, &job.log);
            // The first job must come up: one that never did fails as at start-up.
            let cause = fault(job.status, &job.log).filter(|_| journal.up() || restarts > 0);
            let Some(cause) = cause.filter(|_| restarts < self.max_restarts) else {
                if cause.is_some() && self.max_restarts > 0 {
                    bail!("{why}; the pipeline was started again {restarts} time(s), the --max-restarts limit");
                }
                bail!(why);
            };
            restarts += 1;
            let silent =
                job.log.first_error.as_deref().and_then(m3c_contract::lost_peer::rank_in).and_then(|k| hosts.get(k).cloned().flatten());
            if let Some(h) = job.log.end.lost_node.clone().or(silent).filter(|h| !lost_hosts.contains(h)) {
                lost_hosts.push(h);
                if let Some(p) = self.compiled.avoiding(self.launch, &lost_hosts, std::slice::from_ref(&hosts), 0) {
                    let on: Vec<String> =
                        self.compiled.rank_hosts(&p, self.launch).into_iter().map(|h| h.unwrap_or_else(|| "here".into())).collect();
                    eprintln!("m3c run: host {} is taken as lost; the stages now run on {}", lost_hosts.join(", "), on.join(", "));
                    placement = p;
                }
            }
            eprintln!(
                "m3c run: {why} (cause {cause}); starting the pipeline again ({restarts} of at most {}): {} unfinished prompt(s) go on where they were",
                self.max_restarts,
                journal.unfinished()
            );
        }
    }

    /// One job: launched, fed its requests, its output read to the end.
    fn job(
        &self,
        placement: &m3c_front::launch::Placement,
        requests: Vec<SeqRequest>,
        journal: &mut Journal,
        sink: Option<&mut impl Write>,
    ) -> Result<Job> {
        let frames = stdin_frames(requests, &self.images);
        let mut cmd = self.compiled.mpirun_placed(&self.stage, self.launch, placement)?;
        cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().map_err(m3c_front::launch::spawn_error)?;
        // mpirun passes its input to the first stage, wherever that runs; a
        // writer of its own, since the stage reads it only once it is up. A
        // job that ends first closes the pipe, which ends the writer.
        //
        // The input stays open until mpirun has ended (`_hold` drops then):
        // the stage reads exactly its prompts and needs no end of input,
        // and Open MPI 4.1's mpirun can crash on one. Its stdin handler
        // reads the end after the write side to the stage was released
        // (after a burst of image bytes held it back) and follows a null
        // pointer (orte_iof_hnp_read_local_handler, SIGSEGV in CI).
        let (_hold, held) = std::sync::mpsc::channel::<()>();
        if let Some(mut input) = child.stdin.take() {
            std::thread::spawn(move || {
                for f in frames {
                    if input.write_all(&f).is_err() {
                        return;
                    }
                }
                let _ = held.recv();
            });
        }
        // A stage that failed gives mpirun its --timeout-s to end the job.
        let grace = std::time::Duration::from_secs_f64(self.stage.timeout_s + 2.0);
        let reaper = m3c_front::launch::reap_after_error(&mut child, grace);
        // SIGINT/SIGTERM to m3c are passed on to mpirun, which ends the job.
        let forwarding = m3c_signals::ChildRegistration::new(child.id());
        let pipe = child.stdout.take().context("mpirun's standard output")?;
        // The trace's lines are taken out of the stages' output.
        let (output, tap): (Box<dyn BufRead>, _) = if self.trace {
            let (rest, tap) = m3c_front::trace::tap(pipe);
            (Box::new(rest), Some(tap))
        } else {
            (Box::new(std::io::BufReader::new(pipe)), None)
        };
        let (reader_gone, unread) = pump(output, journal, sink);
        if reader_gone {
            // Nobody reads the output any more: end the job rather than
            // leave a stage blocked on a write.
            let _ = child.kill();
        }
        let status = child.wait().context("waiting for mpirun")?;
        let log = reaper.join().unwrap_or_default();
        let collected = tap.map(|t| t.join().unwrap_or_default());
        let interrupted = forwarding.received();
        Ok(Job { status, log, collected, interrupted, reader_gone, unread })
    }
}

/// A job's end: mpirun's exit status and what the job's standard error said.
struct Job {
    status: std::process::ExitStatus,
    log: StageLog,
    collected: Option<m3c_front::trace::Collected>,
    interrupted: Option<i32>,
    reader_gone: bool,
    /// Why the job's output could not be read to its end, if it could not.
    unread: Option<std::io::Error>,
}

/// Passes a job's output through the journal to the sink (or, without
/// one, its lines that are no event to standard output), to its end:
/// whether the sink's reader went away, and a read error, if one ended it.
/// Bytes that are not UTF-8 pass on replaced, as the reader would see them.
fn pump(mut output: Box<dyn BufRead>, journal: &mut Journal, mut sink: Option<&mut impl Write>) -> (bool, Option<std::io::Error>) {
    let mut raw = Vec::new();
    loop {
        raw.clear();
        match output.read_until(b'\n', &mut raw) {
            Ok(0) => return (false, None),
            Ok(_) => {}
            Err(e) => return (false, Some(e)),
        }
        let text = String::from_utf8_lossy(&raw);
        for line in journal.line(text.trim_end_matches(['\n', '\r'])) {
            let wrote = match sink.as_mut() {
                Some(w) => writeln!(w, "{line}").and_then(|_| w.flush()),
                None if m3c_contract::protocol::Event::parse(&line).is_some() => Ok(()),
                None => {
                    let mut out = std::io::stdout().lock();
                    writeln!(out, "{line}").and_then(|_| out.flush())
                }
            };
            if wrote.is_err() {
                return (true, None);
            }
        }
    }
}

/// The cause of a job's end when it was a lost pipeline, which a restart
/// heals: a stage killed by a signal, a host whose Open MPI daemon was
/// lost, or a stage that found a peer silent.
/// mpirun's own crash counts too: its stages die with it (each is set to),
/// so a new start begins from nothing left behind.
fn fault(status: std::process::ExitStatus, job: &StageLog) -> Option<&'static str> {
    let end = &job.end;
    if end.lost_node.is_some() {
        Some("lost_host")
    } else if job.first_error.as_deref().and_then(m3c_contract::lost_peer::rank_in).is_some() {
        Some("silent_peer")
    } else if end.killed.is_some() && !end.stage_error {
        Some("signal")
    } else if launcher_crash(status, job).is_some() {
        Some("launcher_crash")
    } else {
        None
    }
}

/// The signal that ended mpirun itself when it crashed: a crash signal,
/// and nothing in the stages' log (a stage's error, a killed stage, a lost
/// host) that explains the end. m3c's own kills (SIGKILL after the grace,
/// forwarded SIGINT/SIGTERM) are no crash.
fn launcher_crash(status: std::process::ExitStatus, job: &StageLog) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    let signal = status.signal()?;
    let crash = [libc::SIGSEGV, libc::SIGBUS, libc::SIGABRT, libc::SIGILL, libc::SIGFPE].contains(&signal);
    let explained = job.end.stage_error || job.end.killed.is_some() || job.end.lost_node.is_some() || job.first_error.is_some();
    (crash && !explained).then_some(signal)
}

/// A crash signal's name, for the messages (`signal 11 (SIGSEGV)`).
fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGABRT => "SIGABRT",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        _ => return format!("signal {signal}"),
    };
    format!("signal {signal} ({name})")
}

/// What a failed job's end says: the lost host and its stages, the killed
/// stage, or the first stage's own words.
/// `hosts`: each rank's host in the job's placement (a spare's, after a move).
fn failure(compiled: &Compiled, hosts: &[Option<String>], status: std::process::ExitStatus, job: &StageLog) -> String {
    let end = &job.end;
    if let Some(node) = &end.lost_node {
        let on = |k: &usize| hosts.get(*k).is_some_and(|h| h.as_deref() == Some(node.as_str()));
        let stages: Vec<String> = (0..compiled.stages).filter(on).map(|k| format!("stage {k}")).collect();
        let which = if stages.is_empty() { "the stage(s)".to_string() } else { stages.join(" and ") };
        return format!(
            "{which} on host {node} was lost: Open MPI lost its daemon there (the host went down or was cut off, or the daemon was killed)"
        );
    }
    let code = status.code().map_or("signal".into(), |c| c.to_string());
    // A stage killed outright prints nothing, and a stage's last words
    // can be lost when mpirun tears the job down: name what mpirun saw.
    if let Some((rank, node, signal)) = end.killed.clone().filter(|_| !end.stage_error) {
        return format!("the pipeline failed (mpirun exit status {code}): stage {rank} was killed on {node} by signal {signal}");
    }
    // The stage's own words are the error; mpirun's report of the abort
    // was left out of the log.
    if let Some(first) = &job.first_error {
        // A stage killed outright (out of memory, say) says nothing; the
        // first words may be a peer's about it, so the kill is said too.
        let kill = end.killed.as_ref().map(|(r, n, s)| format!("; mpirun saw stage {r} killed on {n} by signal {s}")).unwrap_or_default();
        return format!("{first} (the pipeline stopped; mpirun exit status {code}{kill})");
    }
    if let Some(signal) = launcher_crash(status, job) {
        return format!(
            "mpirun itself crashed ({}) and took the pipeline with it; no stage reported an error (Open MPI's report is above; --max-restarts starts the pipeline again after such a crash)",
            signal_name(signal)
        );
    }
    format!("the pipeline failed (mpirun exit status {code}); the failing stage's message is above")
}

/// The run's requests as the first stage reads them on its standard input
/// (`--stdin-prompts`): one framed `add` per request, complete as `m3c
/// serve` sends them, with its images (an images file of its own, as
/// sequence 0).
fn stdin_frames(requests: Vec<SeqRequest>, images: &BTreeMap<usize, SeqImages>) -> Vec<Vec<u8>> {
    use m3c_contract::protocol::Command;
    requests
        .into_iter()
        .enumerate()
        .map(|(k, r)| {
            // A request keeps the run's number until here (its images go by
            // it); the job numbers its requests from 0.
            let images = images.get(&r.seq).map(|im| m3c_contract::images::encode(&BTreeMap::from([(0usize, im.clone())])).into());
            Command::Add(SeqRequest { seq: k, images, ..r }).to_bytes()
        })
        .collect()
}
