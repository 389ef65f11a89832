//! The line protocol between the front (`m3c run`, `m3c serve`) and the
//! first stage: commands on the stage's standard input, events on its
//! standard output. Each message is a type with one encoder and one parser
//! here; both sides use them, so a field is added in one place.
//!
//! Commands (front → first stage), one line each, fields as `name=value`
//! words in any order (sampling fields by their [`SamplingParams::fields`]
//! names; fields not given keep greedy's values):
//!
//! ```text
//! add seq=SEQ max_new=N ignore_eos=0|1 prompt=ID,ID,... [images=HEX] [temperature=T top_k=K ...]
//! cancel SEQ
//! ```
//!
//! `images=HEX` is the hex of the images file's path bytes (any path
//! survives a whitespace-separated line).
//!
//! Events (first stage → front): `m3c-ready`, `m3c-id SEQ ID`,
//! `m3c-end SEQ stop|length|cancelled|error`, `m3c-stat STAGE STEPS
//! BUSY_SECONDS`, and `m3c-bad SEQ|- WHY` for a refused command. Any other
//! line is a stage's own output, passed on as it is.

use crate::sampling::SamplingParams;
use std::fmt;
use std::path::PathBuf;

/// A request as the first stage is told it.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRequest {
    pub seq: usize,
    pub max_new: usize,
    pub ignore_eos: bool,
    pub sampling: SamplingParams,
    pub prompt: Vec<i64>,
    /// The request's images file (`crate::images`, its sequence 0).
    pub images: Option<PathBuf>,
}

/// A command from the front.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Add(SeqRequest),
    Cancel(usize),
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes from non-empty, even-length hex.
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.is_empty() || !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| text.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect()
}

fn path_of(bytes: Vec<u8>) -> PathBuf {
    PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(bytes))
}

fn int<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, String> {
    v.parse::<T>().map_err(|_| format!("{name} `{v}`: expected an unsigned integer"))
}

impl Command {
    /// The command's line, without the newline.
    pub fn encode(&self) -> String {
        match self {
            Command::Cancel(seq) => format!("cancel {seq}"),
            Command::Add(r) => {
                let ids: Vec<String> = r.prompt.iter().map(i64::to_string).collect();
                let mut line =
                    format!("add seq={} max_new={} ignore_eos={} prompt={}", r.seq, r.max_new, u8::from(r.ignore_eos), ids.join(","));
                if let Some(p) = &r.images {
                    line.push_str(&format!(" images={}", hex(p.as_os_str().as_encoded_bytes())));
                }
                for (k, v) in r.sampling.fields() {
                    line.push_str(&format!(" {k}={v}"));
                }
                line
            }
        }
    }

    /// Parses one line; the error says why, for any input.
    pub fn parse(line: &str) -> Result<Command, String> {
        let mut words = line.split_ascii_whitespace();
        match words.next() {
            Some("cancel") => match (words.next(), words.next()) {
                (Some(s), None) => Ok(Command::Cancel(int("SEQ", s)?)),
                _ => Err("expected `cancel SEQ`".into()),
            },
            Some("add") => {
                let (mut seq, mut max_new, mut prompt) = (None, None, None);
                let (mut ignore_eos, mut images) = (false, None);
                let mut sampling = SamplingParams::GREEDY;
                for w in words {
                    let (k, v) = w.split_once('=').ok_or_else(|| format!("`{w}`: expected name=value"))?;
                    match k {
                        "seq" => seq = Some(int("seq", v)?),
                        "max_new" => max_new = Some(int("max_new", v)?),
                        "ignore_eos" => ignore_eos = int::<u8>("ignore_eos", v)? != 0,
                        "prompt" => prompt = Some(crate::prompts::parse_ids(v, "prompt")?),
                        "images" => images = Some(path_of(unhex(v).ok_or("images: not a hex path")?)),
                        _ => {
                            if !sampling.set_field(k, v)? {
                                return Err(format!("`{k}` is not a field of `add`"));
                            }
                        }
                    }
                }
                sampling.check()?;
                let need = |what: &str| format!("`add` needs {what}=");
                Ok(Command::Add(SeqRequest {
                    seq: seq.ok_or_else(|| need("seq"))?,
                    max_new: max_new.ok_or_else(|| need("max_new"))?,
                    ignore_eos,
                    sampling,
                    prompt: prompt.ok_or_else(|| need("prompt"))?,
                    images,
                }))
            }
            _ => Err("expected `add seq=SEQ max_new=N prompt=IDS ...` or `cancel SEQ`".into()),
        }
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// EOS or a stop string.
    Stop,
    /// `max_new` tokens.
    Length,
    Cancelled,
    /// The sequence met non-finite logits (serve ends only that sequence).
    Error,
}

impl EndReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Stop => "stop",
            EndReason::Length => "length",
            EndReason::Cancelled => "cancelled",
            EndReason::Error => "error",
        }
    }
}

impl fmt::Display for EndReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the first stage tells the front.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The serve loop runs.
    Ready,
    /// Sequence `seq` generated `id`.
    Id {
        seq: usize,
        id: u32,
    },
    End {
        seq: usize,
        reason: EndReason,
    },
    /// Stage `stage`'s cumulative steps and compute seconds.
    Stat {
        stage: usize,
        steps: u64,
        busy_s: f64,
    },
    /// A refused command; `seq` when it was an `add` whose sequence is known.
    Bad {
        seq: Option<usize>,
        why: String,
    },
}

