//! What the last stage keeps of each live sequence: its record (prompt,
//! generated ids, logits when a dump or `--expect` wants them), its
//! sampling and how many tokens it may generate. The sampling table of a
//! step is built from it, and the step's ids and logits are written back.
//!
//! - **Drawing slots.** A plain segment draws at its last row; a verify
//!   segment (K drafts, K + 1 rows) gives each row a slot of its own (two
//!   bitmap rows each: seen ids, then allowed tokens): row j draws at the
//!   sequence's step `generated + j` with the seen ids, bias row, grammar
//!   mask (the matcher follows the drafts with `try_consume` and rolls
//!   back), reasoning budget and `min_tokens` that the history up to draft
//!   j gives, so each row's draw is the one plain decoding makes there.
//!   Rows after a draft the grammar refuses, or after an id that ends the
//!   sequence, do not draw. `finish` keeps the draws while each equals the
//!   draft the next row was fed, and the first that differs (the correct
//!   token there): 1 to K + 1 tokens, the same bits as without drafts.
//! - **Constraints.** A grammar's allowed-token bitmap goes in the slot's
//!   second row, pointed at by the row's `TOKEN_MASK` word (the sampler,
//!   host or device, gives a left-out token no weight); a chat's grammar
//!   already allows its reasoning, and a grammar that fails ends the
//!   sequence with `Failure::Constraint` (non-finite logits end it with
//!   `Failure::NonFinite`, so a client is told which). A reasoning budget follows the
//!   tokens' bytes through the server's splitter; once spent inside the
//!   reasoning, the next row's mask holds `</mm:think>` alone. `min_tokens`
//!   clears the EOS and stop ids from the mask until it is met.
//! - **Logits.** They come back only for `--dump`/`--expect` (every row;
//!   a verify step records the row of each token it keeps, so the file is
//!   the same with drafts) and for the drawing rows of sequences that want
//!   logprobs (`m3c_sampler::logprobs`, an f64 log-softmax). Non-finite
//!   logits end the run (`m3c run`) or only that sequence (`m3c serve`).

use crate::dump::SeqRecord;
use crate::error::StageError;
use crate::stage::{self, Segment};
use m3c_constrain::thinking::Budget;
use m3c_constrain::Constraint;
use m3c_contract::chat_format::ChatFormat;
use m3c_contract::sampling::SamplingParams;
pub(crate) use m3c_engine::drawn::{Drawn, Failure, Token};
use std::collections::{BTreeMap, HashMap};

/// What non-finite logits end: the run (`m3c run`: the weights are broken),
/// or only the sequence that met them (`m3c serve`: the others go on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnNonFinite {
    EndRun,
    EndSequence,
}

/// Where the last stage finds the model's tokens for grammars, and the
/// vocabulary built from them when the first grammar comes.
pub(crate) struct GrammarSource {
    pub model: Option<std::path::PathBuf>,
    pub vocab: usize,
    /// Every EOS id: what `min_tokens` holds back, with the stop ids; the
    /// first is the one a complete grammar allows.
    pub eos_ids: Vec<i64>,
    built: Option<Result<m3c_constrain::Vocabulary, String>>,
    format: Option<Result<&'static ChatFormat, String>>,
}

impl GrammarSource {
    pub fn new(model: Option<std::path::PathBuf>, vocab: usize, eos_ids: Vec<i64>) -> GrammarSource {
        GrammarSource { model, vocab, eos_ids, built: None, format: None }
    }

    /// The model's tokens, read when the first sequence needs them.
    fn vocabulary(&mut self) -> Result<&m3c_constrain::Vocabulary, String> {
        let (model, vocab) = (self.model.clone(), self.vocab);
        let ends: Vec<u32> = self.eos_ids.iter().filter_map(|&e| u32::try_from(e).ok()).collect();
        let v = self.built.get_or_insert_with(|| match model {
            Some(m) => m3c_constrain::Vocabulary::load(&m, Some(vocab), &ends).map_err(|e| e.to_string()),
            None => Err("structured output and reasoning budgets need --model DIR with a tokenizer.json".into()),
        });
        v.as_ref().map_err(Clone::clone)
    }

