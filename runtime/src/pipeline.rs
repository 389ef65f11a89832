//! The pipeline schedule. The first stage groups ready sequences into
//! micro-batches of `--micro-batch` sequences (default: the prompts shared
//! over the stages), pushes every prompt's prefill (in `--prefill-chunk`
//! pieces), then feeds each id the last stage returns back in as the next
//! decode step, so stages work on different micro-batches at once and each
//! step reads a stage's weights once for all its sequences.

use crate::args::RunArgs;
use crate::dump;
use crate::error::StageError;
use crate::liveness::{self, Peers};
use crate::stage::{self, Segment};
use crate::wire::{self, bytes_f32, f32_bytes, message, Outbox, KIND_STEP, KIND_STOP, TAG_ACT, TAG_IDS};
use m3c_contract::protocol::{EndReason, Event};
use m3c_contract::sampling::SamplingParams;
use mpi::topology::SimpleCommunicator;
use std::collections::VecDeque;
use std::time::Instant;

/// The bytes of every token id, from the checkpoint's `tokenizer.json`.
fn load_token_bytes(args: &RunArgs) -> Result<Vec<Vec<u8>>, StageError> {
    let dir = args.model.as_ref().ok_or_else(|| StageError::Args("--stop needs --model DIR with a tokenizer.json".into()))?;
    let file = dir.join("tokenizer.json");
    let json = m3c_contract::read_user_file(&file, "tokenizer", m3c_contract::input::limits::TOKENIZER)
        .map_err(|e| StageError::Args(format!("--stop: {e}")))?;
    m3c_contract::token_bytes::byte_level_table(&json).map_err(|e| StageError::Args(format!("--stop: {}: {e}", file.display())))
}

/// One line to standard output, flushed so a reader sees it now. A closed
/// pipe is not this stage's failure: `m3c run` reports its own.
fn print_line(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes()).and_then(|_| out.flush());
}

/// Whether a sequence's step ends at or past its prompt's last row, so its
/// last row gives a token.
fn gives_token(r: &dump::SeqRecord, s: &Segment) -> bool {
    s.pos0 + s.rows >= r.prompt.len()
}

/// What non-finite logits end: the run (`m3c run`: the weights are broken),
/// or only the sequence that met them (`m3c serve`: the others go on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnNonFinite {
    EndRun,
    EndSequence,
}

/// What the last stage knows of each sequence: its record (prompt,
/// generated ids, logits when wanted) and its sampling.
pub(crate) trait Books {
    fn seq(&self, seq: usize) -> Result<(&dump::SeqRecord, &SamplingParams), StageError>;
    fn seq_mut(&mut self, seq: usize) -> Result<&mut dump::SeqRecord, StageError>;
}

/// A run's sequences: one per prompt, sampled as the arguments say.
struct RunBooks<'a> {
    records: Vec<dump::SeqRecord>,
    args: &'a RunArgs,
}

impl Books for RunBooks<'_> {
    fn seq(&self, seq: usize) -> Result<(&dump::SeqRecord, &SamplingParams), StageError> {
        let r = self.records.get(seq).ok_or_else(|| StageError::Step(format!("a step for unknown prompt {seq}")))?;
        Ok((r, self.args.sampling_for(seq)))
    }
    fn seq_mut(&mut self, seq: usize) -> Result<&mut dump::SeqRecord, StageError> {
        self.records.get_mut(seq).ok_or_else(|| StageError::Step(format!("a step for unknown prompt {seq}")))
    }
}

