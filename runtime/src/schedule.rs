//! The first stage's scheduler, the one for `m3c run` and `m3c serve`:
//! continuous batching over whatever the [`Feed`] adds. `m3c serve` feeds
//! it the front's commands as they arrive on standard input; `m3c run`
//! feeds it the run's prompts, all at once, and closes the feed.
//!
//! A sequence joins the stages with a `KIND_ADD` message and waits until
//! the KV pool has the blocks of its first chunk (a sequence whose next
//! block another is computing waits for that one, so a shared prefix is
//! computed once); then it takes the longest prefix the cache holds and
//! runs. Each running sequence's next item (a prefill chunk of at most
//! `--prefill-chunk` tokens, or one decode token) waits in a ready queue; up
//! to one micro-batch per stage is in flight, each of up to `--micro-batch`
//! sequences, so a long prompt is prefilled in chunks alongside the others'
//! decodes and no stage idles while there is work. Each step carries the
//! cache blocks its sequences take. When the pool runs out, the newest
//! running sequence gives its blocks back (preemption) and waits again; it
//! resumes by recomputing what it has (mostly from the cache). It leaves
//! with `KIND_DROP` after its last step. What a sequence generates does not
//! depend on what else runs, on a cache hit or on being preempted: the
//! stages are batch- and chunk-invariant and each draw is keyed by the
//! sequence's own step.

use crate::books::{Drawn, LastBooks};
use crate::encoder::{Job, Worker};
use crate::error::StageError;
use crate::follow::{add_message, capacity, stats_words, words};
use crate::kv::{extend_chain, ImageRows, Kv, SeqBlocks};
use crate::liveness::Peers;
use crate::stage::{Segment, Stage};
use crate::wire::{
    self, bytes_f32, f32_bytes, message, message_step, Outbox, KIND_DROP, KIND_RESET, KIND_STATS, KIND_STEP, KIND_STOP, KIND_TRACE,
    TAG_ACT, TAG_ENCODE, TAG_FEATURES, TAG_IDS,
};
use m3c_contract::blocks::{blocks_for, BlockHash};
use m3c_contract::images::SeqImages;
use m3c_contract::protocol::{Command, EndReason, Event, SeqRequest};
use m3c_kvpool::EncoderCache;
use mpi::topology::SimpleCommunicator;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The most cache rows a sequence may ask for (a bound, not a budget: the
/// KV pool is the budget).
const MAX_CAPACITY: usize = 1 << 24;

/// What the feed has next.
// One per line read: boxing the command would buy nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Next {
    Command(Command),
    /// A line that is not a command (serve: refused with `m3c-bad`).
    Bad(String),
    /// Nothing yet.
    Empty,
    /// Nothing ever again: the scheduler finishes what is live and stops.
    Closed,
}

/// Where the scheduler's work comes from and where its events go.
pub(crate) trait Feed {
    /// The next command, waiting up to `wait` for one.
    fn next(&mut self, wait: Duration) -> Next;
    /// A sequence's images, encoded before its first step (`None`: it has none).
    fn images(&mut self, a: &SeqRequest) -> Result<Option<SeqImages>, String>;
    /// Something happened (a token, an end, readiness, stage stats).
    fn event(&mut self, e: Event);
    /// A command cannot be carried out. Serving, the front is told and the
    /// others go on; a run fails.
    fn refuse(&mut self, seq: Option<usize>, why: String) -> Result<(), StageError>;
    /// Whether the stages' step counts are wanted (serve's metrics).
    fn wants_stats(&self) -> bool;
}

/// How the scheduler batches.
pub(crate) struct Batching {
    /// Sequences per micro-batch.
    pub per_batch: usize,
    /// Prompt tokens per prefill step of a sequence.
    pub chunk: usize,
    /// The ids that end a sequence (kept as its last token).
    pub eos: Vec<i64>,
    /// One more step after a sequence's last token, whose logits the run's
    /// dump or `--expect` records (its id is not kept). Such a run computes
    /// every row (no prefix-cache hits), since the dump holds every row.
    pub score_last: bool,
    /// Automatic prefix caching.
    pub prefix_caching: bool,
    /// Speculative decoding by prompt lookup (never with `score_last`,
    /// whose records hold one row per step).
    pub speculative: Option<m3c_contract::speculative::Ngram>,
    /// Speculative decoding by the last stage's EAGLE3 head: at most this
    /// many drafts per step, which come back with each step's ids.
    pub eagle3: Option<usize>,
    /// vLLM's `disable_by_batch_size` for EAGLE3.
    pub eagle3_batch: Option<usize>,
    /// How images and videos are encoded (beside the loop, the cache).
    pub encoder: m3c_contract::stage_args::EncoderOptions,
}

/// A request whose grids are encoding beside the loop: it joins when they
/// are done.
struct Encoding {
    a: SeqRequest,
    image_rows: Vec<ImageRows>,
    placeholders: Vec<usize>,
    /// Each grid's features: from the cache, or `None` for those encoding.
    feats: Vec<Option<Arc<Vec<f32>>>>,
    /// Tokens of each grid.
    tokens: Vec<usize>,
    cancelled: bool,
    /// When its encode was asked for.
    asked: Instant,
    /// The rank encoding it, when another does.
    rank: Option<usize>,
}