    /// The model's chat format (by its config.json's architecture), whose
    /// reasoning tags a budget reads, read when the first budget needs it.
    fn chat_format(&mut self) -> Result<&'static ChatFormat, String> {
        let model = self.model.clone();
        let f = self.format.get_or_insert_with(|| match model {
            Some(m) => ChatFormat::of_model_dir(&m),
            None => Err("reasoning budgets need --model DIR with its config.json".into()),
        });
        f.clone()
    }

    /// What a sequence's output is held to: its grammar and its reasoning
    /// budget (which reads the reasoning as the server will: strictly under
    /// a grammar, leniently without).
    fn output_rules(&mut self, out: &OutputSpec) -> Result<(Option<Constraint>, Option<Budget>), String> {
        if out.grammar.is_none() && out.think.is_none() {
            return Ok((None, None));
        }
        let v = self.vocabulary()?;
        // The grammar decides where the output ends: the request's stop ids
        // are held back until it is complete (`compile_stopping`).
        let stops: Vec<u32> = out.stop_ids.iter().filter_map(|&s| u32::try_from(s).ok()).collect();
        let grammar = out.grammar.as_deref().map(|text| v.compile_stopping(text, &stops)).transpose().map_err(|e| e.to_string())?;
        let budget = match out.think {
            Some(t) => {
                let format = self.chat_format()?;
                let v = self.vocabulary()?;
                Some(Budget::new(v, &format.think, t, grammar.is_none()).map_err(|e| e.to_string())?)
            }
            None => None,
        };
        Ok((grammar, budget))
    }
}

/// One live sequence.
struct SeqBook {
    record: SeqRecord,
    sampling: SamplingParams,
    /// Tokens it may generate; a step past them only scores (its logits
    /// are recorded, its id is not).
    max_new: usize,
    /// Alternatives to report with each token's logprob (`None`: no logprobs).
    logprobs: Option<u8>,
    /// The same for each prompt token's.
    prompt_logprobs: Option<u8>,
    /// The next prompt position whose logprob is still to report (a
    /// preempted sequence recomputes rows whose logprobs went out already).
    prompt_next: usize,
    grammar: Option<Constraint>,
    /// The cap on its reasoning, as far as its output has gone.
    budget: Option<Budget>,
    /// Tokens generated before `held` may be drawn, and the ids held back
    /// until then (EOS and the request's stop ids).
    min_tokens: usize,
    held: Vec<i64>,
    /// Why the sequence cannot go on (its grammar failed): its next draw
    /// ends it (`Failure::Constraint`).
    failed: Option<String>,
    /// Its logit bias and presence/frequency penalties, when it has any.
    bias: Option<m3c_sampler::BiasRow>,
}

/// What a sequence asks of its output besides sampling: logprobs, a
/// grammar (its text) and a reasoning budget.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct OutputSpec {
    pub logprobs: Option<u8>,
    pub grammar: Option<String>,
    pub think: Option<m3c_contract::thinking::ThinkBudget>,
    pub min_tokens: usize,
    pub stop_ids: Vec<i64>,
    pub logit_bias: Vec<(u32, f32)>,
    pub prompt_logprobs: Option<u8>,
    /// What it generated on a pipeline that was lost (see `SeqRequest::resumed`).
    pub resumed: Vec<i64>,
}

impl OutputSpec {
    /// What a request asks of its output.
    pub fn of(r: &m3c_contract::protocol::SeqRequest) -> OutputSpec {
        OutputSpec {
            logprobs: r.logprobs,
            grammar: r.grammar.clone(),
            think: r.think,
            min_tokens: r.min_tokens,
            stop_ids: r.stop_ids.clone(),
            logit_bias: r.logit_bias.clone(),
            prompt_logprobs: r.prompt_logprobs,
            resumed: r.resumed.clone(),
        }
    }
}

