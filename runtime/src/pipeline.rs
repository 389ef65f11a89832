//! A stage's part of the pipeline, for `m3c run` and `m3c serve` alike: the
//! first stage runs the scheduler (`schedule::Leader`), fed by the serve
//! protocol (`serve::ServeFeed`) or by the run's prompts ([`RunFeed`]); the
//! others follow (`follow::follow`); the last one keeps the books
//! (`books::LastBooks`) and, for a run, writes the dumps and checks
//! `--expect` at the end.

use crate::args::RunArgs;
use crate::batching::Batching;
use crate::books::{LastBooks, OnNonFinite};
use crate::dump;
use crate::error::StageError;
use crate::feed::{Feed, Next};
use crate::liveness::{self, Peers};
use crate::schedule::Leader;
use crate::stage::Stage;
use m3c_contract::images::SeqImages;
use m3c_contract::protocol::{Command, Event, SeqRequest};
use m3c_contract::stage_args::Prompts;
use mpi::topology::SimpleCommunicator;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Runs this stage's part of the pipeline. `Err`: a failure mid-run, after
/// which the job must be aborted (peers may be waiting on this stage);
/// `Ok(Err)`: a failure in the closing work (dump, `--expect`), reported
/// through the closing verdict.
pub fn run(world: &SimpleCommunicator, peers: &mut Peers, st: &mut Stage, args: &RunArgs) -> Result<Result<(), StageError>, StageError> {
    // Test hook (documented in ARCHITECTURE.md): this stage falls silent,
    // heartbeats included, as a hung or lost peer would, so that the tests
    // can check the others notice within --timeout-s instead of hanging.
    if std::env::var("M3C_TEST_STALL_STAGE").ok().and_then(|v| v.parse::<usize>().ok()) == Some(st.meta.stage) {
        liveness::fall_silent();
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
    if args.trace {
        // The track of this rank (a stage's is its number; an encoder
        // rank's, its place after the stages).
        crate::trace::enable(mpi::topology::Communicator::rank(world) as usize);
        // A run records from here; serving, from the front's `trace on`.
        crate::trace_exchange::align_clocks(world, peers, !args.serving())?;
    }
    let want_logits = args.dump.is_some() || args.expect.is_some();
    let on_bad = if args.serving() { OnNonFinite::EndSequence } else { OnNonFinite::EndRun };
    let grammars = crate::books::GrammarSource::new(args.weights.checkpoint().cloned(), st.meta.vocab, args.eos_ids.clone());
    let mut books = LastBooks::new(want_logits, on_bad, grammars);
    // The last stage drafts when it holds an EAGLE3 head and the run asks for it.
    if let (Some(d), Some(e)) = (&st.meta.draft, args.eagle3.as_ref()) {
        let dir = args.weights.checkpoint().map(|_| e.model.as_path());
        books.drafter = Some(crate::draft::Drafter::load(dir, d.vocab, st.meta.vocab, e.tokens)?);
    }
    if args.eagle3.is_some() && st.meta.last_stage && st.meta.draft.is_none() {
        return Err(StageError::Step(
            "EAGLE3 speculation needs stages compiled with its draft head (`m3c compile --speculative-config '{\"method\": \"eagle3\", ...}'`)".into(),
        ));
    }
    if st.meta.encoder {
        crate::encoder::serve_rank(world, peers, st)?;
    } else if !st.meta.first_stage {
        crate::follow::follow(world, peers, st, &mut books)?;
    } else if args.serving() {
        let mut feed = crate::serve::ServeFeed::new(st.meta.vision.as_ref().map(|v| v.patch_row));
        Leader::new(st, crate::serve::batching(args), args.weights.checkpoint().cloned()).run(world, peers, st, &mut books, &mut feed)?;
    } else {
        let mut feed = RunFeed::new(st, args)?;
        let batching = Batching {
            // Enough micro-batches to keep every stage busy (one per stage),
            // as few as that allows (weights are read once per step). The
            // prompts may come on standard input (`m3c run`), so count
            // them wherever they come from.
            per_batch: args.micro_batch.unwrap_or_else(|| args.prompt_count().div_ceil(st.meta.stages)).max(1),
            chunk: args.prefill_chunk.unwrap_or(usize::MAX).max(1),
            eos: args.eos_ids.clone(),
            score_last: want_logits,
            prefix_caching: args.kv.prefix_caching,
            kv_events: args.kv.events,
            // A dump records the row of each emitted token, verified or not.
            spec: crate::batching::speculator(args),
            encoder: args.encoder,
        };
        let per_batch = batching.per_batch;
        Leader::new(st, batching, args.weights.checkpoint().cloned()).run(world, peers, st, &mut books, &mut feed)?;
        feed.report(per_batch);
    }
    if !args.serving() {
        crate::trace_exchange::gather(world, peers, &crate::host_name())?;
    }
    Ok(finish_records(st.meta.last_stage, args, &books.finished, st.meta.vocab))
}

/// The run's prompts as requests, all added at once; the run's output (the
/// ids, streamed or at the end, and the timing line) from the events.
struct RunFeed<'a> {
    args: &'a RunArgs,
    requests: VecDeque<SeqRequest>,
    images: BTreeMap<usize, SeqImages>,
    generated: Vec<Vec<i64>>,
    prompt_tokens: usize,
    /// Each prompt's tokens' logprobs, for those that asked (`None`: not asked).
    logprobs: Vec<Option<Vec<(u32, m3c_contract::protocol::TokenLogprobs)>>>,
    start: Instant,
    /// When each prompt's prefill was done (its first event).
    prefilled: Vec<Option<Duration>>,
    /// Prompt tokens looked up in the prefix cache and found there, and
    /// preemptions.
    prefix: (usize, usize),
    preempted: usize,
    /// Speculative decoding: verify steps, draft tokens, accepted drafts.
    spec: (usize, usize, usize),
}

