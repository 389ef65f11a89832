//! The stages' side of `m3c serve`: continuous batching. The pipeline stays
//! up; requests arrive on the first stage's standard input (mpirun forwards
//! it to rank 0, on whichever host that runs), join micro-batches between
//! steps and leave when they finish or are cancelled.
//!
//! Commands arrive one per line and events leave one per line, in the
//! contract's line protocol (`m3c_contract::protocol`: `add`, `cancel`;
//! `m3c-ready`, `m3c-id`, `m3c-end`, `m3c-stat`, `m3c-bad`). A request's
//! images arrive after its `add` line on the same input, and are encoded
//! before its first step; a malformed or
//! refused command gets `m3c-bad` and changes nothing. When its input
//! closes, the first stage lets every open sequence finish, then stops the
//! pipeline.
//!
//! The scheduling is `schedule::Leader`'s, the same as `m3c run`'s; this
//! module is only its feed: commands from standard input, events to
//! standard output.

use crate::args::RunArgs;
use crate::batching::Batching;
use crate::feed::{Feed, Next};
use m3c_contract::images::SeqImages;
use m3c_contract::protocol::{Command, Event, SeqRequest};
use std::sync::mpsc;
use std::time::Duration;

/// Default prefill chunk when serving: long prompts share steps with decodes.
const SERVE_PREFILL_CHUNK: usize = 256;
/// Default sequences per micro-batch when serving.
const SERVE_MICRO_BATCH: usize = 32;

/// One event on standard output, flushed.
pub(crate) fn say(event: Event) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(event.encode().as_bytes()).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush());
}

/// The commands on standard input, framed (`m3c_contract::protocol::read_command`),
/// sent on until the input or the receiver closes.
pub(crate) fn read_commands(tx: mpsc::Sender<Result<Command, String>>) {
    let mut input = std::io::stdin().lock();
    while let Some(cmd) = m3c_contract::protocol::read_command(&mut input, m3c_contract::images::MAX_BYTES) {
        if tx.send(cmd).is_err() {
            break;
        }
    }
}

/// A request's images, from the bytes that came with it (an images file's
/// sequence 0); `patch_row` is `None` where the pipeline has no tower.
pub(crate) fn request_images(a: &SeqRequest, patch_row: Option<usize>) -> Result<Option<SeqImages>, String> {
    match (&a.images, patch_row) {
        (None, _) => Ok(None),
        (Some(_), None) => Err("this pipeline was compiled without the vision tower".into()),
        (Some(bytes), Some(row)) => {
            let mut seqs = m3c_contract::images::decode(bytes, row).map_err(|e| format!("its images: {e}"))?;
            seqs.remove(&0).map(Some).ok_or_else(|| "its images have no sequence 0".into())
        }
    }
}

/// How the first stage batches while serving.
pub(crate) fn batching(args: &RunArgs) -> Batching {
    Batching {
        per_batch: args.micro_batch.unwrap_or(SERVE_MICRO_BATCH).max(1),
        chunk: args.prefill_chunk.unwrap_or(SERVE_PREFILL_CHUNK).max(1),
        eos: args.eos_ids.clone(),
        score_last: false,
        prefix_caching: args.kv.prefix_caching,
        kv_events: args.kv.events,
        spec: crate::batching::speculator(args),
        encoder: args.encoder,
    }
}

/// The front's commands, read from standard input on a thread of its own
/// (the channel closes with the input); events go to standard output.
pub(crate) struct ServeFeed {
    rx: mpsc::Receiver<Result<Command, String>>,
    patch_row: Option<usize>,
}

impl ServeFeed {
    pub fn new(patch_row: Option<usize>) -> ServeFeed {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || read_commands(tx));
        ServeFeed { rx, patch_row }
    }
}

impl Feed for ServeFeed {
    fn next(&mut self, wait: Duration) -> Next {
        let got = if wait.is_zero() {
            self.rx.try_recv().map_err(|e| matches!(e, mpsc::TryRecvError::Disconnected))
        } else {
            self.rx.recv_timeout(wait).map_err(|e| matches!(e, mpsc::RecvTimeoutError::Disconnected))
        };
        match got {
            Ok(Ok(cmd)) => Next::Command(cmd),
            Ok(Err(bad)) => Next::Bad(bad),
            Err(false) => Next::Empty,
            Err(true) => Next::Closed,
        }
    }

    fn images(&mut self, a: &SeqRequest) -> Result<Option<SeqImages>, String> {
        request_images(a, self.patch_row)
    }

    fn event(&mut self, e: Event) {
        say(e);
    }

    fn refuse(&mut self, seq: Option<usize>, why: String) -> Result<(), crate::error::StageError> {
        say(Event::Bad { seq, why });
        Ok(())
    }

    fn wants_stats(&self) -> bool {
        true
    }
}