/// The last stage's books.
pub(crate) struct LastBooks {
    live: HashMap<usize, SeqBook>,
    /// Whether steps return their logits (a dump or `--expect`).
    pub want_logits: bool,
    /// The records of ended sequences, when the run's closing work reads them.
    pub finished: BTreeMap<usize, SeqRecord>,
    pub on_bad: OnNonFinite,
    pub grammars: GrammarSource,
    /// Masks computed, and the seconds they took (structured output).
    pub masks: (usize, f64),
    /// The EAGLE3 draft head's proposer, on a last stage that has one.
    pub drafter: Option<crate::draft::Drafter>,
}

impl crate::draft::SeqIds for LastBooks {
    fn token_at(&self, seq: usize, pos: usize) -> Option<i64> {
        LastBooks::token_at(self, seq, pos)
    }

    fn remaining(&self, seq: usize) -> usize {
        LastBooks::remaining(self, seq)
    }
}

impl LastBooks {
    pub fn new(want_logits: bool, on_bad: OnNonFinite, grammars: GrammarSource) -> LastBooks {
        LastBooks { live: HashMap::new(), want_logits, finished: BTreeMap::new(), on_bad, grammars, masks: (0, 0.0), drafter: None }
    }

    /// A sequence joins.
    /// A sequence joins. A grammar that does not compile here (the front
    /// checked it) fails the sequence at its first draw, with the reason on
    /// standard error.
    pub fn start(&mut self, seq: usize, prompt: Vec<i64>, sampling: SamplingParams, max_new: usize, out: OutputSpec) {
        let bias = m3c_sampler::BiasRow::new(&sampling, &out.logit_bias, self.grammars.vocab);
        let record = SeqRecord { prompt, prefill_logits: Vec::new(), generated: Vec::new(), decode_logits: Vec::new() };
        let (grammar, budget, failed) = match self.grammars.output_rules(&out) {
            Ok((g, b)) => (g, b, None),
            Err(e) => (None, None, Some(e)),
        };
        if let Some(why) = &failed {
            eprintln!("m3c stage: sequence {seq}: {why}");
        }
        let held = self.grammars.eos_ids.iter().chain(&out.stop_ids).copied().collect();
        let min_tokens = out.min_tokens;
        let (logprobs, prompt_logprobs) = (out.logprobs, out.prompt_logprobs);
        let prompt_len = record.prompt.len();
        let mut book = SeqBook {
            record,
            sampling,
            max_new,
            logprobs,
            prompt_logprobs,
            prompt_next: 1,
            grammar,
            budget,
            min_tokens,
            held,
            failed,
            bias,
        };
        // A resumed sequence: its grammar, reasoning budget, penalties and
        // sampler step go where its earlier tokens left them (the next draw
        // is at step `resumed.len()`), and its prompt's logprobs went out.
        if !out.resumed.is_empty() {
            book.prompt_next = prompt_len;
            let vocabulary = self.grammars.built.as_ref().and_then(|v| v.as_ref().ok());
            for &id in &out.resumed {
                book.follow(id, vocabulary);
            }
        }
        self.live.insert(seq, book);
    }

    /// The token at position `pos` of sequence `seq` (prompt, then what it
    /// generated so far), if it has one yet.
    pub fn token_at(&self, seq: usize, pos: usize) -> Option<i64> {
        let r = &self.live.get(&seq)?.record;
        match pos.checked_sub(r.prompt.len()) {
            None => r.prompt.get(pos).copied(),
            Some(g) => r.generated.get(g).copied(),
        }
    }

    /// Tokens sequence `seq` may still generate.
    pub fn remaining(&self, seq: usize) -> usize {
        self.live.get(&seq).map_or(0, |b| b.max_new.saturating_sub(b.record.generated.len()))
    }

