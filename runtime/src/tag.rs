//! Every MPI tag between ranks, in one table: no two may be alike
//! (checked when the crate compiles).

/// Down the pipeline, stage to stage: a step's header and activations,
/// and the first stage's other messages (`KIND_*`: add, drop, reset,
/// stats, trace, stop).
pub const ACT: i32 = 7;
/// The last stage's ids (and stats) back to the first.
pub const IDS: i32 = 8;
/// Heartbeats, every rank to every rank (`liveness`).
pub const BEAT: i32 = 9;
/// Encode jobs from the first stage to the stage that holds the vision
/// tower (a plan's `vision: true` on another stage) or an encoder rank:
/// one segment, the sequence; payload: an images file
/// (`m3c_contract::images`) of its grids to encode, as sequence 0.
pub const ENCODE: i32 = 11;
/// The features back: one segment, the sequence; payload: `[tokens,
/// hidden]` as f32 words (the activation storage).
pub const FEATURES: i32 = 12;
/// Clock alignment for timelines, and each rank's timeline events
/// gathered at the end of a window (`trace_exchange`).
pub const CLOCK: i32 = 20;
pub const TRACE: i32 = 21;

const ALL: [i32; 7] = [ACT, IDS, BEAT, ENCODE, FEATURES, CLOCK, TRACE];
// Evaluated whenever the crate compiles (an unnamed constant always is).
const _: () = {
    let mut i = 0;
    while i < ALL.len() {
        let mut j = i + 1;
        while j < ALL.len() {
            assert!(ALL[i] != ALL[j], "two MPI tags are alike");
            j += 1;
        }
        i += 1;
    }
};