impl Event {
    /// The event's line, without the newline.
    pub fn encode(&self) -> String {
        match self {
            Event::Ready => "m3c-ready".into(),
            Event::Id { seq, id } => format!("m3c-id {seq} {id}"),
            Event::End { seq, reason } => format!("m3c-end {seq} {reason}"),
            Event::Stat { stage, steps, busy_s } => format!("m3c-stat {stage} {steps} {busy_s}"),
            Event::Bad { seq, why } => {
                // One line, whatever the message held.
                let why = why.replace(['\n', '\r'], " ");
                let why = why.trim_start();
                format!("m3c-bad {} {why}", seq.map_or("-".to_string(), |s| s.to_string()))
            }
        }
    }

    /// `None` for a line that is not an event (a stage's own output);
    /// `Some(Err)` for a malformed one.
    pub fn parse(line: &str) -> Option<Result<Event, String>> {
        let (head, rest) = line.split_once(' ').unwrap_or((line, ""));
        if !head.starts_with("m3c-") {
            return None;
        }
        let bad = || format!("a malformed `{head}` line: {:?}", line.chars().take(120).collect::<String>());
        let words: Vec<&str> = rest.split_ascii_whitespace().collect();
        let ev = match (head, &words[..]) {
            ("m3c-ready", []) => Some(Event::Ready),
            ("m3c-id", [s, i]) => s.parse().ok().zip(i.parse().ok()).map(|(seq, id)| Event::Id { seq, id }),
            ("m3c-end", [s, r]) => {
                let reason = match *r {
                    "stop" => Some(EndReason::Stop),
                    "length" => Some(EndReason::Length),
                    "cancelled" => Some(EndReason::Cancelled),
                    "error" => Some(EndReason::Error),
                    _ => None,
                };
                s.parse().ok().zip(reason).map(|(seq, reason)| Event::End { seq, reason })
            }
            ("m3c-stat", [k, s, b]) => match (k.parse(), s.parse(), b.parse::<f64>()) {
                (Ok(stage), Ok(steps), Ok(busy_s)) if busy_s.is_finite() => Some(Event::Stat { stage, steps, busy_s }),
                _ => None,
            },
            ("m3c-bad", [s, ..]) => {
                let flat = rest.replace(['\n', '\r'], " ");
                let after = flat.trim_start();
                let why = after[after.find(|c: char| c.is_ascii_whitespace()).unwrap_or(after.len())..].trim_start().to_string();
                match *s {
                    "-" => Some(Event::Bad { seq: None, why }),
                    s => s.parse().ok().map(|seq| Event::Bad { seq: Some(seq), why }),
                }
            }
            // Another `m3c-` line is a stage's own output (its log lines).
            ("m3c-ready" | "m3c-id" | "m3c-end" | "m3c-stat" | "m3c-bad", _) => None,
            _ => return None,
        };
        Some(ev.ok_or_else(bad))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> SeqRequest {
        SeqRequest {
            seq: 7,
            max_new: 16,
            ignore_eos: true,
            sampling: SamplingParams { temperature: 0.7, top_k: 40, top_p: 0.95, min_p: 0.05, repetition_penalty: 1.1, seed: u64::MAX },
            prompt: vec![1, 2, 200_063],
            images: Some(PathBuf::from("/tmp/a b/\u{e9}.safetensors")),
        }
    }

    #[test]
    fn commands_round_trip() {
        for c in [Command::Add(request()), Command::Add(SeqRequest { images: None, ..request() }), Command::Cancel(3)] {
            assert_eq!(Command::parse(&c.encode()), Ok(c.clone()), "{}", c.encode());
        }
    }

    #[test]
    fn events_round_trip() {
        for e in [
            Event::Ready,
            Event::Id { seq: 1, id: 200_019 },
            Event::End { seq: 2, reason: EndReason::Cancelled },
            Event::End { seq: 2, reason: EndReason::Error },
            Event::Stat { stage: 3, steps: 99, busy_s: 1.25 },
            Event::Bad { seq: Some(4), why: "the sequence is already live".into() },
            Event::Bad { seq: None, why: "expected `cancel SEQ`".into() },
        ] {
            assert_eq!(Event::parse(&e.encode()), Some(Ok(e.clone())), "{}", e.encode());
        }
        assert_eq!(Event::parse("stage 1: layers 0-3"), None);
        assert_eq!(Event::parse("m3c-stage 1 started"), None);
    }

    #[test]
    fn damaged_messages_are_errors() {
        for line in [
            "",
            "add",
            "add seq=1 max_new=2",
            "add seq=1 max_new=2 prompt=1 temperature=hot",
            "add seq=1 max_new=2 prompt=1 temperature=1e-30",
            "add seq=1 max_new=2 prompt=1 colour=red",
            "add seq=-1 max_new=2 prompt=1",
            "add seq=1 max_new=2 prompt=1 images=abc",
            "add 1 2 0 1 0 1 0 1 0 1,2",
            "cancel",
            "cancel x",
            "cancel 1 2",
            "drop 1",
        ] {
            assert!(Command::parse(line).is_err(), "{line:?}");
        }
        for line in ["m3c-id 1", "m3c-id x 2", "m3c-end 1 maybe", "m3c-stat 1 2 nan", "m3c-bad x why", "m3c-ready now"] {
            assert!(matches!(Event::parse(line), Some(Err(_))), "{line:?}");
        }
    }
}
