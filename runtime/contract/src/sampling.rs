//! Sampling the next token from a row of logits, as the last stage does:
//! repetition penalty, temperature (0 = greedy), top-k, top-p, min-p, then
//! one draw from a counter-based generator keyed by (seed, request, step).
//! A request's tokens therefore depend only on the model, the prompt, the
//! parameters and the seed — not on the pipeline split, the micro-batch, what
//! else runs, the thread count or how its prefill was chunked.
//!
//! The random numbers are Philox-4x32-10 (Salmon et al., SC'11, the
//! generator of cuRAND and JAX): pure integer arithmetic, so a device
//! sampler can reproduce the host's draws exactly. Every decision after the
//! draw is made in a fixed order (candidates sorted by descending
//! probability, ties to the lower id) with arithmetic that does not depend on
//! the machine's vector width.

/// The sampling parameters of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (the first maximum).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches
    /// `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one (0 = none).
    pub min_p: f32,
    /// Above 1 makes tokens already in the sequence less likely (1 = none), as
    /// Hugging Face does: a positive logit is divided by it, a negative one
    /// multiplied.
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding.
    pub const GREEDY: SamplingParams =
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, seed: 0 };

    /// Greedy with nothing to adjust: the argmax kernels' id is the answer.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.repetition_penalty == 1.0
    }

    /// Checks every field's range; the message names the field.
    pub fn check(&self) -> Result<(), String> {
        let SamplingParams { temperature: t, top_p, min_p, repetition_penalty: r, .. } = *self;
        if !(t.is_finite() && t >= 0.0) {
            return Err(format!("temperature {t}: expected a number ≥ 0 (0 = greedy)"));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(format!("top_p {top_p}: expected a number in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&min_p) {
            return Err(format!("min_p {min_p}: expected a number in [0, 1]"));
        }
        if !(r.is_finite() && r > 0.0) {
            return Err(format!("repetition_penalty {r}: expected a positive number"));
        }
        Ok(())
    }
}

/// Philox-4x32-10 of a 128-bit counter under a 64-bit key.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (counter, key);
    for _ in 0..10 {
        let p0 = M0 * c[0] as u64;
        let p1 = M1 * c[2] as u64;
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// The uniform number in [0, 1) of draw `step` of request `request` under
/// `seed`: 24 random bits, so it is exact in f32.
pub fn uniform(seed: u64, request: u64, step: u64) -> f32 {
    let r = philox4x32([request as u32, (request >> 32) as u32, step as u32, (step >> 32) as u32], [seed as u32, (seed >> 32) as u32]);
    (r[0] >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// The largest value, NaN ignored (-∞ when there is none), in eight lanes so
/// it vectorises.
fn lane_max(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    for (i, &v) in values.iter().enumerate() {
        let l = &mut lanes[i % 8];
        *l = if v > *l { v } else { *l };
    }
    lanes.into_iter().fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a })
}

/// Index of the first maximum, NaN ranking as -inf (what the argmax
/// kernels compute).
pub fn greedy(logits: &[f32]) -> usize {
    let max = lane_max(logits);
    if max == f32::NEG_INFINITY {
        return 0;
    }
    logits.iter().position(|&x| x == max).unwrap_or(0)
}

/// Hugging Face's repetition penalty on one logit: a positive one is
/// divided by `penalty`, a negative one multiplied.
fn penalised(x: f32, penalty: f32) -> f32 {
    if x > 0.0 {
        x / penalty
    } else {
        x * penalty
    }
}

/// The ids seen in the sequence, each once however often it occurs.
fn seen(context: &[u32]) -> Vec<u32> {
    let mut seen = context.to_vec();
    seen.sort_unstable();
    seen.dedup();
    seen
}

/// Logits with NaN as -∞, the repetition penalty applied, divided by the
/// temperature, written into `x` (reused between calls: a vocabulary row is
/// 800 kB, and a fresh one per token costs more in page faults than the
/// sampling itself).
fn scaled_into(x: &mut Vec<f32>, logits: &[f32], context: &[u32], p: &SamplingParams) {
    let t = p.temperature.max(f32::MIN_POSITIVE);
    let fix = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    x.clear();
    x.extend(logits.iter().map(|&v| fix(v) / t));
    if p.repetition_penalty != 1.0 {
        for id in seen(context) {
            if let Some(v) = logits.get(id as usize) {
                x[id as usize] = fix(penalised(*v, p.repetition_penalty)) / t;
            }
        }
    }
}

/// exp(-d) for d ≥ 0, in plain f32 arithmetic that the compiler turns into
/// vector code (libm's expf is a call per element): Cody-Waite reduction to
/// r in [-ln2/2, ln2/2], a degree-6 Taylor polynomial (relative error below
/// 2e-7) and the power of two written into the exponent bits. Zero past
/// d = 87, where f32 would go subnormal, and for d = ∞ (masked tokens).
#[inline(always)]
fn exp_neg(d: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // Round to nearest without SSE4.1's roundps: adding 1.5·2^23 pushes the
    // fraction out of the mantissa.
    const ROUND: f32 = 12_582_912.0;
    let x = -d.min(87.0);
    let n = (x * LOG2_E + ROUND) - ROUND;
    let r = (x - n * 0.693_145_75) - n * 1.428_606_8e-6;
    let poly = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if d < 87.0 {
        poly * scale
    } else {
        0.0
    }
}

/// Sum in eight lanes so it vectorises, then in f64.
fn lane_sum(values: impl Iterator<Item = f32>) -> f64 {
    let mut lanes = [0.0f32; 8];
    for (i, v) in values.enumerate() {
        lanes[i % 8] += v;
    }
    lanes.iter().map(|&l| l as f64).sum()
}

/// Most likely first, ties to the lower id: the one order every decision
/// after the draw uses.
fn ranked(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The ids of the `k` largest values (ties to the lower id), in one pass
/// over a bounded heap whose weakest member most tokens fail to beat.
fn top_k_ids(x: &[f32], k: usize) -> Vec<(u32, f32)> {
    use std::collections::BinaryHeap;
    // The heap's top is its weakest member: the greatest under `ranked`.
    #[derive(PartialEq)]
    struct Weakest((u32, f32));
    impl Eq for Weakest {}
    impl PartialOrd for Weakest {
        fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Weakest {
        fn cmp(&self, other: &Self) -> std::cmp::Ordering {
            ranked(&self.0, &other.0)
        }
    }
    let mut heap: BinaryHeap<Weakest> = BinaryHeap::with_capacity(k + 1);
    for (i, &v) in x.iter().enumerate() {
        if heap.len() == k {
            // Ids rise, so a tie with the weakest loses to it.
            if v <= heap.peek().map_or(f32::NEG_INFINITY, |w| w.0 .1) {
                continue;
            }
            heap.pop();
        }
        heap.push(Weakest((i as u32, v)));
    }
    heap.into_iter().map(|w| w.0).collect()
}

/// Widths below the maximum (in scaled logits) tried for the top-p band.
const BANDS: [f32; 7] = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0];

/// The probability mass (unnormalised) within each of [`BANDS`] below
/// `max`, and the total, in one pass of eight-wide lanes (each element's
/// exponential computed once).
fn band_masses(x: &[f32], max: f32) -> ([f64; 7], f64) {
    let mut acc = [[0.0f32; 8]; 8];
    let mut add = |c: &[f32; 8]| {
        let d: [f32; 8] = std::array::from_fn(|l| max - c[l]);
        let e: [f32; 8] = std::array::from_fn(|l| exp_neg(d[l]));
        for (j, w) in BANDS.iter().enumerate() {
            for l in 0..8 {
                acc[j][l] += if d[l] <= *w { e[l] } else { 0.0 };
            }
        }
        for l in 0..8 {
            acc[7][l] += e[l];
        }
    };
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        add(c.try_into().expect("chunks_exact(8) yields eight"));
    }
    let mut tail = [f32::NEG_INFINITY; 8];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    add(&tail);
    let sum = |j: usize| acc[j].iter().map(|&v| v as f64).sum::<f64>();
    (std::array::from_fn(sum), sum(7))
}

/// The candidates of a draw: ids with their probabilities, most likely
/// first (ties to the lower id), after every filter, not yet renormalised.
///
/// Probabilities are relative to the k best (every token without top-k).
/// Top-p keeps the shortest most-likely-first prefix reaching `top_p` of
/// that mass; only the tokens near the top are ever sorted: the smallest
/// band below the maximum that holds enough mass is found by masked sums
/// first, and everything outside the band is less likely than everything
/// in it, so the band's sorted prefix is the whole vocabulary's.
pub fn candidates(logits: &[f32], context: &[u32], p: &SamplingParams) -> Vec<(u32, f32)> {
    thread_local! {
        static SCALED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCALED.with_borrow_mut(|x| {
        scaled_into(x, logits, context, p);
        filtered(x, logits, p)
    })
}

/// [`candidates`] on logits already scaled.
fn filtered(x: &[f32], logits: &[f32], p: &SamplingParams) -> Vec<(u32, f32)> {
    let k = if p.top_k == 0 { x.len() } else { p.top_k.min(x.len()) };
    let max = lane_max(x);
    if max == f32::NEG_INFINITY {
        // Nothing is possible: fall back to what greedy would pick.
        return vec![(greedy(logits) as u32, 1.0)];
    }
    let (sorted, total) = if k < x.len() {
        let mut best = top_k_ids(x, k);
        best.sort_unstable_by(ranked);
        let total = lane_sum(best.iter().map(|&(_, v)| exp_neg(max - v)));
        (best, total)
    } else {
        let (band_mass, total) = band_masses(x, max);
        let goal = p.top_p as f64 * total;
        // The narrowest band [max - width, max] holding the nucleus.
        let band = BANDS.iter().zip(band_mass).find(|&(_, m)| m >= goal).map_or(f32::INFINITY, |(&w, _)| w);
        let mut inside: Vec<(u32, f32)> =
            x.iter().enumerate().filter(|&(_, &v)| max - v <= band && v > f32::NEG_INFINITY).map(|(i, &v)| (i as u32, v)).collect();
        inside.sort_unstable_by(ranked);
        (inside, total)
    };
    // Top-p: the shortest prefix reaching p (at least one token).
    let goal = p.top_p as f64 * total;
    let mut cum = 0.0f64;
    let mut kept = Vec::new();
    for &(id, v) in &sorted {
        let e = exp_neg(max - v) as f64;
        kept.push((id, (e / total) as f32));
        cum += e;
        if cum >= goal {
            break;
        }
    }
    if p.min_p > 0.0 {
        let floor = p.min_p * kept[0].1;
        kept.retain(|&(_, q)| q >= floor);
    }
    kept
}

/// The next token of request `request` at `step` (its position among the
/// request's draws): greedy at temperature 0, else a draw from the
/// candidates with the counter-based uniform number.
pub fn sample(logits: &[f32], context: &[u32], p: &SamplingParams, request: u64, step: u64) -> u32 {
    if p.temperature == 0.0 {
        if p.repetition_penalty == 1.0 {
            return greedy(logits) as u32;
        }
        let mut adjusted = logits.to_vec();
        for id in seen(context) {
            if let Some(x) = adjusted.get_mut(id as usize) {
                *x = penalised(*x, p.repetition_penalty);
            }
        }
        return greedy(&adjusted) as u32;
    }
    let kept = candidates(logits, context, p);
    let total: f64 = kept.iter().map(|&(_, q)| q as f64).sum();
    let u = uniform(p.seed, request, step) as f64 * total;
    let mut cum = 0.0f64;
    for &(id, q) in &kept {
        cum += q as f64;
        if u < cum {
            return id;
        }
    }
    kept[kept.len() - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_matches_the_published_test_vectors() {
        // Random123's kat_vectors for philox4x32-10.
        assert_eq!(philox4x32([0, 0, 0, 0], [0, 0]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox4x32([u32::MAX; 4], [u32::MAX; 2]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
        assert_eq!(
            philox4x32([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_skips_nan() {
        assert_eq!(greedy(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(greedy(&[f32::NAN, 0.5, f32::NAN]), 1);
        assert_eq!(sample(&[0.0, 2.0, 1.0], &[], &SamplingParams::GREEDY, 0, 0), 1);
        // A repetition penalty can move the greedy choice.
        let p = SamplingParams { repetition_penalty: 4.0, ..SamplingParams::GREEDY };
        assert_eq!(sample(&[0.0, 2.0, 1.0], &[1], &p, 0, 0), 2);
    }

    #[test]
    fn draws_depend_only_on_seed_request_and_step() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32 / 300.0).collect();
        let p = SamplingParams { temperature: 0.8, top_k: 50, top_p: 0.9, min_p: 0.0, repetition_penalty: 1.0, seed: 7 };
        let a: Vec<u32> = (0..20).map(|s| sample(&logits, &[], &p, 3, s)).collect();
        let b: Vec<u32> = (0..20).map(|s| sample(&logits, &[], &p, 3, s)).collect();
        assert_eq!(a, b);
        let c: Vec<u32> = (0..20).map(|s| sample(&logits, &[], &p, 4, s)).collect();
        assert_ne!(a, c, "another request draws other numbers");
        assert!(p.check().is_ok());
        assert!(SamplingParams { top_p: 0.0, ..p }.check().unwrap_err().contains("top_p"));
        assert!(SamplingParams { temperature: f32::NAN, ..p }.check().unwrap_err().contains("temperature"));
    }

    /// The exact distribution a draw should follow, computed independently
    /// in f64: softmax at temperature t over the k best, then the shortest
    /// most-likely-first prefix reaching p, renormalised.
    fn expected(logits: &[f32], t: f64, k: usize, p: f64) -> Vec<(u32, f64)> {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        ids.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        ids.truncate(k);
        let max = logits[ids[0] as usize] as f64;
        let w: Vec<f64> = ids.iter().map(|&i| ((logits[i as usize] as f64 - max) / t).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut out = Vec::new();
        let mut cum = 0.0;
        for (&id, &x) in ids.iter().zip(&w) {
            out.push((id, x / total));
            cum += x / total;
            if cum >= p {
                break;
            }
        }
        let kept: f64 = out.iter().map(|&(_, q)| q).sum();
        out.iter().map(|&(id, q)| (id, q / kept)).collect()
    }

    #[test]
    fn draws_follow_the_filtered_distribution_chi_square() {
        // 64 logits spread over a few units, 100 000 draws at T = 0.7 with
        // top-k 24 and top-p 0.9. Philox makes the draws fixed, so this
        // cannot flake; a wrong filter or a biased draw fails it.
        let logits: Vec<f32> = (0..64u32).map(|i| ((i * 37) % 64) as f32 / 12.0).collect();
        let p = SamplingParams { temperature: 0.7, top_k: 24, top_p: 0.9, min_p: 0.0, repetition_penalty: 1.0, seed: 2026 };
        let want = expected(&logits, 0.7, 24, 0.9);
        let n = 100_000u64;
        let mut counts = vec![0u64; logits.len()];
        for step in 0..n {
            counts[sample(&logits, &[], &p, 11, step) as usize] += 1;
        }
        let allowed: Vec<u32> = want.iter().map(|&(id, _)| id).collect();
        for (id, &c) in counts.iter().enumerate() {
            assert!(c == 0 || allowed.contains(&(id as u32)), "token {id} lies outside the nucleus but was drawn {c} times");
        }
        let chi2: f64 = want
            .iter()
            .map(|&(id, q)| {
                let e = q * n as f64;
                (counts[id as usize] as f64 - e).powi(2) / e
            })
            .sum();
        // The 0.1 % critical value (Wilson-Hilferty, z = 3.09).
        let df = (want.len() - 1) as f64;
        let crit = df * (1.0 - 2.0 / (9.0 * df) + 3.09 * (2.0 / (9.0 * df)).sqrt()).powi(3);
        assert!(want.len() > 3 && want.len() < 24, "the test should exercise top-p, kept {}", want.len());
        assert!(chi2 < crit, "chi-square {chi2:.1} over {df} degrees of freedom exceeds {crit:.1}");
    }

    #[test]
    fn the_vector_exp_is_within_a_few_ulps() {
        let mut worst = 0.0f64;
        for i in 0..87_000 {
            let d = i as f32 / 1000.0;
            let want = (-(d as f64)).exp();
            worst = worst.max(((exp_neg(d) as f64 - want) / want).abs());
        }
        assert!(worst < 5e-7, "relative error {worst:e}");
        assert_eq!(exp_neg(f32::INFINITY), 0.0);
        assert_eq!(exp_neg(90.0), 0.0);
    }

    #[test]
    fn top_k_breaks_ties_towards_the_lower_id() {
        let mut got = top_k_ids(&[1.0, 2.0, 2.0, 0.5, 2.0, 3.0], 3);
        got.sort_unstable_by(ranked);
        assert_eq!(got, [(5, 3.0), (1, 2.0), (2, 2.0)]);
        let p = SamplingParams { temperature: 1.0, top_k: 1, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, seed: 0 };
        assert_eq!(candidates(&[f32::NAN, 1.0, 1.0], &[], &p), [(1, 1.0)]);
        assert_eq!(candidates(&[f32::NAN, f32::NAN], &[], &p).len(), 1, "an all-NaN row still yields one token");
    }

    #[test]
    fn the_repetition_penalty_counts_each_id_once() {
        let p = SamplingParams { repetition_penalty: 2.0, ..SamplingParams::GREEDY };
        // 3.0 / 2 = 1.5 beats 1.2; halving twice (0.75) would not.
        assert_eq!(sample(&[1.2, 3.0], &[1, 1, 1], &p, 0, 0), 1);
    }
}
