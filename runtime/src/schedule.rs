//! The first stage's loop, the one for `m3c run` and `m3c serve`: it
//! executes the engine's plans (`m3c_engine`, which decides every step)
//! over whatever the [`Feed`] adds. `m3c serve` feeds it the front's
//! commands as they arrive on standard input; `m3c run` feeds it the run's
//! prompts, all at once, and closes the feed.
//!
//! A request is checked by the engine, opened on every stage (`KIND_ADD`),
//! its images encoded ([`crate::encodes`]), and then waits in the engine.
//! Each plan's rows go through every stage with the blocks its sequences
//! took, the drafts they verify and what the last stage's draft head is
//! asked for; what comes back (and the step's time, for speculation's cost
//! model) goes back to the engine. The engine's effects are carried out in
//! order: events to the feed, a preempted sequence's rows reset on every
//! stage (`KIND_RESET`), an ended one dropped (`KIND_DROP`).

use crate::batching::Batching;
use crate::books::{Drawn, LastBooks};
use crate::encodes::{image_rows, placeholders_without_images, Encodes};
use crate::error::StageError;
use crate::feed::{stat_events, Feed, Next};
use crate::follow::{add_message, capacity, stats_words, words};
use crate::in_flight::InFlight;
use crate::liveness::Peers;
use crate::stage::{Segment, Stage};
use crate::tag;
use crate::wire::{self, f32_bytes, message, message_step, Outbox, KIND_DROP, KIND_RESET, KIND_STATS, KIND_STEP, KIND_STOP};
use m3c_contract::protocol::{Command, Event, SeqRequest};
use m3c_engine::kv::ImageRows;
use m3c_engine::{Effect, Engine, Request};
use mpi::topology::SimpleCommunicator;
use std::time::{Duration, Instant};

/// The first stage's loop.
pub(crate) struct Leader {
    engine: Engine,
    stages: usize,
    model: Option<std::path::PathBuf>,
    outbox: Outbox,
    encodes: Encodes,
    /// Encoder ranks of their own, after the stages.
    encoders: usize,
    /// Each micro-batch in flight.
    launched: InFlight,
}

impl Leader {
    pub fn new(st: &Stage, b: Batching, model: Option<std::path::PathBuf>) -> Leader {
        let cfg = m3c_engine::Config {
            stages: st.meta.stages,
            per_batch: b.per_batch,
            chunk: b.chunk,
            eos: b.eos,
            score_last: b.score_last,
            prefix_caching: b.prefix_caching,
            blocks: st.pool_blocks(),
            block: st.meta.kv_block,
            max_positions: st.meta.max_positions,
            vocab: st.meta.vocab,
            kv_events: b.kv_events,
        };
        Leader {
            engine: Engine::new(cfg, b.spec),
            stages: st.meta.stages,
            model,
            outbox: Outbox::default(),
            encodes: Encodes::new(st, &b.encoder),
            encoders: st.meta.encoders,
            launched: InFlight::default(),
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
            let (used, cached, total) = self.engine.blocks();
            feed.event(Event::Kv { used, cached, total, running: 0, waiting: 0 });
        }
        feed.event(Event::Ready);
        loop {
            peers.drain(world);
            let mut worked = false;
            // Commands first, so a new request joins the very next step.
            while feed_open {
                match feed.next(Duration::ZERO) {
                    Next::Empty => break,
                    Next::Closed => feed_open = false,
                    next => {
                        self.take(world, peers, st, books, feed, next)?;
                        worked = true;
                    }
                }
            }
            worked |= self.encoded(world, peers, st, books, feed)?;
            worked |= self.engine.admit();
            self.apply(world, st, books, feed);
            // One micro-batch per stage in flight. With one stage a step runs
            // to its end here: one per turn, so commands are read between steps.
            while self.engine.can_step() && self.launch(world, st, books, feed)? {
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
                let (used, cached, total) = self.engine.blocks();
                let (running, waiting) = (self.engine.running(), self.engine.waiting());
                if (used, cached, total, running, waiting) != last_usage {
                    (last_usage, last_kv) = ((used, cached, total, running, waiting), Instant::now());
                    feed.event(Event::Kv { used, cached, total, running, waiting });
                }
            }
            if feed.wants_stats() && last_stats.elapsed() >= Duration::from_secs(1) && !stats_pending {
                last_stats = Instant::now();
                if self.stages > 1 {
                    let payload: Vec<u8> = stats_words(st).iter().flat_map(|w| w.to_le_bytes()).collect();
                    self.outbox.send(world, 1, tag::ACT, message(KIND_STATS, &[], &payload));
                    stats_pending = true;
                } else {
                    stat_events(feed, &stats_words(st));
                }
            }
            self.encodes.report(feed);
            if !feed_open && self.engine.idle() {
                break;
            }
            if !worked {
                self.outbox.poll();
                // Idle: wait briefly for a command (or, with steps in flight,
                // for the ids, which the loop probes).
                let quiet = self.engine.in_flight() == 0 && self.engine.encoding() == 0;
                let wait = if self.engine.in_flight() > 0 { Duration::from_micros(50) } else { Duration::from_millis(2) };
                if feed_open && quiet {
                    match feed.next(wait) {
                        Next::Empty => {}
                        Next::Closed => feed_open = false,
                        next => self.take(world, peers, st, books, feed, next)?,
                    }
                } else {
                    std::thread::sleep(wait);
                }
            }
        }
        if self.stages > 1 {
            self.outbox.send(world, 1, tag::ACT, message(KIND_STOP, &[], &[]));
        }
        // Encoder ranks of their own stop too (every encode came back).
        for k in st.encoder_ranks().into_iter().filter(|_| self.encoders > 0) {
            self.outbox.send(world, k, tag::ENCODE, message(KIND_STOP, &[], &[]));
        }
        self.outbox.drain(world, peers)
    }

