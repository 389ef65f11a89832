//! The stages' side of `m3c serve`: continuous batching. The pipeline stays
//! up; requests arrive on the first stage's standard input (mpirun forwards
//! it to rank 0, on whichever host that runs), join micro-batches between
//! steps and leave when they finish or are cancelled.
//!
//! Commands arrive one per line and events leave one per line, in the
//! contract's line protocol (`m3c_contract::protocol`: `add`, `cancel`;
//! `m3c-ready`, `m3c-id`, `m3c-end`, `m3c-stat`, `m3c-bad`). A request's
//! images file is read and encoded before its first step; a malformed or
//! refused command gets `m3c-bad` and changes nothing. When its input
//! closes, the first stage lets every open sequence finish, then stops the
//! pipeline.
//!
//! Scheduling: each sequence's next item (a prefill chunk of at most
//! `--prefill-chunk` tokens, or one decode token) waits in a ready queue; up
//! to one micro-batch per stage is in flight, each of up to `--micro-batch`
//! sequences, so a long prompt is prefilled in chunks alongside the others'
//! decodes and no stage idles while there is work. A sequence joins the
//! stages (its caches are allocated) with a `KIND_ADD` message before its
//! first step and leaves with `KIND_DROP` after its last, so each stage's
//! memory holds only the live sequences.

use crate::args::RunArgs;
use crate::dump::SeqRecord;
use crate::error::StageError;
use crate::liveness::Peers;
use crate::pipeline::{finish, sample_in, Books, OnNonFinite};
use crate::stage::{Segment, Stage};
use crate::wire::{self, bytes_f32, f32_bytes, message, Outbox, KIND_ADD, KIND_DROP, KIND_STATS, KIND_STEP, KIND_STOP, TAG_ACT, TAG_IDS};
use m3c_contract::protocol::{Command, EndReason, Event, SeqRequest};
use m3c_contract::sampling::{row_params, row_words, SamplingParams, ROW_WORDS};
use mpi::topology::SimpleCommunicator;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Default prefill chunk when serving: long prompts share steps with decodes.
const SERVE_PREFILL_CHUNK: usize = 256;
/// Default sequences per micro-batch when serving.
const SERVE_MICRO_BATCH: usize = 32;
/// The most cache rows a sequence may ask for (a bound, not a budget: the
/// front admits requests against its cache budget and the model's context).
const MAX_CAPACITY: usize = 1 << 24;

/// One event on standard output, flushed.
pub(crate) fn say(event: Event) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(event.encode().as_bytes()).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush());
}

/// A refused command.
fn refuse(seq: Option<usize>, why: impl Into<String>) {
    say(Event::Bad { seq, why: why.into() });
}

/// Reads commands from standard input on a thread of its own; the channel
/// closes with the input.
fn commands() -> mpsc::Receiver<Result<Command, String>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if line.trim().is_empty() {
                continue;
            }
            let cmd = Command::parse(&line).map_err(|e| format!("{}: {e}", line.chars().take(80).collect::<String>()));
            if tx.send(cmd).is_err() {
                break;
            }
        }
    });
    rx
}

/// The last stage's books while serving: the live sequences, as their
/// `KIND_ADD` messages described them.
#[derive(Default)]
struct ServeBooks {
    seqs: HashMap<usize, (SeqRecord, SamplingParams)>,
}

impl Books for ServeBooks {
    fn seq(&self, seq: usize) -> Result<(&SeqRecord, &SamplingParams), StageError> {
        self.seqs.get(&seq).map(|(r, p)| (r, p)).ok_or_else(|| StageError::Step(format!("a step for sequence {seq}, which is not live")))
    }
    fn seq_mut(&mut self, seq: usize) -> Result<&mut SeqRecord, StageError> {
        self.seqs.get_mut(&seq).map(|(r, _)| r).ok_or_else(|| StageError::Step(format!("a step for sequence {seq}, which is not live")))
    }
}

