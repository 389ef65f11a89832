//! Tool calls out of MiniMax-M3's content as the model writes them: the
//! `<tool_call>` block of `<invoke name="...">` elements whose parameters
//! are XML elements (`../shared/spec/minimax-m3-chat.md` §3-4), read as
//! the text arrives and written out at once as OpenAI's streamed calls: a
//! call's name as soon as its `<invoke>` tag is whole, then its arguments
//! as fragments of JSON that concatenate to the final arguments. A string
//! value streams as it is written; any other leaf waits for its closing
//! tag (its type comes from the tool's schema, `args`).
//!
//! The reader recovers per call, so one malformed call never costs the
//! ones after it, and markup never reaches the content (the README's
//! "Tool calls" section lists the rules):
//!
//! - marks are dropped; a tag after a mark is certainly markup, and a
//!   mark before `invoke name=...>` stands for the `<` the model dropped;
//! - a value written without its opening tag (`]<]minimax[>[Paris]<]minimax[>[</city>`)
//!   belongs to the closing tag that follows it;
//! - an element left open ends where a tag of an enclosing element (after
//!   a mark), `</invoke>` or the next `<invoke>` begins;
//! - inside a string value only its own closing tag, or markup after a
//!   mark, ends it: `<b>` or `</div>` there is the string's text;
//! - a closing tag that closes nothing is dropped; text between calls or
//!   after a block is content;
//! - an unknown tool or parameter is still returned (typed as JSON if it
//!   parses, else a string), as is a value that does not read as its type:
//!   the client's agent sees what the model asked for and can answer it;
//! - an output that ends inside a call closes it as valid JSON (what was
//!   written so far), and the chat's finish reason says `length`.

use super::args::{self, Types};
use super::scan::{self, Lexeme, Tags};
use super::Piece;
use m3c_contract::chat_format::ToolMarkup;
use serde_json::Value;

/// The reader of one output's calls.
pub struct CallReader {
    /// The family's tags.
    m: &'static ToolMarkup,
    /// The request's tools: name and parameters schema.
    tools: Vec<(String, Value)>,
    /// Text not yet read (it may end in part of a tag).
    buf: String,
    at: At,
    /// Calls started so far (the next one's index).
    started: usize,
    /// The lexeme before was a mark.
    after_mark: bool,
    /// Text inside a block between calls, given out (trimmed) as content
    /// when the next tag comes.
    between: String,
    /// A block just ended: the whitespace it ends with is not content.
    skip_space: bool,
}

/// Where the reader is.
enum At {
    /// In content.
    Outside,
    /// Inside `<tool_call>` (or after a call written without one), between
    /// calls.
    Block,
    Call(Call),
}

/// A call being read.
struct Call {
    m: &'static ToolMarkup,
    index: usize,
    /// The tool's parameters schema (what `$ref`s resolve in).
    root: Value,
    /// The open elements; the first is the arguments object itself.
    stack: Vec<Node>,
    /// Text found among the elements, given out when the call ends.
    aside: String,
}

/// An open element.
struct Node {
    tag: String,
    schema: Value,
    body: Body,
    /// Members (or items) written so far.
    members: usize,
    /// Text between members not yet accounted for: a value whose opening
    /// tag was left out, if a closing tag comes to claim it.
    orphan: String,
}

/// What an element's value has become so far.
enum Body {
    /// Nothing but whitespace yet; the schema does not settle the kind.
    Pending(String),
    /// Child elements: `{` written when `open`.
    Object { open: bool },
    /// `<item>` children: `[` written.
    Array,
    /// A string, streamed: its `"` written when `started`; `nullable`: an
    /// empty one is null.
    Str { started: bool, nullable: bool },
    /// Any other leaf: its whole text, typed at the end.
    Leaf(String),
}

/// An owned lexeme, with the text it was written as.
#[derive(Debug, Clone)]
enum Lex {
    Text(String),
    Mark,
    Open { name: String, attrs: String, raw: String },
    Close { name: String, raw: String },
}