/// The last stage's sampling inputs for a step: one table row per row of
/// the step (the last row of each segment that gives a token draws, keyed by
/// the sequence's own step, so the draw is the same whatever the split, the
/// batch or the chunking), and a seen-id bitmap per segment for those with
/// a repetition penalty.
pub(crate) fn sample_in(books: &impl Books, segs: &[Segment], vocab: usize, want_logits: bool) -> Result<stage::SampleIn, StageError> {
    use m3c_contract::sampling::{row_words, seen_bitmap, seen_words, ROW_WORDS};
    let words = seen_words(vocab);
    let tokens: usize = segs.iter().map(|s| s.rows).sum();
    let mut table = Vec::with_capacity(tokens * ROW_WORDS);
    let mut seen = vec![0u32; segs.len() * words];
    let mut penalised = false;
    for (k, s) in segs.iter().enumerate() {
        let (r, p) = books.seq(s.seq)?;
        let draws = gives_token(r, s);
        if draws && p.repetition_penalty != 1.0 {
            penalised = true;
            let bits = seen_bitmap(r.prompt.iter().chain(&r.generated).map(|&i| i as u32), vocab);
            seen[k * words..(k + 1) * words].copy_from_slice(&bits);
        }
        for j in 0..s.rows {
            table.extend_from_slice(&row_words(p, 0, r.generated.len() as u64, draws && j + 1 == s.rows, k));
        }
    }
    Ok(stage::SampleIn { table, seen, penalised, want_logits })
}

/// The last stage's part of a step: checks the logits, records them (when a
/// dump or `--expect` wants them), and returns one id per segment.
/// Non-finite logits (NaN or Inf in the weights, or an overflow) end the run
/// with the sequence and position.
pub(crate) fn finish(
    books: &mut impl Books,
    segs: &[Segment],
    out: &stage::StepOut,
    vocab: usize,
    max_new: usize,
    stage: usize,
    on_bad: OnNonFinite,
) -> Result<Vec<i64>, StageError> {
    use m3c_contract::sampling::{row, ROW_WORDS};
    let mut row0 = 0;
    let mut ids = Vec::with_capacity(segs.len());
    'segments: for s in segs {
        for j in 0..s.rows {
            let bad = out
                .table
                .get((row0 + j) * ROW_WORDS + row::NON_FINITE)
                .copied()
                .ok_or_else(|| StageError::Step("a step returned a short sampling table".into()))?;
            if bad != 0 && on_bad == OnNonFinite::EndSequence {
                // Only this sequence fails: its id is -1, which ends it.
                ids.push(-1);
                row0 += s.rows;
                continue 'segments;
            }
            if bad != 0 {
                return Err(StageError::Step(format!(
                    "stage {stage}: {bad} non-finite logits (NaN or Inf) at step for prompt {}, position {}; the weights or activations \
                     hold NaN or Inf (check the checkpoint with `m3c inspect MODEL --check-values`)",
                    s.seq,
                    s.pos0 + j
                )));
            }
        }
        let id = out.ids.get(row0 + s.rows - 1).copied().ok_or_else(|| StageError::Step("a step returned fewer ids than rows".into()))?;
        if id < 0 || id as usize >= vocab {
            return Err(StageError::Step(format!("stage {stage}: the sampler chose id {id}, outside the vocabulary (0..{vocab})")));
        }
        let r = books.seq_mut(s.seq)?;
        if let Some(rows) = out.logits.get(row0 * vocab..(row0 + s.rows) * vocab) {
            if s.pos0 < r.prompt.len() {
                // A prefill chunk (chunks of a sequence arrive in order).
                r.prefill_logits.extend_from_slice(rows);
            } else {
                r.decode_logits.extend_from_slice(&rows[(s.rows - 1) * vocab..]);
            }
        }
        // Only the prompt's last row and decode rows give tokens.
        if gives_token(r, s) && r.generated.len() < max_new {
            r.generated.push(id);
        }
        ids.push(id);
        row0 += s.rows;
    }
    Ok(ids)
}