/// The request's images, read and encoded on this (the first) stage; a
/// prompt with image placeholders and no images is refused.
fn encode_images(st: &mut Stage, a: &SeqRequest) -> Result<(), String> {
    match (&a.images, st.meta.vision.clone()) {
        (None, None) => Ok(()),
        (None, Some(v)) => match a.prompt.iter().filter(|&&id| id == v.image_token).count() {
            0 => Ok(()),
            n => Err(format!("the prompt has {n} image placeholder(s) (id {}) but no image", v.image_token)),
        },
        (Some(_), None) => Err("this pipeline was compiled without the vision tower".into()),
        (Some(f), Some(v)) => {
            let mut seqs = crate::pipeline::read_images(f, v.patch_row).map_err(|e| e.to_string())?;
            let im = seqs.remove(&0).ok_or("the images file has no sequence 0")?;
            st.encode_images(a.seq, &a.prompt, &im).map_err(|e| e.to_string())
        }
    }
}

/// A `KIND_ADD` message: the sequence, its cache capacity, sampling and prompt.
fn add_message(a: &SeqRequest) -> Vec<u8> {
    let mut payload: Vec<u8> = row_words(&a.sampling, 0, 0, true, 0).iter().flat_map(|w| w.to_le_bytes()).collect();
    payload.extend(a.prompt.iter().flat_map(|i| i.to_le_bytes()));
    message(KIND_ADD, &[Segment { seq: a.seq, pos0: 0, rows: capacity(a) }], &payload)
}

/// Cache rows a sequence needs: its prompt and every token it may generate.
fn capacity(a: &SeqRequest) -> usize {
    a.prompt.len() + a.max_new + 1
}

/// Words of an i64 payload.
fn words(payload: &[u8]) -> Vec<i64> {
    payload.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect()
}

/// A stage's own line of a stats message: (stage, steps, busy seconds).
fn stats_words(st: &Stage) -> [i64; 3] {
    let (steps, busy) = st.busy();
    [st.meta.stage as i64, steps as i64, (busy * 1e6) as i64]
}

fn print_stats(w: &[i64]) {
    for s in w.chunks_exact(3) {
        say(Event::Stat { stage: s[0] as usize, steps: s[1] as u64, busy_s: s[2] as f64 / 1e6 });
    }
}

/// Runs this stage's part of the served pipeline until the first stage's
/// input closes and every sequence has finished.
pub fn run(world: &SimpleCommunicator, peers: &mut Peers, st: &mut Stage, args: &RunArgs) -> Result<(), StageError> {
    if st.meta.first_stage {
        Leader::new(st, args).run(world, peers, st)
    } else {
        follow(world, peers, st)
    }
}