impl<'a> RunFeed<'a> {
    fn new(st: &Stage, args: &'a RunArgs) -> Result<RunFeed<'a>, StageError> {
        // `m3c run` sends complete requests, as `m3c serve` does; prompts
        // given as flags (a stage run by hand) take the run's flags.
        let (requests, images) = match args.prompts {
            Prompts::Stdin(n) => stdin_requests(n, st.meta.vision.as_ref().map(|v| v.patch_row), args.timeout_s)?,
            _ => (inline_requests(args), inline_images(st, args)?),
        };
        let requests: VecDeque<SeqRequest> = requests.into();
        let n = requests.len();
        Ok(RunFeed {
            args,
            prompt_tokens: requests.iter().map(|r| r.prompt.len()).sum(),
            logprobs: requests.iter().map(|r| r.logprobs.map(|_| Vec::new())).collect(),
            requests,
            images,
            generated: vec![Vec::new(); n],
            start: Instant::now(),
            prefilled: vec![None; n],
            prefix: (0, 0),
            preempted: 0,
            spec: (0, 0, 0),
        })
    }

    /// The ids of each prompt (unless they were streamed) and the timing line.
    fn report(&self, per_batch: usize) {
        let total = self.start.elapsed();
        for (s, g) in self.generated.iter().enumerate().filter(|_| !self.args.stream_ids) {
            let ids: Vec<String> = g.iter().map(|i| i.to_string()).collect();
            print_line(&format!("prompt {s}: {}\n", ids.join(",")));
            if let Some(Some(lps)) = self.logprobs.get(s) {
                print_line(&format!("logprobs {s}: {}\n", m3c_contract::protocol::logprobs_json(lps)));
            }
        }
        let prefill_end = self.prefilled.iter().flatten().max().copied().unwrap_or_default();
        let prompt_tokens = self.prompt_tokens;
        let decode_tokens: usize = self.generated.iter().map(Vec::len).sum();
        let dt = (total - prefill_end).as_secs_f64();
        say!(
            "m3c timing: prefill {prompt_tokens} tokens in {:.1} ms ({:.1} tok/s); decode {decode_tokens} tokens in {:.1} ms ({:.1} tok/s); up to {per_batch} sequence(s) per micro-batch",
            prefill_end.as_secs_f64() * 1e3,
            prompt_tokens as f64 / prefill_end.as_secs_f64().max(1e-9),
            dt * 1e3,
            decode_tokens as f64 / dt.max(1e-9)
        );
        let (drafts, drafted, accepted) = self.spec;
        if drafts > 0 {
            // vLLM's mean acceptance length: the bonus token counts.
            say!(
                "m3c spec: {drafts} verify step(s), {drafted} draft tokens, {accepted} accepted ({:.1}%); mean acceptance length {:.3}",
                100.0 * accepted as f64 / drafted as f64,
                1.0 + accepted as f64 / drafts as f64
            );
        } else if self.args.speculative.is_some() || self.args.eagle3.is_some() {
            // Asked for, never chosen: say so (the README says the run ends with this line).
            say!("m3c spec: 0 verify step(s), 0 draft tokens, 0 accepted: no draft was expected to pay for the rows it costs on this model and batch");
        }
        let (queried, hit) = self.prefix;
        say!("m3c kv: {hit} of {queried} prompt tokens came from the prefix cache; {} preemption(s)", self.preempted);
    }
}

impl Feed for RunFeed<'_> {
    fn next(&mut self, _wait: Duration) -> Next {
        match self.requests.pop_front() {
            Some(a) => Next::Command(Command::Add(a)),
            None => Next::Closed,
        }
    }