/// A live sequence.
struct Live {
    prompt_len: usize,
    max_new: usize,
    ignore_eos: bool,
    /// Its inputs so far: the prompt, then each generated token.
    ids: Vec<i64>,
    /// The hashes of the full blocks of `ids` (its prefix-cache keys).
    chain: Vec<BlockHash>,
    /// Its images' content hashes and placeholder rows (in those keys).
    images: Vec<ImageRows>,
    /// Steps still to take before its next draw: (first position, ids).
    chunks: VecDeque<(usize, Vec<i64>)>,
    generated: usize,
    last_id: i64,
    /// A step of it is in flight.
    busy: bool,
    cancelled: bool,
    /// Stop strings (bytes), and the bytes it has generated so far.
    stops: Vec<Vec<u8>>,
    /// Token ids that end it when generated.
    stop_ids: Vec<i64>,
    text: Vec<u8>,
    /// Its cache blocks.
    kv: SeqBlocks,
    /// It holds blocks and takes steps (else it waits for blocks: new, or
    /// preempted).
    running: bool,
    /// When it last started running: the newest is preempted first.
    started: u64,
    /// Its first start was reported (the prefix-cache counts).
    counted: bool,
    /// It asked for prompt logprobs: its first start computes every row.
    prompt_rows: bool,
    /// The draft ids its step in flight verifies (empty: a plain step).
    drafts: Vec<i64>,
    /// Speculation backs off while drafts miss: decode steps to take
    /// without a draft, and verify steps in a row that accepted nothing.
    spec_skip: usize,
    spec_misses: u32,
    /// Drafts its recent verify steps kept (a running mean): its next
    /// draft is one longer, at most K, so rows a draft would likely lose
    /// are not computed.
    spec_kept: f32,
    /// The EAGLE3 head's proposals for its next step (from its last step's ids).
    proposals: Vec<i64>,
}

impl Live {
    /// Where its next draw is: the row of its last prompt token, or, once
    /// it has generated, the row of its last token (fed as a decode step).
    fn draw_row(&self) -> usize {
        self.prompt_len + self.generated - 1
    }
}

/// The first stage's scheduler.
pub(crate) struct Leader {
    live: HashMap<usize, Live>,
    /// Waiting for blocks, in order (preempted ones first).
    waiting: VecDeque<usize>,
    ready: VecDeque<usize>,
    in_flight: usize,
    stages: usize,
    batching: Batching,
    /// Each token id's bytes, for stop strings (read when first needed).
    token_bytes: Option<Vec<Vec<u8>>>,
    model: Option<std::path::PathBuf>,
    outbox: Outbox,
    /// The one allocator of every stage's KV blocks (all pools have the
    /// same count), with the prefix cache.
    kv: Kv,
    clock: u64,
    /// Encoded features by content.
    cache: EncoderCache,
    /// The vision entry on a thread of its own (host stages, unless
    /// `--encodes inline`).
    worker: Option<Worker>,
    /// Requests waiting for their encodes, by sequence.
    encoding: HashMap<usize, Encoding>,
    /// What the encoder last reported (to report changes only).
    last_encoder: (u64, u64, u64, u64, usize),
    /// Grids encoded for this stage (here, beside the loop or on the
    /// tower's stage), and the seconds from asking to having the features.
    encodes: (u64, f64),
    /// Encoder ranks of their own, after the stages.
    encoders: usize,
}

impl Leader {
    pub fn new(st: &Stage, batching: Batching, model: Option<std::path::PathBuf>) -> Leader {
        let kv = Kv::new(st.pool_blocks(), st.meta.kv_block, batching.prefix_caching);
        Leader {
            live: HashMap::new(),
            waiting: VecDeque::new(),
            ready: VecDeque::new(),
            in_flight: 0,
            stages: st.meta.stages,
            token_bytes: None,
            model,
            outbox: Outbox::default(),
            kv,
            clock: 0,
            cache: EncoderCache::new(batching.encoder.cache_bytes),
            worker: if batching.encoder.inline { None } else { st.vision_runner().map(Worker::start) },
            encoding: HashMap::new(),
            last_encoder: (0, 0, 0, 0, 0),
            encodes: (0, 0.0),
            encoders: st.meta.encoders,
            batching,
        }
    }

    /// Runs until the feed is closed and every sequence has ended, then
    /// stops the pipeline.
    pub fn run(
        mut self,
        world: &SimpleCommunicator,
        peers: &mut Peers,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
    ) -> Result<(), StageError> {
        let mut feed_open = true;
        let mut last_stats = Instant::now();
        let mut stats_pending = false;
        let mut last_usage = (usize::MAX, 0, 0, 0, 0);
        let mut last_kv = Instant::now() - Duration::from_secs(1);
        if feed.wants_stats() {
            // The pool's size before anything else (a front that let the
            // stages size it learns it here).
            let (used, cached, total) = self.kv.usage();
            feed.event(Event::Kv { used, cached, total, running: 0, waiting: 0 });
        }
        feed.event(Event::Ready);
        loop {
            peers.drain(world);
            let mut worked = false;
            // Commands first, so a new request joins the very next step.
            while feed_open {
                match feed.next(Duration::ZERO) {
                    Next::Command(Command::Trace(on)) => self.trace(world, peers, feed, on)?,
                    Next::Command(cmd) => {
                        self.command(world, st, books, feed, cmd)?;
                        worked = true;
                    }
                    Next::Bad(why) => feed.refuse(None, why)?,
                    Next::Empty => break,
                    Next::Closed => feed_open = false,
                }
            }
            worked |= self.encoded(world, peers, st, books, feed)?;
            worked |= self.admit(feed);
            // One micro-batch per stage in flight. With one stage a step runs
            // to its end here: one per turn, so commands are read between steps.
            while self.in_flight < self.stages && !self.ready.is_empty() {
                if !self.launch(world, st, books, feed)? {
                    break;
                }
                worked = true;
                if self.stages == 1 {
                    break;
                }
            }
            if self.stages > 1 {
                worked |= self.collect(world, peers, st, books, feed, &mut stats_pending)?;
            }
            // The pool's figures when they change, at most ten times a second.
            if feed.wants_stats() && last_kv.elapsed() >= Duration::from_millis(100) {
                let (used, cached, total) = self.kv.usage();
                let running = self.live.values().filter(|l| l.running).count();
                let usage = (used, cached, total, running, self.waiting.len());
                if usage != last_usage {
                    (last_usage, last_kv) = (usage, Instant::now());
                    feed.event(Event::Kv { used, cached, total, running, waiting: self.waiting.len() });
                }
            }
            if feed.wants_stats() && last_stats.elapsed() >= Duration::from_secs(1) && !stats_pending {
                last_stats = Instant::now();
                if self.stages > 1 {
                    let payload: Vec<u8> = stats_words(st).iter().flat_map(|w| w.to_le_bytes()).collect();
                    self.outbox.send(world, 1, TAG_ACT, message(KIND_STATS, &[], &payload));
                    stats_pending = true;
                } else {
                    stat_events(feed, &stats_words(st));
                }
            }
            self.report_encoder(feed);
            if !feed_open && self.live.is_empty() && self.in_flight == 0 && self.encoding.is_empty() {
                break;
            }
            if !worked {
                self.outbox.poll();
                // Idle: wait briefly for a command (or, with steps in flight,
                // for the ids, which the loop probes).
                let wait = if self.in_flight > 0 { Duration::from_micros(50) } else { Duration::from_millis(2) };
                if feed_open && self.in_flight == 0 && self.encoding.is_empty() {
                    match feed.next(wait) {
                        Next::Command(Command::Trace(on)) => self.trace(world, peers, feed, on)?,
                        Next::Command(cmd) => self.command(world, st, books, feed, cmd)?,
                        Next::Bad(why) => feed.refuse(None, why)?,
                        Next::Empty => {}
                        Next::Closed => feed_open = false,
                    }
                } else {
                    std::thread::sleep(wait);
                }
            }
        }
        if self.stages > 1 {
            self.outbox.send(world, 1, TAG_ACT, message(KIND_STOP, &[], &[]));
        }
        // Encoder ranks of their own stop too (every encode came back).
        for k in st.encoder_ranks().into_iter().filter(|_| st.meta.encoders > 0) {
            self.outbox.send(world, k, TAG_ENCODE, message(KIND_STOP, &[], &[]));
        }
        self.outbox.drain(world, peers)
    }

