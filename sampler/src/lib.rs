//! Sampling the next token from a row of logits, as the last stage does:
//! repetition penalty, temperature (0 = greedy), top-k, top-p, min-p, then
//! one draw from a counter-based generator keyed by (seed, request, step).
//! A request's tokens therefore depend only on the model, the prompt, the
//! parameters and the seed — not on the pipeline split, the micro-batch, what
//! else runs, the thread count or how its prefill was chunked.
//!
//! The random numbers are Philox-4x32-10 (Salmon et al., SC'11, the
//! generator of cuRAND and JAX): pure integer arithmetic, so a device
//! sampler can reproduce the host's draws exactly. Every decision is made on
//! integer weights ([`weight`]: `exp(x − max)` in units of 2^-30, from a
//! fixed polynomial whose constants the device kernel shares), whose sums
//! are exact in any order: top-k, top-p and min-p each keep a prefix of the
//! order by weight (ties to the lower id), found by weighted radix selects,
//! and the draw lands at ⌊kept · 64 random bits / 2^64⌋. So a GPU, summing in
//! its own order, picks the very token the host picks.

pub mod logprobs;

use m3c_contract::sampling::*;

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

/// A uniform number in [0, 1) from the same generator (24 random bits, exact
/// in f32), for tests and benches that need reproducible noise.
pub fn uniform(seed: u64, request: u64, step: u64) -> f32 {
    let r = philox4x32([request as u32, (request >> 32) as u32, step as u32, (step >> 32) as u32], [seed as u32, (seed >> 32) as u32]);
    (r[0] >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// Draw `step` of request `request` under `seed`: 64 random bits, the
/// first two words of one Philox block (counter = request, step; key = seed).
pub fn draw_bits(seed: u64, request: u64, step: u64) -> u64 {
    let r = philox4x32([request as u32, (request >> 32) as u32, step as u32, (step >> 32) as u32], [seed as u32, (seed >> 32) as u32]);
    r[0] as u64 | (r[1] as u64) << 32
}

/// exp(-d) for d ≥ 0, in plain f32 arithmetic that the compiler turns into
/// vector code (libm's expf is a call per element) and that a GPU computes
/// to the same bits (no fused multiply-add: every product is rounded):
/// Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-6 Taylor
/// polynomial (relative error below 2e-7) and the power of two written into
/// the exponent bits. Zero past d = 87 and for d = ∞ (masked tokens).
#[inline(always)]
pub fn exp_neg(d: f32) -> f32 {
    use exp_consts::*;
    // Clamped to [0, 87] (NaN to 0), so n below is an integer in [-126,
    // 0]; compares and selects, which vectorise (f32::max would not).
    let c = if d > 0.0 { d } else { 0.0 };
    let x = -(if c < CUTOFF { c } else { CUTOFF });
    let n = (x * LOG2_E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut poly = POLY[0];
    for c in &POLY[1..] {
        poly = poly * r + c;
    }
    // SAFETY: n is finite and integral in [-126, 0] (x is in [-87, 0]), so
    // it converts exactly. (The checked `as` would not vectorise.)
    let n = unsafe { n.to_int_unchecked::<i32>() };
    let scale = f32::from_bits(((n + 127) as u32) << 23);
    if d < CUTOFF {
        poly * scale
    } else {
        0.0
    }
}

/// The integer weight of a token `d` below the maximum (scaled logits).
/// Every decision of the sampler is made on these integers, whose sums are
/// exact in any order: that is what lets a GPU, summing in its own order,
/// pick the very token the host picks. A token more than ~20.8 below the
/// maximum weighs 0 (less than 1e-9 of the most likely one).
#[inline(always)]
pub fn weight(d: f32) -> u32 {
    // exp_neg is at most 1 (the clamp only makes that visible to the reader).
    let e = exp_neg(d) * WEIGHT_ONE;
    let scaled = if e < WEIGHT_ONE { e } else { WEIGHT_ONE };
    // SAFETY: `scaled` is finite and in [0, 2^30], inside i32.
    unsafe { scaled.to_int_unchecked::<i32>() as u32 }
}

/// NaN as -∞: NaN never wins and is never drawn.
fn fix(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else {
        v
    }
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

/// The scaled value of one token: NaN as -∞, the repetition penalty if the
/// token was seen, divided by the temperature (by 1 when greedy, which
/// changes nothing).
#[inline(always)]
fn scaled(l: f32, seen: bool, penalty: f32, t: f32) -> f32 {
    (if seen { fix(penalised(l, penalty)) } else { fix(l) }) / t
}

/// Index of the first maximum, NaN ranking as -inf.
pub fn greedy(logits: &[f32]) -> usize {
    let max = lanes::max(logits);
    logits.iter().position(|&x| x == max).unwrap_or(0)
}

/// Where, in the order of descending weight then ascending id, a goal is
/// reached: every token above `tau` comes before it (`above_count` tokens
/// of `above_mass` weight), then tokens of weight `tau`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Boundary {
    tau: u32,
    above_count: u64,
    above_mass: u64,
}

/// A goal along that order: the first `k` tokens, or the shortest prefix
/// whose weight reaches `g`.
#[derive(Debug, Clone, Copy)]
enum Goal {
    Count(u64),
    Mass(u64),
}

impl Goal {
    fn reached(self, count: u64, mass: u64) -> bool {
        match self {
            Goal::Count(k) => count >= k,
            Goal::Mass(g) => mass >= g,
        }
    }
}

/// The weight levels at which tokens are gathered, heaviest first. The
/// first holds the tokens within ~6.9 of the maximum (in scaled logits, a
/// thousandth of the most likely token): in a language model's row they are
/// few and hold nearly all the weight, so most goals are settled among a
/// handful of tokens; a goal beyond a level's count or weight moves to the
/// next, which a scan of the row gathers when first needed.
const LEVELS: [u32; 5] = [1 << 20, 1 << 15, 1 << 10, 1 << 5, 1];

/// One row's weights, the per-call scratch of the sampler.
#[derive(Default)]
struct Row {
    w: Vec<u32>,
    total: u64,
    /// Weight of the tokens at or above the min-p floor.
    floor_mass: u64,
    /// Per level gathered so far: the ids of weight ≥ `LEVELS[j]`,
    /// ascending, and their weight.
    levels: Vec<(Vec<u32>, u64)>,
    /// The first level overflowed ([`WIDE`]): a flat row, where goals are
    /// found from a histogram of the whole row instead of id lists.
    wide: bool,
    /// That histogram by leading zeros (count, weight), once built.
    histogram: Option<Box<([u64; 33], [u64; 33])>>,
}

/// Heavy tokens past which a row counts as flat: gathering ids would cost
/// more than a histogram of every weight.
const WIDE: usize = 8192;

/// The ids set in a seen bitmap.
fn seen_ids(seen: &[u32]) -> impl Iterator<Item = usize> + '_ {
    seen.iter().enumerate().flat_map(|(wi, &word)| {
        let mut bits = word;
        std::iter::from_fn(move || {
            (bits != 0).then(|| {
                let i = wi * 32 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                i
            })
        })
    })
}

/// The hot loops, compiled twice: for AVX2 (eight lanes) where the CPU has
/// it, and for the x86-64 baseline. Rust never fuses a multiply and an add,
/// so both give the same bits.
mod lanes {
    use super::{fix, weight, LEVELS};

    #[inline(always)]
    fn max_body(logits: &[f32]) -> f32 {
        let mut lanes = [f32::NEG_INFINITY; 8];
        let chunks = logits.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            for l in 0..8 {
                lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
            }
        }
        for (l, &v) in tail.iter().enumerate() {
            lanes[l] = if v > lanes[l] { v } else { lanes[l] };
        }
        lanes.into_iter().fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a })
    }

    #[inline(always)]
    fn weigh_body(w: &mut [u32], logits: &[f32], max: f32, t: f32, floor: u32, heavy: &mut Vec<u32>) -> (u64, u64) {
        // Past 21 below the maximum a weight is surely 0 (e^-21·2^30 < 0.82
        // even with the polynomial's error), so a block of such tokens, most
        // of a peaked row at low temperature, skips the exponential. The test
        // is on the raw logit against a cut whose own distance is checked:
        // l ↦ max − l/t, rounded as the weights round it, never increases,
        // so l ≤ cut puts l at least as far down as the cut. Blocks of 64
        // keep the loops plain enough to vectorise.
        let cut = (max - 21.5) * t;
        let cut = if max - cut / t >= 21.0 { cut } else { f32::NEG_INFINITY };
        for (block, (w64, l64)) in w.chunks_mut(64).zip(logits.chunks(64)).enumerate() {
            if l64.iter().fold(true, |a, &l| a & (fix(l) <= cut)) {
                w64.fill(0);
            } else {
                for (w, &l) in w64.iter_mut().zip(l64) {
                    *w = weight(max - fix(l) / t);
                }
                // The first level's tokens, gathered on the way (until there
                // are too many to be worth listing).
                if heavy.len() <= super::WIDE && w64.iter().fold(0, |a, &w| a.max(w)) >= LEVELS[0] {
                    heavy.extend(w64.iter().enumerate().filter(|&(_, &w)| w >= LEVELS[0]).map(|(i, _)| (block * 64 + i) as u32));
                }
            }
        }
        let total = w.iter().map(|&w| w as u64).sum();
        let above = w.iter().map(|&w| if w >= floor { w as u64 } else { 0 }).sum();
        (total, above)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn max_avx2(logits: &[f32]) -> f32 {
        max_body(logits)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn weigh_avx2(w: &mut [u32], logits: &[f32], max: f32, t: f32, floor: u32, heavy: &mut Vec<u32>) -> (u64, u64) {
        weigh_body(w, logits, max, t, floor, heavy)
    }

    fn avx2() -> bool {
        #[cfg(target_arch = "x86_64")]
        return std::is_x86_feature_detected!("avx2");
        #[allow(unreachable_code)]
        false
    }

    /// The largest value, NaN ignored (-∞ when there is none).
    pub fn max(logits: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if avx2() {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { max_avx2(logits) };
        }
        max_body(logits)
    }

    /// Every token's weight below `max` at temperature `t` (no penalty),
    /// into `w`, and the ids of weight ≥ `LEVELS[0]` into `heavy`; returns
    /// the total and the weight at or above `floor`.
    pub fn weigh(w: &mut [u32], logits: &[f32], max: f32, t: f32, floor: u32, heavy: &mut Vec<u32>) -> (u64, u64) {
        #[cfg(target_arch = "x86_64")]
        if avx2() {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { weigh_avx2(w, logits, max, t, floor, heavy) };
        }
        weigh_body(w, logits, max, t, floor, heavy)
    }
}

impl Row {
    /// The largest scaled value: the plain maximum unless a penalised token
    /// may change it.
    fn max(logits: &[f32], seen: &[u32], p: &SamplingParams, t: f32) -> f32 {
        let plain = lanes::max(logits) / t;
        if p.repetition_penalty == 1.0 {
            return plain;
        }
        let hit = |i: usize| seen.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1);
        let penalised = seen_ids(seen).filter_map(|i| logits.get(i).map(|&l| scaled(l, true, p.repetition_penalty, t)));
        let best_seen = penalised.fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
        // If a seen token held the plain maximum, the unseen maximum needs a
        // scan without it (rare: only when the penalty applies to the top).
        let top_seen = seen_ids(seen).any(|i| logits.get(i).is_some_and(|&l| fix(l) / t == plain));
        let unseen = if top_seen {
            logits
                .iter()
                .enumerate()
                .filter(|&(i, _)| !hit(i))
                .map(|(_, &l)| fix(l) / t)
                .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a })
        } else {
            plain
        };
        if best_seen > unseen {
            best_seen
        } else {
            unseen
        }
    }

    /// The weights below `max` (finite), their histogram, total, and the
    /// weight at or above `floor`; penalised tokens weighed by their
    /// penalised value.
    fn weigh(&mut self, logits: &[f32], seen: &[u32], p: &SamplingParams, max: f32, floor: u32) {
        let t = p.temperature;
        // Every weight is written below: no need to clear them first.
        self.w.resize(logits.len(), 0);
        self.levels.clear();
        self.histogram = None;
        let mut heavy = Vec::new();
        (self.total, self.floor_mass) = lanes::weigh(&mut self.w, logits, max, t, floor, &mut heavy);
        if p.repetition_penalty != 1.0 {
            for i in seen_ids(seen).filter(|&i| i < logits.len()) {
                let (old, new) = (self.w[i], weight(max - scaled(logits[i], true, p.repetition_penalty, t)));
                self.total = self.total - old as u64 + new as u64;
                let above = |w: u32| if w >= floor { w as u64 } else { 0 };
                self.floor_mass = self.floor_mass - above(old) + above(new);
                self.w[i] = new;
            }
            // A penalty moves weights across the first level: gather it afresh.
            heavy = gather(&self.w, |w| w >= LEVELS[0]);
        }
        self.wide = heavy.len() > WIDE;
        let mass = heavy.iter().map(|&i| self.w[i as usize] as u64).sum();
        self.levels.push((heavy, mass));
    }

    /// The whole row's histogram by leading zeros, in four copies so that
    /// neighbours landing in one bucket do not wait on each other's stores.
    fn histogram(&mut self) -> ([u64; 33], [u64; 33]) {
        if self.histogram.is_none() {
            let (mut hc, mut hm) = ([[0u64; 33]; 4], [[0u64; 33]; 4]);
            for (i, &w) in self.w.iter().enumerate() {
                let b = w.leading_zeros() as usize;
                hc[i & 3][b] += 1;
                hm[i & 3][b] += w as u64;
            }
            let sum = |h: &[[u64; 33]; 4]| -> [u64; 33] { std::array::from_fn(|b| h.iter().map(|c| c[b]).sum()) };
            self.histogram = Some(Box::new((sum(&hc), sum(&hm))));
        }
        *self.histogram.as_deref().expect("built above")
    }

    /// A mass goal on a flat row: the bucket from the row's histogram, then
    /// the digits of that bucket's weights.
    fn select_wide(&mut self, goal: Goal) -> Boundary {
        let (hc, hm) = self.histogram();
        let (mut ac, mut am) = (0u64, 0u64);
        let mut b = 0;
        while b < 32 && !goal.reached(ac + hc[b], am + hm[b]) {
            ac += hc[b];
            am += hm[b];
            b += 1;
        }
        if b == 32 {
            return Boundary { tau: 0, above_count: ac, above_mass: am };
        }
        let values: Vec<u32> = self.w.iter().copied().filter(|&w| w.leading_zeros() as usize == b).collect();
        select_digits(values, goal, ac, am, 31 - b as u32)
    }

    /// Level `j`, gathered by a scan when first needed.
    fn level(&mut self, j: usize) -> &(Vec<u32>, u64) {
        while self.levels.len() <= j {
            let lo = LEVELS[self.levels.len()];
            let ids = gather(&self.w, |w| w >= lo);
            let mass = ids.iter().map(|&i| self.w[i as usize] as u64).sum();
            self.levels.push((ids, mass));
        }
        &self.levels[j]
    }

    /// The boundary of `goal` (1 ≤ goal ≤ the row's count or mass), among
    /// the first level that reaches it: every token above the boundary is
    /// in that level too.
    fn select(&mut self, goal: Goal) -> Boundary {
        if self.wide {
            return self.select_wide(goal);
        }
        for j in 0..LEVELS.len() {
            self.level(j);
            let (ids, mass) = &self.levels[j];
            if goal.reached(ids.len() as u64, *mass) {
                let values = ids.iter().map(|&i| self.w[i as usize]).collect();
                return select_in(values, goal);
            }
        }
        // A count beyond every token of some weight: the rest weigh 0.
        let (ids, mass) = self.level(LEVELS.len() - 1);
        Boundary { tau: 0, above_count: ids.len() as u64, above_mass: *mass }
    }

    /// The boundary of the first `k` tokens (k ≥ 1): one scan that keeps
    /// the weights at or above a threshold, raised to the k-th largest kept
    /// whenever the kept pile grows past 4k, so most of the row is skipped by
    /// a vector compare.
    fn select_top(&self, k: usize) -> Boundary {
        let mut threshold = 1u32;
        let mut kept: Vec<u32> = Vec::with_capacity(4 * k + 8);
        for w8 in self.w.chunks(8) {
            if w8.iter().fold(false, |a, &w| a | (w >= threshold)) {
                kept.extend(w8.iter().copied().filter(|&w| w >= threshold));
                if kept.len() >= (4 * k).max(1024) {
                    kept.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
                    threshold = kept[k - 1];
                    kept.truncate(k);
                }
            }
        }
        if kept.len() < k {
            // Fewer than k tokens weigh anything (the threshold never rose).
            return Boundary { tau: 0, above_count: kept.len() as u64, above_mass: self.total };
        }
        select_in(kept, Goal::Count(k as u64))
    }

    /// The `n`-th (from 1) lowest id of weight `tau` > 0, from the first
    /// level holding that weight (gathered by the select that found it).
    fn nth_of_weight(&mut self, tau: u32, n: usize) -> u32 {
        if self.wide {
            return self.w.iter().enumerate().filter(|&(_, &w)| w == tau).nth(n - 1).map_or(0, |(i, _)| i as u32);
        }
        let j = LEVELS.iter().position(|&lo| tau >= lo).unwrap_or(LEVELS.len() - 1);
        self.level(j);
        let w = &self.w;
        self.levels[j].0.iter().copied().filter(|&i| w[i as usize] == tau).nth(n - 1).unwrap_or(0)
    }
}

