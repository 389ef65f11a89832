//! The host target's sampling kernel: the compiled `Sample` kernel's host
//! body calls `m3c_sample_rows`, which runs the contract's sampler over
//! every row of a step. (On a GPU the kernel's own device code samples, and
//! is checked to pick the same ids.)

use m3c_contract::sampling::{bias_row, mask_row, seen_row, ROW_WORDS};
use m3c_sampler::sample_row;

/// Samples `rows` rows of `vocab` logits under their sampling-table rows
/// (writing each row's non-finite count into it) into `ids`. The stage
/// entry passes the step's own buffers, sized by the same `rows`, `vocab`
/// and sequence count.
///
/// # Safety
/// In parameter order the buffers hold `rows × vocab` f32, `rows × ROW_WORDS` i64, `seen_rows ×
/// seen_words` u32, `bias_rows × vocab` f32 and `rows` i64, none overlapping.
#[no_mangle]
pub unsafe extern "C" fn m3c_sample_rows(
    logits: *const f32,
    table: *mut i64,
    seen: *const u32,
    bias: *const f32,
    ids: *mut i64,
    rows: i64,
    vocab: i64,
    seen_rows: i64,
    seen_words: i64,
    bias_rows: i64,
) {
    let (rows, vocab) = (rows.max(0) as usize, vocab.max(0) as usize);
    let (seen_rows, seen_words) = (seen_rows.max(0) as usize, seen_words.max(0) as usize);
    // SAFETY: the sizes are the caller's contract above.
    let (logits, table, ids) = unsafe {
        (
            std::slice::from_raw_parts(logits, rows * vocab),
            std::slice::from_raw_parts_mut(table, rows * ROW_WORDS),
            std::slice::from_raw_parts_mut(ids, rows),
        )
    };
    // SAFETY: as above; no bitmaps (a zero count) is an empty slice.
    let seen = if seen_rows * seen_words == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(seen, seen_rows * seen_words) } };
    let bias_len = bias_rows.max(0) as usize * vocab;
    // SAFETY: as above.
    let bias = if bias_len == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(bias, bias_len) } };
    for ((row, words), id) in logits.chunks_exact(vocab.max(1)).zip(table.chunks_exact_mut(ROW_WORDS)).zip(ids.iter_mut()) {
        let words: &mut [i64; ROW_WORDS] = words.try_into().expect("chunks of ROW_WORDS");
        let rows_of = |s: usize| seen.get(s * seen_words..(s + 1) * seen_words);
        let bitmap = rows_of(seen_row(words)).unwrap_or(&[]);
        // A mask row past the buffer allows nothing rather than everything.
        let allowed = mask_row(words).map(|m| rows_of(m).unwrap_or(&[]));
        // A bias row past the buffer adds nothing (the books never name one).
        let add = bias_row(words).and_then(|b| bias.get(b * vocab..(b + 1) * vocab));
        *id = sample_row(row, bitmap, allowed, add, words) as i64;
    }
}