    /// A sequence leaves; its record is kept when logits are wanted.
    pub fn end(&mut self, seq: usize) {
        if let Some(b) = self.live.remove(&seq) {
            if self.want_logits {
                self.finished.insert(seq, b.record);
            }
        }
    }

    /// The sampling inputs of a step: one table row per row of the step.
    /// The last row of each segment that gives a token draws, keyed by the
    /// sequence's own step, so the draw is the same whatever the split, the
    /// batch or the chunking. A verify segment (`drafts[k]` not empty: its
    /// rows after the first hold draft ids) draws at every row, row j as
    /// plain decoding would draw that position had the drafts before it
    /// been drawn: step `generated + j`, and the seen ids, grammar mask,
    /// reasoning budget, `min_tokens` and bias of that history. Each
    /// drawing slot (a segment, or a verify segment's row) has a seen-id
    /// bitmap when its sequence has a repetition penalty, an allowed-token
    /// bitmap when something masks its draw, and a bias row when its
    /// sequence has a logit bias or presence/frequency penalties.
    pub fn sample_in(&mut self, segs: &[Segment], drafts: &[Vec<i64>], vocab: usize) -> Result<stage::SampleIn, StageError> {
        use m3c_contract::sampling::{row, row_words, seen_words, BITMAP_ROWS, ROW_WORDS};
        let words = seen_words(vocab);
        let tokens: usize = segs.iter().map(|s| s.rows).sum();
        let draft_of = |k: usize| drafts.get(k).map_or(&[][..], Vec::as_slice);
        let slots: usize = segs.iter().enumerate().map(|(k, s)| if draft_of(k).is_empty() { 1 } else { s.rows }).sum();
        let mut inp = SlotInputs { words, vocab, slots, seen: vec![0u32; BITMAP_ROWS * slots * words], bias: Vec::new(), penalised: false };
        let mut table = Vec::with_capacity(tokens * ROW_WORDS);
        let mut want_logits = self.want_logits;
        let mut slot0 = 0;
        for (k, s) in segs.iter().enumerate() {
            let draft = draft_of(k);
            let vocabulary = self.grammars.built.as_ref().and_then(|v| v.as_ref().ok());
            let b =
                self.live.get_mut(&s.seq).ok_or_else(|| StageError::Step(format!("a step for sequence {}, which is not live", s.seq)))?;
            let draws = gives_token(&b.record, s, draft.len());
            if !draft.is_empty() && (!draws || draft.len() + 1 != s.rows) {
                return Err(StageError::Step(format!("runtime bug: sequence {}'s verify step is not at its next draw", s.seq)));
            }
            // Logprobs come from the logits of the rows that draw; prompt
            // logprobs from every prompt row.
            want_logits |= draws && b.logprobs.is_some();
            want_logits |= b.prompt_logprobs.is_some() && unreported_prompt_rows(&b.record, s, b.prompt_next);
            let drawing = if draws { b.draw_rows(&mut inp, slot0, draft, vocabulary, &mut self.masks) } else { Vec::new() };
            let generated = b.record.generated.len();
            for j in 0..s.rows {
                // The slot's row: a plain segment's last row, or each row of a verify segment.
                let d = if draft.is_empty() { (j + 1 == s.rows).then(|| drawing.first()).flatten() } else { drawing.get(j) };
                let step = (generated + if draft.is_empty() { 0 } else { j }) as u64;
                let slot = slot0 + if draft.is_empty() { 0 } else { j };
                let mut w = row_words(&b.sampling, 0, step, d.is_some(), slot);
                if let Some(d) = d {
                    if d.mask {
                        w[row::TOKEN_MASK] = (slots + slot) as i64 + 1;
                    }
                    // 1 + the row: the count after it was pushed.
                    if let Some(n) = d.bias_row {
                        w[row::BIAS_ROW] = n as i64;
                    }
                }
                table.extend_from_slice(&w);
            }
            slot0 += if draft.is_empty() { 1 } else { s.rows };
        }
        Ok(stage::SampleIn { table, seen: inp.seen, penalised: inp.penalised, want_logits, bias: inp.bias })
    }