/// The ids of the weights that `keep` accepts, ascending; chunks of eight
/// with none (most of them) are skipped with a vector compare.
fn gather(w: &[u32], keep: impl Fn(u32) -> bool) -> Vec<u32> {
    let mut ids = Vec::new();
    for (c, w8) in w.chunks(8).enumerate() {
        if w8.iter().fold(false, |a, &w| a | keep(w)) {
            ids.extend(w8.iter().enumerate().filter(|&(_, &w)| keep(w)).map(|(l, _)| (c * 8 + l) as u32));
        }
    }
    ids
}

/// The boundary of `goal` among `values` (every token above it is among
/// them): first by leading zeros (a power-of-two bucket, which splits
/// exponentially spread weights well), then a radix select within the
/// bucket, eight bits at a time, then a sort of the few left.
fn select_in(mut current: Vec<u32>, goal: Goal) -> Boundary {
    let (mut ac, mut am) = (0u64, 0u64);
    // Bits from `shift` up are shared by every value left.
    let mut shift = 32;
    if current.len() > 64 {
        // Four copies, so that neighbours landing in one bucket do not wait
        // on each other's stores.
        let (mut hc, mut hm) = ([[0u64; 33]; 4], [[0u64; 33]; 4]);
        for (i, &w) in current.iter().enumerate() {
            let b = w.leading_zeros() as usize;
            hc[i & 3][b] += 1;
            hm[i & 3][b] += w as u64;
        }
        let sum = |h: &[[u64; 33]; 4], b: usize| h.iter().map(|c| c[b]).sum::<u64>();
        let mut b = 0;
        while !goal.reached(ac + sum(&hc, b), am + sum(&hm, b)) {
            ac += sum(&hc, b);
            am += sum(&hm, b);
            b += 1;
        }
        current.retain(|&w| w.leading_zeros() as usize == b);
        shift = 31u32.saturating_sub(b as u32);
    }
    select_digits(current, goal, ac, am, shift)
}

