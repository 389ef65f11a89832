//! What a step costs, learned while serving: the seconds a micro-batch
//! step took at each row count (the median of its last measurements, so
//! one step slowed by the machine does not sway a choice), read back as
//! an estimate at any count: measured, else interpolated between the
//! nearest measured counts, else extrapolated from the two largest. Cost
//! never falls as rows are added (measurements are noisy; an estimate is
//! at least every measurement at fewer rows).

use std::collections::{BTreeMap, VecDeque};

/// Measurements kept per row count.
const WINDOW: usize = 15;

#[derive(Debug, Clone, Default)]
pub struct StepCost {
    /// The last seconds per step, by the step's rows, and their median
    /// (kept as they come: estimates are read every plan).
    by_rows: BTreeMap<usize, (VecDeque<f64>, f64)>,
}

impl StepCost {
    /// A step of `rows` rows took `seconds`.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        if !(seconds.is_finite() && seconds >= 0.0) || rows == 0 {
            return;
        }
        let (w, m) = self.by_rows.entry(rows).or_default();
        if w.len() == WINDOW {
            w.pop_front();
        }
        w.push_back(seconds);
        *m = median(w);
    }

    /// Whether a step of exactly `rows` was measured.
    pub fn measured(&self, rows: usize) -> bool {
        self.by_rows.contains_key(&rows)
    }

    /// Whether a step of more rows than `rows` was measured (so the cost of
    /// adding rows can be told).
    pub fn measured_above(&self, rows: usize) -> bool {
        self.by_rows.range(rows + 1..).next().is_some()
    }

    /// Measurements held of steps of exactly `rows` rows.
    pub fn samples(&self, rows: usize) -> usize {
        self.by_rows.get(&rows).map_or(0, |(w, _)| w.len())
    }

    /// Measurements held of steps of more rows than `rows`.
    pub fn samples_above(&self, rows: usize) -> usize {
        self.by_rows.range(rows + 1..).map(|(_, (w, _))| w.len()).sum()
    }

    /// How many row counts were measured.
    pub fn counts(&self) -> usize {
        self.by_rows.len()
    }

    /// The median seconds at the largest row count measured below `rows`.
    pub fn largest_below(&self, rows: usize) -> Option<(usize, f64)> {
        self.by_rows.range(..rows).next_back().map(|(&r, (_, m))| (r, *m))
    }

    /// The seconds a step of `rows` rows is expected to take (`None`
    /// before any measurement).
    pub fn estimate(&self, rows: usize) -> Option<f64> {
        let at = |(&r, (_, m)): (&usize, &(VecDeque<f64>, f64))| (r, *m);
        let below = self.by_rows.range(..=rows).next_back().map(at);
        let above = self.by_rows.range(rows + 1..).next().map(at);
        let floor = self.by_rows.range(..=rows).map(|(_, (_, m))| *m).fold(0.0, f64::max);
        let line = |(r0, s0): (usize, f64), (r1, s1): (usize, f64)| {
            let slope = ((s1 - s0) / (r1 as f64 - r0 as f64)).max(0.0);
            s0 + slope * (rows as f64 - r0 as f64)
        };
        let est = match (below, above) {
            (Some((r, s)), _) if r == rows => s,
            (Some(lo), Some(hi)) => line(lo, hi),
            (None, Some((_, s))) => s,
            (Some(hi), None) => match self.by_rows.range(..hi.0).next_back().map(at) {
                Some(lo) => line(lo, hi),
                None => hi.1,
            },
            (None, None) => return None,
        };
        Some(est.max(floor))
    }
}

fn median(w: &VecDeque<f64>) -> f64 {
    let mut v: Vec<f64> = w.iter().copied().collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_interpolate_extrapolate_and_never_fall_with_rows() {
        let mut c = StepCost::default();
        assert_eq!(c.estimate(4), None);
        c.observe(1, 1.0);
        assert_eq!(c.estimate(1), Some(1.0));
        assert_eq!(c.estimate(5), Some(1.0), "one point: flat");
        assert!(!c.measured_above(1));
        c.observe(5, 3.0);
        assert!(c.measured_above(1) && c.measured(5) && !c.measured(3));
        assert_eq!(c.estimate(3), Some(2.0));
        assert_eq!(c.estimate(9), Some(5.0), "the slope of the two largest");
        // A noisy point below a cheaper one does not make rows free.
        c.observe(7, 2.5);
        assert_eq!(c.estimate(7), Some(3.0));
        assert!(c.estimate(8).unwrap() >= 3.0);
        c.observe(1, f64::NAN);
        assert_eq!(c.estimate(1), Some(1.0), "a bad measurement is ignored");
    }

    #[test]
    fn one_slow_step_does_not_sway_the_estimate_but_a_lasting_change_does() {
        let mut c = StepCost::default();
        for _ in 0..5 {
            c.observe(1, 1.0);
        }
        c.observe(1, 50.0);
        assert_eq!(c.estimate(1), Some(1.0), "an outlier");
        for _ in 0..WINDOW {
            c.observe(1, 2.0);
        }
        assert_eq!(c.estimate(1), Some(2.0), "the machine got slower");
    }
}