    /// Ids (and stats) back from the last stage; whether any came.
    fn collect(
        &mut self,
        world: &SimpleCommunicator,
        peers: &mut Peers,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
        stats_pending: &mut bool,
    ) -> Result<bool, StageError> {
        let mut worked = false;
        while let Some(m) = wire::try_recv(world, peers, self.stages - 1, TAG_IDS) {
            let m = m?;
            if m.kind == KIND_STATS {
                stat_events(feed, &words(&m.payload));
                *stats_pending = false;
            } else {
                self.in_flight -= 1;
                let drawn = Drawn::decode(&words(&m.payload), m.segments.len()).map_err(StageError::Peer)?;
                self.returned(world, st, books, feed, &m.segments, &drawn)?;
            }
            worked = true;
        }
        // Heartbeats that came in during a long command (an image encode)
        // count before anyone is judged silent.
        peers.drain(world);
        if let Some(r) = peers.silent(1..self.stages) {
            return Err(StageError::Peer(crate::liveness::silent_message(r, peers.timeout)));
        }
        Ok(worked)
    }

    fn command(
        &mut self,
        world: &SimpleCommunicator,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
        cmd: Command,
    ) -> Result<(), StageError> {
        match cmd {
            Command::Add(a) => self.add(world, st, books, feed, a),
            // Taken by the loop, which holds the peers the gather needs.
            Command::Trace(_) => Err(StageError::Step("runtime bug: a trace command reached Leader::command".into())),
            Command::Cancel(seq) => {
                if let Some(p) = self.encoding.get_mut(&seq) {
                    // It ends when its encode does (the thread holds its job).
                    p.cancelled = true;
                    return Ok(());
                }
                let Some(l) = self.live.get_mut(&seq) else { return Ok(()) };
                l.cancelled = true;
                if !l.busy {
                    self.end(world, st, books, feed, seq, EndReason::Cancelled);
                }
                Ok(())
            }
        }
    }

    /// A timeline window starts or ends: every stage turns as the
    /// `KIND_TRACE` message reaches it, in order with the steps; at the
    /// end each sends its events here, and they are printed.
    fn trace(&mut self, world: &SimpleCommunicator, peers: &mut Peers, feed: &mut impl Feed, on: bool) -> Result<(), StageError> {
        if !crate::trace::armed() {
            return feed.refuse(None, "tracing is off: the pipeline was started without --trace (m3c serve --trace-dir DIR)".into());
        }
        if self.stages > 1 {
            self.outbox.send(world, 1, TAG_ACT, message(KIND_TRACE, &[], &[u8::from(on)]));
        }
        for k in (self.stages..self.stages + self.encoders).filter(|_| self.encoders > 0) {
            self.outbox.send(world, k, TAG_ENCODE, message(KIND_TRACE, &[], &[u8::from(on)]));
        }
        crate::trace::set_recording(on);
        if !on {
            crate::trace_exchange::gather(world, peers, &crate::host_name())?;
        }
        Ok(())
    }

