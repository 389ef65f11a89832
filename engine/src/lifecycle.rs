//! Each request's one lifecycle, as the engine keeps it:
//!
//! ```text
//! encoding ─► waiting ─► prefilling ─► decoding ─► finished(reason)
//!                ▲            │             │
//!                └──── preempted ◄──────────┘
//! ```
//!
//! A request whose images or video still encode waits in `encoding`; one
//! that holds no cache blocks waits (new, or `preempted`, first in line);
//! once it has the blocks of its first step it runs, prefilling its prompt
//! (or recomputing what it had) in chunks, then decoding a token (or a
//! verified draft) per step, until it finishes. A preempted request keeps
//! what it generated; it resumes by recomputing its rows, mostly from the
//! prefix cache. The state is plain data that serialises ([`SeqState`]), so
//! a request can be handed on and re-admitted elsewhere.

use m3c_contract::protocol::EndReason;
use serde::{Deserialize, Serialize};

/// Where a request is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Its images' features are being made; it joins when they are.
    Encoding,
    /// Waiting for the cache blocks of its first step.
    Waiting,
    /// Running: its steps up to the next draw are prompt chunks (or a
    /// resumed request's rows being recomputed).
    Prefilling,
    /// Running: each step draws.
    Decoding,
    /// It gave its blocks back so older requests could go on, and waits
    /// to resume.
    Preempted,
    Finished(EndReason),
}

impl Phase {
    pub fn running(self) -> bool {
        matches!(self, Phase::Prefilling | Phase::Decoding)
    }

    pub fn finished(self) -> bool {
        matches!(self, Phase::Finished(_))
    }
}

/// A request's state as the engine knows it: enough to report it, and to
/// admit it again from its prompt and what it generated so far.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeqState {
    pub seq: usize,
    pub phase: Phase,
    pub prompt: Vec<i64>,
    /// The tokens it generated so far, in order.
    pub generated: Vec<i64>,
    pub max_new: usize,
    /// Times it was preempted.
    pub preemptions: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_round_trips_through_json() {
        let s = SeqState {
            seq: 3,
            phase: Phase::Finished(EndReason::Length),
            prompt: vec![1, 2],
            generated: vec![7],
            max_new: 1,
            preemptions: 2,
        };
        let text = serde_json::to_string(&s).unwrap();
        assert!(text.contains("\"finished\":\"length\""), "{text}");
        assert_eq!(serde_json::from_str::<SeqState>(&text).unwrap(), s);
        assert!(Phase::Decoding.running() && !Phase::Waiting.running() && Phase::Finished(EndReason::Stop).finished());
    }
}
