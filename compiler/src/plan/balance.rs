//! The balanced split: an exact dynamic program over contiguous ranges of
//! pipeline items that minimises the slowest stage's step time while every
//! stage fits its memory.

/// One unit the splitter may not cut: the embedding, a layer, or the head
/// (final norm + lm_head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Item {
    pub time: f64,
    pub memory: f64,
}

/// A split into stages: `bounds[k]..bounds[k+1]` are the items of stage k.
#[derive(Debug, Clone, PartialEq)]
pub struct Split {
    pub bounds: Vec<usize>,
    /// The slowest stage's time.
    pub bottleneck: f64,
}

fn stage_cost(prefix_t: &[f64], prefix_m: &[f64], a: usize, b: usize, cap: f64) -> Option<f64> {
    let m = prefix_m[b] - prefix_m[a];
    (m <= cap * (1.0 + 1e-12)).then(|| prefix_t[b] - prefix_t[a])
}

/// The split of `items` into `stages` non-empty contiguous groups whose
/// largest summed time is smallest, with every group's memory ≤ `cap`.
/// `None` when no split fits. Ties go to the split whose earlier stages end
/// earliest, so the result is deterministic.
pub fn balance(items: &[Item], stages: usize, cap: f64) -> Option<Split> {
    let n = items.len();
    if stages == 0 || stages > n {
        return None;
    }
    let mut pt = vec![0.0; n + 1];
    let mut pm = vec![0.0; n + 1];
    for (i, it) in items.iter().enumerate() {
        pt[i + 1] = pt[i] + it.time;
        pm[i + 1] = pm[i] + it.memory;
    }
    // best[k][i]: the smallest bottleneck of the first i items in k stages.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages + 1];
    let mut from = vec![vec![usize::MAX; n + 1]; stages + 1];
    best[0][0] = 0.0;
    for k in 1..=stages {
        for i in k..=n {
            for j in (k - 1)..i {
                if !best[k - 1][j].is_finite() {
                    continue;
                }
                let Some(c) = stage_cost(&pt, &pm, j, i, cap) else { continue };
                let v = best[k - 1][j].max(c);
                if v < best[k][i] {
                    best[k][i] = v;
                    from[k][i] = j;
                }
            }
        }
    }
    if !best[stages][n].is_finite() {
        return None;
    }
    let mut bounds = vec![n];
    let mut i = n;
    for k in (1..=stages).rev() {
        i = from[k][i];
        bounds.push(i);
    }
    bounds.reverse();
    Some(Split { bounds, bottleneck: best[stages][n] })
}

/// The fewest stages whose memory fits `cap` (greedy fill is optimal for that).
pub fn min_stages(items: &[Item], cap: f64) -> Option<usize> {
    let mut stages = 1;
    let mut used = 0.0;
    for it in items {
        if it.memory > cap {
            return None;
        }
        if used + it.memory > cap {
            stages += 1;
            used = 0.0;
        }
        used += it.memory;
    }
    Some(stages)
}

/// Every split by enumeration: the reference the tests hold the DP to.
pub fn brute_force(items: &[Item], stages: usize, cap: f64) -> Option<f64> {
    fn rec(items: &[Item], start: usize, left: usize, cap: f64, worst: f64, best: &mut Option<f64>) {
        let n = items.len();
        if left == 0 {
            if start == n {
                *best = Some(best.map_or(worst, |b: f64| b.min(worst)));
            }
            return;
        }
        for end in start + 1..=n - (left - 1) {
            let g = &items[start..end];
            let m: f64 = g.iter().map(|i| i.memory).sum();
            if m > cap * (1.0 + 1e-12) {
                continue;
            }
            let t: f64 = g.iter().map(|i| i.time).sum();
            rec(items, end, left - 1, cap, worst.max(t), best);
        }
    }
    if stages == 0 || stages > items.len() {
        return None;
    }
    let mut best = None;
    rec(items, 0, stages, cap, 0.0, &mut best);
    best
}