/// The boundary of `goal` among `current`, values that share their bits
/// from `shift` up and lie below every token already counted (`ac` tokens
/// of weight `am`): a radix select eight bits at a time, then a sort of the
/// few left.
fn select_digits(mut current: Vec<u32>, goal: Goal, mut ac: u64, mut am: u64, mut shift: u32) -> Boundary {
    while current.len() > 64 && shift > 0 {
        let low = shift.saturating_sub(8);
        let digit = |w: u32| ((w as u64 >> low) & ((1u64 << (shift - low)) - 1)) as usize;
        let (mut hc, mut hm) = ([0u64; 256], [0u64; 256]);
        for &w in &current {
            hc[digit(w)] += 1;
            hm[digit(w)] += w as u64;
        }
        let mut d = (1usize << (shift - low)) - 1;
        while !goal.reached(ac + hc[d], am + hm[d]) {
            ac += hc[d];
            am += hm[d];
            d -= 1;
        }
        current.retain(|&w| digit(w) == d);
        shift = low;
    }
    current.sort_unstable_by(|a, b| b.cmp(a));
    for group in current.chunk_by(|a, b| a == b) {
        let (c, m) = (group.len() as u64, group.len() as u64 * group[0] as u64);
        if goal.reached(ac + c, am + m) {
            return Boundary { tau: group[0], above_count: ac, above_mass: am };
        }
        ac += c;
        am += m;
    }
    unreachable!("the goal lies within the values given")
}