    /// Carries out what the feed gave.
    fn take(
        &mut self,
        world: &SimpleCommunicator,
        peers: &mut Peers,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
        next: Next,
    ) -> Result<(), StageError> {
        match next {
            Next::Command(Command::Add(a)) => self.add(world, st, books, feed, a)?,
            Next::Command(Command::Cancel(seq)) => self.engine.cancel(seq),
            Next::Command(Command::Trace(on)) => {
                if let Err(why) = crate::trace_exchange::turn(world, peers, &mut self.outbox, (self.stages, self.encoders), on)? {
                    feed.refuse(None, why)?;
                }
            }
            Next::Bad(why) => feed.refuse(None, why)?,
            Next::Empty | Next::Closed => {}
        }
        self.apply(world, st, books, feed);
        Ok(())
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
        while let Some(m) = wire::try_recv(world, peers, self.stages - 1, tag::IDS) {
            let m = m?;
            if m.kind == KIND_STATS {
                stat_events(feed, &words(&m.payload));
                *stats_pending = false;
            } else {
                // The last stage's busy seconds for the step come first.
                let w = words(&m.payload);
                let (&micros, rest) = w.split_first().ok_or_else(|| StageError::Peer("an ids message without its step time".into()))?;
                if let Some((plan, seconds)) = self.launched.returned(micros) {
                    self.engine.timed(&plan, seconds);
                }
                let drawn = Drawn::decode(rest, m.segments.len()).map_err(StageError::Peer)?;
                self.engine.returned(&m.segments, &drawn).map_err(|e| StageError::Peer(e.0))?;
                self.apply(world, st, books, feed);
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

    /// A request arrives: checked, opened on this stage, its images
    /// checked and encoded; it joins, or waits in the engine for its
    /// encodes.
    fn add(
        &mut self,
        world: &SimpleCommunicator,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
        a: SeqRequest,
    ) -> Result<(), StageError> {
        let seq = a.seq;
        let probe = Request::of(&a, Vec::new());
        if let Err(why) = self.engine.check(&probe) {
            return feed.refuse(Some(seq), why);
        }
        if self.engine.needs_token_bytes(&probe) {
            match crate::weights::load_token_bytes(self.model.as_deref()) {
                Ok(t) => self.engine.set_token_bytes(t),
                Err(why) => return feed.refuse(Some(seq), why),
            }
        }
        st.start_seq(seq, capacity(&a))?;
        match self.open(world, st, feed, a) {
            Ok(Some((a, rows))) => {
                self.engine.add(Request::of(&a, rows), false);
                self.join(world, books, &a);
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(why) => {
                st.end_seq(seq);
                feed.refuse(Some(seq), why)
            }
        }
    }

    /// A checked request's images: `Some` with its images' rows once every
    /// feature is in hand, `None` while they encode (it waits in the
    /// engine), `Err` when they cannot be.
    fn open(
        &mut self,
        world: &SimpleCommunicator,
        st: &mut Stage,
        feed: &mut impl Feed,
        a: SeqRequest,
    ) -> Result<Option<(SeqRequest, Vec<ImageRows>)>, String> {
        let Some(images) = feed.images(&a)? else {
            placeholders_without_images(st, &a.prompt)?;
            return Ok(Some((a, Vec::new())));
        };
        let placeholders = st.check_images(a.seq, &a.prompt, &images).map_err(|e| e.to_string())?;
        let rows = image_rows(st, &a.prompt, &images);
        let waiting = Request::of(&a, rows.clone());
        match self.encodes.start(world, &mut self.outbox, st, a, images, rows, placeholders)? {
            Some(p) => Ok(Some(p.hand_over(st))),
            None => {
                self.engine.add(waiting, true);
                Ok(None)
            }
        }
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
        let done = self.encodes.finished(world, peers, st)?;
        let any = !done.is_empty();
        for p in done {
            if self.engine.encoded(p.a.seq) {
                let (a, _) = p.hand_over(st);
                self.join(world, books, &a);
            }
        }
        self.apply(world, st, books, feed);
        Ok(any)
    }

    /// A request with its features in place opens on the other stages (the
    /// last one's books, with one stage here).
    fn join(&mut self, world: &SimpleCommunicator, books: &mut LastBooks, a: &SeqRequest) {
        if self.stages > 1 {
            self.outbox.send(world, 1, tag::ACT, add_message(a));
        } else {
            books.start(a.seq, a.prompt.clone(), a.sampling, a.max_new, crate::books::OutputSpec::of(a));
        }
    }

    /// Executes the engine's next plan, if one can start: its blocks into
    /// each sequence's table, its rows through the stages.
    fn launch(
        &mut self,
        world: &SimpleCommunicator,
        st: &mut Stage,
        books: &mut LastBooks,
        feed: &mut impl Feed,
    ) -> Result<bool, StageError> {
        let plan = self.engine.next_plan().map_err(|e| StageError::Step(e.0))?;
        // A preemption's resets reach the stages before the step.
        self.apply(world, st, books, feed);
        let Some(plan) = plan else { return Ok(false) };
        for s in &plan.seqs {
            st.grow_seq(s.seq, &s.blocks)?;
        }
        let (segs, ids) = (plan.segments(), plan.ids());
        let wire = wire::StepLists::of(&plan);
        let mut x = vec![0f32; ids.len() * st.meta.carry_words()];
        if self.stages == 1 {
            let started = Instant::now();
            let sample = books.sample_in(&segs, &wire.drafts, st.meta.vocab)?;
            let out = st.step(&segs, &ids, &mut x, Some(sample), plan.verifies())?;
            let mut got = books.finish(&segs, &wire.drafts, &out, st.meta.vocab, 0)?;
            crate::draft::attach(st, books.drafter.as_ref(), &*books, &segs, &wire.drafts, &wire.asks, &mut got, &x)?;
            self.engine.timed(&plan, started.elapsed().as_secs_f64());
            self.engine.returned(&segs, &got).map_err(|e| StageError::Step(e.0))?;
            self.apply(world, st, books, feed);
            return Ok(true);
        }
        let header = |payload: &[u8]| message_step(KIND_STEP, &segs, &wire.blocks, &wire.drafts, &wire.asks, payload);
        if st.uses_collectives() {
            // The step's NCCL send waits for the receiver, who needs the header first.
            self.outbox.send(world, 1, tag::ACT, header(&[]));
        }
        let started = Instant::now();
        st.step(&segs, &ids, &mut x, None, plan.verifies())?;
        self.launched.launch(plan, started);
        if !st.uses_collectives() {
            self.outbox.send(world, 1, tag::ACT, header(&f32_bytes(&x)));
        }
        Ok(true)
    }

    /// Carries out the engine's effects, in order.
    fn apply(&mut self, world: &SimpleCommunicator, st: &mut Stage, books: &mut LastBooks, feed: &mut impl Feed) {
        for e in self.engine.effects() {
            match e {
                Effect::Event(ev) => feed.event(ev),
                Effect::Reset(seq) => {
                    st.reset_seq(seq);
                    if self.stages > 1 {
                        self.outbox.send(world, 1, tag::ACT, message(KIND_RESET, &[Segment { seq, pos0: 0, rows: 0 }], &[]));
                    }
                }
                Effect::Ended { seq, reason, joined } => {
                    books.end(seq);
                    st.end_seq(seq);
                    if joined && self.stages > 1 {
                        self.outbox.send(world, 1, tag::ACT, message(KIND_DROP, &[Segment { seq, pos0: 0, rows: 0 }], &[]));
                    }
                    feed.event(Event::End { seq, reason });
                }
            }
        }
    }
}