    /// The last stage's part of a step: checks the logits, records them
    /// (when wanted) and returns each segment's tokens: one where it draws,
    /// and for a verify segment its draws while they equal the drafts, then
    /// the first that does not (or the last row's). Non-finite logits (NaN
    /// or Inf in the weights, or an overflow) end the run with the sequence
    /// and position, or (serving) only that sequence, whose last token is
    /// then -1.
    pub fn finish(
        &mut self,
        segs: &[Segment],
        drafts: &[Vec<i64>],
        out: &stage::StepOut,
        vocab: usize,
        stage: usize,
    ) -> Result<Vec<Drawn>, StageError> {
        let mut row0 = 0;
        let mut drawn = Vec::with_capacity(segs.len());
        for (k, s) in segs.iter().enumerate() {
            let draft = drafts.get(k).map_or(&[][..], Vec::as_slice);
            let d = if draft.is_empty() {
                self.finish_segment(s, out, row0, vocab, stage)?
            } else {
                self.finish_verify(s, draft, out, row0, vocab, stage)?
            };
            drawn.push(d);
            row0 += s.rows;
        }
        Ok(drawn)
    }

    /// Whether row `row` of the step had non-finite logits: an error for a
    /// run, `true` (the sequence ends) while serving.
    fn non_finite(&self, out: &stage::StepOut, row: usize, s: &Segment, pos: usize, stage: usize) -> Result<bool, StageError> {
        use m3c_contract::sampling::{row, ROW_WORDS};
        let bad = out
            .table
            .get(row * ROW_WORDS + row::NON_FINITE)
            .copied()
            .ok_or_else(|| StageError::Step("a step returned a short sampling table".into()))?;
        if bad != 0 && self.on_bad == OnNonFinite::EndRun {
            return Err(StageError::Step(format!(
                "stage {stage}: {bad} non-finite logits (NaN or Inf) at step for prompt {}, position {pos}; the weights or activations \
                 hold NaN or Inf (check the checkpoint with `m3c inspect MODEL --check-values`)",
                s.seq
            )));
        }
        Ok(bad != 0)
    }

    /// A segment without drafts: a prefill chunk, or one row that draws.
    fn finish_segment(&mut self, s: &Segment, out: &stage::StepOut, row0: usize, vocab: usize, stage: usize) -> Result<Drawn, StageError> {
        for j in 0..s.rows {
            if self.non_finite(out, row0 + j, s, s.pos0 + j, stage)? {
                return Ok(Drawn::failed(Failure::NonFinite));
            }
        }
        let id = sampled(out, row0 + s.rows - 1, vocab, stage)?;
        let want_logits = self.want_logits;
        let vocabulary = self.grammars.built.as_ref().and_then(|v| v.as_ref().ok());
        let b = self.live.get_mut(&s.seq).ok_or_else(|| StageError::Step(format!("a step for sequence {}, which is not live", s.seq)))?;
        let gives = gives_token(&b.record, s, 0);
        let draws = gives && b.record.generated.len() < b.max_new;
        if let (true, Some(why)) = (draws, &b.failed) {
            eprintln!("m3c stage: sequence {}: its grammar or reasoning budget could not be applied ({why}); it ends", s.seq);
            return Ok(Drawn::failed(Failure::Constraint));
        }
        let token = if draws { Some(b.take(id, out, row0 + s.rows - 1, vocab, vocabulary)?) } else { None };
        // Row j predicts prompt token pos0 + j + 1, while there is one
        // not reported yet.
        let mut prompt = Vec::new();
        let r = &mut b.record;
        let unreported = unreported_prompt_rows(r, s, b.prompt_next);
        if let (Some(k), Some(rows), true) = (b.prompt_logprobs, out.logits.get(row0 * vocab..(row0 + s.rows) * vocab), unreported) {
            for (j, row) in rows.chunks_exact(vocab.max(1)).enumerate() {
                let p = s.pos0 + j + 1;
                if let (Some(&tok), true) = (r.prompt.get(p), p >= b.prompt_next) {
                    prompt.push((tok as u32, m3c_sampler::logprobs::logprobs(row, tok as u32, k as usize)));
                    b.prompt_next = p + 1;
                }
            }
        } else if b.prompt_logprobs.is_some() && unreported {
            return Err(StageError::Step("runtime bug: prompt logprobs wanted, but the step returned no logits".into()));
        }
        if let Some(rows) = out.logits.get(row0 * vocab..(row0 + s.rows) * vocab).filter(|_| want_logits) {
            if s.pos0 < r.prompt.len() {
                // A prefill chunk (a sequence's chunks arrive in order;
                // rows recomputed after a preemption are not recorded twice).
                if r.prefill_logits.len() == s.pos0 * vocab {
                    r.prefill_logits.extend_from_slice(rows);
                }
            } else if gives {
                r.decode_logits.extend_from_slice(&rows[(s.rows - 1) * vocab..]);
            }
        }
        Ok(Drawn { tokens: token.into_iter().collect(), prompt, proposals: Vec::new() })
    }