    /// A sequence joins: checked, its block table opened on every stage, its
    /// images encoded; it waits for blocks.
    fn add(
        &mut self,
        world: &SimpleCommunicator,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
        a: SeqRequest,
    ) -> Result<(), StageError> {
        if self.live.contains_key(&a.seq) || self.encoding.contains_key(&a.seq) {
            return feed.refuse(Some(a.seq), "the sequence is already live".into());
        }
        if a.prompt.is_empty() {
            return feed.refuse(Some(a.seq), "the prompt is empty".into());
        }
        if let Some(bad) = a.prompt.iter().find(|&&i| i < 0 || i as usize >= st.meta.vocab) {
            return feed.refuse(Some(a.seq), format!("token id {bad} is outside the vocabulary (0..{})", st.meta.vocab));
        }
        if a.stop_ids.iter().any(|&i| i < 0 || i as usize >= st.meta.vocab) {
            return feed.refuse(Some(a.seq), "a stop id is outside the vocabulary".into());
        }
        if a.prompt.len().checked_add(a.max_new).is_none_or(|n| n > st.meta.max_positions) {
            let (p, m) = (a.prompt.len(), a.max_new);
            let why =
                format!("{p} prompt tokens + {m} new exceed the model's {} positions (max_position_embeddings)", st.meta.max_positions);
            return feed.refuse(Some(a.seq), why);
        }
        if a.prompt.len().checked_add(a.max_new).and_then(|n| n.checked_add(1)).is_none_or(|n| n > MAX_CAPACITY) {
            return feed.refuse(Some(a.seq), format!("the prompt and max_new exceed {MAX_CAPACITY} positions"));
        }
        // Alone in the pool it must fit, or it could never finish.
        let blocks = blocks_for(capacity(&a), self.kv.block);
        if blocks > self.kv.total() {
            let why = format!(
                "{} prompt tokens + {} new need {blocks} cache blocks of {} positions; the KV pool has {}",
                a.prompt.len(),
                a.max_new,
                self.kv.block,
                self.kv.total()
            );
            return feed.refuse(Some(a.seq), why);
        }
        if !a.stops.is_empty() && self.token_bytes.is_none() {
            match load_token_bytes(self.model.as_deref()) {
                Ok(t) => self.token_bytes = Some(t),
                Err(why) => return feed.refuse(Some(a.seq), why),
            }
        }
        st.start_seq(a.seq, capacity(&a))?;
        let images = match feed.images(&a) {
            Ok(Some(im)) => im,
            Ok(None) => {
                if let Err(why) = placeholders_without_images(st, &a.prompt) {
                    st.end_seq(a.seq);
                    return feed.refuse(Some(a.seq), why);
                }
                return self.join(world, books, a, Vec::new());
            }
            Err(why) => {
                st.end_seq(a.seq);
                return feed.refuse(Some(a.seq), why);
            }
        };
        let placeholders = match st.check_images(a.seq, &a.prompt, &images) {
            Ok(p) => p,
            Err(e) => {
                st.end_seq(a.seq);
                return feed.refuse(Some(a.seq), e.to_string());
            }
        };
        let image_rows = image_rows(st, &a.prompt, &images);
        self.encode(world, st, books, feed, a, images, image_rows, placeholders)
    }

    /// A checked request's grids: those the cache holds are taken from it,
    /// the others encoded, beside the loop where the stage can (the request
    /// joins when they are done, [`Leader::encoded`]), else here and now.
    #[allow(clippy::too_many_arguments)]
    fn encode(
        &mut self,
        world: &SimpleCommunicator,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
        a: SeqRequest,
        images: SeqImages,
        image_rows: Vec<ImageRows>,
        placeholders: Vec<usize>,
    ) -> Result<(), StageError> {
        let feats: Vec<Option<Arc<Vec<f32>>>> = image_rows.iter().map(|(key, _)| self.cache.get(key)).collect();
        let tokens = images.tokens();
        let missing = missing_grids(&images, &feats);
        let seq = a.seq;
        let mut pending = Encoding { a, image_rows, placeholders, feats, tokens, cancelled: false, asked: Instant::now(), rank: None };
        if missing.grids.is_empty() {
            return self.joined(world, st, books, pending);
        }
        let words = st.meta.x_words();
        // The tower's stage, or the least busy encoder rank, encodes; the
        // features come back (`encoded`).
        let load = |r: usize| self.encoding.values().filter(|p| p.rank == Some(r)).count();
        if let Some(k) = st.encoder_ranks().into_iter().min_by_key(|&r| (load(r), r)) {
            let file = m3c_contract::images::encode(&std::collections::BTreeMap::from([(0usize, missing)]));
            self.outbox.send(world, k, TAG_ENCODE, message(0, &[Segment { seq, pos0: 0, rows: 0 }], &file));
            pending.rank = Some(k);
            self.encoding.insert(seq, pending);
            return Ok(());
        }
        let missing = match &self.worker {
            Some(w) => match w.submit(Job { seq, images: missing, words }) {
                Ok(()) => {
                    self.encoding.insert(seq, pending);
                    return Ok(());
                }
                Err(job) => job.images,
            },
            None => missing,
        };
        match st.encode_now(seq, &missing) {
            Ok(f) => {
                self.fill(&mut pending, f, words);
                self.joined(world, st, books, pending)
            }
            Err(e) => {
                st.end_seq(seq);
                feed.refuse(Some(seq), e.to_string())
            }
        }
    }

    /// Puts freshly encoded features (the missing grids', in order) into a
    /// pending request and the cache.
    fn fill(&mut self, p: &mut Encoding, feats: Vec<f32>, words: usize) {
        self.encodes.0 += p.feats.iter().filter(|f| f.is_none()).count() as u64;
        self.encodes.1 += p.asked.elapsed().as_secs_f64();
        let mut at = 0;
        for (i, slot) in p.feats.iter_mut().enumerate() {
            if slot.is_none() {
                let n = p.tokens[i] * words;
                let f = Arc::new(feats[at..at + n].to_vec());
                at += n;
                self.cache.put(p.image_rows[i].0, f.clone());
                *slot = Some(f);
            }
        }
    }

    /// A request whose features are all here: the stage keeps them and
    /// the request joins.
    fn joined(&mut self, world: &SimpleCommunicator, st: &mut Stage, books: &mut LastBooks, p: Encoding) -> Result<(), StageError> {
        let feats: Vec<f32> = p.feats.iter().flat_map(|f| f.as_deref().map_or(&[][..], Vec::as_slice)).copied().collect();
        st.set_images(p.a.seq, p.placeholders, feats);
        self.join(world, books, p.a, p.image_rows)
    }