    fn images(&mut self, a: &SeqRequest) -> Result<Option<SeqImages>, String> {
        Ok(self.images.remove(&a.seq))
    }

    fn event(&mut self, e: Event) {
        match &e {
            // A streaming run's front learns that the pipeline came up (a
            // lost one is then started again, not failed as at start-up).
            Event::Ready => {
                if self.args.stream_ids {
                    crate::serve::say(e);
                }
                return;
            }
            Event::Prefix { queried, hit, .. } => {
                self.prefix.0 += queried;
                self.prefix.1 += hit;
                return;
            }
            Event::Preempted { .. } => {
                self.preempted += 1;
                return;
            }
            Event::Spec { drafted, accepted, .. } => {
                self.spec.0 += 1;
                self.spec.1 += drafted;
                self.spec.2 += accepted;
                return;
            }
            _ => {}
        }
        if let Event::Logprobs { seq, id, lp } = &e {
            if self.args.stream_ids {
                crate::serve::say(e);
            } else if let Some(Some(l)) = self.logprobs.get_mut(*seq) {
                l.push((*id, lp.clone()));
            }
            return;
        }
        let seq = match &e {
            Event::Id { seq, .. } | Event::End { seq, .. } => *seq,
            _ => return,
        };
        if let Some(p) = self.prefilled.get_mut(seq).filter(|p| p.is_none()) {
            *p = Some(self.start.elapsed());
        }
        if let (Event::Id { id, .. }, Some(g)) = (&e, self.generated.get_mut(seq)) {
            g.push(i64::from(*id));
        }
        if self.args.stream_ids {
            crate::serve::say(e);
        }
    }

    fn refuse(&mut self, seq: Option<usize>, why: String) -> Result<(), StageError> {
        Err(StageError::Args(match seq {
            Some(s) => format!("prompt {s}: {why}"),
            None => why,
        }))
    }

    fn wants_stats(&self) -> bool {
        false
    }
}

/// One line to standard output, flushed so a reader sees it now. A closed
/// pipe is not this stage's failure: `m3c run` reports its own.
fn print_line(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes()).and_then(|_| out.flush());
}

/// Each prompt's images, by its sequence.
type ImagesBySeq = BTreeMap<usize, SeqImages>;

/// The images of a run's `--images` file (prompts on the command line).
fn inline_images(st: &Stage, args: &RunArgs) -> Result<ImagesBySeq, StageError> {
    let images = match (&args.images, &st.meta.vision) {
        (None, _) => BTreeMap::new(),
        (Some(f), None) => {
            return Err(StageError::Args(format!(
                "--images {}: this pipeline was compiled without the vision tower (the plan says `vision: false`)",
                f.display()
            )))
        }
        (Some(f), Some(v)) => read_images(f, v.patch_row)?,
    };
    let prompts = args.prompt_count();
    if let Some(s) = images.keys().find(|&&s| s >= prompts) {
        return Err(StageError::Args(format!("--images has images for sequence {s}, but there are {prompts} prompts")));
    }
    Ok(images)
}