    /// A verify segment: row j drew the token after draft j - 1; its draws
    /// are kept while each equals the draft the next row was fed, and the
    /// first that differs (or the last row's) ends the list. Acceptance
    /// also stops after an id that ends sequences (EOS, a stop id), so the
    /// books never run past what plain decoding would have drawn.
    fn finish_verify(
        &mut self,
        s: &Segment,
        draft: &[i64],
        out: &stage::StepOut,
        row0: usize,
        vocab: usize,
        stage: usize,
    ) -> Result<Drawn, StageError> {
        use m3c_contract::sampling::{row, ROW_WORDS};
        let mut tokens = Vec::with_capacity(draft.len() + 1);
        for j in 0..=draft.len() {
            // A row left out of the draws (after a draft the grammar refuses).
            let flags = out.table.get((row0 + j) * ROW_WORDS + row::FLAGS).copied().unwrap_or(0);
            if flags & row::SAMPLE == 0 {
                break;
            }
            if self.non_finite(out, row0 + j, s, s.pos0 + j, stage)? {
                tokens.push(Failure::NonFinite.token());
                break;
            }
            let id = sampled(out, row0 + j, vocab, stage)?;
            let vocabulary = self.grammars.built.as_ref().and_then(|v| v.as_ref().ok());
            let b =
                self.live.get_mut(&s.seq).ok_or_else(|| StageError::Step(format!("a step for sequence {}, which is not live", s.seq)))?;
            if b.record.generated.len() >= b.max_new {
                break;
            }
            if let Some(why) = &b.failed {
                eprintln!("m3c stage: sequence {}: its grammar or reasoning budget could not be applied ({why}); it ends", s.seq);
                tokens.push(Failure::Constraint.token());
                break;
            }
            tokens.push(b.take(id, out, row0 + j, vocab, vocabulary)?);
            // A dump holds the row of each token fed, as plain decoding's
            // steps give it: the step's first row, then each kept draft's.
            if let Some(row) = out.logits.get((row0 + j) * vocab..(row0 + j + 1) * vocab).filter(|_| self.want_logits) {
                b.record.decode_logits.extend_from_slice(row);
            }
            if j == draft.len() || id != draft[j] || b.held.contains(&id) {
                break;
            }
        }
        Ok(Drawn { tokens, prompt: Vec::new(), proposals: Vec::new() })
    }
}

/// The bitmaps and bias rows of a step's drawing slots, as they are filled.
struct SlotInputs {
    words: usize,
    vocab: usize,
    slots: usize,
    /// `[BITMAP_ROWS × slots, words]`: seen ids, then allowed tokens.
    seen: Vec<u32>,
    bias: Vec<f32>,
    /// Some row reads its bitmaps.
    penalised: bool,
}