impl CallReader {
    /// `tools`: the request's, each `{"type": "function", "function": {...}}`.
    pub fn new(m: &'static ToolMarkup, tools: &[Value]) -> CallReader {
        let tools = tools
            .iter()
            .filter_map(|t| {
                let f = &t["function"];
                let params = if f["parameters"].is_object() { f["parameters"].clone() } else { Value::Null };
                Some((f["name"].as_str()?.to_string(), params))
            })
            .collect();
        CallReader {
            m,
            tools,
            buf: String::new(),
            at: At::Outside,
            started: 0,
            after_mark: false,
            between: String::new(),
            skip_space: false,
        }
    }

    /// Reads more content; what it decides goes to `out`.
    pub fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    /// The end of the output: everything held back is decided, and a call
    /// still open is closed. Returns whether the output ended inside a call.
    pub fn finish(&mut self, out: &mut Vec<Piece>) -> bool {
        // What is still undecided is a tag or a mark cut off by the end of
        // the output: markup, dropped; except inside a value, where it is
        // the value's text.
        if !matches!(&self.at, At::Call(c) if c.in_leaf()) {
            self.buf.clear();
        }
        self.run(true, out);
        self.flush_between(out);
        match std::mem::replace(&mut self.at, At::Outside) {
            At::Call(mut c) => {
                c.close_all(out);
                true
            }
            _ => false,
        }
    }

    fn run(&mut self, end: bool, out: &mut Vec<Piece>) {
        loop {
            let tags = if matches!(self.at, At::Outside) { Tags::Block } else { Tags::Any };
            let Some((lex, n)) = scan::next(&self.buf, self.m, tags, self.after_mark, end) else { break };
            let raw = self.buf[..n].to_string();
            let lex = match lex {
                Lexeme::Text(t) => Lex::Text(t.to_string()),
                Lexeme::Mark => Lex::Mark,
                Lexeme::Open { name, attrs } => Lex::Open { name: name.to_string(), attrs: attrs.to_string(), raw },
                Lexeme::Close(name) => Lex::Close { name: name.to_string(), raw },
            };
            self.buf.drain(..n);
            let mark = matches!(lex, Lex::Mark);
            self.step(lex, out);
            self.after_mark = mark;
        }
    }

    fn step(&mut self, lex: Lex, out: &mut Vec<Piece>) {
        match &mut self.at {
            At::Outside => match lex {
                Lex::Text(t) => {
                    let t = if self.skip_space { t.trim_start() } else { &t };
                    self.skip_space &= t.is_empty();
                    content(out, t);
                }
                Lex::Open { name, .. } if name == self.m.block => self.at = At::Block,
                // A call without its block: read as if it had one.
                Lex::Open { attrs, .. } => self.begin(&attrs, out),
                // A stray closing tag, or a mark: markup, dropped.
                Lex::Close { .. } | Lex::Mark => {}
            },
            At::Block => match lex {
                Lex::Text(t) => self.between.push_str(&t),
                Lex::Mark => {}
                Lex::Open { name, attrs, .. } if name == self.m.invoke => {
                    self.flush_between(out);
                    self.begin(&attrs, out);
                }
                Lex::Close { name, .. } if name == self.m.block => {
                    self.flush_between(out);
                    self.at = At::Outside;
                    self.skip_space = true;
                }
                // Tags outside any call: markup, dropped.
                _ => self.flush_between(out),
            },
            At::Call(c) => match c.step(lex, self.after_mark, out) {
                Next::Stay => {}
                Next::Ended => self.at = At::Block,
                Next::BlockEnded => {
                    self.at = At::Outside;
                    self.skip_space = true;
                }
                Next::NewCall(attrs) => self.begin(&attrs, out),
            },
        }
    }

    /// Text between calls, as content without the whitespace around it.
    fn flush_between(&mut self, out: &mut Vec<Piece>) {
        stray(out, &std::mem::take(&mut self.between));
    }

    /// A call starts (`<invoke ...>` with these attributes). One without a
    /// name cannot be a call: its tags are dropped and its text becomes
    /// content.
    fn begin(&mut self, attrs: &str, out: &mut Vec<Piece>) {
        let Some(name) = scan::invoke_name(attrs) else {
            self.at = At::Block;
            return;
        };
        let root = self.tools.iter().find(|(n, _)| n == name).map_or(Value::Null, |(_, s)| s.clone());
        let index = self.started;
        self.started += 1;
        out.push(Piece::Call { index, name: name.to_string() });
        let node =
            Node { tag: self.m.invoke.into(), schema: root.clone(), body: Body::Object { open: false }, members: 0, orphan: String::new() };
        self.at = At::Call(Call { m: self.m, index, root, stack: vec![node], aside: String::new() });
    }
}