/// Reads the prompts' images (`--images`) and encodes them on the stage
/// that holds the vision tower. A prompt with image placeholders and no
/// images is an error, as in the reference.
fn encode_images(st: &mut stage::Stage, args: &RunArgs) -> Result<(), StageError> {
    let mut images = match (&args.images, &st.meta.vision) {
        (None, _) => Default::default(),
        (Some(f), None) => {
            return Err(StageError::Args(format!(
                "--images {}: this pipeline was compiled without the vision tower (the plan says `vision: false`)",
                f.display()
            )))
        }
        (Some(f), Some(v)) => read_images(f, v.patch_row)?,
    };
    for (s, p) in args.prompts.iter().enumerate() {
        match images.remove(&s) {
            Some(im) => st.encode_images(s, p, &im)?,
            None => {
                if let Some(v) = &st.meta.vision {
                    let n = p.iter().filter(|&&id| id == v.image_token).count();
                    if n > 0 {
                        return Err(StageError::Args(format!(
                            "prompt {s} has {n} image placeholder(s) (id {}) but no image",
                            v.image_token
                        )));
                    }
                }
            }
        }
    }
    if let Some(s) = images.keys().next() {
        return Err(StageError::Args(format!("--images has images for sequence {s}, but there are {} prompts", args.prompts.len())));
    }
    Ok(())
}

/// An images file (`m3c_contract::images`), every error naming it.
pub(crate) fn read_images(
    f: &std::path::Path,
    patch_row: usize,
) -> Result<std::collections::BTreeMap<usize, m3c_contract::images::SeqImages>, StageError> {
    let bytes =
        m3c_contract::input::read_bytes(f, "--images", m3c_contract::images::MAX_BYTES).map_err(|e| StageError::Args(e.to_string()))?;
    m3c_contract::images::decode(&bytes, patch_row).map_err(|e| StageError::Args(format!("{}: {e}", f.display())))
}

