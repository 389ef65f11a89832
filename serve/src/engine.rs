//! The front's side of the pipeline: the stages run under mpirun with
//! `--serve`; requests become `add` lines on the first stage's standard
//! input and come back as `m3c-id`/`m3c-end` lines on its standard output.
//! Here requests are admitted against the batch limit (the rest wait, up
//! to `--max-queue`; the first stage starts each sequence when the KV pool
//! has blocks for it), tokens are routed to their request, the pool's
//! figures are kept for `/metrics`, and a request that could never fit the
//! pool is a 400. A dropped [`Ticket`] cancels its request.
//!
//! The stages' log is read as it comes: a stage's fatal line loses the
//! pipeline at once (mpirun may wait minutes on a lost host). Each running
//! request keeps the tokens it sent, so when the supervisor (`lib.rs`)
//! starts the pipeline again ([`Engine::attach`], a new epoch whose earlier
//! lines are dropped), it is re-added with them and goes on where it was
//! (`resume`, `SeqRequest::resumed`). Without restarts left, a pipeline
//! that stops fails every request still open. A sequence the stage ends for
//! non-finite logits or for a grammar or budget it cannot apply
//! (`EndReason::Error`, `EndReason::Constraint`) fails that request only,
//! saying which.

use super::metrics::{Gauges, Metrics, StageStat};
use m3c_contract::protocol::{Command, EndReason, Event as StageEvent, SeqRequest, TokenLogprobs};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

/// What a request hears from the pipeline.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token, with its logprobs when the request asked.
    Token(u32, Option<TokenLogprobs>),
    /// A prompt token's logprobs (position, id), before the first token.
    Prompt(usize, u32, TokenLogprobs),
    /// `stop` (EOS), `length`, or `cancelled`.
    End(String),
    /// The pipeline stopped, or the server is shutting down.
    Failed(String),
}

/// Why a request was not taken.
#[derive(Debug, Clone, PartialEq)]
pub enum SubmitError {
    /// The waiting queue is full (503).
    QueueFull(usize),
    /// It could never fit the KV pool, even alone (400).
    TooLarge(String),
    /// The pipeline is not up (503).
    Down(String),
}

/// Limits of admission (each replica's).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Cache bytes per position of the largest stage.
    pub per_position: u64,
    /// Positions per cache block: a sequence's cache is whole blocks.
    pub kv_block: u64,
    /// Blocks in every stage's pool (0 until the first stage reports them,
    /// when the stages size their pools from their free memory).
    pub blocks: u64,
    /// Sequences running at once.
    pub max_batch: usize,
    /// Requests waiting at once.
    pub max_queue: usize,
}

struct Running {
    tx: mpsc::UnboundedSender<Event>,
    arrived: Instant,
    last: Option<Instant>,
    /// The logprobs of the token whose id comes next.
    logprobs: Option<TokenLogprobs>,
    /// The request as it was added, and the tokens it has sent since: what
    /// a restarted pipeline is given to go on from ([`SeqRequest::resumed`]).
    request: SeqRequest,
    sent: Vec<i64>,
    /// The next prompt position whose logprobs are still to send.
    prompt_next: usize,
    /// A cancel went to the pipeline (the client left, or a stop string
    /// ended it): after a loss it is not resumed.
    cancelled: bool,
}

struct Waiting {
    seq: usize,
    request: SeqRequest,
    tx: mpsc::UnboundedSender<Event>,
    arrived: Instant,
}

/// A pipeline lost: why, and the cause as `m3c:pipeline_restarts_total`
/// labels it.
#[derive(Debug, Clone)]
pub struct Loss {
    pub why: String,
    pub cause: &'static str,
}

/// How often a lost pipeline is started again (`--max-restarts N` within
/// `--restart-window-s`); 0: never (a lost pipeline fails its requests).
#[derive(Debug, Clone, Copy)]
pub struct Healing {
    pub max_restarts: usize,
    pub window: Duration,
}

