//! Reading MiniMax-M3's chat output as OpenAI's API gives it: the reasoning
//! between `<mm:think>` tags as `reasoning` (as vLLM's reasoning parser
//! does) and a `<tool_call>` block as `tool_calls`
//! (`../shared/spec/minimax-m3-chat.md` §4), incrementally, so a stream
//! never shows a tag or half a tool call. Where the reasoning ends is
//! `m3c_constrain::thinking`'s rule, the one a constrained request's grammar
//! and the stage's reasoning budget follow too.

use m3c_constrain::thinking::{Splitter, ThinkStart};
use serde_json::{json, Map, Value};

/// Removed wherever it appears (the spec's parsers do so first).
const MARK: &str = "]<]minimax[>[";
const CALLS: &str = "<tool_call>";
const END_CALLS: &str = "</tool_call>";

/// How a chat's output is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// No constraint: a lenient reasoning prefix, and a tool-call block
    /// anywhere in the content.
    Free,
    /// A grammar binds the content: it is every byte after the reasoning,
    /// as the grammar matched it.
    Constrained,
    /// A forced tool call: the content is the grammar's call block.
    ForcedCalls,
}

/// What a piece of output adds.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Delta {
    pub reasoning: String,
    pub content: String,
}

/// The incremental reader of one chat completion's text.
pub struct ChatOutput {
    splitter: Splitter,
    reading: Reading,
    /// Received text that may end in the start of a marker.
    raw: String,
    /// Content not yet given out (a `<tool_call>` tag may be forming).
    pending: String,
    /// Inside the tool-call block: held back until it is whole.
    in_calls: bool,
    calls: String,
    pub reasoning: String,
    pub content: String,
}

impl ChatOutput {
    /// `start`: where the rendered prompt left the model's reasoning.
    pub fn new(start: ThinkStart, reading: Reading) -> ChatOutput {
        ChatOutput {
            splitter: Splitter::new(start, reading == Reading::Free),
            reading,
            raw: String::new(),
            pending: String::new(),
            in_calls: false,
            calls: String::new(),
            reasoning: String::new(),
            content: String::new(),
        }
    }

    /// Adds decoded text; returns what can be shown now.
    pub fn push(&mut self, text: &str) -> Delta {
        let ready = if self.reading == Reading::Constrained {
            text.to_string()
        } else {
            // Markers go; an end that may begin one waits for the next piece.
            self.raw.push_str(text);
            let keep = held(&self.raw, &[MARK]);
            let ready: String = self.raw.drain(..self.raw.len() - keep).collect();
            ready.replace(MARK, "")
        };
        let split = self.splitter.push(ready.as_bytes());
        self.advance(split, false)
    }

    /// The end of the output: everything held back.
    pub fn finish(&mut self) -> Delta {
        let rest = std::mem::take(&mut self.raw);
        let mut split = self.splitter.push(rest.as_bytes());
        let tail = self.splitter.finish();
        split.reasoning.extend(tail.reasoning);
        split.content.extend(tail.content);
        self.advance(split, true)
    }

    fn advance(&mut self, split: m3c_constrain::thinking::Split, end: bool) -> Delta {
        // The splitter cuts only at ASCII tags, so whole characters stay whole.
        let text = |b: Vec<u8>| String::from_utf8(b).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        let mut d = Delta { reasoning: text(split.reasoning), content: String::new() };
        self.pending.push_str(&text(split.content));
        if self.reading == Reading::Constrained {
            d.content = std::mem::take(&mut self.pending);
        } else if self.in_calls {
            self.calls.push_str(&std::mem::take(&mut self.pending));
        } else if take_until(&mut self.pending, CALLS, &mut d.content, end) {
            self.in_calls = true;
            self.calls.push_str(&std::mem::take(&mut self.pending));
        }
        self.reasoning.push_str(&d.reasoning);
        self.content.push_str(&d.content);
        d
    }

    /// The tool calls, once the output has ended; `tools` are the request's
    /// (their JSON schemas type the arguments). A block that does not parse
    /// is given back as content.
    pub fn tool_calls(&mut self, tools: &[Value]) -> Vec<Value> {
        if self.calls.is_empty() {
            return Vec::new();
        }
        let block = self.calls.split(END_CALLS).next().unwrap_or("").to_string();
        // Without tools the request allowed no call: the block is text.
        let calls = if tools.is_empty() { Vec::new() } else { parse_invokes(&block, tools) };
        if calls.is_empty() {
            self.content.push_str(CALLS);
            self.content.push_str(&self.calls);
            self.calls.clear();
        }
        calls
    }

