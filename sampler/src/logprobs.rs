//! A token's logprobs: the log-softmax of the row its draw came from, and
//! the most likely alternatives (what `logprobs` and `prompt_logprobs`
//! report).

use m3c_contract::protocol::TokenLogprobs;

/// The logprobs of token `id` and the `k` most likely under `logits`
/// (one row): log-softmax in f64, so the same row gives the same bits
/// whatever batch or split it came from.
pub fn logprobs(logits: &[f32], id: u32, k: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let lp = |v: f32| (v as f64 - lse) as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        // Keep the k best by (logit desc, id asc) in one pass.
        for (i, &v) in logits.iter().enumerate() {
            if v.is_nan() || (top.len() == k && v <= top[k - 1].1) {
                continue;
            }
            let at = top.partition_point(|&(_, w)| w >= v);
            top.insert(at, (i as u32, v));
            top.truncate(k);
        }
    }
    let own = logits.get(id as usize).copied();
    let logprob = own.map_or(f32::NEG_INFINITY, lp);
    let rank = own.map_or(0, |o| 1 + logits.iter().filter(|&&v| v > o).count() as u32);
    TokenLogprobs { logprob, rank, top: top.into_iter().map(|(i, v)| (i, lp(v))).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_k_best_first() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, f32::NEG_INFINITY];
        let lp = logprobs(&logits, 3, 3);
        let lse = logits.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
        assert!((lp.logprob as f64 - (-2.0 - lse)).abs() < 1e-6, "{lp:?}");
        // Ties go to the lower id; the chosen token need not be in the top.
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1) && lp.top.iter().all(|t| t.1 <= 0.0));
        let sum: f64 = logits.iter().map(|&v| ((v as f64) - lse).exp()).sum();
        assert!((sum - 1.0).abs() < 1e-12);
        assert_eq!(logprobs(&logits, 4, 0), TokenLogprobs { logprob: f32::NEG_INFINITY, rank: 5, top: vec![] });
        assert_eq!((lp.rank, logprobs(&logits, 2, 0).rank, logprobs(&logits, 0, 0).rank), (4, 1, 3), "ties share a rank");
    }
}