#[derive(Default)]
struct State {
    next_seq: usize,
    running: HashMap<usize, Running>,
    waiting: VecDeque<Waiting>,
    /// The pool's blocks held by sequences and held by the prefix cache
    /// only (the first stage's last report).
    blocks_used: u64,
    blocks_cached: u64,
    /// Blocks in every stage's pool, as the first stage reports them.
    blocks_total: u64,
    /// Sequences the first stage runs (holding blocks) and holds back
    /// (waiting for blocks).
    sequences: (usize, usize),
    /// Per stage: the last report (steps, busy seconds, when).
    reports: Vec<Option<(u64, f64, Instant)>>,
}

/// Why a timeline window could not be recorded.
#[derive(Debug)]
pub enum TraceError {
    /// Another window is being recorded (409).
    Busy,
    /// The pipeline is not up, or did not send the trace in time (503).
    Down(String),
}

/// A timeline window under way: the lines so far, and who waits for them.
#[derive(Default)]
struct TraceWindow {
    busy: bool,
    got: m3c_front::trace::Collected,
    done: Option<tokio::sync::oneshot::Sender<m3c_front::trace::Collected>>,
}

pub struct Engine {
    /// The first stage's input, of the pipeline started last.
    lines: Mutex<Option<mpsc::UnboundedSender<Vec<u8>>>>,
    /// Which start of the pipeline is current: lines and losses of an
    /// earlier one are ignored.
    epoch: std::sync::atomic::AtomicU64,
    /// The last start whose loss was told, and the last that came up.
    lost_epoch: std::sync::atomic::AtomicU64,
    ready_epoch: std::sync::atomic::AtomicU64,
    /// `close_input` was called: the server stops, no pipeline starts again.
    closing: AtomicBool,
    /// When the engine was made, and how long its first start took to be up
    /// (a restart gets twice that, at least).
    created: Instant,
    first_up: Mutex<Option<Duration>>,
    /// Losses go to the supervisor, which restarts the pipeline.
    lost_tx: mpsc::UnboundedSender<Loss>,
    /// Why the pipeline is restarting, and since when (None while it runs).
    restarting: Mutex<Option<(String, Instant)>>,
    /// When the pipeline last went down, until a resumed request's first
    /// token comes (the log gives the whole recovery).
    resumed_since: Mutex<Option<Instant>>,
    /// What mpirun's log said of a start's end, once it closed (by epoch).
    ended: Mutex<Option<(u64, m3c_front::launch::JobEnd)>>,
    healing: Healing,
    /// Ids that end a sequence (a resumed request whose last token was one
    /// had ended: it is not resumed).
    eos_ids: Vec<i64>,
    trace: Mutex<TraceWindow>,
    /// How long a stage may be silent (`--timeout-s`): bounds the wait for a trace.
    timeout: Duration,
    st: Mutex<State>,
    limits: Limits,
    pub metrics: Metrics,
    ready: AtomicBool,
    /// The KV-cache event publisher (`--kv-events-config`).
    pub kv_events: std::sync::OnceLock<crate::kv_events::Publisher>,
    /// Why the pipeline is down (None while it runs).
    down: watch::Sender<Option<String>>,
    /// Which replica this pipeline is, of how many (`--data-parallel-size`).
    pub replica: Replica,
    /// The blocks its prefix cache holds or will hold, for routing.
    pub affinity: Mutex<crate::route::Affinity>,
}

/// A pipeline's place among the server's replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replica {
    pub index: usize,
    pub of: usize,
}

impl Replica {
    /// What its log lines and errors start with: nothing for a lone pipeline.
    pub fn prefix(&self) -> String {
        if self.of > 1 {
            format!("replica {}: ", self.index)
        } else {
            String::new()
        }
    }
}

/// A submitted request: its events, and a cancel when dropped before the
/// end (a client that went away).
pub struct Ticket {
    pub seq: usize,
    pub rx: mpsc::UnboundedReceiver<Event>,
    engine: Arc<Engine>,
    done: bool,
}

impl Ticket {
    /// A number no other request on the server has (for response ids).
    pub fn number(&self) -> u64 {
        let r = self.engine.replica;
        self.seq as u64 * r.of.max(1) as u64 + r.index as u64
    }