    /// Text held back in a tool-call block that did not parse (after
    /// [`ChatOutput::tool_calls`]).
    pub fn has_calls(&self) -> bool {
        !self.calls.is_empty()
    }
}

/// Moves `pending` up to `marker` into `into` and drops the marker: true.
/// Without the marker, moves what cannot be the start of one (all of it at
/// the `end`) and returns false: the caller waits for more text.
fn take_until(pending: &mut String, marker: &str, into: &mut String, end: bool) -> bool {
    match pending.find(marker) {
        Some(i) => {
            into.push_str(&pending[..i]);
            pending.drain(..i + marker.len());
            true
        }
        None => {
            let keep = if end { 0 } else { held(pending, &[marker]) };
            let cut = pending.len() - keep;
            into.extend(pending.drain(..cut));
            false
        }
    }
}

/// The longest end of `text` that begins one of `tags`.
fn held(text: &str, tags: &[&str]) -> usize {
    tags.iter().filter_map(|t| (1..t.len()).rev().find(|&k| text.ends_with(&t[..k]))).max().unwrap_or(0)
}

/// The `<invoke name="...">...</invoke>` elements of a tool-call block as
/// OpenAI tool calls.
fn parse_invokes(block: &str, tools: &[Value]) -> Vec<Value> {
    let mut calls = Vec::new();
    let mut rest = block;
    while let Some(start) = rest.find("<invoke name=\"") {
        let after = &rest[start + "<invoke name=\"".len()..];
        let Some(q) = after.find("\">") else { break };
        let name = after[..q].to_string();
        let body = &after[q + 2..];
        let Some(end) = body.find("</invoke>") else { break };
        let schema = tools
            .iter()
            .find(|t| t["function"]["name"].as_str() == Some(&name))
            .map(|t| t["function"]["parameters"].clone())
            .unwrap_or(Value::Null);
        let Some(args) = parse_elements(&body[..end], &schema) else { break };
        calls.push(json!({
            "id": format!("call_{}_{}", calls.len(), name.chars().filter(|c| c.is_ascii_alphanumeric()).collect::<String>()),
            "type": "function",
            "function": {"name": name, "arguments": Value::Object(args).to_string()},
        }));
        rest = &body[end + "</invoke>".len()..];
    }
    calls
}

/// `<k>v</k>` elements into an object; a value with elements of its own is
/// an object (or an array when they are all `<item>`), else a leaf typed by
/// the schema (else JSON if it parses, else the string).
fn parse_elements(text: &str, schema: &Value) -> Option<Map<String, Value>> {
    let mut out = Map::new();
    for (tag, inner) in elements(text)? {
        let sub = &schema["properties"][&tag];
        out.insert(tag, value_of(&inner, sub)?);
    }
    Some(out)
}

fn value_of(inner: &str, schema: &Value) -> Option<Value> {
    let kids = elements(inner)?;
    if kids.is_empty() {
        // An array or object without elements is empty, not a string.
        return Some(match (schema["type"].as_str(), inner.trim().is_empty()) {
            (Some("array"), true) => Value::Array(Vec::new()),
            (Some("object"), true) => Value::Object(Map::new()),
            _ => leaf(inner.trim(), schema),
        });
    }
    if kids.iter().all(|(t, _)| t == "item") {
        return kids.iter().map(|(_, v)| value_of(v, &schema["items"])).collect::<Option<Vec<_>>>().map(Value::Array);
    }
    parse_elements(inner, schema).map(Value::Object)
}

fn leaf(text: &str, schema: &Value) -> Value {
    match schema["type"].as_str() {
        Some("string") => Value::String(text.to_string()),
        Some("integer") => text.parse::<i64>().map(Value::from).unwrap_or_else(|_| Value::String(text.into())),
        Some("number") => text
            .parse::<f64>()
            .ok()
            .and_then(|f| serde_json::Number::from_f64(f).map(Value::Number))
            .unwrap_or_else(|| Value::String(text.into())),
        Some("boolean") => match text {
            "true" | "True" => Value::Bool(true),
            "false" | "False" => Value::Bool(false),
            _ => Value::String(text.into()),
        },
        _ => serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string())),
    }
}