/// What one drawing row's table row points at.
struct RowDraw {
    mask: bool,
    bias_row: Option<usize>,
}

impl SeqBook {
    /// The sampling inputs of a sequence's drawing rows: one row at
    /// `slot0`, or, verifying `draft`, a row per draft token and one more,
    /// row j with the state after the first j drafts. Its grammar, budget
    /// and bias are advanced through the drafts on copies (the grammar
    /// rolls back), so the books stay where the sequence's output is. Rows
    /// after a draft the grammar refuses never draw (the row before cannot
    /// draw that draft), and are left out.
    fn draw_rows(
        &mut self,
        inp: &mut SlotInputs,
        slot0: usize,
        draft: &[i64],
        vocabulary: Option<&m3c_constrain::Vocabulary>,
        masks: &mut (usize, f64),
    ) -> Vec<RowDraw> {
        use std::borrow::Cow;
        let (words, vocab) = (inp.words, inp.vocab);
        // Copies only once a draft advances them: a plain decode step (every
        // step without speculation) reads the books as they are.
        let mut budget = Cow::Borrowed(&self.budget);
        let mut bias = Cow::Borrowed(&self.bias);
        let penalised = self.sampling.repetition_penalty != 1.0;
        let mut history: Vec<u32> = match penalised {
            true => self.record.prompt.iter().chain(&self.record.generated).map(|&i| i as u32).collect(),
            false => Vec::new(),
        };
        let mut advanced = 0;
        let mut rows = Vec::with_capacity(draft.len() + 1);
        for j in 0..=draft.len() {
            if j > 0 {
                // Nothing is drawn after an id that ends the sequence.
                if self.held.contains(&draft[j - 1]) {
                    break;
                }
                let t = draft[j - 1] as u32;
                if let Some(g) = self.grammar.as_mut().filter(|_| self.failed.is_none()) {
                    if !g.try_consume(t).unwrap_or(false) {
                        break;
                    }
                    advanced += 1;
                }
                if let (Some(bu), Some(v)) = (budget.is_some().then(|| budget.to_mut().as_mut()).flatten(), vocabulary) {
                    bu.consume(v, t);
                }
                if let Some(adj) = bias.is_some().then(|| bias.to_mut().as_mut()).flatten() {
                    adj.generated(t);
                }
                if penalised {
                    history.push(t);
                }
            }
            let slot = slot0 + j;
            if penalised {
                inp.penalised = true;
                let bits = m3c_contract::sampling::seen_bitmap(history.iter().copied(), vocab);
                inp.seen[slot * words..(slot + 1) * words].copy_from_slice(&bits);
            }
            let mask_row = inp.slots + slot;
            let allowed = &mut inp.seen[mask_row * words..(mask_row + 1) * words];
            let mut mask = false;
            // A started grammar's allowed tokens.
            if let (None, Some(g)) = (&self.failed, self.grammar.as_mut()) {
                let t0 = std::time::Instant::now();
                match g.mask() {
                    Ok(bits) => {
                        allowed.copy_from_slice(&bits[..words]);
                        mask = true;
                    }
                    // The row cannot draw: its sequence ends at it (a
                    // verify row after the first ends there too).
                    Err(e) if j == 0 => self.failed = Some(e.to_string()),
                    Err(_) => break,
                }
                masks.0 += 1;
                masks.1 += t0.elapsed().as_secs_f64();
            }
            // A spent reasoning budget: the next token closes the reasoning
            // (a grammar allows it wherever the reasoning is open).
            if let (None, Some(close)) = (&self.failed, (*budget).as_ref().and_then(Budget::forced)) {
                let ok = !mask || allowed[close as usize / 32] >> (close % 32) & 1 == 1;
                if ok && (close as usize) < vocab {
                    allowed.fill(0);
                    allowed[close as usize / 32] = 1 << (close % 32);
                    mask = true;
                }
            }
            // `min_tokens`: EOS and the stop ids are held back until then
            // (from the grammar's allowed tokens, or from every token).
            if self.record.generated.len() + j < self.min_tokens && !self.held.is_empty() {
                if !mask {
                    allowed.copy_from_slice(&m3c_contract::sampling::seen_bitmap(0..vocab as u32, vocab));
                    mask = true;
                }
                for &h in self.held.iter().filter(|&&h| h >= 0 && (h as usize) < vocab) {
                    allowed[h as usize / 32] &= !(1 << (h % 32));
                }
            }
            inp.penalised |= mask;
            let bias_row = (*bias).as_ref().map(|adj| {
                inp.bias.extend_from_slice(adj.row());
                inp.bias.len() / vocab.max(1)
            });
            rows.push(RowDraw { mask, bias_row });
        }
        if let (true, Some(g)) = (advanced > 0, self.grammar.as_mut()) {
            if let Err(e) = g.rollback(advanced) {
                self.failed = Some(e.to_string());
            }
        }
        rows
    }