/// The weight of the kept prefix before the draw: the least of top-k's,
/// top-p's and min-p's prefixes (all three are prefixes of one order).
fn kept_mass(row: &mut Row, p: &SamplingParams, vocab: usize) -> u64 {
    let top_k = if p.top_k == 0 || p.top_k >= vocab {
        row.total
    } else {
        let b = row.select_top(p.top_k);
        b.above_mass + (p.top_k as u64 - b.above_count) * b.tau as u64
    };
    let top_p = if p.top_p < 1.0 {
        let goal = nucleus_goal(top_k, p.top_p);
        let b = row.select(Goal::Mass(goal));
        b.above_mass + (goal - b.above_mass).div_ceil(b.tau as u64) * b.tau as u64
    } else {
        top_k
    };
    let min_p = if p.min_p > 0.0 { row.floor_mass } else { row.total };
    top_k.min(top_p).min(min_p)
}

/// The weight top-p must reach: ⌈mass · p⌉, in f64 (exact for any mass
/// below 2^53; the product is rounded once, as on the GPU).
pub fn nucleus_goal(mass: u64, top_p: f32) -> u64 {
    (mass as f64 * top_p as f64).ceil() as u64
}

/// The least weight min-p keeps: ⌈min_p · 2^30⌉ (the most likely token
/// weighs 2^30); 0 keeps everything.
pub fn min_p_floor(min_p: f32) -> u32 {
    if min_p > 0.0 {
        (min_p as f64 * WEIGHT_ONE as f64).ceil() as u32
    } else {
        0
    }
}