    /// Encodes finished beside the loop: each request joins (or, cancelled
    /// meanwhile, ends). Whether any finished.
    fn encoded(
        &mut self,
        world: &SimpleCommunicator,
        peers: &mut Peers,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
    ) -> Result<bool, StageError> {
        let mut any = false;
        let mut finished = Vec::new();
        while let Some(done) = self.worker.as_ref().and_then(Worker::try_done) {
            st.count_encoded(done.grids, (done.finished - done.started).as_secs_f64());
            crate::trace::vision_beside(done.started, done.finished, done.seq, done.rows);
            finished.push((done.seq, done.feats));
        }
        let busy: std::collections::BTreeSet<usize> = self.encoding.values().filter_map(|p| p.rank).collect();
        for k in busy {
            while let Some(m) = wire::try_recv(world, peers, k, TAG_FEATURES) {
                let m = m?;
                let seq = m
                    .segments
                    .first()
                    .map(|s| s.seq)
                    .ok_or_else(|| StageError::Peer(format!("features from stage {k} without their sequence")))?;
                finished.push((seq, bytes_f32(&m.payload)));
            }
        }
        for (seq, feats) in finished {
            any = true;
            let Some(mut p) = self.encoding.remove(&seq) else { continue };
            let want: usize = p.feats.iter().zip(&p.tokens).filter(|(f, _)| f.is_none()).map(|(_, t)| t * st.meta.x_words()).sum();
            if feats.len() != want {
                return Err(StageError::Peer(format!(
                    "sequence {seq}: {} feature words came back for its images; expected {want}",
                    feats.len()
                )));
            }
            self.fill(&mut p, feats, st.meta.x_words());
            if p.cancelled {
                st.end_seq(p.a.seq);
                feed.event(Event::End { seq: p.a.seq, reason: EndReason::Cancelled });
                continue;
            }
            self.joined(world, st, books, p)?;
        }
        Ok(any)
    }

    /// The encoder's figures for the front, when they changed.
    fn report_encoder(&mut self, feed: &mut impl Feed) {
        let (entries, bytes) = self.cache.held();
        let now = (self.cache.hits, self.cache.misses, entries, bytes, self.encoding.len());
        if now != self.last_encoder && feed.wants_stats() {
            self.last_encoder = now;
            let (encoded, seconds) = self.encodes;
            feed.event(Event::Encoder {
                hits: now.0,
                misses: now.1,
                entries,
                bytes,
                in_flight: now.4 as u64,
                encoded,
                encode_us: (seconds * 1e6) as u64,
            });
        }
    }

    /// A request with its features in place joins the stages and waits for
    /// blocks.
    fn join(
        &mut self,
        world: &SimpleCommunicator,
        books: &mut LastBooks,
        a: SeqRequest,
        image_rows: Vec<ImageRows>,
    ) -> Result<(), StageError> {
        if self.stages > 1 {
            self.outbox.send(world, 1, TAG_ACT, add_message(&a));
        } else {
            books.start(a.seq, a.prompt.clone(), a.sampling, a.max_new, crate::books::OutputSpec::of(&a));
        }
        let mut chain = Vec::new();
        if self.kv.caching {
            extend_chain(&mut chain, &a.prompt, &image_rows, self.kv.block);
        }
        self.live.insert(
            a.seq,
            Live {
                prompt_len: a.prompt.len(),
                max_new: a.max_new,
                ignore_eos: a.ignore_eos,
                ids: a.prompt,
                chain,
                images: image_rows,
                chunks: VecDeque::new(),
                generated: 0,
                last_id: 0,
                busy: false,
                cancelled: false,
                // Under a grammar the grammar decides where the output
                // ends (its stop ids are masked until it is complete):
                // a stop string must not cut it short either.
                stops: if a.grammar.is_some() { Vec::new() } else { a.stops },
                stop_ids: a.stop_ids,
                text: Vec::new(),
                kv: SeqBlocks::default(),
                running: false,
                started: 0,
                counted: false,
                prompt_rows: a.prompt_logprobs.is_some(),
                drafts: Vec::new(),
                spec_skip: 0,
                spec_misses: 0,
                spec_kept: self.batching.speculative.map(|n| n.tokens).or(self.batching.eagle3).unwrap_or(0) as f32,
                proposals: Vec::new(),
            },
        );
        self.waiting.push_back(a.seq);
        Ok(())
    }

    /// Starts waiting sequences, oldest first, while the pool has the
    /// blocks of their first step (beyond one block per running sequence,
    /// so those can go on): each takes the longest prefix the cache holds
    /// and prefills the rest, or, preempted, recomputes what it had. One
    /// whose next block another sequence is computing waits for it. Returns
    /// whether any started.
    fn admit(&mut self, feed: &mut impl Feed) -> bool {
        let mut started = false;
        let mut deferred = Vec::new();
        let reserved: usize = self.live.values().map(|l| blocks_for(l.prompt_len + l.max_new + 1, self.kv.block)).sum();
        while let Some(seq) = self.waiting.pop_front() {
            let running = self.live.values().filter(|l| l.running).count();
            let Some(l) = self.live.get_mut(&seq) else { continue };
            let b = self.kv.block;
            // Its rows up to the next draw: computed, or from the cache.
            let draw = l.draw_row();
            let cold = self.batching.score_last || (l.prompt_rows && l.generated == 0);
            if self.kv.caching && l.chain.len() * b < l.ids.len() {
                extend_chain(&mut l.chain, &l.ids, &l.images, b);
            }
            let limit = if cold { 0 } else { draw / b };
            let hit = self.kv.lookup(&mut l.kv, &l.chain, limit);
            let first_end = hit.saturating_add(self.batching.chunk).min(draw + 1);
            let next_block = hit / b;
            let wait_for_other = hit < draw && !cold && self.kv.computed_elsewhere(&l.chain, next_block, seq);
            let need = self.kv.need(&l.kv, first_end);
            // Beyond its own, a block for each running sequence to go on
            // with, unless every live sequence's whole need fits the pool
            // (then none can run out: an `m3c run` sizes it so).
            let watermark = if reserved <= self.kv.total() { 0 } else { running };
            let room = self.kv.available() >= need + watermark;
            if wait_for_other || (!room && running > 0) || !self.kv.grow(&mut l.kv, first_end) {
                self.kv.release(&mut l.kv);
                deferred.push(seq);
                if wait_for_other {
                    continue;
                }
                break;
            }
            // Its steps up to the next draw: chunks from the first row not
            // cached; a resumed sequence then feeds its last token as usual.
            let upto = if l.generated == 0 { l.prompt_len } else { draw };
            let chunk = self.batching.chunk;
            l.chunks = l.ids[hit..upto].chunks(chunk).enumerate().map(|(k, c)| (hit + k * chunk, c.to_vec())).collect();
            if !cold {
                self.kv.will_compute(&mut l.kv, &l.chain, next_block, seq);
            }
            l.running = true;
            self.clock += 1;
            l.started = self.clock;
            if !l.counted {
                l.counted = true;
                feed.event(Event::Prefix { seq, queried: l.prompt_len, hit: hit.min(l.prompt_len) });
            }
            self.ready.push_back(seq);
            started = true;
        }
        // The deferred keep their places at the head of the queue.
        for seq in deferred.into_iter().rev() {
            self.waiting.push_front(seq);
        }
        started
    }

