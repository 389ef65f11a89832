//! What the last stage keeps of each live sequence: its record (prompt,
//! generated ids, logits when a dump or `--expect` wants them), its
//! sampling and how many tokens it may generate. The sampling table of a
//! step is built from it, and the step's ids and logits are written back.

use crate::dump::SeqRecord;
use crate::error::StageError;
use crate::stage::{self, Segment};
use m3c_constrain::thinking::Budget;
use m3c_constrain::Constraint;
pub(crate) use m3c_contract::drawn::Drawn;
use m3c_contract::protocol::TokenLogprobs;
use m3c_contract::sampling::SamplingParams;
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
    pub eos: u32,
    /// Every EOS id: what `min_tokens` holds back, with the stop ids.
    pub eos_ids: Vec<i64>,
    built: Option<Result<m3c_constrain::Vocabulary, String>>,
}

impl GrammarSource {
    pub fn new(model: Option<std::path::PathBuf>, vocab: usize, eos: u32) -> GrammarSource {
        GrammarSource { model, vocab, eos, eos_ids: Vec::new(), built: None }
    }

    /// The model's tokens, read when the first sequence needs them.
    fn vocabulary(&mut self) -> Result<&m3c_constrain::Vocabulary, String> {
        let (model, vocab, eos) = (self.model.clone(), self.vocab, self.eos);
        let v = self.built.get_or_insert_with(|| match model {
            Some(m) => m3c_constrain::Vocabulary::load(&m, Some(vocab), eos).map_err(|e| e.to_string()),
            None => Err("structured output and reasoning budgets need --model DIR with a tokenizer.json".into()),
        });
        v.as_ref().map_err(Clone::clone)
    }

    /// What a sequence's output is held to: its grammar and its reasoning
    /// budget (which reads the reasoning as the server will: strictly under
    /// a grammar, leniently without).
    fn output_rules(&mut self, out: &OutputSpec) -> Result<(Option<Constraint>, Option<Budget>), String> {
        if out.grammar.is_none() && out.think.is_none() {
            return Ok((None, None));
        }
        let v = self.vocabulary()?;
        let grammar = out.grammar.as_deref().map(|text| v.compile(text)).transpose().map_err(|e| e.to_string())?;
        let budget = out.think.map(|t| Budget::new(v, t, grammar.is_none())).transpose().map_err(|e| e.to_string())?;
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
    /// ends it, as non-finite logits do.
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
}

impl LastBooks {
    pub fn new(want_logits: bool, on_bad: OnNonFinite, grammars: GrammarSource) -> LastBooks {
        LastBooks { live: HashMap::new(), want_logits, finished: BTreeMap::new(), on_bad, grammars, masks: (0, 0.0) }
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
        self.live.insert(
            seq,
            SeqBook {
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
            },
        );
    }

    /// A sequence leaves; its record is kept when logits are wanted.
    pub fn end(&mut self, seq: usize) {
        if let Some(b) = self.live.remove(&seq) {
            if self.want_logits {
                self.finished.insert(seq, b.record);
            }
        }
    }