    /// The sequence drew `id` at row `row` of the step: its grammar, budget,
    /// record and bias follow, and its logprobs are read from the row.
    fn take(
        &mut self,
        id: i64,
        out: &stage::StepOut,
        row: usize,
        vocab: usize,
        vocabulary: Option<&m3c_constrain::Vocabulary>,
    ) -> Result<Token, StageError> {
        let logprobs = match (self.logprobs, out.logits.get(row * vocab..(row + 1) * vocab)) {
            (Some(k), Some(logits)) => Some(m3c_sampler::logprobs::logprobs(logits, id as u32, k as usize)),
            (Some(_), None) => return Err(StageError::Step("runtime bug: logprobs wanted, but the step returned no logits".into())),
            _ => None,
        };
        self.follow(id, vocabulary);
        Ok(Token { id, logprobs })
    }

    /// `id` is the sequence's next token: its grammar, budget, record and
    /// bias follow it.
    fn follow(&mut self, id: i64, vocabulary: Option<&m3c_constrain::Vocabulary>) {
        if let Some(g) = self.grammar.as_mut() {
            if let Err(e) = g.consume(id as u32) {
                self.failed = Some(e.to_string());
            }
        }
        if let (Some(budget), Some(v)) = (self.budget.as_mut(), vocabulary) {
            budget.consume(v, id as u32);
        }
        self.record.generated.push(id);
        if let Some(adj) = self.bias.as_mut() {
            adj.generated(id as u32);
        }
    }
}

/// The id the sampler drew at `row`, checked against the vocabulary.
fn sampled(out: &stage::StepOut, row: usize, vocab: usize, stage: usize) -> Result<i64, StageError> {
    let id = out.ids.get(row).copied().ok_or_else(|| StageError::Step("a step returned fewer ids than rows".into()))?;
    if id < 0 || id as usize >= vocab {
        return Err(StageError::Step(format!("stage {stage}: the sampler chose id {id}, outside the vocabulary (0..{vocab})")));
    }
    Ok(id)
}

/// Whether a sequence's step reaches its next draw: the row of its
/// prompt's last token, or of the last token it generated, followed by
/// `drafts` draft rows. (Steps before that are prefill chunks, or a
/// preempted sequence recomputing its rows.)
fn gives_token(r: &SeqRecord, s: &Segment, drafts: usize) -> bool {
    s.pos0 + s.rows == r.prompt.len() + r.generated.len() + drafts
}

/// Whether a step's rows predict a prompt token whose logprob is still to
/// report (row j predicts token pos0 + j + 1).
fn unreported_prompt_rows(r: &SeqRecord, s: &Segment, next: usize) -> bool {
    s.pos0 + s.rows >= next && next < r.prompt.len() && s.pos0 + 1 < r.prompt.len()
}