/// Where a draw of 64 random bits lands in a prefix of weight `kept`:
/// ⌊kept · bits / 2^64⌋, in [0, kept).
pub fn draw_target(kept: u64, bits: u64) -> u64 {
    ((kept as u128 * bits as u128) >> 64) as u64
}

thread_local! {
    static ROW: std::cell::RefCell<Row> = std::cell::RefCell::new(Row::default());
}

/// The next token of request `request` at `step` (its position among the
/// request's draws), with `seen` the bitmap of the ids the repetition
/// penalty applies to ([`seen_bitmap`]).
///
/// Greedy (temperature 0) takes the first maximum of the penalised logits.
/// Otherwise every token gets an integer [`weight`] from its scaled logit
/// and the tokens are ordered by descending weight, ties to the lower id;
/// top-k, top-p (the shortest prefix reaching ⌈p · top-k's weight⌉) and
/// min-p each keep a prefix of that order, and the draw picks the token
/// where ⌊kept · bits / 2^64⌋ falls in the shortest one. Nothing is sorted
/// but the few weights at a boundary, and every sum is an exact integer, so
/// the device sampler picks the same token.
pub fn sample(logits: &[f32], seen: &[u32], p: &SamplingParams, request: u64, step: u64) -> u32 {
    let t = if p.temperature > 0.0 { p.temperature } else { 1.0 };
    let max = Row::max(logits, seen, p, t);
    if p.temperature == 0.0 || !max.is_finite() {
        // Greedy, or nothing finite to weigh: the first maximum.
        let hit = |i: usize| p.repetition_penalty != 1.0 && seen.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1);
        return logits.iter().enumerate().position(|(i, &l)| scaled(l, hit(i), p.repetition_penalty, t) == max).unwrap_or(0) as u32;
    }
    ROW.with_borrow_mut(|row| {
        row.weigh(logits, seen, p, max, min_p_floor(p.min_p));
        let kept = kept_mass(row, p, logits.len());
        let g = draw_target(kept, draw_bits(p.seed, request, step)) + 1;
        let b = row.select(Goal::Mass(g));
        let nth = (g - b.above_mass).div_ceil(b.tau as u64) as usize;
        row.nth_of_weight(b.tau, nth)
    })
}

/// A sequence's additive logit adjustments: its `logit_bias` and its
/// presence and frequency penalties, as one dense row that the sampler adds
/// to the raw logits before the repetition penalty, temperature and every
/// filter (vLLM applies the bias there too; it subtracts the presence and
/// frequency penalties after the repetition penalty, which only differs
/// when both kinds are on). Each entry is recomputed from its count, never
/// accumulated, so `bias − (frequency × count + presence)` in f32 is the
/// exact value a reference computes.
#[derive(Debug, Clone, PartialEq)]
pub struct BiasRow {
    presence: f32,
    frequency: f32,
    base: std::collections::HashMap<u32, f32>,
    counts: std::collections::HashMap<u32, u32>,
    row: Vec<f32>,
}

impl BiasRow {
    /// The row of a sequence with these parameters and `logit_bias` (ids
    /// inside `vocab`; the caller checked them), or `None` when it adjusts
    /// nothing.
    pub fn new(p: &SamplingParams, logit_bias: &[(u32, f32)], vocab: usize) -> Option<BiasRow> {
        if !p.adjusts() && logit_bias.is_empty() {
            return None;
        }
        let mut row = vec![0f32; vocab];
        let base: std::collections::HashMap<u32, f32> = logit_bias.iter().copied().filter(|&(i, _)| (i as usize) < vocab).collect();
        for (&i, &b) in &base {
            row[i as usize] = b;
        }
        let counts = std::collections::HashMap::new();
        Some(BiasRow { presence: p.presence_penalty, frequency: p.frequency_penalty, base, counts, row })
    }

    /// The sequence generated `id`.
    pub fn generated(&mut self, id: u32) {
        if (id as usize) >= self.row.len() || (self.presence == 0.0 && self.frequency == 0.0) {
            return;
        }
        let c = self.counts.entry(id).or_insert(0);
        *c += 1;
        self.row[id as usize] = adjusted_bias(self.base.get(&id).copied().unwrap_or(0.0), self.presence, self.frequency, *c);
    }

    /// What the sampler adds to each logit.
    pub fn row(&self) -> &[f32] {
        &self.row
    }
}