    /// Steps the next micro-batch of ready sequences; false when none
    /// could take a step (they wait for blocks that steps in flight hold).
    fn launch(
        &mut self,
        world: &SimpleCommunicator,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
    ) -> Result<bool, StageError> {
        let mut segs = Vec::new();
        let mut ids = Vec::new();
        let mut grown: Vec<Vec<u32>> = Vec::new();
        let mut drafts: Vec<Vec<i64>> = Vec::new();
        // Per segment, the proposals the EAGLE3 head should make after it.
        let mut propose: Vec<i64> = Vec::new();
        let mut stalled = Vec::new();
        // vLLM's `disable_by_batch_size`: a large batch takes no drafts.
        let running = self.live.values().filter(|l| l.running).count();
        let speculative = self.batching.speculative.filter(|n| n.disable_by_batch_size.is_none_or(|b| running <= b));
        'seqs: while segs.len() < self.batching.per_batch {
            let Some(seq) = self.ready.pop_front() else { break };
            let l = self.live.get(&seq).ok_or_else(|| StageError::Step(format!("runtime bug: sequence {seq} is ready but not live")))?;
            let (pos0, mut item) = match l.chunks.front() {
                Some((p, c)) => (*p, c.clone()),
                None => (l.prompt_len + l.generated - 1, vec![l.last_id]),
            };
            // A decode step verifies a draft when one is proposed, at most
            // the tokens the sequence may still generate less the one the
            // step draws anyway.
            let drafting = l.chunks.is_empty() && !self.batching.score_last && !l.cancelled && l.spec_skip == 0;
            let cap = l.max_new.saturating_sub(l.generated + 1).min(l.spec_kept.ceil() as usize + 1);
            let draft = match (speculative, self.batching.eagle3) {
                (Some(ngram), _) if drafting => ngram.propose(&l.ids, cap),
                (None, Some(_)) if drafting => l.proposals.iter().copied().take(cap).collect(),
                _ => Vec::new(),
            };
            item.extend_from_slice(&draft);
            // The EAGLE3 head writes its own rows up to K − 1 positions past
            // the step's, when the step draws and proposals are asked of it:
            // blocks for them come now, while the pool has them.
            let draws = l.chunks.len() <= 1;
            let ahead = match self.batching.eagle3 {
                Some(k) if draws && eagle3_asks(&self.batching, l, running) > 0 => k.saturating_sub(1),
                _ => 0,
            };
            // The blocks its positions reach; when the pool is out of them,
            // a draft is dropped first, then the newest running sequence
            // not in flight gives its back.
            loop {
                let l = self.live.get_mut(&seq).ok_or_else(|| StageError::Step(format!("runtime bug: sequence {seq} vanished")))?;
                let reach = (pos0 + item.len() + ahead).min(l.prompt_len + l.max_new + 1);
                if self.kv.grow(&mut l.kv, reach) || (ahead > 0 && reach > pos0 + item.len() && self.kv.grow(&mut l.kv, pos0 + item.len()))
                {
                    break;
                }
                if item.len() > 1 && l.chunks.is_empty() {
                    item.truncate(1);
                    continue;
                }
                let victim = self.live.iter().filter(|(_, v)| v.running && !v.busy).max_by_key(|(_, v)| v.started).map(|(&s, _)| s);
                match victim {
                    Some(v) => {
                        self.preempt(world, st, feed, v);
                        if v == seq {
                            continue 'seqs;
                        }
                    }
                    None => {
                        stalled.push(seq);
                        break 'seqs;
                    }
                }
            }
            let l = self.live.get_mut(&seq).ok_or_else(|| StageError::Step(format!("runtime bug: sequence {seq} vanished")))?;
            // A decode item's rows after the first are its draft.
            l.drafts = if l.chunks.pop_front().is_none() { item[1..].to_vec() } else { Vec::new() };
            if l.drafts.is_empty() && l.chunks.is_empty() {
                l.spec_skip = l.spec_skip.saturating_sub(1);
            }
            l.busy = true;
            let new = Kv::unsent(&mut l.kv);
            st.grow_seq(seq, &new)?;
            segs.push(Segment { seq, pos0, rows: item.len() });
            grown.push(new);
            drafts.push(l.drafts.clone());
            propose.push(eagle3_asks(&self.batching, l, running));
            ids.extend(item);
        }
        for seq in stalled.into_iter().rev() {
            self.ready.push_front(seq);
        }
        if segs.is_empty() {
            return Ok(false);
        }
        if grown.iter().all(Vec::is_empty) {
            grown.clear();
        }
        if drafts.iter().all(Vec::is_empty) {
            drafts.clear();
        }
        if propose.iter().all(|&k| k == 0) {
            propose.clear();
        }
        let mut x = vec![0f32; ids.len() * st.meta.carry_words()];
        if self.stages == 1 {
            let sample = books.sample_in(&segs, &drafts, st.meta.vocab)?;
            let out = st.step(&segs, &ids, &mut x, Some(sample), !drafts.is_empty())?;
            let mut got = books.finish(&segs, &drafts, &out, st.meta.vocab, 0)?;
            crate::draft::attach(st, books, &segs, &drafts, &propose, &mut got, &x)?;
            self.returned(world, st, books, feed, &segs, &got)?;
            return Ok(true);
        }
        if st.uses_collectives() {
            // The step's NCCL send waits for the receiver, who needs the header first.
            self.outbox.send(world, 1, TAG_ACT, message_step(KIND_STEP, &segs, &grown, &drafts, &propose, &[]));
        }
        st.step(&segs, &ids, &mut x, None, !drafts.is_empty())?;
        if !st.uses_collectives() {
            self.outbox.send(world, 1, TAG_ACT, message_step(KIND_STEP, &segs, &grown, &drafts, &propose, &f32_bytes(&x)));
        }
        self.in_flight += 1;
        Ok(true)
    }

    /// Sequence `seq` (running, no step in flight) gives its blocks back on
    /// every stage and waits again, first in line; what it generated stays
    /// (the last stage's books, the stop-string text), and it resumes by
    /// recomputing its rows, from the cache where it can.
    fn preempt(&mut self, world: &SimpleCommunicator, st: &mut Stage, feed: &mut impl Feed, seq: usize) {
        let Some(l) = self.live.get_mut(&seq) else { return };
        self.kv.release(&mut l.kv);
        l.running = false;
        l.chunks.clear();
        self.ready.retain(|&s| s != seq);
        self.waiting.push_front(seq);
        st.reset_seq(seq);
        if self.stages > 1 {
            self.outbox.send(world, 1, TAG_ACT, message(KIND_RESET, &[Segment { seq, pos0: 0, rows: 0 }], &[]));
        }
        feed.event(Event::Preempted { seq });
    }

    /// A micro-batch came back with each segment's tokens: none for a
    /// prefill chunk, one for a decode step, the accepted drafts and one
    /// more for a verify step.
    fn returned(
        &mut self,
        world: &SimpleCommunicator,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
        segs: &[Segment],
        drawn: &[Drawn],
    ) -> Result<(), StageError> {
        if drawn.len() != segs.len() {
            return Err(StageError::Peer("an id message with one entry per segment expected".into()));
        }
        for (s, d) in segs.iter().zip(drawn) {
            // Prompt logprobs: row j predicts prompt token pos0 + j + 1.
            for (j, (tok, lp)) in d.prompt.iter().enumerate() {
                feed.event(Event::PromptLogprobs { seq: s.seq, pos: s.pos0 + j + 1, id: *tok, lp: lp.clone() });
            }
            let l = self.live.get_mut(&s.seq).ok_or_else(|| StageError::Step(format!("ids for sequence {}, which is not live", s.seq)))?;
            l.busy = false;
            l.proposals.clone_from(&d.proposals);
            let drafts = std::mem::take(&mut l.drafts);
            // The step reached its next draw (else it was a prefill chunk
            // before the prompt's last, or recomputed a resumed sequence's rows).
            let draws = s.pos0 + s.rows == l.prompt_len + l.generated + drafts.len();
            let mut reason = if l.cancelled { Some(EndReason::Cancelled) } else { None };
            let mut taken = 0;
            for t in &d.tokens {
                if reason.is_some() {
                    break;
                }
                if t.id < 0 {
                    // Its logits were not finite (or its grammar failed): it
                    // ends, the others go on.
                    reason = Some(EndReason::Error);
                    break;
                }
                if !draws {
                    return Err(StageError::Peer(format!("a token for sequence {}'s prefill chunk", s.seq)));
                }
                if l.generated >= l.max_new {
                    break;
                }
                let id = t.id;
                taken += 1;
                l.generated += 1;
                l.last_id = id;
                l.ids.push(id);
                if let Some(lp) = &t.logprobs {
                    feed.event(Event::Logprobs { seq: s.seq, id: id as u32, lp: lp.clone() });
                }
                feed.event(Event::Id { seq: s.seq, id: id as u32 });
                let eos = !l.ignore_eos && self.batching.eos.contains(&id);
                if eos || l.stop_ids.contains(&id) || stop_string_ends(l, id, self.token_bytes.as_deref()) {
                    reason = Some(EndReason::Stop);
                } else if l.generated >= l.max_new && !self.batching.score_last {
                    reason = Some(EndReason::Length);
                }
            }
            if draws && reason.is_none() && (taken == 0 || taken > drafts.len() + 1) {
                // Nothing more to generate: this step only scored the last
                // token (or, with max_new 0, the prompt).
                if l.generated >= l.max_new && taken == 0 {
                    reason = Some(EndReason::Length);
                } else {
                    return Err(StageError::Peer(format!("{} tokens for sequence {}'s step of {} drafts", taken, s.seq, drafts.len())));
                }
            }
            if !drafts.is_empty() {
                let accepted = taken.saturating_sub(1).min(drafts.len());
                feed.event(Event::Spec { seq: s.seq, drafted: drafts.len(), accepted });
                l.spec_kept = 0.5 * l.spec_kept + 0.5 * accepted as f32;
                // A verify step's rows cost more than one (a row of an MoE
                // layer reads its own experts' weights): a sequence whose
                // drafts keep failing to earn them (fewer than half kept)
                // skips 4, 8, ... then 64 decode steps before the next try.
                (l.spec_misses, l.spec_skip) =
                    if 2 * accepted < drafts.len() { (l.spec_misses + 1, 4 << l.spec_misses.min(4)) } else { (0, 0) };
            }
            if self.kv.caching && (l.chain.len() + 1) * self.kv.block <= l.ids.len() {
                extend_chain(&mut l.chain, &l.ids, &l.images, self.kv.block);
            }
            // Every stage has written these rows: their full blocks can be
            // shared. A verify step's rows hold its fed token and the
            // accepted drafts; those after hold rejected drafts, which the
            // sequence's next steps overwrite.
            let written = if drafts.is_empty() { s.pos0 + s.rows } else { s.pos0 + taken.max(1) };
            self.kv.commit(&mut l.kv, &l.chain, written);
            match reason {
                Some(r) => self.end(world, st, books, feed, s.seq, r),
                None => self.ready.push_back(s.seq),
            }
        }
        Ok(())
    }

    /// A sequence leaves: the feed is told, every stage frees its caches.
    fn end(
        &mut self,
        world: &SimpleCommunicator,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
        seq: usize,
        reason: EndReason,
    ) {
        if let Some(mut l) = self.live.remove(&seq) {
            self.kv.release(&mut l.kv);
        }
        self.ready.retain(|&s| s != seq);
        self.waiting.retain(|&s| s != seq);
        books.end(seq);
        st.end_seq(seq);
        if self.stages > 1 {
            self.outbox.send(world, 1, TAG_ACT, message(KIND_DROP, &[Segment { seq, pos0: 0, rows: 0 }], &[]));
        }
        feed.event(Event::End { seq, reason });
    }
}