    /// The request has ended: nothing to cancel on drop.
    pub fn done(&mut self) {
        self.done = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.done {
            self.engine.cancel(self.seq);
        }
    }
}

impl Engine {
    /// An engine with no pipeline yet ([`Engine::attach`] starts one), and
    /// where its losses go (the supervisor's end).
    pub fn new(
        limits: Limits,
        stages: usize,
        timeout: Duration,
        replica: Replica,
        healing: Healing,
        eos_ids: Vec<i64>,
    ) -> (Arc<Engine>, mpsc::UnboundedReceiver<Loss>) {
        let (down, _) = watch::channel(None);
        let (lost_tx, lost_rx) = mpsc::unbounded_channel();
        // The affinity table holds about what the pool can (routed blocks
        // not yet stored age out past twice that).
        let cap = 2 * (limits.blocks as usize).clamp(1024, m3c_contract::blocks::MAX_BLOCKS);
        let engine = Arc::new(Engine {
            replica,
            affinity: Mutex::new(crate::route::Affinity::new(cap)),
            lines: Mutex::new(None),
            epoch: std::sync::atomic::AtomicU64::new(0),
            lost_epoch: std::sync::atomic::AtomicU64::new(0),
            ready_epoch: std::sync::atomic::AtomicU64::new(0),
            closing: AtomicBool::new(false),
            created: Instant::now(),
            first_up: Mutex::new(None),
            lost_tx,
            restarting: Mutex::new(None),
            resumed_since: Mutex::new(None),
            ended: Mutex::new(None),
            healing,
            eos_ids,
            trace: Mutex::new(TraceWindow::default()),
            timeout,
            st: Mutex::new(State { reports: vec![None; stages], ..State::default() }),
            limits,
            metrics: Metrics::default(),
            ready: AtomicBool::new(false),
            kv_events: std::sync::OnceLock::new(),
            down,
        });
        engine.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).stages = vec![StageStat::default(); stages];
        (engine, lost_rx)
    }

    /// Starts a pipeline (`cmd` is mpirun over the stages with `--serve`)
    /// as the engine's current one; its mpirun.
    pub fn attach(self: &Arc<Engine>, mut cmd: std::process::Command) -> anyhow::Result<tokio::process::Child> {
        if self.closing.load(Ordering::SeqCst) {
            anyhow::bail!("the server is stopping");
        }
        // A process group of its own: a terminal's Ctrl-C (or a service
        // manager's SIGTERM to the group) reaches the front only, which then
        // drains; mpirun still dies with the front (PR_SET_PDEATHSIG).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut cmd = tokio::process::Command::from(cmd);
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(m3c_front::launch::spawn_error)?;
        let (Some(mut stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take()) else {
            anyhow::bail!("mpirun started without its pipes");
        };
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        *self.lines.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        // Writer: commands to the first stage; dropping the sender closes its input.
        let e = self.clone();
        tokio::spawn(async move {
            while let Some(frame) = rx.recv().await {
                if stdin.write_all(&frame).await.is_err() || stdin.flush().await.is_err() {
                    e.lost(epoch, "the first stage's input closed (the pipeline stopped)", "input_closed");
                    break;
                }
            }
        });
        // The stages' log, passed on. A stage's fatal error means the
        // pipeline is lost now: mpirun may wait minutes on a host that is
        // cut off before it exits (and closes the first stage's output).
        let e = self.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            let mut log = m3c_front::launch::StageLog::new();
            let mut told = false;
            let prefix = e.replica.prefix();
            while let Ok(Some(line)) = lines.next_line().await {
                for shown in log.line(&line) {
                    eprintln!("{prefix}{shown}");
                }
                if let Some(first) = log.first_error.as_ref().filter(|_| !told) {
                    e.lost(epoch, &format!("the pipeline stopped: {first}"), "stage_error");
                    told = true;
                }
            }
            for shown in log.finish() {
                eprintln!("{prefix}{shown}");
            }
            *e.ended.lock().unwrap_or_else(|p| p.into_inner()) = Some((epoch, log.end.clone()));
        });
        // Reader: the first stage's lines (an earlier start's are dropped).
        let e = self.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if e.epoch.load(Ordering::SeqCst) == epoch {
                    e.on_line(&line);
                }
            }
            e.lost(epoch, "the pipeline stopped (a stage ended or was lost; its message is in the server's log)", "stage_lost");
        });
        Ok(child)
    }

    fn window(&self) -> std::sync::MutexGuard<'_, TraceWindow> {
        self.trace.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records every stage's timeline for `span`: `trace on`, the wait,
    /// `trace off`, then the first stage's `m3c-trace` lines (within the
    /// stages' timeout). One window at a time.
    pub async fn record_trace(&self, span: Duration) -> Result<m3c_front::trace::Collected, TraceError> {
        if let Some(why) = self.down_reason() {
            return Err(TraceError::Down(why));
        }
        {
            let mut w = self.window();
            if w.busy {
                return Err(TraceError::Busy);
            }
            *w = TraceWindow { busy: true, ..TraceWindow::default() };
        }
        self.send(Command::Trace(true).to_bytes());
        tokio::time::sleep(span).await;
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.window().done = Some(tx);
        self.send(Command::Trace(false).to_bytes());
        let got = tokio::time::timeout(self.timeout + Duration::from_secs(10), rx).await;
        self.window().busy = false;
        match got {
            Ok(Ok(c)) => Ok(c),
            _ => Err(TraceError::Down(self.down_reason().unwrap_or_else(|| "the stages did not send their timeline in time".into()))),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn send(&self, frame: Vec<u8>) {
        if let Some(tx) = self.lines.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = tx.send(frame);
        }
    }

    /// Every stage is up and nothing has failed.
    pub fn healthy(&self) -> bool {
        self.ready.load(Ordering::SeqCst) && self.down.borrow().is_none()
    }

    /// What mpirun's log said of the end of start `epoch`, once its log
    /// closed (within `wait`).
    pub async fn job_end(&self, epoch: u64, wait: Duration) -> Option<m3c_front::launch::JobEnd> {
        let t0 = Instant::now();
        loop {
            if let Some((e, end)) = self.ended.lock().unwrap_or_else(|p| p.into_inner()).as_ref().filter(|(e, _)| *e == epoch) {
                let _ = e;
                return Some(end.clone());
            }
            if t0.elapsed() > wait {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether start `epoch` came up (took requests).
    pub fn served(&self, epoch: u64) -> bool {
        self.ready_epoch.load(Ordering::SeqCst) == epoch
    }

    /// Whether the server is stopping (no restart then).
    pub fn closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// How long its first start took to be up, once it was.
    pub fn first_up(&self) -> Option<Duration> {
        *self.first_up.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Which start of the pipeline is current.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Why it takes no requests now: down, restarting, or still loading.
    pub fn unready_reason(&self) -> String {
        self.down_reason()
            .or_else(|| self.restarting().map(|why| format!("{}the pipeline is restarting after: {why}", self.replica.prefix())))
            .unwrap_or_else(|| "the model is loading".into())
    }

    /// Why the pipeline is restarting, while it is.
    pub fn restarting(&self) -> Option<String> {
        self.restarting.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|(why, _)| why.clone())
    }

    /// Why the pipeline is down, once it is.
    pub fn down_reason(&self) -> Option<String> {
        self.down.borrow().clone()
    }

    /// Resolves when the pipeline goes down.
    pub async fn wait_down(&self) -> String {
        let mut rx = self.down.subscribe();
        loop {
            if let Some(why) = rx.borrow().clone() {
                return why;
            }
            if rx.changed().await.is_err() {
                return "the engine ended".into();
            }
        }
    }

    /// Closes the first stage's input: it finishes the open sequences and
    /// stops the pipeline.
    pub fn close_input(&self) {
        self.closing.store(true, Ordering::SeqCst);
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    pub fn gauges(&self) -> Gauges {
        let st = self.state();
        let block_bytes = self.limits.kv_block * self.limits.per_position;
        let blocks = if st.blocks_total > 0 { st.blocks_total } else { self.limits.blocks };
        Gauges {
            running: st.running.len(),
            waiting: st.waiting.len(),
            cache_used: st.blocks_used * block_bytes,
            cache_budget: blocks * block_bytes,
            blocks_used: st.blocks_used,
            blocks_cached: st.blocks_cached,
            blocks_total: blocks,
            sequences: st.sequences,
        }
    }

    /// Admits a request, or queues it while the batch is full; its `seq`
    /// is the engine's to give.
    pub fn submit(self: &Arc<Engine>, mut request: SeqRequest) -> Result<Ticket, SubmitError> {
        if let Some(why) = self.down_reason() {
            return Err(SubmitError::Down(why));
        }
        // While the pipeline restarts, requests wait (up to --max-queue).
        if !self.ready.load(Ordering::SeqCst) && self.restarting().is_none() {
            return Err(SubmitError::Down("the model is still loading".into()));
        }
        let mut st = self.state();
        let pool = if st.blocks_total > 0 { st.blocks_total } else { self.limits.blocks };
        let positions = (request.prompt.len() + request.max_new + 1) as u64;
        let need = positions.div_ceil(self.limits.kv_block.max(1));
        if need > pool {
            let block_mb = (self.limits.kv_block * self.limits.per_position) as f64 / 1e6;
            return Err(SubmitError::TooLarge(format!(
                "the prompt ({} tokens) and max_tokens ({}) need {:.1} MB of cache per stage; the server's KV pool holds {:.1} MB",
                request.prompt.len(),
                request.max_new,
                need as f64 * block_mb,
                pool as f64 * block_mb
            )));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let would_wait = !st.waiting.is_empty() || !self.fits(&st) || !self.ready.load(Ordering::SeqCst);
        if would_wait && st.waiting.len() >= self.limits.max_queue {
            return Err(SubmitError::QueueFull(self.limits.max_queue));
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        request.seq = seq;
        st.waiting.push_back(Waiting { seq, request, tx, arrived: Instant::now() });
        self.admit(&mut st);
        drop(st);
        Ok(Ticket { seq, rx, engine: self.clone(), done: false })
    }

    /// Requests running and waiting here.
    pub fn load(&self) -> usize {
        let st = self.state();
        st.running.len() + st.waiting.len()
    }

    fn fits(&self, st: &State) -> bool {
        st.running.len() < self.limits.max_batch
    }

    /// Starts waiting requests, in order, while they fit (and the pipeline is up).
    fn admit(&self, st: &mut State) {
        while self.fits(st) && self.ready.load(Ordering::SeqCst) {
            let Some(w) = st.waiting.pop_front() else { break };
            self.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).prompt_tokens += w.request.prompt.len() as u64;
            self.send(Command::Add(w.request.clone()).to_bytes());
            let running = Running {
                tx: w.tx,
                arrived: w.arrived,
                last: None,
                logprobs: None,
                request: w.request,
                sent: Vec::new(),
                prompt_next: 0,
                cancelled: false,
            };
            st.running.insert(w.seq, running);
        }
    }

    /// The restarted pipeline is up: every request that was running goes on
    /// from the tokens it sent (one that had ended, by its last token or its
    /// length, ends), then the waiting ones are admitted.
    fn resume(&self, st: &mut State) {
        let mut seqs: Vec<usize> = st.running.keys().copied().collect();
        seqs.sort_unstable();
        let mut resumed = 0u64;
        for seq in seqs {
            let Some(r) = st.running.get(&seq) else { continue };
            // A request whose client left, or that a cancel ended, ends here.
            if r.cancelled || r.tx.is_closed() {
                if let Some(r) = st.running.remove(&seq) {
                    self.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).requests_cancelled += 1;
                    let _ = r.tx.send(Event::End("cancelled".into()));
                }
                continue;
            }
            let last = r.sent.last().copied();
            let ended = last.is_some_and(|t| (!r.request.ignore_eos && self.eos_ids.contains(&t)) || r.request.stop_ids.contains(&t));
            let reason = if ended {
                Some(EndReason::Stop)
            } else if r.sent.len() >= r.request.max_new {
                Some(EndReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                if let Some(r) = st.running.remove(&seq) {
                    self.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).requests_ok += 1;
                    let _ = r.tx.send(Event::End(reason.as_str().to_string()));
                }
                continue;
            }
            let mut again = r.request.clone();
            again.resumed = r.sent.clone();
            if !r.sent.is_empty() {
                again.prompt_logprobs = None;
            }
            self.send(Command::Add(again).to_bytes());
            resumed += 1;
        }
        self.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).requests_resumed += resumed;
        self.admit(st);
    }

    /// Cancels a request: a waiting one leaves the queue, a running one is
    /// told to the first stage (its caches are freed within a step).
    pub fn cancel(&self, seq: usize) {
        let mut st = self.state();
        if let Some(i) = st.waiting.iter().position(|w| w.seq == seq) {
            if let Some(w) = st.waiting.remove(i) {
                let _ = w.tx.send(Event::End("cancelled".into()));
            }
            self.admit(&mut st);
        } else if st.running.contains_key(&seq) && !self.ready.load(Ordering::SeqCst) {
            // No pipeline holds it while it restarts (the flag changes
            // under this lock): it ends here, and is not resumed.
            if let Some(r) = st.running.remove(&seq) {
                self.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).requests_cancelled += 1;
                let _ = r.tx.send(Event::End("cancelled".into()));
            }
        } else if let Some(r) = st.running.get_mut(&seq) {
            r.cancelled = true;
            self.send(Command::Cancel(seq).to_bytes());
        }
    }

    /// The pipeline of start `epoch` is lost: with restarts left, the
    /// supervisor gets it (its requests wait to resume); otherwise every
    /// open request fails. A loss of an earlier start, or one already
    /// told, is ignored.
    pub fn lost(&self, epoch: u64, why: &str, cause: &'static str) {
        if epoch != self.epoch.load(Ordering::SeqCst) || self.down.borrow().is_some() {
            return;
        }
        if self.lost_epoch.swap(epoch, Ordering::SeqCst) == epoch {
            return;
        }
        // A pipeline that never came up (bad weights, no memory) fails as
        // at start-up; one that served is healed.
        if self.healing.max_restarts == 0 || self.ready_epoch.load(Ordering::SeqCst) == 0 || self.closing.load(Ordering::SeqCst) {
            // The supervisor still ends the job.
            self.fail(why);
            let _ = self.lost_tx.send(Loss { why: why.to_string(), cause });
            return;
        }
        // A restart that is lost again keeps the time of the first loss.
        let mut r = self.restarting.lock().unwrap_or_else(|e| e.into_inner());
        let since = r.as_ref().map_or_else(Instant::now, |(_, t)| *t);
        *r = Some((why.to_string(), since));
        drop(r);
        self.ready.store(false, Ordering::SeqCst);
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).take();
        let _ = self.lost_tx.send(Loss { why: why.to_string(), cause });
    }

    /// Ends every open request with `why` and marks the pipeline down.
    pub fn fail(&self, why: &str) {
        let why = &format!("{}{why}", self.replica.prefix());
        self.restarting.lock().unwrap_or_else(|e| e.into_inner()).take();
        let mut st = self.state();
        self.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).requests_failed += (st.running.len() + st.waiting.len()) as u64;
        for (_, r) in st.running.drain() {
            let _ = r.tx.send(Event::Failed(why.to_string()));
        }
        for w in st.waiting.drain(..) {
            let _ = w.tx.send(Event::Failed(why.to_string()));
        }
        self.down.send_if_modified(|d| {
            if d.is_none() {
                *d = Some(why.to_string());
                true
            } else {
                false
            }
        });
    }

    /// Ends every open request with `why`; the pipeline stays up (the grace
    /// period of a shutdown ran out).
    pub fn fail_open(&self, why: &str) {
        let seqs: Vec<usize> = {
            let mut st = self.state();
            for w in st.waiting.drain(..) {
                let _ = w.tx.send(Event::Failed(why.to_string()));
            }
            st.running
                .iter()
                .map(|(&s, r)| {
                    let _ = r.tx.send(Event::Failed(why.to_string()));
                    s
                })
                .collect()
        };
        for s in seqs {
            self.send(Command::Cancel(s).to_bytes());
        }
    }

    /// Every stage is up: the pool is empty, and after a restart the open
    /// requests go on.
    fn on_ready(&self) {
        self.affinity.lock().unwrap_or_else(|e| e.into_inner()).clear();
        if let Some(p) = self.kv_events.get() {
            p.all_cleared();
        }
        // Under the state lock, so a cancel sees the pipeline up and its
        // requests resumed, or neither.
        let mut st = self.state();
        self.ready.store(true, Ordering::SeqCst);
        self.ready_epoch.store(self.epoch.load(Ordering::SeqCst), Ordering::SeqCst);
        let restarted = self.restarting.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some((_, since)) = restarted else {
            *self.first_up.lock().unwrap_or_else(|e| e.into_inner()) = Some(self.created.elapsed());
            drop(st);
            return eprintln!("m3c serve: {}every stage is up", self.replica.prefix());
        };
        let took = since.elapsed().as_secs_f64();
        self.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).restart_seconds.observe(took);
        eprintln!(
            "m3c serve: {}the pipeline is up again {took:.2} s after it was lost; {} request(s) go on",
            self.replica.prefix(),
            st.running.len()
        );
        if !st.running.is_empty() {
            *self.resumed_since.lock().unwrap_or_else(|e| e.into_inner()) = Some(since);
        }
        self.resume(&mut st);
    }

    fn on_line(&self, line: &str) {
        if let Some(e) = line.strip_prefix("m3c-trace ") {
            return self.window().got.events.push(e.to_string());
        }
        if let Some(m) = line.strip_prefix("m3c-trace-meta ") {
            let mut w = self.window();
            w.got.meta = Some(m.to_string());
            let got = std::mem::take(&mut w.got);
            if let Some(tx) = w.done.take() {
                let _ = tx.send(got);
            }
            return;
        }
        let event = match StageEvent::parse(line) {
            None => return eprintln!("{line}"),
            Some(Err(e)) => return eprintln!("m3c serve: the first stage printed {e}"),
            Some(Ok(ev)) => ev,
        };
        match event {
            StageEvent::BlockStored { .. } | StageEvent::BlocksRemoved { .. } => {
                {
                    let mut a = self.affinity.lock().unwrap_or_else(|e| e.into_inner());
                    match &event {
                        StageEvent::BlockStored { hash, .. } => a.stored(*hash),
                        StageEvent::BlocksRemoved { hashes } => a.removed(hashes),
                        _ => {}
                    }
                }
                if let Some(p) = self.kv_events.get() {
                    p.publish(&event);
                }
            }
            StageEvent::Ready => self.on_ready(),
            StageEvent::Id { seq, id } => {
                let mut st = self.state();
                if let Some(r) = st.running.get_mut(&seq) {
                    let now = Instant::now();
                    let mut c = self.metrics.c.lock().unwrap_or_else(|e| e.into_inner());
                    match r.last {
                        None => c.ttft.observe(now.duration_since(r.arrived).as_secs_f64()),
                        Some(t) => c.itl.observe(now.duration_since(t).as_secs_f64()),
                    }
                    c.generation_tokens += 1;
                    r.last = Some(now);
                    r.sent.push(i64::from(id));
                    let _ = r.tx.send(Event::Token(id, r.logprobs.take()));
                    if let Some(since) = self.resumed_since.lock().unwrap_or_else(|e| e.into_inner()).take() {
                        eprintln!(
                            "m3c serve: {}the first token after the restart came {:.2} s after the loss",
                            self.replica.prefix(),
                            since.elapsed().as_secs_f64()
                        );
                    }
                }
            }
            StageEvent::PromptLogprobs { seq, pos, id, lp } => {
                // A restarted pipeline may report again what went out before.
                if let Some(r) = self.state().running.get_mut(&seq).filter(|r| pos >= r.prompt_next) {
                    r.prompt_next = pos + 1;
                    let _ = r.tx.send(Event::Prompt(pos, id, lp));
                }
            }
            StageEvent::Logprobs { seq, lp, .. } => {
                if let Some(r) = self.state().running.get_mut(&seq) {
                    r.logprobs = Some(lp);
                }
            }
            StageEvent::End { seq, reason } => {
                let mut st = self.state();
                if let Some(r) = st.running.remove(&seq) {
                    let mut c = self.metrics.c.lock().unwrap_or_else(|e| e.into_inner());
                    match reason {
                        EndReason::Cancelled => c.requests_cancelled += 1,
                        EndReason::Error | EndReason::Constraint => c.requests_failed += 1,
                        EndReason::Stop | EndReason::Length => c.requests_ok += 1,
                    }
                    let ev = match reason {
                        EndReason::Error => Event::Failed("the model produced non-finite logits (NaN or Inf) for this request".into()),
                        EndReason::Constraint => Event::Failed(
                            "the request's grammar (response_format, tool_choice or structured_outputs) or reasoning budget could not \
                             be applied past this point; the server's log has the stage's reason"
                                .into(),
                        ),
                        _ => Event::End(reason.as_str().to_string()),
                    };
                    let _ = r.tx.send(ev);
                }
                self.admit(&mut st);
            }
            StageEvent::Stat { stage: k, steps, busy_s: busy } => {
                let now = Instant::now();
                let mut st = self.state();
                let Some(slot) = st.reports.get_mut(k) else { return };
                let mut c = self.metrics.c.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(stat) = c.stages.get_mut(k) {
                    stat.steps = steps;
                    stat.busy_s = busy;
                }
                if let (Some((s0, b0, t0)), Some(stat)) = (*slot, c.stages.get_mut(k)) {
                    let (ds, db, dt) = (steps - s0.min(steps), (busy - b0).max(0.0), now.duration_since(t0).as_secs_f64());
                    stat.step_s = if ds > 0 { db / ds as f64 } else { 0.0 };
                    stat.busy_fraction = if dt > 0.0 { (db / dt).min(1.0) } else { 0.0 };
                }
                *slot = Some((steps, busy, now));
            }
            StageEvent::Prefix { queried, hit, .. } => {
                let mut c = self.metrics.c.lock().unwrap_or_else(|e| e.into_inner());
                c.prefix_queries += queried as u64;
                c.prefix_hits += hit as u64;
            }
            StageEvent::Preempted { .. } => self.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).preemptions += 1,
            StageEvent::Spec { drafted, accepted, .. } => {
                let mut c = self.metrics.c.lock().unwrap_or_else(|e| e.into_inner());
                c.spec_drafts += 1;
                c.spec_draft_tokens += drafted as u64;
                c.spec_accepted += accepted as u64;
                if c.spec_accepted_per_pos.len() < drafted {
                    c.spec_accepted_per_pos.resize(drafted, 0);
                }
                for n in &mut c.spec_accepted_per_pos[..accepted] {
                    *n += 1;
                }
            }
            StageEvent::Encoder { hits, misses, entries, bytes, in_flight, encoded, encode_us } => {
                self.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).encoder =
                    crate::metrics::EncoderStats { hits, misses, entries, bytes, in_flight, encoded, encode_us };
            }
            StageEvent::Kv { used, cached, total, running, waiting } => {
                let mut st = self.state();
                (st.blocks_used, st.blocks_cached, st.blocks_total) = (used as u64, cached as u64, total as u64);
                st.sequences = (running, waiting);
            }
            StageEvent::Bad { seq, why } => {
                eprintln!("m3c serve: the first stage refused a command: {line}");
                // A refused add ends its request (and frees its reservation).
                let mut st = self.state();
                if let Some(r) = seq.and_then(|s| st.running.remove(&s)) {
                    self.metrics.c.lock().unwrap_or_else(|e| e.into_inner()).requests_failed += 1;
                    let _ = r.tx.send(Event::Failed(format!("the pipeline refused the request: {why}")));
                }
                self.admit(&mut st);
            }
        }
    }
}