/// A token's adjustment: its bias less `frequency × count + presence` once
/// it has been generated (`count` > 0).
pub fn adjusted_bias(bias: f32, presence: f32, frequency: f32, count: u32) -> f32 {
    if count == 0 {
        bias
    } else {
        bias - (frequency * count as f32 + presence)
    }
}

/// One row of the sampling kernel's work, as the host target runs it:
/// counts the row's non-finite logits into its table row and returns the
/// sampled id (0 for a row that gives no token). `allowed` is the row's
/// allowed-token bitmap, when it has one ([`row::TOKEN_MASK`]), and `bias`
/// its bias row ([`row::BIAS_ROW`]). The non-finite count is of the raw
/// logits.
pub fn sample_row(logits: &[f32], seen: &[u32], allowed: Option<&[u32]>, bias: Option<&[f32]>, words: &mut [i64; ROW_WORDS]) -> u32 {
    words[row::NON_FINITE] = logits.iter().filter(|v| !v.is_finite()).count() as i64;
    let (p, request, step, give) = row_params(words);
    if !give {
        return 0;
    }
    if allowed.is_none() && bias.is_none() {
        return sample(logits, seen, &p, request, step);
    }
    // A token left out weighs nothing: as if its logit were -∞; a bias is
    // added to the raw logit (only rows with either pay for the copy).
    let adjusted: Vec<f32> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let l = bias.map_or(l, |b| l + b.get(i).copied().unwrap_or(0.0));
            match allowed {
                Some(mask) if mask.get(i / 32).is_none_or(|w| w >> (i % 32) & 1 == 0) => f32::NEG_INFINITY,
                _ => l,
            }
        })
        .collect();
    sample(&adjusted, seen, &p, request, step)
}

