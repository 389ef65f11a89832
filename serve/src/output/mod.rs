//! Reading a chat's output, in its family's format (`ChatFormat`; MiniMax-M3's
//! in the examples), as OpenAI's and Anthropic's APIs give it,
//! incrementally: the reasoning between `<mm:think>` tags as
//! `reasoning` (as vLLM's reasoning parser does), the content, and the
//! tool calls of a `<tool_call>` block (`../shared/spec/minimax-m3-chat.md`
//! §4) as streamed calls whose arguments go out as the model writes them
//! (`calls`). A stream never shows a tag, a mark or half a call, and what
//! it shows concatenates to the whole answer: both are read by the same
//! reader. Where the reasoning ends is `m3c_constrain::thinking`'s rule,
//! the one a constrained request's grammar and the stage's reasoning
//! budget follow too.

mod args;
mod calls;
mod scan;

use calls::CallReader;
use m3c_constrain::thinking::{Splitter, ThinkStart};
use m3c_contract::chat_format::ChatFormat;
use serde_json::Value;

/// How a chat's output is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// No constraint on the content (or one that also leaves it to be read
    /// as any answer: a grammar beside `tools`, or one that binds the
    /// reasoning too): a lenient reasoning prefix, and tool calls when the
    /// request offers tools.
    Free,
    /// A grammar binds the content: it is every byte after the reasoning,
    /// as the grammar matched it.
    Constrained,
    /// A forced tool call: the content is the grammar's call block.
    ForcedCalls,
}

/// A piece of the answer, in the order the model wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    /// Call `index` (0, 1, ... in the answer) starts: its function's name.
    Call {
        index: usize,
        name: String,
    },
    /// A fragment of call `index`'s arguments (JSON text; the fragments
    /// concatenate to the whole arguments).
    Args {
        index: usize,
        json: String,
    },
}

/// A tool call as far as it was read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// The incremental reader of one chat completion's text.
pub struct ChatOutput {
    splitter: Splitter,
    /// Content as the grammar matched it (nothing removed).
    verbatim: bool,
    /// The tool-call reader, when the request offers tools.
    calls: Option<CallReader>,
    /// Marks are removed from reasoning (and content without tools); these
    /// hold what may be the start of one.
    reasoning_marks: MarkFilter,
    content_marks: MarkFilter,
    /// Everything read so far: what the pieces add up to.
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
    /// The output ended inside a call.
    cut: bool,
}

impl ChatOutput {
    /// `start`: where the rendered prompt left the model's reasoning;
    /// `tools`: the request's (empty: a call block is text, there being
    /// nothing to call).
    pub fn new(format: &'static ChatFormat, start: ThinkStart, reading: Reading, tools: &[Value]) -> ChatOutput {
        let calls = (reading != Reading::Constrained && !tools.is_empty()).then(|| CallReader::new(&format.tools, tools));
        let marks = MarkFilter { mark: format.tools.mark, held: String::new() };
        ChatOutput {
            splitter: Splitter::new(&format.think, start, reading == Reading::Free),
            verbatim: reading == Reading::Constrained,
            calls,
            reasoning_marks: marks.clone(),
            content_marks: marks,
            reasoning: String::new(),
            content: String::new(),
            tool_calls: Vec::new(),
            cut: false,
        }
    }

    /// Adds decoded text; returns what can be shown now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let split = self.splitter.push(text.as_bytes());
        self.advance(split, false)
    }

    /// The end of the output: everything held back.
    pub fn finish(&mut self) -> Vec<Piece> {
        let split = self.splitter.finish();
        self.advance(split, true)
    }

    /// Whether the output ended inside a tool call (after [`ChatOutput::finish`]).
    pub fn cut(&self) -> bool {
        self.cut
    }

    fn advance(&mut self, split: m3c_constrain::thinking::Split, end: bool) -> Vec<Piece> {
        // The splitter cuts only at ASCII tags, so whole characters stay whole.
        let text = |b: Vec<u8>| String::from_utf8(b).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        let mut out = Vec::new();
        let reasoning = text(split.reasoning);
        let reasoning = if self.verbatim { reasoning } else { self.reasoning_marks.push(&reasoning, end) };
        if !reasoning.is_empty() {
            out.push(Piece::Reasoning(reasoning));
        }
        let content = text(split.content);
        match &mut self.calls {
            _ if self.verbatim => out.push(Piece::Content(content)),
            Some(reader) => {
                reader.push(&content, &mut out);
                if end {
                    self.cut = reader.finish(&mut out);
                }
            }
            None => out.push(Piece::Content(self.content_marks.push(&content, end))),
        }
        let out = merged(out);
        for p in &out {
            match p {
                Piece::Reasoning(t) => self.reasoning.push_str(t),
                Piece::Content(t) => self.content.push_str(t),
                Piece::Call { name, .. } => self.tool_calls.push(ToolCall { name: name.clone(), arguments: String::new() }),
                Piece::Args { index, json } => {
                    if let Some(c) = self.tool_calls.get_mut(*index) {
                        c.arguments.push_str(json);
                    }
                }
            }
        }
        out
    }
}

/// Pieces with empty text dropped and neighbours of one kind joined (one
/// delta each).
fn merged(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for p in pieces {
        match (out.last_mut(), p) {
            (_, Piece::Reasoning(t) | Piece::Content(t)) if t.is_empty() => {}
            (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
            (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
            (Some(Piece::Args { index: i, json: a }), Piece::Args { index: j, json: b }) if *i == j => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    out
}

/// Removes marks from text that arrives in pieces.
#[derive(Debug, Clone)]
struct MarkFilter {
    mark: &'static str,
    held: String,
}

impl MarkFilter {
    fn push(&mut self, text: &str, end: bool) -> String {
        self.held.push_str(text);
        let mark = self.mark;
        let keep = if end {
            0
        } else {
            (1..mark.len()).rev().filter(|&k| mark.is_char_boundary(k)).find(|&k| self.held.ends_with(&mark[..k])).unwrap_or(0)
        };
        let ready: String = self.held.drain(..self.held.len() - keep).collect();
        ready.replace(mark, "")
    }
}

#[cfg(test)]
mod tests;
