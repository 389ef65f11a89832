//! EAGLE3 proposals on the last stage, right after a step's draws (vLLM's
//! `EagleProposer` at inference, on the head m3c compiled into the stage).
//!
//! - First entry: over every row the target just computed whose next token
//!   is known (a prefill chunk's rows, a decode row, a verify step's
//!   accepted rows), row p reads the target's aux states at p and the token
//!   at p + 1, and writes the head's K and V at p. Its last row per
//!   sequence that drew proposes the token after the one just drawn.
//! - Next entries: K − 1 more rows per sequence, each at the next position,
//!   reading its own last proposal and pre-norm hidden state.
//!
//! Draft ids map to the target's through `d2t` (target = draft + d2t[draft]).
//! Proposals only choose what a verify step checks: every token is still
//! drawn by the target's sampler, so they change no bit of the output.

use crate::error::StageError;
use crate::stage::{Segment, Stage};
use m3c_contract::{CheckpointLayout, DType};
use m3c_engine::drawn::Drawn;
use m3c_engine::Ask;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

pub(crate) struct Drafter {
    /// Drafts per step.
    pub tokens: usize,
    /// Per draft id, the offset to its target id.
    d2t: Vec<i64>,
}

impl Drafter {
    /// The head's settings: `tokens` drafts per step, `d2t` read from the
    /// draft's checkpoint in `dir` (absent: the draft vocabulary is the
    /// target's, offsets 0).
    pub fn load(dir: Option<&Path>, vocab: usize, target_vocab: usize, tokens: usize) -> Result<Drafter, StageError> {
        let d2t = match dir {
            Some(dir) => read_d2t(dir, vocab)?,
            None => None,
        };
        let d2t = match d2t {
            Some(v) => v,
            None if vocab == target_vocab => vec![0; vocab],
            None => {
                return Err(StageError::Weights(format!(
                "the EAGLE3 draft's vocabulary ({vocab}) is not the target's ({target_vocab}), and its checkpoint has no `d2t` to map it"
            )))
            }
        };
        if let Some((d, off)) = d2t.iter().enumerate().find(|(d, off)| !(0..target_vocab as i64).contains(&(*d as i64 + **off))) {
            return Err(StageError::Weights(format!(
                "the EAGLE3 draft's `d2t` maps draft id {d} to {}, outside the target's vocabulary (0..{target_vocab})",
                d as i64 + off
            )));
        }
        Ok(Drafter { tokens, d2t })
    }

    fn target_id(&self, draft: i64) -> Result<i64, StageError> {
        let off = usize::try_from(draft)
            .ok()
            .and_then(|d| self.d2t.get(d))
            .ok_or_else(|| StageError::Step(format!("the draft head chose id {draft}, outside its vocabulary (0..{})", self.d2t.len())))?;
        Ok(draft + off)
    }