/// Replays a sequence's draws from its logits: token 0 from the prompt's
/// last row of logits, token j from decode row j − 1 (`rows`: the logits
/// rows in that order, `vocab` wide), each with the sequence so far as the
/// repetition penalty's context. Returns the positions where `generated`
/// differs from what this host sampler picks: how a device sampler is
/// checked against it on the device's own logits.
pub fn replay_mismatches(prompt: &[u32], rows: &[f32], vocab: usize, generated: &[u32], p: &SamplingParams) -> Vec<usize> {
    let mut context: Vec<u32> = prompt.to_vec();
    let mut bad = Vec::new();
    for (j, (row, &got)) in rows.chunks_exact(vocab.max(1)).zip(generated).enumerate() {
        let seen = seen_bitmap(context.iter().copied(), vocab);
        if sample(row, &seen, p, 0, j as u64) != got {
            bad.push(j);
        }
        context.push(got);
    }
    bad
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
        assert_eq!(sample(&[0.0, 2.0, 1.0], &[0], &SamplingParams::GREEDY, 0, 0), 1);
        // A repetition penalty can move the greedy choice.
        let p = SamplingParams { repetition_penalty: 4.0, ..SamplingParams::GREEDY };
        assert_eq!(sample(&[0.0, 2.0, 1.0], &seen_bitmap([1], 3), &p, 0, 0), 2);
        // Nothing finite: the first position.
        let t = SamplingParams { temperature: 1.0, ..SamplingParams::GREEDY };
        assert_eq!(sample(&[f32::NAN, f32::NAN], &[0], &t, 0, 0), 0);
    }

    #[test]
    fn draws_depend_only_on_seed_request_and_step() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32 / 300.0).collect();
        let p = SamplingParams { temperature: 0.8, top_k: 50, top_p: 0.9, seed: 7, ..SamplingParams::GREEDY };
        let none = seen_bitmap([], 1000);
        let a: Vec<u32> = (0..20).map(|s| sample(&logits, &none, &p, 3, s)).collect();
        let b: Vec<u32> = (0..20).map(|s| sample(&logits, &none, &p, 3, s)).collect();
        assert_eq!(a, b);
        let c: Vec<u32> = (0..20).map(|s| sample(&logits, &none, &p, 4, s)).collect();
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
        // 64 logits spread over a few units, 40 000 draws at T = 0.7 with
        // top-k 24 and top-p 0.9 (about 4 s unoptimised: the unit tests
        // run in the test command's single-threaded phase). Philox makes
        // the draws fixed, so this cannot flake; a wrong filter or a biased
        // draw fails it.
        let logits: Vec<f32> = (0..64u32).map(|i| ((i * 37) % 64) as f32 / 12.0).collect();
        let p = SamplingParams { temperature: 0.7, top_k: 24, top_p: 0.9, seed: 2026, ..SamplingParams::GREEDY };
        let want = expected(&logits, 0.7, 24, 0.9);
        let n = 40_000u64;
        let mut counts = vec![0u64; logits.len()];
        let none = seen_bitmap([], logits.len());
        for step in 0..n {
            counts[sample(&logits, &none, &p, 11, step) as usize] += 1;
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
        assert_eq!(weight(0.0), 1 << 30, "the most likely token weighs exactly 2^30");
        assert_eq!(weight(f32::INFINITY), 0);
    }

    /// The sampler's definition, the slow way: every token weighed, the
    /// whole vocabulary sorted, prefix sums walked.
    fn reference(logits: &[f32], seen: &[u32], p: &SamplingParams, request: u64, step: u64) -> u32 {
        let t = if p.temperature > 0.0 { p.temperature } else { 1.0 };
        let hit = |i: usize| p.repetition_penalty != 1.0 && seen[i / 32] >> (i % 32) & 1 == 1;
        let x: Vec<f32> = logits.iter().enumerate().map(|(i, &l)| scaled(l, hit(i), p.repetition_penalty, t)).collect();
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if p.temperature == 0.0 || !max.is_finite() {
            return x.iter().position(|&v| v == max).unwrap_or(0) as u32;
        }
        let w: Vec<u64> = x.iter().map(|&v| weight(max - v) as u64).collect();
        let mut order: Vec<usize> = (0..w.len()).collect();
        order.sort_by(|&a, &b| w[b].cmp(&w[a]).then(a.cmp(&b)));
        let cum: Vec<u64> = order
            .iter()
            .scan(0u64, |s, &i| {
                *s += w[i];
                Some(*s)
            })
            .collect();
        let total = *cum.last().unwrap();
        let first_reaching = |g: u64| cum.iter().position(|&c| c >= g).unwrap();
        let k = if p.top_k == 0 { w.len() } else { p.top_k.min(w.len()) };
        let m_k = cum[k - 1];
        let m_p = if p.top_p < 1.0 { cum[first_reaching(nucleus_goal(m_k, p.top_p))] } else { m_k };
        let floor = min_p_floor(p.min_p) as u64;
        let m_min = w.iter().filter(|&&v| v >= floor).sum::<u64>();
        let kept = m_k.min(m_p).min(if p.min_p > 0.0 { m_min } else { total });
        order[first_reaching(draw_target(kept, draw_bits(p.seed, request, step)) + 1)] as u32
    }

    #[test]
    fn the_fast_sampler_is_its_definition() {
        // Random rows (with ties, NaN, -∞ and penalties) and parameters: the
        // histogram-and-radix path must pick the very token the sorted
        // reference picks, every time.
        let mut n = 0u64;
        let mut rnd = || {
            n += 1;
            draw_bits(99, n, 0)
        };
        for case in 0..400 {
            let vocab = 1 + (rnd() % 3000) as usize;
            let levels = 1 + rnd() % 200;
            let spread = (rnd() % 40) as f32 + 0.5;
            let logits: Vec<f32> = (0..vocab)
                .map(|_| match rnd() % 50 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    _ => (rnd() % levels) as f32 * spread / levels as f32,
                })
                .collect();
            let seen = seen_bitmap((0..rnd() % 20).map(|_| (rnd() % vocab as u64) as u32), vocab);
            let p = SamplingParams {
                temperature: [0.0, 0.3, 0.7, 1.0, 2.5][(rnd() % 5) as usize],
                top_k: [0, 1, 2, 5, 50, 5000][(rnd() % 6) as usize],
                top_p: [1.0, 0.95, 0.5, 0.1, 1e-6][(rnd() % 5) as usize],
                min_p: [0.0, 0.05, 0.5, 1.0][(rnd() % 4) as usize],
                repetition_penalty: [1.0, 1.3, 0.8][(rnd() % 3) as usize],
                seed: rnd(),
                ..SamplingParams::GREEDY
            };
            for step in 0..5 {
                assert_eq!(
                    sample(&logits, &seen, &p, case, step),
                    reference(&logits, &seen, &p, case, step),
                    "case {case} step {step}: {p:?}"
                );
            }
        }
    }

    #[test]
    fn a_flat_row_takes_the_histogram_path_and_is_still_its_definition() {
        // 40 000 tokens within a few units of each other: far more heavy
        // tokens than WIDE, so goals come from the whole row's histogram.
        let vocab = 40_000;
        let logits: Vec<f32> = (0..vocab as u64).map(|i| (draw_bits(5, i, 0) % 3001) as f32 / 1000.0).collect();
        let seen = seen_bitmap((0..300u32).map(|i| i * 131), vocab);
        for (case, p) in [
            SamplingParams { temperature: 1.0, top_p: 0.95, seed: 1, ..SamplingParams::GREEDY },
            SamplingParams { temperature: 0.7, top_p: 0.5, min_p: 0.1, repetition_penalty: 1.3, seed: 2, ..SamplingParams::GREEDY },
            SamplingParams { temperature: 2.0, top_k: 20_000, seed: 3, ..SamplingParams::GREEDY },
        ]
        .iter()
        .enumerate()
        {
            for step in 0..4 {
                assert_eq!(sample(&logits, &seen, p, 0, step), reference(&logits, &seen, p, 0, step), "case {case} step {step}");
            }
        }
        ROW.with_borrow(|r| assert!(r.wide, "the test should exercise the flat path"));
    }

    #[test]
    fn top_k_breaks_ties_towards_the_lower_id() {
        let p = SamplingParams { temperature: 1.0, top_k: 1, seed: 0, ..SamplingParams::GREEDY };
        let none = seen_bitmap([], 6);
        for step in 0..50 {
            assert_eq!(sample(&[1.0, 2.0, 3.0, 0.5, 3.0, 3.0], &none, &p, 0, step), 2);
            assert_eq!(sample(&[f32::NAN, 1.0, 1.0], &none, &p, 0, step), 1);
        }
    }

    #[test]
    fn the_repetition_penalty_counts_each_id_once() {
        let p = SamplingParams { repetition_penalty: 2.0, ..SamplingParams::GREEDY };
        // 3.0 / 2 = 1.5 beats 1.2; halving twice (0.75) would not.
        assert_eq!(sample(&[1.2, 3.0], &seen_bitmap([1, 1, 1], 2), &p, 0, 0), 1);
    }

    #[test]
    fn replaying_draws_finds_exactly_the_changed_token() {
        let vocab = 300;
        let rows: Vec<f32> = (0..vocab * 6).map(|i| ((i * 7919) % 997) as f32 / 150.0).collect();
        let p = SamplingParams { temperature: 0.9, top_k: 50, top_p: 0.95, repetition_penalty: 1.2, seed: 4, ..SamplingParams::GREEDY };
        let prompt = [1u32, 2, 3];
        let mut gen = Vec::new();
        let mut ctx = prompt.to_vec();
        for (j, row) in rows.chunks_exact(vocab).enumerate() {
            let id = sample(row, &seen_bitmap(ctx.iter().copied(), vocab), &p, 0, j as u64);
            gen.push(id);
            ctx.push(id);
        }
        assert!(replay_mismatches(&prompt, &rows, vocab, &gen, &p).is_empty());
        gen[3] = (gen[3] + 1) % vocab as u32;
        assert_eq!(replay_mismatches(&prompt, &rows, vocab, &gen, &p)[0], 3);
    }

    #[test]
    fn table_rows_round_trip_and_count_non_finite_logits() {
        let p = SamplingParams {
            temperature: 0.6,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.01,
            repetition_penalty: 1.1,
            seed: u64::MAX - 3,
            ..SamplingParams::GREEDY
        };
        let mut w = row_words(&p, 5, 1 << 40, true, 3);
        assert_eq!(row_params(&w), (p, 5, 1 << 40, true));
        assert_eq!(seen_row(&w), 3);
        let logits = [0.5, f32::NAN, 2.0, f32::INFINITY, -1.0];
        let id = sample_row(&logits, &seen_bitmap([], 5), None, None, &mut w);
        assert_eq!(w[row::NON_FINITE], 2);
        assert!(id < 5);
        let mut off = row_words(&p, 5, 0, false, 0);
        assert_eq!(sample_row(&logits, &seen_bitmap([], 5), None, None, &mut off), 0);
        assert_eq!(off[row::NON_FINITE], 2);
        // An allowed-token bitmap: only its tokens are drawn, the non-finite
        // count is still the raw row's, and greedy takes the best allowed.
        assert_eq!(mask_row(&w), None);
        w[row::TOKEN_MASK] = 1;
        assert_eq!(mask_row(&w), Some(0));
        let only = seen_bitmap([0, 4], 5);
        for seed in 0..20 {
            let mut r = row_words(&SamplingParams { seed, ..p }, 5, 0, true, 0);
            assert!([0, 4].contains(&sample_row(&logits, &[], Some(&only), None, &mut r)));
            assert_eq!(r[row::NON_FINITE], 2);
        }
        let mut g = row_words(&SamplingParams::GREEDY, 0, 0, true, 0);
        assert_eq!(sample_row(&logits, &[], Some(&only), None, &mut g), 0, "0.5 beats -1.0");
    }

    #[test]
    fn bias_rows_follow_openai_penalties_and_logit_bias() {
        let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..SamplingParams::GREEDY };
        assert!(p.adjusts() && !p.is_plain_greedy());
        assert_eq!(BiasRow::new(&SamplingParams::GREEDY, &[], 8), None, "nothing to adjust");
        let mut b = BiasRow::new(&p, &[(2, 3.0), (9, 1.0)], 8).unwrap();
        assert_eq!(b.row(), &[0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0], "ids past the vocabulary are dropped");
        for id in [2, 2, 5, 2, 8] {
            b.generated(id);
        }
        // Token 2: 3 − (0.25·3 + 0.5); token 5: −(0.25 + 0.5); id 8 is outside.
        assert_eq!(b.row()[2], 3.0 - (0.25 * 3.0 + 0.5));
        assert_eq!(b.row()[5], -0.75);
        assert_eq!(b.row().iter().filter(|&&v| v != 0.0).count(), 2);
        assert_eq!(adjusted_bias(1.5, 0.5, 0.25, 0), 1.5, "an ungenerated token keeps its bias");
        // Only a bias: the penalties never touch the row.
        let mut only = BiasRow::new(&SamplingParams::GREEDY, &[(1, -100.0)], 4).unwrap();
        only.generated(1);
        assert_eq!(only.row(), &[0.0, -100.0, 0.0, 0.0]);
        // The sampler adds the row to the raw logits first: greedy moves,
        // and the non-finite count is still the raw row's.
        let logits = [1.0, 2.0, f32::NAN, 1.5];
        let mut w = row_words(&SamplingParams::GREEDY, 0, 0, true, 0);
        assert_eq!(sample_row(&logits, &[], None, None, &mut w), 1);
        assert_eq!(sample_row(&logits, &[], None, Some(only.row()), &mut w), 3);
        assert_eq!(w[row::NON_FINITE], 1);
        assert_eq!(bias_row(&w), None);
        w[row::BIAS_ROW] = 2;
        assert_eq!(bias_row(&w), Some(1));
        // The penalties round-trip through the table row.
        let (back, ..) = row_params(&row_words(&p, 0, 0, true, 0));
        assert_eq!(back, p);
        assert!(SamplingParams { presence_penalty: 2.5, ..p }.check().unwrap_err().starts_with("presence_penalty"));
        assert!(SamplingParams { frequency_penalty: -2.0, ..p }.check().is_ok());
    }
}