/// The requests of a run whose prompts come as flags: each prompt with the
/// run's sampling (and its own, `--seq-sampling`), stop strings, logprobs
/// and grammar.
fn inline_requests(args: &RunArgs) -> Vec<SeqRequest> {
    args.prompts
        .inline()
        .iter()
        .enumerate()
        .map(|(seq, prompt)| SeqRequest {
            stops: args.stops.clone(),
            logprobs: args.logprobs,
            grammar: args.grammar.clone(),
            ..SeqRequest::new(seq, prompt.clone(), args.max_new_tokens, *args.sampling_for(seq))
        })
        .collect()
}

/// The run's requests and images from standard input (`m3c run`'s: each
/// complete, as a served request is): `n` framed `add` commands, sequence
/// `i` the `i`-th, each waited for at most `timeout_s` (the front writes
/// them all at once, so a wait that long means it is gone).
fn stdin_requests(n: usize, patch_row: Option<usize>, timeout_s: f64) -> Result<(Vec<SeqRequest>, ImagesBySeq), StageError> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || crate::serve::read_commands(tx));
    let (mut prompts, mut images) = (Vec::with_capacity(n), BTreeMap::new());
    let bad = |why: String| StageError::Args(format!("--stdin-prompts: {why}"));
    for i in 0..n {
        let got = rx.recv_timeout(Duration::from_secs_f64(timeout_s)).map_err(|e| {
            bad(match e {
                std::sync::mpsc::RecvTimeoutError::Timeout => format!("prompt {i} of {n} did not arrive within --timeout-s {timeout_s}"),
                std::sync::mpsc::RecvTimeoutError::Disconnected => format!("standard input ended after {i} of {n} prompts"),
            })
        })?;
        match got.map_err(|e| bad(format!("prompt {i}: {e}")))? {
            Command::Add(a) if a.seq == i => {
                if let Some(im) = crate::serve::request_images(&a, patch_row).map_err(|e| bad(format!("prompt {i}: {e}")))? {
                    images.insert(i, im);
                }
                prompts.push(a);
            }
            other => return Err(bad(format!("expected prompt {i} (`add seq={i} ...`), got `{}`", other.encode()))),
        }
    }
    Ok((prompts, images))
}

/// An images file (`m3c_contract::images`), every error naming it.
pub(crate) fn read_images(f: &std::path::Path, patch_row: usize) -> Result<BTreeMap<usize, SeqImages>, StageError> {
    let bytes =
        m3c_contract::input::read_bytes(f, "--images", m3c_contract::images::MAX_BYTES).map_err(|e| StageError::Args(e.to_string()))?;
    m3c_contract::images::decode(&bytes, patch_row).map_err(|e| StageError::Args(format!("{}: {e}", f.display())))
}

/// The last stage's closing work: dumps and the `--expect` check. Runs after
/// every stage has left its loop, so a failure here is reported through the
/// closing verdict instead of aborting peers that are shutting down.
fn finish_records(last: bool, args: &RunArgs, records: &BTreeMap<usize, dump::SeqRecord>, vocab: usize) -> Result<(), StageError> {
    if !last {
        return Ok(());
    }
    let n = args.prompt_count();
    let record = |i: usize| records.get(&i).ok_or_else(|| StageError::Step(format!("runtime bug: prompt {i} left no record")));
    if let Some(file) = &args.dump {
        for i in 0..n {
            dump::write(&dump::dump_path(file, i, n), record(i)?, vocab)?;
        }
    }
    if let Some(golden) = &args.expect {
        // The golden file describes one prompt: the first.
        let line = dump::check(golden, record(0)?, vocab, 1e-3)?;
        say!("{line}");
    }
    Ok(())
}