    /// Each segment's proposals after the step that drew `got` (verify
    /// segments' drafts in `drafts`; at most `wanted[k]` for segment k, none
    /// where `wanted` is empty), from the aux states the step left in
    /// `carry` after its `x` rows.
    #[allow(clippy::too_many_arguments)]
    pub fn propose(
        &self,
        st: &mut Stage,
        books: &impl SeqIds,
        segs: &[Segment],
        drafts: &[Vec<i64>],
        wanted: &[i64],
        got: &[Drawn],
        carry: &[f32],
    ) -> Result<Vec<Vec<i64>>, StageError> {
        let (xw, slots) = (st.meta.x_words(), st.meta.aux_slots);
        // The carry slot of each state, in the order the head's `fc` reads them.
        let order = st.meta.draft.as_ref().map(|d| d.order.clone()).unwrap_or_default();
        if order.len() != slots || order.iter().any(|&s| s >= slots) {
            return Err(StageError::Step("runtime bug: the draft's aux order does not fit the stage's slots".into()));
        }
        let tokens: usize = segs.iter().map(|s| s.rows).sum();
        if carry.len() != tokens * xw * (1 + slots) {
            return Err(StageError::Step("runtime bug: a step's buffer without its aux states".into()));
        }
        // The first entry's rows: per segment, its rows whose next token is known.
        let (mut first, mut ids, mut aux) = (Vec::new(), Vec::new(), Vec::new());
        // Per segment: (its row in the first entry's output, the position of its new token, drafts to make).
        let mut chains: Vec<Option<(usize, usize, usize)>> = vec![None; segs.len()];
        let mut row0 = 0;
        for (k, s) in segs.iter().enumerate() {
            let verify = drafts.get(k).is_some_and(|d| !d.is_empty());
            let next = |j: usize| -> Option<i64> {
                if verify {
                    got[k].tokens.get(j).map(|t| t.id)
                } else {
                    books.token_at(s.seq, s.pos0 + j + 1)
                }
            };
            // (−1: the first stage asks nothing of the head for it.)
            // The first stage's ask for it, as the wire carries it (none
            // listed: only the head's cache rows).
            let ask = wanted.get(k).map_or(Ask::CacheOnly, |&w| Ask::from_word(w));
            let skip = ask == Ask::Nothing;
            let rows = if skip { 0 } else { (0..s.rows).take_while(|&j| next(j).is_some_and(|id| id >= 0)).count() };
            if rows > 0 {
                first.push(Segment { seq: s.seq, pos0: s.pos0, rows });
                for j in 0..rows {
                    ids.push(next(j).unwrap_or_default());
                    for &slot in &order {
                        let at = (1 + slot) * tokens * xw + (row0 + j) * xw;
                        aux.extend_from_slice(&carry[at..at + xw]);
                    }
                }
                // It drew a token this step (and may take more): it drafts.
                let drew = got[k].tokens.last().is_some_and(|t| t.id >= 0);
                let asked = if let Ask::Drafts(n) = ask { n } else { 0 };
                let want = self.tokens.min(asked).min(books.remaining(s.seq).saturating_sub(1));
                if drew && want > 0 {
                    chains[k] = Some((ids.len() - 1, s.pos0 + rows, want));
                }
            }
            row0 += s.rows;
        }
        let mut proposals = vec![Vec::new(); segs.len()];
        if chains.iter().all(Option::is_none) {
            // Only prefill chunks: their rows still fill the head's cache.
            if !first.is_empty() {
                let mut x = vec![0f32; ids.len() * xw];
                st.draft_step(true, &first, &ids, &mut x, &mut aux)?;
            }
            return Ok(proposals);
        }
        let mut x = vec![0f32; ids.len() * xw];
        let out = st.draft_step(true, &first, &ids, &mut x, &mut aux)?;
        // The chains still growing: (segment, last proposal, its hidden state, next position, drafts to make).
        let mut live: Vec<(usize, i64, Vec<f32>, usize, usize)> = Vec::new();
        for (k, c) in chains.iter().enumerate() {
            if let Some((row, pos, want)) = *c {
                let id = self.target_id(out.ids[row])?;
                proposals[k].push(id);
                live.push((k, id, x[row * xw..(row + 1) * xw].to_vec(), pos, want));
            }
        }
        loop {
            // A chain grows while it wants more and its next position lies
            // in the blocks it holds (the first stage gives it K ahead).
            live.retain(|(k, _, _, pos, want)| proposals[*k].len() < *want && *pos < st.held_positions(segs[*k].seq));
            if live.is_empty() {
                break;
            }
            let next: Vec<Segment> = live.iter().map(|(k, _, _, pos, _)| Segment { seq: segs[*k].seq, pos0: *pos, rows: 1 }).collect();
            let ids: Vec<i64> = live.iter().map(|(_, id, _, _, _)| *id).collect();
            let mut x: Vec<f32> = live.iter().flat_map(|(_, _, h, _, _)| h.iter().copied()).collect();
            let out = st.draft_step(false, &next, &ids, &mut x, &mut [])?;
            for (i, (k, id, h, pos, _)) in live.iter_mut().enumerate() {
                *id = self.target_id(out.ids[i])?;
                proposals[*k].push(*id);
                h.copy_from_slice(&x[i * xw..(i + 1) * xw]);
                *pos += 1;
            }
        }
        Ok(proposals)
    }
}

/// What the head needs of the last stage's books: each sequence's ids so
/// far, and how many more it may take.
pub(crate) trait SeqIds {
    fn token_at(&self, seq: usize, pos: usize) -> Option<i64>;
    fn remaining(&self, seq: usize) -> usize;
}

/// Sets each segment's proposals in `got` when the stage drafts (it holds
/// a `drafter`) and the first stage asked for them (`wanted`); `carry` is
/// the step's buffer.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attach(
    st: &mut Stage,
    drafter: Option<&Drafter>,
    books: &impl SeqIds,
    segs: &[Segment],
    drafts: &[Vec<i64>],
    wanted: &[i64],
    got: &mut [Drawn],
    carry: &[f32],
) -> Result<(), StageError> {
    let Some(drafter) = drafter else { return Ok(()) };
    let proposals = drafter.propose(st, books, segs, drafts, wanted, got, carry)?;
    // Test hook (documented in ARCHITECTURE.md): each proposal on standard
    // error, so the tests can hold them against the reference's goldens.
    let log = std::env::var_os("M3C_TEST_LOG_DRAFTS").is_some();
    for ((d, p), s) in got.iter_mut().zip(proposals).zip(segs) {
        if log && !p.is_empty() {
            let ids: Vec<String> = p.iter().map(i64::to_string).collect();
            eprintln!("m3c-draft {} {}", s.seq, ids.join(","));
        }
        d.proposals = p;
    }
    Ok(())
}

/// `d2t` of the draft's checkpoint (i64, one per draft id), if it has one.
fn read_d2t(dir: &Path, vocab: usize) -> Result<Option<Vec<i64>>, StageError> {
    let err = |e: String| StageError::Weights(format!("EAGLE3 draft {}: {e}", dir.display()));
    let layout = CheckpointLayout::open(dir).map_err(|e| err(e.to_string()))?;
    let Some(t) = layout.tensors.get("d2t") else { return Ok(None) };
    if t.dtype != DType::I64 || t.shape != [vocab] {
        return Err(err(format!(
            "`d2t` is {} {:?}; expected i64 [{vocab}] (one offset per draft id)",
            t.dtype.safetensors_name(),
            t.shape
        )));
    }
    let path = &layout.files[t.file];
    let mut f = std::fs::File::open(path).map_err(|e| err(format!("{}: {e}", path.display())))?;
    let mut bytes = vec![0u8; (t.end - t.start) as usize];
    f.seek(SeekFrom::Start(t.start)).and_then(|_| f.read_exact(&mut bytes)).map_err(|e| err(format!("{}: {e}", path.display())))?;
    Ok(Some(bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect()))
}