/// A stage after the first: applies joins and leaves, steps, and (last)
/// samples and returns the ids.
fn follow(world: &SimpleCommunicator, peers: &mut Peers, st: &mut Stage) -> Result<(), StageError> {
    let (rank, last) = (st.meta.stage, st.meta.last_stage);
    let (x_words, vocab) = (st.meta.x_words(), st.meta.vocab);
    let mut outbox = Outbox::default();
    let mut books = ServeBooks::default();
    loop {
        outbox.poll();
        let m = wire::recv(world, peers, rank - 1, TAG_ACT)?;
        match m.kind {
            KIND_STOP => {
                if !last {
                    outbox.send(world, rank + 1, TAG_ACT, message(KIND_STOP, &[], &[]));
                }
                return outbox.drain(world, peers);
            }
            KIND_ADD => {
                let s = m.segments.first().ok_or_else(|| StageError::Peer("an add message without its sequence".into()))?;
                st.start_seq(s.seq, s.rows)?;
                if last {
                    let w = words(&m.payload);
                    let table: [i64; ROW_WORDS] =
                        w.get(..ROW_WORDS).and_then(|t| t.try_into().ok()).ok_or_else(|| StageError::Peer("a short add message".into()))?;
                    let (sampling, ..) = row_params(&table);
                    let record = SeqRecord {
                        prompt: w[ROW_WORDS..].to_vec(),
                        prefill_logits: Vec::new(),
                        generated: Vec::new(),
                        decode_logits: Vec::new(),
                    };
                    books.seqs.insert(s.seq, (record, sampling));
                } else {
                    outbox.send(world, rank + 1, TAG_ACT, message(KIND_ADD, &m.segments, &m.payload));
                }
            }
            KIND_DROP => {
                for s in &m.segments {
                    st.end_seq(s.seq);
                    books.seqs.remove(&s.seq);
                }
                if !last {
                    outbox.send(world, rank + 1, TAG_ACT, message(KIND_DROP, &m.segments, &[]));
                }
            }
            KIND_STATS => {
                let mut payload = m.payload;
                payload.extend(stats_words(st).iter().flat_map(|w| w.to_le_bytes()));
                let (to, tag) = if last { (0, TAG_IDS) } else { (rank + 1, TAG_ACT) };
                outbox.send(world, to, tag, message(KIND_STATS, &[], &payload));
            }
            KIND_STEP => {
                let tokens: usize = m.segments.iter().map(|s| s.rows).sum();
                let mut x = if st.uses_nccl() { vec![0f32; tokens * x_words] } else { bytes_f32(&m.payload) };
                if !last && st.uses_nccl() {
                    outbox.send(world, rank + 1, TAG_ACT, message(KIND_STEP, &m.segments, &[]));
                }
                let sample = if last { Some(sample_in(&books, &m.segments, vocab, false)?) } else { None };
                let out = st.step(&m.segments, &[], &mut x, sample)?;
                if last {
                    let got = finish(&mut books, &m.segments, &out, vocab, usize::MAX, rank, OnNonFinite::EndSequence)?;
                    let payload: Vec<u8> = got.iter().flat_map(|i| i.to_le_bytes()).collect();
                    outbox.send(world, 0, TAG_IDS, message(KIND_STEP, &m.segments, &payload));
                } else if !st.uses_nccl() {
                    outbox.send(world, rank + 1, TAG_ACT, message(KIND_STEP, &m.segments, &f32_bytes(&x)));
                }
            }
            k => return Err(StageError::Peer(format!("a message of unknown kind {k}"))),
        }
    }
}

/// A live sequence on the first stage.
struct Live {
    prompt_len: usize,
    max_new: usize,
    ignore_eos: bool,
    /// Prefill chunks not yet stepped: (first position, ids).
    chunks: VecDeque<(usize, Vec<i64>)>,
    generated: usize,
    last_id: i64,
    /// A step of it is in flight.
    busy: bool,
    cancelled: bool,
}

/// The first stage's scheduler.
struct Leader {
    live: HashMap<usize, Live>,
    ready: VecDeque<usize>,
    in_flight: usize,
    stages: usize,
    per_batch: usize,
    chunk: usize,
    eos: Vec<i64>,
    /// The last stage's books when this stage is also the last (pp = 1).
    books: ServeBooks,
    outbox: Outbox,
}

impl Leader {
    fn new(st: &Stage, args: &RunArgs) -> Leader {
        Leader {
            live: HashMap::new(),
            ready: VecDeque::new(),
            in_flight: 0,
            stages: st.meta.stages,
            per_batch: args.micro_batch.unwrap_or(SERVE_MICRO_BATCH).max(1),
            chunk: args.prefill_chunk.unwrap_or(SERVE_PREFILL_CHUNK).max(1),
            eos: args.eos_ids.clone(),
            books: ServeBooks::default(),
            outbox: Outbox::default(),
        }
    }

