//! Where the first stage's work comes from and where its events go: the
//! serve front's commands on standard input, or a run's prompts.

use crate::error::StageError;
use m3c_contract::protocol::{Command, Event, SeqRequest};
use std::time::Duration;

/// What the feed has next.
// One per line read: boxing the command would buy nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Next {
    Command(Command),
    /// A line that is not a command (serve: refused with `m3c-bad`).
    Bad(String),
    /// Nothing yet.
    Empty,
    /// Nothing ever again: the scheduler finishes what is live and stops.
    Closed,
}

/// Where the scheduler's work comes from and where its events go.
pub(crate) trait Feed {
    /// The next command, waiting up to `wait` for one.
    fn next(&mut self, wait: Duration) -> Next;
    /// A sequence's images, encoded before its first step (`None`: it has none).
    fn images(&mut self, a: &SeqRequest) -> Result<Option<m3c_contract::images::SeqImages>, String>;
    /// Something happened (a token, an end, readiness, stage stats).
    fn event(&mut self, e: Event);
    /// A command cannot be carried out. Serving, the front is told and the
    /// others go on; a run fails.
    fn refuse(&mut self, seq: Option<usize>, why: String) -> Result<(), StageError>;
    /// Whether the stages' step counts are wanted (serve's metrics).
    fn wants_stats(&self) -> bool;
}

/// The stages' step counts (three words per stage) as events.
pub(crate) fn stat_events(feed: &mut impl Feed, w: &[i64]) {
    for s in w.chunks_exact(3) {
        feed.event(Event::Stat { stage: s[0] as usize, steps: s[1] as u64, busy_s: s[2] as f64 / 1e6 });
    }
}