/// What a lexeme did to a call.
enum Next {
    Stay,
    /// `</invoke>`: the call is complete.
    Ended,
    /// `</tool_call>`: the call and its block are.
    BlockEnded,
    /// `<invoke ...>`: this call ends and another starts.
    NewCall(String),
}

fn content(out: &mut Vec<Piece>, t: &str) {
    if !t.is_empty() {
        out.push(Piece::Content(t.to_string()));
    }
}

/// Text the model wrote among the markup: content, without the
/// whitespace around it (the layout of the block).
fn stray(out: &mut Vec<Piece>, t: &str) {
    content(out, t.trim());
}

fn json_str(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

impl Call {
    fn emit(&self, out: &mut Vec<Piece>, json: &str) {
        if !json.is_empty() {
            out.push(Piece::Args { index: self.index, json: json.to_string() });
        }
    }

    /// One lexeme; a lexeme that closes the open element is read again by
    /// the element it returns to.
    fn step(&mut self, lex: Lex, after_mark: bool, out: &mut Vec<Piece>) -> Next {
        loop {
            if let Lex::Open { name, attrs, .. } = &lex {
                if name == self.m.invoke && (after_mark || !self.in_leaf()) {
                    let attrs = attrs.clone();
                    self.close_all(out);
                    return Next::NewCall(attrs);
                }
                // A block cannot open inside a call: markup, dropped.
                if name == self.m.block && (after_mark || !self.in_leaf()) {
                    return Next::Stay;
                }
            }
            let redo = match self.top_kind() {
                Kind::Leaf => self.leaf_step(&lex, after_mark, out),
                Kind::Pending => self.pending_step(&lex, out),
                Kind::Container => self.container_step(&lex, out),
            };
            match redo {
                Redo::No => return Next::Stay,
                Redo::Again => continue,
                Redo::Done(n) => return n,
            }
        }
    }

    fn in_leaf(&self) -> bool {
        self.top_kind() == Kind::Leaf
    }

    fn top_kind(&self) -> Kind {
        match self.stack.last().map(|n| &n.body) {
            Some(Body::Str { .. } | Body::Leaf(_)) => Kind::Leaf,
            Some(Body::Pending(_)) => Kind::Pending,
            _ => Kind::Container,
        }
    }

    /// Inside a leaf value: text is the value's; its own closing tag ends
    /// it, and so does markup of an enclosing element after a mark; any
    /// other tag is text.
    fn leaf_step(&mut self, lex: &Lex, after_mark: bool, out: &mut Vec<Piece>) -> Redo {
        let text = match lex {
            Lex::Mark => return Redo::No,
            Lex::Text(t) => t.as_str(),
            Lex::Close { name, .. } if Some(name) == self.stack.last().map(|n| &n.tag) => return self.pop(out),
            Lex::Close { name, .. } if after_mark && self.encloses(name) => {
                self.pop(out);
                return Redo::Again;
            }
            Lex::Open { name, .. } if after_mark && self.sibling(name) => {
                self.pop(out);
                return Redo::Again;
            }
            Lex::Close { raw, .. } | Lex::Open { raw, .. } => raw.as_str(),
        };
        let index = self.index;
        let Some(top) = self.stack.last_mut() else { return Redo::No };
        match &mut top.body {
            Body::Str { started, .. } => {
                let mut s = json_str(text);
                s.pop();
                if *started {
                    s.remove(0);
                }
                *started = true;
                out.push(Piece::Args { index, json: s });
            }
            Body::Leaf(t) => t.push_str(text),
            _ => {}
        }
        Redo::No
    }

    /// Just inside an element whose kind its schema leaves open: a child
    /// tag makes it an object (or an array, for `<item>`), text a leaf.
    fn pending_step(&mut self, lex: &Lex, out: &mut Vec<Piece>) -> Redo {
        let Some(top) = self.stack.last_mut() else { return Redo::No };
        match lex {
            Lex::Mark => Redo::No,
            Lex::Text(t) => {
                if let Body::Pending(ws) = &mut top.body {
                    ws.push_str(t);
                    if !t.trim().is_empty() {
                        top.body = Body::Leaf(std::mem::take(ws));
                    }
                }
                Redo::No
            }
            Lex::Close { name, .. } if *name == top.tag => self.pop(out),
            Lex::Close { name, .. } => self.close_elsewhere(name, out),
            Lex::Open { name, .. } => {
                let claims = self.claims_as_pending(name);
                if !claims && self.claimed_above(name) {
                    self.pop(out);
                    return Redo::Again;
                }
                let Some(top) = self.stack.last_mut() else { return Redo::No };
                let t = args::types(&top.schema, &self.root);
                let array =
                    name == self.m.item && (t.unknown() || t.has(Types::ARRAY)) && !args::names(&top.schema, self.m.item, &self.root);
                top.body = if array { Body::Array } else { Body::Object { open: true } };
                self.emit(out, if array { "[" } else { "{" });
                self.push_child(name, out);
                Redo::No
            }
        }
    }

    /// Between the members of an object or the items of an array.
    fn container_step(&mut self, lex: &Lex, out: &mut Vec<Piece>) -> Redo {
        let Some(top) = self.stack.last_mut() else { return Redo::No };
        match lex {
            Lex::Mark => Redo::No,
            Lex::Text(t) => {
                if !(top.orphan.is_empty() && t.trim().is_empty()) {
                    top.orphan.push_str(t);
                }
                Redo::No
            }
            Lex::Open { name, .. } => {
                let orphan = std::mem::take(&mut top.orphan);
                let array = matches!(top.body, Body::Array);
                self.aside(&orphan);
                if !array && !self.claims(self.stack.len() - 1, name) && self.claimed_above(name) {
                    self.pop(out);
                    return Redo::Again;
                }
                self.push_child(name, out);
                Redo::No
            }
            Lex::Close { name, .. } if *name == top.tag => self.pop(out),
            Lex::Close { name, .. } => {
                if self.encloses(name) {
                    return self.close_elsewhere(name, out);
                }
                // A value whose opening tag was left out.
                let Some(top) = self.stack.last_mut() else { return Redo::No };
                let orphan = std::mem::take(&mut top.orphan);
                if !orphan.trim().is_empty() && matches!(top.body, Body::Object { .. }) {
                    let schema = args::property(&top.schema, name, &self.root);
                    let value = args::typed(&orphan, &schema, &self.root);
                    self.member_key(name, out);
                    self.emit(out, &value.to_string());
                }
                Redo::No
            }
        }
    }

    /// A closing tag that is not the open element's own.
    fn close_elsewhere(&mut self, name: &str, out: &mut Vec<Piece>) -> Redo {
        if name == self.m.block {
            self.close_all(out);
            return Redo::Done(Next::BlockEnded);
        }
        if self.encloses(name) {
            self.pop(out);
            return Redo::Again;
        }
        Redo::No
    }

    /// Whether an element above the open one is `name` (so `</name>`
    /// closes the open one too).
    fn encloses(&self, name: &str) -> bool {
        name == self.m.block || self.stack.iter().rev().skip(1).any(|n| n.tag == name)
    }

    /// Whether `<name>` after a mark, inside a leaf, starts the leaf's
    /// sibling (a member of the element around it) or a new call.
    fn sibling(&self, name: &str) -> bool {
        name == self.m.invoke || (self.stack.len() >= 2 && self.claims(self.stack.len() - 2, name)) || self.claimed_above(name)
    }

    /// Whether the element at `i` takes `<name>` as a child.
    fn claims(&self, i: usize, name: &str) -> bool {
        let n = &self.stack[i];
        if matches!(n.body, Body::Array) {
            return name == self.m.item;
        }
        let t = args::types(&n.schema, &self.root);
        (t.unknown() || t.has(Types::OBJECT)) && (args::names(&n.schema, name, &self.root) || !lists_properties(&n.schema, &self.root))
    }

    /// The same for a pending element (which may become either kind).
    fn claims_as_pending(&self, name: &str) -> bool {
        let Some(n) = self.stack.last() else { return false };
        let t = args::types(&n.schema, &self.root);
        if name == self.m.item && (t.unknown() || t.has(Types::ARRAY)) {
            return true;
        }
        (t.unknown() || t.has(Types::OBJECT)) && (args::names(&n.schema, name, &self.root) || !lists_properties(&n.schema, &self.root))
    }

    /// Whether an element above the open one names `name` among its
    /// properties (so `<name>` there means the open one was left open).
    fn claimed_above(&self, name: &str) -> bool {
        self.stack.iter().rev().skip(1).any(|n| !matches!(n.body, Body::Array) && args::names(&n.schema, name, &self.root))
    }

    /// Writes the separator and key of a new member of the open object.
    fn member_key(&mut self, name: &str, out: &mut Vec<Piece>) {
        let index = self.index;
        let Some(top) = self.stack.last_mut() else { return };
        let mut s = String::new();
        match &mut top.body {
            Body::Object { open } if !*open => {
                *open = true;
                s.push('{');
            }
            _ if top.members > 0 => s.push(','),
            _ => {}
        }
        if !matches!(top.body, Body::Array) {
            s.push_str(&json_str(name));
            s.push(':');
        }
        top.members += 1;
        out.push(Piece::Args { index, json: s });
    }

    /// A child element opens in the open container.
    fn push_child(&mut self, name: &str, out: &mut Vec<Piece>) {
        let Some(top) = self.stack.last() else { return };
        let schema = if matches!(top.body, Body::Array) {
            args::items(&top.schema, &self.root)
        } else {
            args::property(&top.schema, name, &self.root)
        };
        self.member_key(name, out);
        let t = args::types(&schema, &self.root);
        let body = if t.only(Types::STRING) {
            self.emit(out, "\"");
            Body::Str { started: true, nullable: false }
        } else if t.only(Types::STRING.with(Types::NULL)) {
            Body::Str { started: false, nullable: true }
        } else {
            Body::Pending(String::new())
        };
        self.stack.push(Node { tag: name.to_string(), schema, body, members: 0, orphan: String::new() });
    }

    /// The open element ends: its value is written whole. The arguments
    /// object itself ending ends the call.
    fn pop(&mut self, out: &mut Vec<Piece>) -> Redo {
        let Some(n) = self.stack.pop() else { return Redo::Done(Next::Ended) };
        self.aside(&n.orphan);
        let end = match n.body {
            Body::Pending(ws) => args::typed(&ws, &n.schema, &self.root).to_string(),
            Body::Str { started: true, .. } => "\"".into(),
            Body::Str { started: false, nullable } => (if nullable { "null" } else { "\"\"" }).into(),
            Body::Leaf(text) => args::typed(&text, &n.schema, &self.root).to_string(),
            Body::Object { open: true } => "}".into(),
            Body::Object { open: false } => "{}".into(),
            Body::Array => "]".into(),
        };
        self.emit(out, &end);
        if self.stack.is_empty() {
            // The call is whole: the text found inside it follows it.
            stray(out, &std::mem::take(&mut self.aside));
            Redo::Done(Next::Ended)
        } else {
            Redo::No
        }
    }

    /// Text found among a call's elements: content, given out after the
    /// call (a client's block of arguments is not interrupted).
    fn aside(&mut self, t: &str) {
        if !t.trim().is_empty() {
            if !self.aside.is_empty() {
                self.aside.push(' ');
            }
            self.aside.push_str(t.trim());
        }
    }

    /// Every open element ends (the call is complete or cut).
    fn close_all(&mut self, out: &mut Vec<Piece>) {
        while !self.stack.is_empty() {
            self.pop(out);
        }
    }
}

/// What the open element is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Leaf,
    Pending,
    Container,
}

/// Whether a lexeme is read again after an element closed.
enum Redo {
    No,
    Again,
    Done(Next),
}

/// Whether some alternative of `schema` lists properties (else any
/// member is its own).
fn lists_properties(schema: &Value, root: &Value) -> bool {
    let s = args::resolve(schema, root);
    s.get("properties").is_some_and(|p| p.as_object().is_some_and(|o| !o.is_empty()))
        || ["anyOf", "oneOf"]
            .iter()
            .any(|k| s.get(*k).and_then(Value::as_array).is_some_and(|a| a.iter().any(|x| lists_properties(x, root))))
}