    fn run(mut self, world: &SimpleCommunicator, peers: &mut Peers, st: &mut Stage) -> Result<(), StageError> {
        let rx = commands();
        let mut input_open = true;
        let mut last_stats = Instant::now();
        let mut stats_pending = false;
        say(Event::Ready);
        loop {
            peers.drain(world);
            let mut worked = false;
            // Commands first, so a new request joins the very next step.
            loop {
                match rx.try_recv() {
                    Ok(Ok(cmd)) => {
                        self.command(world, st, cmd)?;
                        worked = true;
                    }
                    Ok(Err(bad)) => refuse(None, bad),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        input_open = false;
                        break;
                    }
                }
            }
            // One micro-batch per stage in flight. With one stage a step runs
            // to its end here: one per turn, so commands are read between steps.
            while self.in_flight < self.stages && !self.ready.is_empty() {
                self.launch(world, st)?;
                worked = true;
                if self.stages == 1 {
                    break;
                }
            }
            // Ids (and stats) back from the last stage.
            if self.stages > 1 {
                while let Some(m) = wire::try_recv(world, peers, self.stages - 1, TAG_IDS) {
                    let m = m?;
                    if m.kind == KIND_STATS {
                        print_stats(&words(&m.payload));
                        stats_pending = false;
                    } else {
                        self.in_flight -= 1;
                        self.returned(world, st, &m.segments, &words(&m.payload))?;
                    }
                    worked = true;
                }
                // Heartbeats that came in during a long command (an image
                // encode) count before anyone is judged silent.
                peers.drain(world);
                if let Some(r) = peers.silent(1..self.stages) {
                    return Err(StageError::Peer(crate::liveness::silent_message(r, peers.timeout)));
                }
            }
            if last_stats.elapsed() >= Duration::from_secs(1) && !stats_pending {
                last_stats = Instant::now();
                if self.stages > 1 {
                    let payload: Vec<u8> = stats_words(st).iter().flat_map(|w| w.to_le_bytes()).collect();
                    self.outbox.send(world, 1, TAG_ACT, message(KIND_STATS, &[], &payload));
                    stats_pending = true;
                } else {
                    print_stats(&stats_words(st));
                }
            }
            if !input_open && self.live.is_empty() && self.in_flight == 0 {
                break;
            }
            if !worked {
                self.outbox.poll();
                // Idle: wait briefly for a command (or, with steps in flight,
                // for the ids, which the loop probes).
                let wait = if self.in_flight > 0 { Duration::from_micros(50) } else { Duration::from_millis(2) };
                if input_open && self.in_flight == 0 {
                    match rx.recv_timeout(wait) {
                        Ok(Ok(cmd)) => self.command(world, st, cmd)?,
                        Ok(Err(bad)) => refuse(None, bad),
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => input_open = false,
                    }
                } else {
                    std::thread::sleep(wait);
                }
            }
        }
        if self.stages > 1 {
            self.outbox.send(world, 1, TAG_ACT, message(KIND_STOP, &[], &[]));
        }
        self.outbox.drain(world, peers)
    }

    fn command(&mut self, world: &SimpleCommunicator, st: &mut Stage, cmd: Command) -> Result<(), StageError> {
        match cmd {
            Command::Add(a) => {
                if self.live.contains_key(&a.seq) {
                    refuse(Some(a.seq), "the sequence is already live");
                    return Ok(());
                }
                if a.prompt.is_empty() || a.prompt.iter().any(|&i| i < 0 || i as usize >= st.meta.vocab) {
                    refuse(Some(a.seq), "the prompt is empty or has ids outside the vocabulary");
                    return Ok(());
                }
                if a.prompt.len().checked_add(a.max_new).and_then(|n| n.checked_add(1)).is_none_or(|n| n > MAX_CAPACITY) {
                    refuse(Some(a.seq), format!("the prompt and max_new exceed {MAX_CAPACITY} positions"));
                    return Ok(());
                }
                st.start_seq(a.seq, capacity(&a))?;
                if let Err(why) = encode_images(st, &a) {
                    st.end_seq(a.seq);
                    refuse(Some(a.seq), why);
                    return Ok(());
                }
                if self.stages > 1 {
                    self.outbox.send(world, 1, TAG_ACT, add_message(&a));
                } else {
                    let record = SeqRecord {
                        prompt: a.prompt.clone(),
                        prefill_logits: Vec::new(),
                        generated: Vec::new(),
                        decode_logits: Vec::new(),
                    };
                    self.books.seqs.insert(a.seq, (record, a.sampling));
                }
                let chunks = a.prompt.chunks(self.chunk).enumerate().map(|(k, c)| (k * self.chunk, c.to_vec())).collect();
                self.live.insert(
                    a.seq,
                    Live {
                        prompt_len: a.prompt.len(),
                        max_new: a.max_new.max(1),
                        ignore_eos: a.ignore_eos,
                        chunks,
                        generated: 0,
                        last_id: 0,
                        busy: false,
                        cancelled: false,
                    },
                );
                self.ready.push_back(a.seq);
            }
            Command::Cancel(seq) => {
                let Some(l) = self.live.get_mut(&seq) else { return Ok(()) };
                l.cancelled = true;
                if !l.busy {
                    self.ready.retain(|&s| s != seq);
                    self.end(world, st, seq, EndReason::Cancelled);
                }
            }
        }
        Ok(())
    }

    /// Steps the next micro-batch of ready sequences.
    fn launch(&mut self, world: &SimpleCommunicator, st: &mut Stage) -> Result<(), StageError> {
        let mut segs = Vec::new();
        let mut ids = Vec::new();
        while segs.len() < self.per_batch {
            let Some(seq) = self.ready.pop_front() else { break };
            let l =
                self.live.get_mut(&seq).ok_or_else(|| StageError::Step(format!("runtime bug: sequence {seq} is ready but not live")))?;
            let (pos0, item) = match l.chunks.pop_front() {
                Some(c) => c,
                None => (l.prompt_len + l.generated - 1, vec![l.last_id]),
            };
            l.busy = true;
            segs.push(Segment { seq, pos0, rows: item.len() });
            ids.extend(item);
        }
        let mut x = vec![0f32; ids.len() * st.meta.x_words()];
        if self.stages == 1 {
            let sample = sample_in(&self.books, &segs, st.meta.vocab, false)?;
            let out = st.step(&segs, &ids, &mut x, Some(sample))?;
            let got = finish(&mut self.books, &segs, &out, st.meta.vocab, usize::MAX, 0, OnNonFinite::EndSequence)?;
            return self.returned(world, st, &segs, &got);
        }
        if st.uses_nccl() {
            // The step's NCCL send waits for the receiver, who needs the header first.
            self.outbox.send(world, 1, TAG_ACT, message(KIND_STEP, &segs, &[]));
        }
        st.step(&segs, &ids, &mut x, None)?;
        if !st.uses_nccl() {
            self.outbox.send(world, 1, TAG_ACT, message(KIND_STEP, &segs, &f32_bytes(&x)));
        }
        self.in_flight += 1;
        Ok(())
    }

    /// A micro-batch came back with one id per segment.
    fn returned(&mut self, world: &SimpleCommunicator, st: &mut Stage, segs: &[Segment], ids: &[i64]) -> Result<(), StageError> {
        if ids.len() != segs.len() {
            return Err(StageError::Peer("an id message with one id per segment expected".into()));
        }
        for (s, &id) in segs.iter().zip(ids) {
            let l = self.live.get_mut(&s.seq).ok_or_else(|| StageError::Step(format!("ids for sequence {}, which is not live", s.seq)))?;
            l.busy = false;
            if l.cancelled {
                self.end(world, st, s.seq, EndReason::Cancelled);
                continue;
            }
            if id < 0 {
                // Its logits were not finite: it ends, the others go on.
                self.end(world, st, s.seq, EndReason::Error);
                continue;
            }
            if s.pos0 + s.rows < l.prompt_len {
                // A prefill chunk before the prompt's last: no token yet.
                self.ready.push_back(s.seq);
                continue;
            }
            l.generated += 1;
            l.last_id = id;
            say(Event::Id { seq: s.seq, id: id as u32 });
            let eos = !l.ignore_eos && self.eos.contains(&id);
            if eos || l.generated >= l.max_new {
                self.end(world, st, s.seq, if eos { EndReason::Stop } else { EndReason::Length });
            } else {
                self.ready.push_back(s.seq);
            }
        }
        Ok(())
    }

    /// A sequence leaves: the front is told, every stage frees its caches.
    fn end(&mut self, world: &SimpleCommunicator, st: &mut Stage, seq: usize, reason: EndReason) {
        self.live.remove(&seq);
        self.books.seqs.remove(&seq);
        st.end_seq(seq);
        if self.stages > 1 {
            self.outbox.send(world, 1, TAG_ACT, message(KIND_DROP, &[Segment { seq, pos0: 0, rows: 0 }], &[]));
        }
        say(Event::End { seq, reason });
    }
}