/// What a step asks of the last stage's EAGLE3 head for sequence `l`
/// (`Msg::propose`): K proposals for a next step that would verify
/// them; 0 (its cache rows only) while it backs off or the batch is
/// over `disable_by_batch_size`; −1 (nothing) once its drafts have
/// missed twice in a row, so a sequence the head cannot predict costs
/// its decode steps almost nothing (its head cache then has holes,
/// which only make later proposals worse).
fn eagle3_asks(b: &Batching, l: &Live, running: usize) -> i64 {
    let Some(k) = b.eagle3.filter(|_| !b.score_last && !l.cancelled) else { return 0 };
    let big = b.eagle3_batch.is_some_and(|b| running > b);
    match (l.spec_skip, big) {
        (0, false) => k as i64,
        (_, _) if l.spec_misses >= 2 => -1,
        _ => 0,
    }
}

/// Whether the token `id` completes one of the sequence's stop strings (the
/// token is kept; the text the front shows is cut before the stop string).
fn stop_string_ends(l: &mut Live, id: i64, token_bytes: Option<&[Vec<u8>]>) -> bool {
    let Some(table) = token_bytes.filter(|_| !l.stops.is_empty()) else { return false };
    let from = l.text.len();
    l.text.extend_from_slice(usize::try_from(id).ok().and_then(|i| table.get(i)).map_or(&[][..], Vec::as_slice));
    m3c_contract::token_bytes::stop_end(&l.text, from, &l.stops).is_some()
}