/// The top-level `<tag>inner</tag>` elements of `text`, in order; `None` if
/// it is not well formed. Text outside elements (whitespace) is ignored.
fn elements(text: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut rest = text;
    loop {
        let Some(open) = rest.find('<') else {
            return Some(out);
        };
        let after = &rest[open + 1..];
        let close = after.find('>')?;
        let tag = &after[..close];
        if tag.is_empty() || tag.starts_with('/') || tag.contains(char::is_whitespace) {
            // Not an element of ours: a leaf's text.
            return if out.is_empty() { Some(Vec::new()) } else { None };
        }
        let body = &after[close + 1..];
        // The matching close, counting nested elements of the same name.
        let (open_tag, close_tag) = (format!("<{tag}>"), format!("</{tag}>"));
        let (mut depth, mut i) = (1usize, 0usize);
        let end = loop {
            let next_close = body[i..].find(&close_tag)? + i;
            let next_open = body[i..].find(&open_tag).map(|p| p + i);
            match next_open {
                Some(o) if o < next_close => {
                    depth += 1;
                    i = o + open_tag.len();
                }
                _ => {
                    depth -= 1;
                    if depth == 0 {
                        break next_close;
                    }
                    i = next_close + close_tag.len();
                }
            }
        };
        out.push((tag.to_string(), body[..end].to_string()));
        rest = &body[end + close_tag.len()..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(thinking: bool, pieces: &[&str]) -> ChatOutput {
        let start = if thinking { ThinkStart::Open } else { ThinkStart::Adaptive };
        let mut o = ChatOutput::new(start, Reading::Free);
        let mut shown = Delta::default();
        for p in pieces {
            let d = o.push(p);
            shown.reasoning += &d.reasoning;
            shown.content += &d.content;
        }
        let d = o.finish();
        shown.reasoning += &d.reasoning;
        shown.content += &d.content;
        assert_eq!(shown.reasoning, o.reasoning);
        assert_eq!(shown.content, o.content);
        o
    }

    #[test]
    fn reasoning_is_split_from_content_even_when_tags_span_pieces() {
        let o = whole(false, &["<mm:", "think>Let me", " think.</mm", ":think>\n\nParis."]);
        assert_eq!(o.reasoning, "Let me think.");
        assert_eq!(o.content, "Paris.");
        let o = whole(true, &["Because.", "</mm:think>", "Yes"]);
        assert_eq!((o.reasoning.as_str(), o.content.as_str()), ("Because.", "Yes"));
        let o = whole(false, &["</mm:think>", "Direct answer"]);
        assert_eq!((o.reasoning.as_str(), o.content.as_str()), ("", "Direct answer"));
        let o = whole(false, &["Plain ", "text <b>"]);
        assert_eq!((o.reasoning.as_str(), o.content.as_str()), ("", "Plain text <b>"));
    }

    #[test]
    fn a_recorded_tool_call_block_becomes_typed_tool_calls() {
        // The template's own rendering of a call (spec §3), as the model emits it.
        let text = "<mm:think>I need two tools.</mm:think>]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name=\"get_weather\">]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[<days>3]<]minimax[>[</days>]<]minimax[>[</invoke>\n]<]minimax[>[<invoke name=\"search\">]<]minimax[>[<query>m3c</query>]<]minimax[>[<filters>]<]minimax[>[<item>]<]minimax[>[<key>a</key>]<]minimax[>[</item>]<]minimax[>[</filters>]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>";
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
        ];
        let pieces: Vec<String> = text.chars().collect::<Vec<_>>().chunks(7).map(|c| c.iter().collect()).collect();
        let mut o = whole(false, &pieces.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(o.reasoning, "I need two tools.");
        assert_eq!(o.content, "", "no tag or call text leaks into the content");
        let calls = o.tool_calls(&tools);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let a: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(a, json!({"city": "Paris", "days": 3}));
        let b: Value = serde_json::from_str(calls[1]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(b, json!({"query": "m3c", "filters": [{"key": "a"}]}));
    }

    #[test]
    fn a_broken_block_is_given_back_as_content() {
        let mut o = whole(false, &["Hi <tool_call>\n<invoke name=\"f\"><x>1"]);
        assert!(o.tool_calls(&[]).is_empty());
        assert_eq!(o.content, "Hi <tool_call>\n<invoke name=\"f\"><x>1");
    }
}