    /// The sampling inputs of a step: one table row per row of the step
    /// (the last row of each segment that gives a token draws, keyed by the
    /// sequence's own step, so the draw is the same whatever the split, the
    /// batch or the chunking), and a seen-id bitmap per segment for those
    /// with a repetition penalty, and a bias row for each drawing segment
    /// whose sequence has a logit bias or presence/frequency penalties.
    pub fn sample_in(&mut self, segs: &[Segment], vocab: usize) -> Result<stage::SampleIn, StageError> {
        use m3c_contract::sampling::{row, row_words, seen_bitmap, seen_words, ROW_WORDS};
        let words = seen_words(vocab);
        let tokens: usize = segs.iter().map(|s| s.rows).sum();
        let mut table = Vec::with_capacity(tokens * ROW_WORDS);
        // Row k: segment k's seen ids; row segs + k: its allowed tokens.
        let mut seen = vec![0u32; m3c_contract::sampling::BITMAP_ROWS * segs.len() * words];
        let (mut penalised, mut want_logits) = (false, self.want_logits);
        let mut bias: Vec<f32> = Vec::new();
        for (k, s) in segs.iter().enumerate() {
            let masks = &mut self.masks;
            let b =
                self.live.get_mut(&s.seq).ok_or_else(|| StageError::Step(format!("a step for sequence {}, which is not live", s.seq)))?;
            let (r, p) = (&b.record, &b.sampling);
            let draws = gives_token(r, s);
            // Logprobs come from the logits of the row that draws; prompt
            // logprobs from every prompt row.
            want_logits |= draws && b.logprobs.is_some();
            want_logits |= b.prompt_logprobs.is_some() && unreported_prompt_rows(r, s, b.prompt_next);
            if draws && p.repetition_penalty != 1.0 {
                penalised = true;
                let bits = seen_bitmap(r.prompt.iter().chain(&r.generated).map(|&i| i as u32), vocab);
                seen[k * words..(k + 1) * words].copy_from_slice(&bits);
            }
            // A started grammar's allowed tokens.
            let mask_row = segs.len() + k;
            let mut mask = false;
            if let (true, Some(g)) = (draws && b.failed.is_none(), b.grammar.as_mut()) {
                let t0 = std::time::Instant::now();
                match g.mask() {
                    Ok(bits) => {
                        seen[mask_row * words..(mask_row + 1) * words].copy_from_slice(&bits[..words]);
                        (mask, penalised) = (true, true);
                    }
                    Err(e) => b.failed = Some(e.to_string()),
                }
                masks.0 += 1;
                masks.1 += t0.elapsed().as_secs_f64();
            }
            // A spent reasoning budget: the next token closes the reasoning
            // (a grammar allows it wherever the reasoning is open).
            if let (true, Some(close)) = (draws && b.failed.is_none(), b.budget.as_ref().and_then(Budget::forced)) {
                let row = &mut seen[mask_row * words..(mask_row + 1) * words];
                let allowed = !mask || row[close as usize / 32] >> (close % 32) & 1 == 1;
                if allowed && (close as usize) < vocab {
                    row.fill(0);
                    row[close as usize / 32] = 1 << (close % 32);
                    (mask, penalised) = (true, true);
                }
            }
            // `min_tokens`: EOS and the stop ids are held back until then
            // (from the grammar's allowed tokens, or from every token).
            if draws && b.record.generated.len() < b.min_tokens && !b.held.is_empty() {
                let row = &mut seen[mask_row * words..(mask_row + 1) * words];
                if !mask {
                    row.copy_from_slice(&m3c_contract::sampling::seen_bitmap(0..vocab as u32, vocab));
                    mask = true;
                    penalised = true;
                }
                for &h in b.held.iter().filter(|&&h| h >= 0 && (h as usize) < vocab) {
                    row[h as usize / 32] &= !(1 << (h % 32));
                }
            }
            let bias_row = match (draws, &b.bias) {
                (true, Some(adj)) => {
                    bias.extend_from_slice(adj.row());
                    Some(bias.len() / vocab.max(1))
                }
                _ => None,
            };
            let r = &b.record;
            for j in 0..s.rows {
                let mut w = row_words(&b.sampling, 0, r.generated.len() as u64, draws && j + 1 == s.rows, k);
                if j + 1 == s.rows {
                    if mask {
                        w[row::TOKEN_MASK] = mask_row as i64 + 1;
                    }
                    // 1 + the row: the count after it was pushed.
                    if let Some(n) = bias_row {
                        w[row::BIAS_ROW] = n as i64;
                    }
                }
                table.extend_from_slice(&w);
            }
        }
        Ok(stage::SampleIn { table, seen, penalised, want_logits, bias })
    }