/// Runs this stage's part of the pipeline. `Err`: a failure mid-run, after
/// which the job must be aborted (peers may be waiting on this stage);
/// `Ok(Err)`: a failure in the closing work (dump, `--expect`), reported
/// through the closing verdict.
pub fn run(
    world: &SimpleCommunicator,
    peers: &mut Peers,
    st: &mut stage::Stage,
    args: &RunArgs,
) -> Result<Result<(), StageError>, StageError> {
    let (first, last) = (st.meta.first_stage, st.meta.last_stage);
    let (rank, size) = (st.meta.stage, st.meta.stages);
    // Activations travel as f32 words: `hidden` of them per row, or half as many for bf16.
    let (x_words, vocab) = (st.meta.x_words(), st.meta.vocab);
    let n_new = args.max_new_tokens;
    for (s, p) in args.prompts.iter().enumerate() {
        st.start_seq(s, p.len() + n_new + 1)?;
    }
    if first {
        encode_images(st, args)?;
    }
    let records: Vec<dump::SeqRecord> = args
        .prompts
        .iter()
        .map(|p| dump::SeqRecord { prompt: p.clone(), prefill_logits: Vec::new(), generated: Vec::new(), decode_logits: Vec::new() })
        .collect();
    let mut books = RunBooks { records, args };
    let want_logits = args.dump.is_some() || args.expect.is_some();
    // Sequences per micro-batch: enough micro-batches to keep every stage busy
    // (one per stage), as few as that allows (weights are read once per step).
    let per_batch = args.micro_batch.unwrap_or_else(|| args.prompts.len().div_ceil(size)).max(1);
    let mut outbox = Outbox::default();
    // Test hook (documented in ARCHITECTURE.md): this stage falls silent,
    // heartbeats included, as a hung or lost peer would, so that the tests
    // can check the others notice within --timeout-s instead of hanging.
    if std::env::var("M3C_TEST_STALL_STAGE").ok().and_then(|v| v.parse::<usize>().ok()) == Some(rank) {
        liveness::fall_silent();
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }

    if first {
        // Ready work: (seq, pos0, token ids). Every prompt's prefill comes first.
        let chunk = args.prefill_chunk.unwrap_or(usize::MAX).max(1);
        let mut queue: VecDeque<(usize, usize, Vec<i64>)> = args
            .prompts
            .iter()
            .enumerate()
            .flat_map(|(s, p)| p.chunks(chunk).enumerate().map(move |(k, c)| (s, k * chunk, c.to_vec())))
            .collect();
        let mut generated: Vec<Vec<i64>> = vec![Vec::new(); args.prompts.len()];
        let mut open = args.prompts.len();
        let start = Instant::now();
        let mut prefill_done = vec![None; args.prompts.len()];
        // Stop strings: each sequence's generated bytes, and each id's bytes.
        let token_bytes = if args.stops.is_empty() { Vec::new() } else { load_token_bytes(args)? };
        let mut text: Vec<Vec<u8>> = vec![Vec::new(); args.prompts.len()];
        let mut on_id = |seq: usize,
                         pos0: usize,
                         rows: usize,
                         id: i64,
                         queue: &mut VecDeque<(usize, usize, Vec<i64>)>,
                         open: &mut usize|
         -> Result<(), StageError> {
            let plen = args.prompts.get(seq).ok_or_else(|| StageError::Step(format!("an id for unknown prompt {seq}")))?.len();
            if pos0 + rows < plen {
                return Ok(()); // a prefill chunk before the prompt's last: no token yet
            }
            let pass = if pos0 < plen { 0 } else { pos0 + 1 - plen };
            if pass == 0 {
                prefill_done[seq] = Some(start.elapsed());
            }
            if pass < n_new {
                generated[seq].push(id);
                if args.stream_ids {
                    crate::serve::say(Event::Id { seq, id: id as u32 });
                }
            }
            // The sequence ends on an EOS id (kept as its last token), or
            // after one more step past its last token (whose logits the dump
            // records); it then leaves the micro-batches, the others go on.
            let stopped = pass < n_new && !args.stops.is_empty() && {
                let t = &mut text[seq];
                let from = t.len();
                t.extend_from_slice(usize::try_from(id).ok().and_then(|i| token_bytes.get(i)).map_or(&[][..], Vec::as_slice));
                m3c_contract::token_bytes::stop_end(t, from, &args.stops).is_some()
            };
            let eos = pass < n_new && (args.eos_ids.contains(&id) || stopped);
            if eos || pass >= n_new {
                *open = open.saturating_sub(1);
                if args.stream_ids {
                    crate::serve::say(Event::End { seq, reason: if eos { EndReason::Stop } else { EndReason::Length } });
                }
            } else {
                queue.push_back((seq, plen + pass, vec![id]));
            }
            Ok(())
        };
        while open > 0 {
            // Heartbeats pile up while this stage only computes.
            peers.drain(world);
            if !queue.is_empty() {
                let take = per_batch.min(queue.len());
                let items: Vec<(usize, usize, Vec<i64>)> = queue.drain(..take).collect();
                let segs: Vec<Segment> = items.iter().map(|(s, p, ids)| Segment { seq: *s, pos0: *p, rows: ids.len() }).collect();
                let ids: Vec<i64> = items.iter().flat_map(|(_, _, ids)| ids.iter().copied()).collect();
                let mut x = vec![0f32; ids.len() * x_words];
                if !last && st.uses_nccl() {
                    // The step's NCCL send waits for the receiver, who needs the header first.
                    outbox.send(world, 1, TAG_ACT, message(KIND_STEP, &segs, &[]));
                }
                let sample = if last { Some(sample_in(&books, &segs, vocab, want_logits)?) } else { None };
                let out = st.step(&segs, &ids, &mut x, sample)?;
                if last {
                    let got = finish(&mut books, &segs, &out, vocab, n_new, rank, OnNonFinite::EndRun)?;
                    for (s, id) in segs.iter().zip(got) {
                        on_id(s.seq, s.pos0, s.rows, id, &mut queue, &mut open)?;
                    }
                } else if !st.uses_nccl() {
                    outbox.send(world, 1, TAG_ACT, message(KIND_STEP, &segs, &f32_bytes(&x)));
                }
            } else {
                outbox.poll();
                let m = wire::recv(world, peers, size - 1, TAG_IDS)?;
                for (i, s) in m.segments.iter().enumerate() {
                    let id = m
                        .payload
                        .get(i * 8..i * 8 + 8)
                        .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                        .ok_or_else(|| StageError::Step("malformed id message".into()))?;
                    on_id(s.seq, s.pos0, s.rows, id, &mut queue, &mut open)?;
                }
            }
        }
        let total = start.elapsed();
        if !last {
            outbox.send(world, 1, TAG_ACT, message(KIND_STOP, &[], &[]));
        }
        outbox.drain(world, peers)?;
        for (s, g) in generated.iter().enumerate().filter(|_| !args.stream_ids) {
            let ids: Vec<String> = g.iter().map(|i| i.to_string()).collect();
            print_line(&format!("prompt {s}: {}\n", ids.join(",")));
        }
        let prefill_end = prefill_done.iter().flatten().max().copied().unwrap_or_default();
        let prompt_tokens: usize = args.prompts.iter().map(|p| p.len()).sum();
        let decode_steps = args.prompts.len() * n_new;
        let dt = (total - prefill_end).as_secs_f64();
        say!(
            "m3c timing: prefill {prompt_tokens} tokens in {:.1} ms ({:.1} tok/s); decode {decode_steps} steps in {:.1} ms ({:.1} tok/s); up to {per_batch} sequence(s) per micro-batch",
            prefill_end.as_secs_f64() * 1e3,
            prompt_tokens as f64 / prefill_end.as_secs_f64().max(1e-9),
            dt * 1e3,
            decode_steps as f64 / dt.max(1e-9)
        );
    } else {
        loop {
            outbox.poll();
            let m = wire::recv(world, peers, rank - 1, TAG_ACT)?;
            if m.kind == KIND_STOP {
                if !last {
                    outbox.send(world, rank + 1, TAG_ACT, message(KIND_STOP, &[], &[]));
                }
                outbox.drain(world, peers)?;
                break;
            }
            let tokens: usize = m.segments.iter().map(|s| s.rows).sum();
            let mut x = if st.uses_nccl() { vec![0f32; tokens * x_words] } else { bytes_f32(&m.payload) };
            if !last && st.uses_nccl() {
                outbox.send(world, rank + 1, TAG_ACT, message(KIND_STEP, &m.segments, &[]));
            }
            let sample = if last { Some(sample_in(&books, &m.segments, vocab, want_logits)?) } else { None };
            let out = st.step(&m.segments, &[], &mut x, sample)?;
            if last {
                let got = finish(&mut books, &m.segments, &out, vocab, n_new, rank, OnNonFinite::EndRun)?;
                let payload: Vec<u8> = got.iter().flat_map(|i| i.to_le_bytes()).collect();
                outbox.send(world, 0, TAG_IDS, message(KIND_STEP, &m.segments, &payload));
            } else if !st.uses_nccl() {
                outbox.send(world, rank + 1, TAG_ACT, message(KIND_STEP, &m.segments, &f32_bytes(&x)));
            }
        }
    }
    finish_records(last, args, &books.records, vocab)
}

/// The last stage's closing work: dumps and the `--expect` check. Runs after
/// every stage has left its loop, so a failure here is reported through the
/// closing verdict instead of aborting peers that are shutting down.
fn finish_records(last: bool, args: &RunArgs, records: &[dump::SeqRecord], vocab: usize) -> Result<Result<(), StageError>, StageError> {
    if !last {
        return Ok(Ok(()));
    }
    if let Some(file) = &args.dump {
        for (i, r) in records.iter().enumerate() {
            if let Err(e) = dump::write(&dump::dump_path(file, i, records.len()), r, vocab) {
                return Ok(Err(e));
            }
        }
    }
    if let Some(golden) = &args.expect {
        // The golden file describes one prompt: the first.
        match dump::check(golden, &records[0], vocab, 1e-3) {
            Ok(line) => say!("{line}"),
            Err(e) => return Ok(Err(e)),
        }
    }
    Ok(Ok(()))
}