/// The grids of `im` whose features are not in hand (`feats[i]` is `None`).
fn missing_grids(im: &SeqImages, feats: &[Option<Arc<Vec<f32>>>]) -> SeqImages {
    let row = im.pixels.len() / im.patches().max(1);
    let mut out = SeqImages { grids: Vec::new(), pixels: Vec::new() };
    let mut at = 0;
    for (g, f) in im.grids.iter().zip(feats) {
        let rows = g[0] * g[1] * g[2];
        if f.is_none() {
            out.grids.push(*g);
            out.pixels.extend_from_slice(&im.pixels[at * row..(at + rows) * row]);
        }
        at += rows;
    }
    out
}

/// A prompt with image placeholders needs its images, as in the reference.
fn placeholders_without_images(st: &Stage, prompt: &[i64]) -> Result<(), String> {
    match &st.meta.vision {
        Some(v) => match prompt.iter().filter(|&&id| v.is_placeholder(id)).count() {
            0 => Ok(()),
            n => Err(format!(
                "the prompt has {n} image or video placeholder(s) (ids {} and {}) but no image or video",
                v.image_token, v.video_token
            )),
        },
        None => Ok(()),
    }
}

/// The bytes of every token id, from the checkpoint's `tokenizer.json`.
fn load_token_bytes(model: Option<&std::path::Path>) -> Result<Vec<Vec<u8>>, String> {
    let dir = model.ok_or("stop strings need --model DIR with a tokenizer.json")?;
    let file = dir.join("tokenizer.json");
    let json = m3c_contract::read_user_file(&file, "tokenizer", m3c_contract::input::limits::TOKENIZER)
        .map_err(|e| format!("stop strings: {e}"))?;
    m3c_contract::token_bytes::byte_level_table(&json).map_err(|e| format!("stop strings: {}: {e}", file.display()))
}

fn stat_events(feed: &mut impl Feed, w: &[i64]) {
    for s in w.chunks_exact(3) {
        feed.event(Event::Stat { stage: s[0] as usize, steps: s[1] as u64, busy_s: s[2] as f64 / 1e6 });
    }
}

/// Each image's content hash and the prompt positions of its placeholder
/// rows (the images' tokens, in order), for the prefix-cache keys.
fn image_rows(st: &Stage, prompt: &[i64], im: &SeqImages) -> Vec<ImageRows> {
    use sha2::{Digest, Sha256};
    let Some(v) = &st.meta.vision else { return Vec::new() };
    let mut rows = prompt.iter().enumerate().filter(|(_, &id)| v.is_placeholder(id)).map(|(p, _)| p);
    let row = im.pixels.len() / im.patches().max(1);
    let mut out = Vec::new();
    let mut at = 0;
    for (i, n) in im.tokens().into_iter().enumerate() {
        let grid = &im.grids[i];
        let patches: usize = grid.iter().product();
        let mut h = Sha256::new();
        for d in grid {
            h.update((*d as u64).to_le_bytes());
        }
        for x in im.pixels.get(at * row..(at + patches) * row).unwrap_or_default() {
            h.update(x.to_bits().to_le_bytes());
        }
        at += patches;
        out.push((h.finalize().into(), rows.by_ref().take(n).collect()));
    }
    out
}