    /// The last stage's part of a step: checks the logits, records them
    /// (when wanted) and returns one id per segment. Non-finite logits (NaN
    /// or Inf in the weights, or an overflow) end the run with the sequence
    /// and position, or (serving) only that sequence, whose id is then -1.
    pub fn finish(&mut self, segs: &[Segment], out: &stage::StepOut, vocab: usize, stage: usize) -> Result<Vec<Drawn>, StageError> {
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
                if bad != 0 && self.on_bad == OnNonFinite::EndSequence {
                    ids.push(Drawn { id: -1, logprobs: None, prompt: Vec::new() });
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
            let id =
                out.ids.get(row0 + s.rows - 1).copied().ok_or_else(|| StageError::Step("a step returned fewer ids than rows".into()))?;
            if id < 0 || id as usize >= vocab {
                return Err(StageError::Step(format!("stage {stage}: the sampler chose id {id}, outside the vocabulary (0..{vocab})")));
            }
            let want_logits = self.want_logits;
            let vocabulary = self.grammars.built.as_ref().and_then(|v| v.as_ref().ok());
            let b =
                self.live.get_mut(&s.seq).ok_or_else(|| StageError::Step(format!("a step for sequence {}, which is not live", s.seq)))?;
            let r = &mut b.record;
            let draws = gives_token(r, s) && r.generated.len() < b.max_new;
            if let (true, Some(why)) = (draws, &b.failed) {
                eprintln!("m3c stage: sequence {}: its grammar or reasoning budget could not be applied ({why}); it ends", s.seq);
                ids.push(Drawn { id: -1, logprobs: None, prompt: Vec::new() });
                row0 += s.rows;
                continue 'segments;
            }
            if let (true, Some(g)) = (draws, b.grammar.as_mut()) {
                if let Err(e) = g.consume(id as u32) {
                    b.failed = Some(e.to_string());
                }
            }
            if let (true, Some(budget), Some(v)) = (draws, b.budget.as_mut(), vocabulary) {
                budget.consume(v, id as u32);
            }
            let logprobs = match (b.logprobs, out.logits.get((row0 + s.rows - 1) * vocab..(row0 + s.rows) * vocab)) {
                (Some(k), Some(row)) if draws => Some(TokenLogprobs::of(row, id as u32, k as usize)),
                (Some(_), None) if draws => {
                    return Err(StageError::Step("runtime bug: logprobs wanted, but the step returned no logits".into()))
                }
                _ => None,
            };
            // Row j predicts prompt token pos0 + j + 1, while there is one
            // not reported yet.
            let mut prompt = Vec::new();
            let unreported = unreported_prompt_rows(r, s, b.prompt_next);
            if let (Some(k), Some(rows), true) = (b.prompt_logprobs, out.logits.get(row0 * vocab..(row0 + s.rows) * vocab), unreported) {
                for (j, row) in rows.chunks_exact(vocab.max(1)).enumerate() {
                    let p = s.pos0 + j + 1;
                    if let (Some(&tok), true) = (r.prompt.get(p), p >= b.prompt_next) {
                        prompt.push((tok as u32, TokenLogprobs::of(row, tok as u32, k as usize)));
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
                } else if gives_token(r, s) {
                    r.decode_logits.extend_from_slice(&rows[(s.rows - 1) * vocab..]);
                }
            }
            // Only the prompt's last row and decode rows give tokens.
            if draws {
                r.generated.push(id);
                if let Some(adj) = b.bias.as_mut() {
                    adj.generated(id as u32);
                }
            }
            ids.push(Drawn { id, logprobs, prompt });
            row0 += s.rows;
        }
        Ok(ids)
    }
}

/// Whether a sequence's step ends at its next draw: the row of its
/// prompt's last token, or of the last token it generated. (Steps before
/// that are prefill chunks, or a preempted sequence recomputing its rows.)
fn gives_token(r: &SeqRecord, s: &Segment) -> bool {
    s.pos0 + s.rows == r.prompt.len() + r.generated.len()
}

/// Whether a step's rows predict a prompt token whose logprob is still to
/// report (row j predicts token pos0 + j + 1).
fn unreported_prompt_rows(r: &SeqRecord, s: &Segment, next: usize) -> bool {
    s.pos0 + s.rows >= next && next < r.prompt.len() && s.pos0 + 1 < r.prompt.len()
}
