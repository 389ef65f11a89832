//! The first stage's micro-batches in flight, and what each cost the
//! pipeline when its ids come back: the engine's cost model weighs a
//! verify step against a plain one by these seconds.
//!
//! A micro-batch that had the pipeline to itself (none other was in flight
//! at any time, as with one sequence at pp 2) costs its round trip: every
//! stage and hop lies on the path to the next token, so a verify row's
//! extra seconds are weighed against the whole trip it may save. One that
//! shared the pipeline costs its time on the slower of the two stages that
//! measure it (the first, and the last, which sends its busy time with the
//! ids): there, stages overlap micro-batches, and a round trip would count
//! its waits behind the others.

use m3c_engine::StepPlan;
use std::collections::VecDeque;
use std::time::Instant;

#[derive(Default)]
pub(crate) struct InFlight {
    /// They come back in order.
    queue: VecDeque<Launched>,
}

struct Launched {
    plan: StepPlan,
    /// Its seconds on the first stage.
    first: f64,
    at: Instant,
    /// No other micro-batch has been in flight beside it.
    alone: bool,
}

impl InFlight {
    /// `plan` left the first stage, whose step began at `at` and has just ended.
    pub fn launch(&mut self, plan: StepPlan, at: Instant) {
        self.queue.iter_mut().for_each(|l| l.alone = false);
        let alone = self.queue.is_empty();
        self.queue.push_back(Launched { plan, first: at.elapsed().as_secs_f64(), at, alone });
    }

    /// The oldest micro-batch's ids came back, with the last stage's busy
    /// microseconds for it: the plan and the seconds it cost.
    pub fn returned(&mut self, last_micros: i64) -> Option<(StepPlan, f64)> {
        let l = self.queue.pop_front()?;
        let busy = l.first.max(last_micros.max(0) as f64 / 1e6);
        Some((l.plan, if l.alone { l.at.elapsed().as_secs_f64().max(busy) } else { busy }))
    }
}
