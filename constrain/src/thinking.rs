//! A chat's reasoning block as one rule (`m3c_contract::thinking`), under
//! the family's reasoning tags (`m3c_contract::chat_format::ThinkTags`;
//! MiniMax-M3's `<mm:think>…</mm:think>` in the examples below),
//! implemented three times over the same definitions so the three can
//! never disagree about where content starts:
//!
//! - [`Splitter`] reads output bytes into reasoning and content (the
//!   server's chat reader and the stage's budget both run it);
//! - [`wrap`] puts a content grammar behind the reasoning the prompt allows,
//!   as an llguidance grammar, so a constraint binds exactly what the reader
//!   will call content;
//! - [`Budget`] counts reasoning tokens in the last stage and names the
//!   token to force when the cap is reached.
//!
//! Reasoning is text up to the first closing tag; it never contains one. A
//! constrained reader is strict: content is every byte after the prefix,
//! with nothing trimmed. An unconstrained one is lenient, as it was before
//! constraints followed reasoning: whitespace before the opening tag is
//! skipped, blank lines before the content are dropped, a model that
//! opens `<mm:think>` after a `disabled` prompt is still read as reasoning
//! (and one that opens it again after an `enabled` prompt loses only the
//! repeated tag), and no reasoning tag ever reaches the content: a later
//! `<mm:think>` opens reasoning again, a stray `</mm:think>` is dropped.

use crate::{ConstrainError, Vocabulary};
pub use m3c_contract::chat_format::ThinkTags;
pub use m3c_contract::thinking::{ThinkBudget, ThinkStart};

/// Where the output is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// Nothing decided yet: a tag may come first.
    Start,
    /// The prompt opened the reasoning; a lenient reader drops the model's
    /// own `<mm:think>` if it writes one first.
    OpenStart,
    Reasoning,
    Content,
}

/// What a piece of output adds to each side.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    pub reasoning: Vec<u8>,
    pub content: Vec<u8>,
}

/// The incremental reader of one output's reasoning and content. Bytes
/// that may begin a tag are held until the next piece shows what they are.
#[derive(Debug, Clone)]
pub struct Splitter {
    tags: &'static ThinkTags,
    part: Part,
    pending: Vec<u8>,
    lenient: bool,
    content_seen: bool,
}

impl Splitter {
    /// `lenient`: the unconstrained reading (above).
    pub fn new(tags: &'static ThinkTags, start: ThinkStart, lenient: bool) -> Splitter {
        let part = match start {
            ThinkStart::Open if lenient => Part::OpenStart,
            ThinkStart::Open => Part::Reasoning,
            ThinkStart::Closed if !lenient => Part::Content,
            ThinkStart::Closed | ThinkStart::Adaptive => Part::Start,
        };
        Splitter { tags, part, pending: Vec::new(), lenient, content_seen: false }
    }

    /// Whether the output is inside the reasoning now.
    pub fn in_reasoning(&self) -> bool {
        matches!(self.part, Part::Reasoning | Part::OpenStart)
    }

    /// Adds bytes; returns what is decided now.
    pub fn push(&mut self, bytes: &[u8]) -> Split {
        self.pending.extend_from_slice(bytes);
        self.advance(false)
    }

    /// The end of the output: everything held back.
    pub fn finish(&mut self) -> Split {
        self.advance(true)
    }

    fn advance(&mut self, end: bool) -> Split {
        let (open, close) = (self.tags.open, self.tags.close);
        let mut out = Split::default();
        loop {
            match self.part {
                Part::Start => {
                    let skip = if self.lenient { self.pending.iter().take_while(|b| b.is_ascii_whitespace()).count() } else { 0 };
                    let t = &self.pending[skip..];
                    if t.starts_with(open.as_bytes()) {
                        self.pending.drain(..skip + open.len());
                        self.part = Part::Reasoning;
                    } else if t.starts_with(close.as_bytes()) {
                        self.pending.drain(..skip + close.len());
                        self.part = Part::Content;
                    } else if !end && (open.as_bytes().starts_with(t) || close.as_bytes().starts_with(t)) {
                        break; // a tag may be forming
                    } else {
                        self.part = Part::Content;
                    }
                }
                Part::Reasoning => match find(&self.pending, close.as_bytes()) {
                    Some(i) => {
                        out.reasoning.extend(self.pending.drain(..i));
                        self.pending.drain(..close.len());
                        self.part = Part::Content;
                    }
                    None => {
                        let keep = if end { 0 } else { held(&self.pending, close.as_bytes()) };
                        out.reasoning.extend(self.pending.drain(..self.pending.len() - keep));
                        break;
                    }
                },
                Part::Content => {
                    if self.lenient && !self.content_seen {
                        let blank = self.pending.iter().take_while(|&&b| b == b'\n').count();
                        self.pending.drain(..blank);
                    }
                    if !self.lenient {
                        out.content.append(&mut self.pending);
                        break;
                    }
                    // Lenient: reasoning tags never reach the content. A
                    // `<mm:think>` there opens reasoning again (a model
                    // that thinks between answers), a stray `</mm:think>`
                    // is dropped.
                    let open_at = find(&self.pending, open.as_bytes());
                    let close_at = find(&self.pending, close.as_bytes());
                    let (i, tag, reopens) = match (open_at, close_at) {
                        (Some(o), Some(c)) if o < c => (o, open, true),
                        (_, Some(c)) => (c, close, false),
                        (Some(o), None) => (o, open, true),
                        (None, None) => {
                            let keep =
                                if end { 0 } else { held(&self.pending, open.as_bytes()).max(held(&self.pending, close.as_bytes())) };
                            let cut = self.pending.len() - keep;
                            self.content_seen |= cut > 0;
                            out.content.extend(self.pending.drain(..cut));
                            break;
                        }
                    };
                    self.content_seen |= i > 0;
                    out.content.extend(self.pending.drain(..i));
                    self.pending.drain(..tag.len());
                    if reopens {
                        self.part = Part::Reasoning;
                    }
                }
                Part::OpenStart => {
                    // A model that opens its reasoning again right after the
                    // prompt opened it: the tag is not reasoning.
                    if self.pending.starts_with(open.as_bytes()) {
                        self.pending.drain(..open.len());
                    } else if !end && open.as_bytes().starts_with(&self.pending) {
                        break;
                    }
                    self.part = Part::Reasoning;
                }
            }
        }
        out
    }
}

/// The first position of `needle` in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The longest end of `text` that begins `tag` (and is shorter than it).
fn held(text: &[u8], tag: &[u8]) -> usize {
    (1..tag.len()).rev().find(|&k| text.ends_with(&tag[..k])).unwrap_or(0)
}

/// The name the wrapped content grammar goes by in the grammar list.
const BODY: &str = "m3c_content";

/// A content grammar (llguidance's JSON form, as `Grammar::to_text`
/// writes it) behind the reasoning prefix `start` allows, so that the
/// output's content, as [`Splitter`] reads it strictly, is exactly what
/// the grammar matches:
///
/// - `Open`: reasoning (any text without `</mm:think>`), `</mm:think>`,
///   then the content;
/// - `Adaptive`: `<mm:think>` + reasoning + `</mm:think>`, or a bare
///   `</mm:think>`, then the content (the two ways the template's adaptive
///   mode lets the model begin: `minimax-m3-chat.md` §3; a content that
///   began with neither could itself begin with a tag, which the reader
///   would take for reasoning);
/// - `Closed`: the content grammar as it is.
///
/// The reasoning and its tags are one terminal, so the lexer ends it at
/// the first `</mm:think>` without looking back.
pub fn wrap(content: &str, start: ThinkStart, tags: &ThinkTags) -> Result<String, ConstrainError> {
    use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
    if start == ThinkStart::Closed {
        return Ok(content.to_string());
    }
    let mut g: TopLevelGrammar = serde_json::from_str(content).map_err(|e| ConstrainError::Grammar(e.to_string()))?;
    let Some(first) = g.grammars.first_mut() else {
        return Err(ConstrainError::Grammar("a grammar list without grammars".into()));
    };
    let name = first.name.get_or_insert_with(|| BODY.to_string()).clone();
    let (open, close) = (tags.open, tags.close);
    let reasoning = format!("REASONING: /(?s:.*)/ & ~/(?s:.*){}(?s:.*)/", regex_literal(close));
    let lark = match start {
        ThinkStart::Open => format!("start: THOUGHT @{name}\nTHOUGHT: REASONING \"{close}\"\n{reasoning}\n"),
        _ => format!(
            "start: THOUGHT @{name} | NO_THOUGHT @{name}\nTHOUGHT: \"{open}\" REASONING \"{close}\"\nNO_THOUGHT: \"{close}\"\n{reasoning}\n"
        ),
    };
    let wrapper = GrammarWithLexer { name: None, json_schema: None, lark_grammar: Some(lark) };
    g.grammars.insert(0, wrapper);
    serde_json::to_string(&g).map_err(|e| ConstrainError::Grammar(e.to_string()))
}

/// `text` as a lark regex that matches it literally (inside `/.../`).
fn regex_literal(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// One sequence's reasoning budget in the last stage: it follows the
/// drawn tokens through a [`Splitter`] and, once `budget` tokens were drawn
/// inside the reasoning, says that the next draw must close it.
#[derive(Debug, Clone)]
pub struct Budget {
    splitter: Splitter,
    budget: u32,
    spent: u32,
    close: u32,
}

impl Budget {
    /// `lenient`: the sequence has no grammar, so the server reads its
    /// output leniently (the budget then counts what that reader calls
    /// reasoning).
    pub fn new(vocabulary: &Vocabulary, tags: &'static ThinkTags, b: ThinkBudget, lenient: bool) -> Result<Budget, ConstrainError> {
        let close = vocabulary.token_of(tags.close.as_bytes()).ok_or_else(|| {
            ConstrainError::Tokenizer(format!("a reasoning budget needs `{}` as one token, and the tokenizer has none", tags.close))
        })?;
        Ok(Budget { splitter: Splitter::new(tags, b.start, lenient), budget: b.budget, spent: 0, close })
    }

    /// The token the next draw must take (the closing tag), if the budget
    /// is spent while the reasoning is still open.
    pub fn forced(&self) -> Option<u32> {
        (self.splitter.in_reasoning() && self.spent >= self.budget).then_some(self.close)
    }

    /// The token the sequence drew.
    pub fn consume(&mut self, vocabulary: &Vocabulary, id: u32) {
        if self.splitter.in_reasoning() {
            self.spent = self.spent.saturating_add(1);
        }
        self.splitter.push(vocabulary.text_of(id));
    }

    /// Reasoning tokens drawn so far.
    pub fn spent(&self) -> u32 {
        self.spent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: &str = "<mm:think>";
    const CLOSE: &str = "</mm:think>";

    /// MiniMax-M3's tags, which the examples spell.
    fn tags() -> &'static ThinkTags {
        let tags = &m3c_contract::chat_format::ChatFormat::of_family("minimax_m3").unwrap().think;
        assert_eq!((tags.open, tags.close), (OPEN, CLOSE));
        tags
    }

    fn read(start: ThinkStart, lenient: bool, pieces: &[&str]) -> (String, String) {
        let mut s = Splitter::new(tags(), start, lenient);
        let mut all = Split::default();
        for p in pieces.iter().map(|p| p.as_bytes()).chain([&b""[..]]) {
            let d = if p.is_empty() { s.finish() } else { s.push(p) };
            all.reasoning.extend(d.reasoning);
            all.content.extend(d.content);
        }
        (String::from_utf8(all.reasoning).unwrap(), String::from_utf8(all.content).unwrap())
    }

    #[test]
    fn the_prefix_is_read_as_the_mode_says_even_when_tags_span_pieces() {
        let r = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(read(ThinkStart::Adaptive, false, &["<mm:", "think>a</mm", ":think>{}"]), r("a", "{}"));
        assert_eq!(read(ThinkStart::Adaptive, false, &["</mm:", "think>\n{}"]), r("", "\n{}"));
        assert_eq!(read(ThinkStart::Adaptive, false, &["{", "}"]), r("", "{}"));
        assert_eq!(read(ThinkStart::Open, false, &["x </mm:thi", "nk", ">yes"]), r("x ", "yes"));
        assert_eq!(read(ThinkStart::Open, false, &["never closed </mm:th"]), r("never closed </mm:th", ""));
        assert_eq!(read(ThinkStart::Closed, false, &["<mm:think>x</mm:think>"]), r("", "<mm:think>x</mm:think>"));
        // Lenient: whitespace before the tag, blank lines after it.
        assert_eq!(read(ThinkStart::Adaptive, true, &["\n<mm:think>a</mm:think>\n\nParis"]), r("a", "Paris"));
        assert_eq!(read(ThinkStart::Closed, true, &["<mm:think>a</mm:think>b"]), r("a", "b"));
        // Only the first close ends the reasoning.
        assert_eq!(read(ThinkStart::Open, false, &["a</mm:think>b</mm:think>"]), r("a", "b</mm:think>"));
        // Lenient: no reasoning tag reaches the content.
        assert_eq!(read(ThinkStart::Open, true, &["a</mm:think>b</mm:th", "ink>c"]), r("a", "bc"));
        assert_eq!(read(ThinkStart::Adaptive, true, &["</mm:think>x <mm:", "think>more</mm:think> y"]), r("more", "x  y"));
        assert_eq!(read(ThinkStart::Open, true, &["<mm:th", "ink>a</mm:think>b"]), r("a", "b"), "a repeated opening tag");
        assert_eq!(read(ThinkStart::Open, true, &["<b>a</mm:think>b"]), r("<b>a", "b"));
        assert_eq!(read(ThinkStart::Closed, true, &["x</mm:", "think>"]), r("", "x"));
        assert_eq!(read(ThinkStart::Closed, true, &["x</mm:"]), r("", "x</mm:"), "a cut tag at the end is text");
    }

    /// The test tokenizer of the crate, with MiniMax-M3's two reasoning
    /// tags as (non-special) tokens of their own.
    fn vocabulary() -> (Vocabulary, u32, u32, u32) {
        let (v, open, close) = vocabulary_ending_on(None);
        (v, open - 1, open, close)
    }

    /// The same, ending on `eos` (default: the tokenizer's special `<eos>`).
    fn vocabulary_ending_on(eos: Option<u32>) -> (Vocabulary, u32, u32) {
        let mut t: serde_json::Value = serde_json::from_str(&crate::tests::tokenizer()).unwrap();
        let n = t["model"]["vocab"].as_object().unwrap().len() as u64 + 1;
        let added = t["added_tokens"].as_array_mut().unwrap();
        added.push(serde_json::json!({"id": n, "content": OPEN, "special": false}));
        added.push(serde_json::json!({"id": n + 1, "content": CLOSE, "special": false}));
        let eos = eos.unwrap_or(n as u32 - 1);
        let v = Vocabulary::from_tokenizer_json(&t.to_string(), Some(100), &[eos]).unwrap();
        (v, n as u32, n as u32 + 1)
    }

    /// Draws as the last stage does: the grammar's mask, narrowed to the
    /// closing tag when the budget is spent; `pick` chooses among the
    /// allowed ids. Returns the output's bytes and whether the grammar ended.
    fn generate(v: &Vocabulary, grammar: &str, budget: Option<ThinkBudget>, pick: impl Fn(&[u32], usize) -> u32) -> (Vec<u8>, bool) {
        let mut c = v.compile(grammar).unwrap();
        let mut b = budget.map(|b| Budget::new(v, tags(), b, false).unwrap());
        let mut out = Vec::new();
        for step in 0..200 {
            let mut m = c.mask().unwrap();
            if let Some(f) = b.as_ref().and_then(Budget::forced) {
                assert!(m[f as usize / 32] >> (f % 32) & 1 == 1, "the grammar allows the close wherever the budget forces it");
                m.iter_mut().for_each(|w| *w = 0);
                m[f as usize / 32] |= 1 << (f % 32);
            }
            let id = pick(&m, step);
            assert!(m[id as usize / 32] >> (id % 32) & 1 == 1, "picked a disallowed token {id}");
            if c.is_done() {
                return (out, true);
            }
            c.consume(id).unwrap();
            if let Some(b) = b.as_mut() {
                b.consume(v, id);
            }
            out.extend_from_slice(v.text_of(id));
        }
        (out, false)
    }

    fn allowed(m: &[u32], i: u32) -> bool {
        m[i as usize / 32] >> (i % 32) & 1 == 1
    }

    fn content_of(start: ThinkStart, out: &[u8]) -> (String, String) {
        let mut s = Splitter::new(tags(), start, false);
        let mut d = s.push(out);
        let e = s.finish();
        d.reasoning.extend(e.reasoning);
        d.content.extend(e.content);
        (String::from_utf8(d.reasoning).unwrap(), String::from_utf8(d.content).unwrap())
    }

    #[test]
    fn a_wrapped_grammar_binds_exactly_what_the_reader_calls_content() {
        let (v, _eos, open, close) = vocabulary();
        let choice = crate::Grammar::Choice(vec!["yes".into(), "no".into()]).to_text();
        // Adaptive: a model that opens its reasoning, thinks, closes it.
        let g = wrap(&choice, ThinkStart::Adaptive, tags()).unwrap();
        let thinker = |m: &[u32], step: usize| {
            let want = match step {
                0 => open,
                1..=4 => b'z' as u32 - b'!' as u32,
                _ => close,
            };
            if allowed(m, want) {
                want
            } else {
                (0..100).rev().find(|&i| allowed(m, i)).unwrap()
            }
        };
        let (out, done) = generate(&v, &g, None, thinker);
        assert!(done);
        assert_eq!(content_of(ThinkStart::Adaptive, &out), ("zzzz".into(), "yes".into()), "{:?}", String::from_utf8_lossy(&out));
        // Adaptive, a model that closes at once (the highest ids first:
        // the closing tag).
        let (out, done) = generate(&v, &g, None, |m, _| (0..100).rev().find(|&i| allowed(m, i)).unwrap());
        let (_, content) = content_of(ThinkStart::Adaptive, &out);
        assert!(done && out.starts_with(CLOSE.as_bytes()) && (content == "yes" || content == "no"), "{:?}", String::from_utf8_lossy(&out));
        // Adaptive, the content cannot come first: it could itself begin
        // with a tag, which the reader would take for reasoning.
        let mut c =
            v.compile(&wrap(&crate::Grammar::Regex("<mm:think>.*|y".into()).to_text(), ThinkStart::Adaptive, tags()).unwrap()).unwrap();
        let m = c.mask().unwrap();
        assert!(!allowed(&m, b'y' as u32 - b'!' as u32), "a bare answer before the tag");
        // Open: the reasoning is required, and a bare answer is not allowed
        // until it closes.
        let g = wrap(&choice, ThinkStart::Open, tags()).unwrap();
        let (out, done) = generate(&v, &g, None, thinker);
        assert!(done);
        let (r, c) = content_of(ThinkStart::Open, &out);
        assert!(r.ends_with("zzzz") && (c == "yes" || c == "no"), "{:?}", String::from_utf8_lossy(&out));
        // Closed: the grammar as it was.
        assert_eq!(wrap(&choice, ThinkStart::Closed, tags()).unwrap(), choice);
    }

    /// A model whose EOS is an ordinary token (the tiny fixture's config
    /// names id 2, `#`) and a request that also stops on an ordinary id:
    /// whatever the reasoning, neither is ever allowed before the grammar
    /// is complete, so the answer cannot end before its constraint starts.
    /// The picker takes EOS or the stop id whenever it may, and else a
    /// pseudo-random allowed token.
    #[test]
    fn an_ordinary_eos_or_stop_id_never_ends_a_constrained_answer_early() {
        let (hash, bang) = (b'#' as u32 - b'!' as u32, 0);
        let (v, open, close) = vocabulary_ending_on(Some(hash));
        let schema = serde_json::json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
        let json = crate::Grammar::JsonSchema(schema).to_text();
        for start in [ThinkStart::Open, ThinkStart::Adaptive] {
            for seed in 0..8u32 {
                let mut c = v.compile_stopping(&wrap(&json, start, tags()).unwrap(), &[bang, hash]).unwrap();
                let mut out = Vec::new();
                let mut state = seed.wrapping_mul(2654435761) | 1;
                for step in 0..400 {
                    let m = c.mask().unwrap();
                    assert!(!allowed(&m, bang), "{start:?} seed {seed}: the stop id is allowed at step {step}");
                    if c.is_done() {
                        assert!(allowed(&m, hash), "the EOS once the grammar is complete");
                        break;
                    }
                    assert!(!allowed(&m, hash), "{start:?} seed {seed}: EOS allowed at step {step}: {:?}", String::from_utf8_lossy(&out));
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    // Close the reasoning now and then, as a model would.
                    let want = if state % 7 == 0 {
                        close
                    } else if step == 0 {
                        open
                    } else {
                        state % 100
                    };
                    let id = if allowed(&m, want) { want } else { (0..100).map(|i| (want + i) % 100).find(|&i| allowed(&m, i)).unwrap() };
                    c.consume(id).unwrap();
                    out.extend_from_slice(v.text_of(id));
                }
                assert!(c.is_done(), "{start:?} seed {seed}: {:?}", String::from_utf8_lossy(&out));
                let (_, content) = content_of(start, &out);
                let parsed: serde_json::Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("{e}: {content:?}"));
                assert!(parsed["ok"].is_boolean());
            }
        }
        // The EOS is a special token to grammars: its text is nothing.
        assert_eq!(v.text_of(hash), b"");
    }

    #[test]
    fn a_spent_budget_closes_the_reasoning_and_the_content_still_matches() {
        let (v, _eos, open, close) = vocabulary();
        let schema = serde_json::json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
        let json = crate::Grammar::JsonSchema(schema).to_text();
        // A model that would think forever: it never picks the close.
        let never_closes = |m: &[u32], _| (0..100u32).find(|&i| i != close && allowed(m, i)).unwrap_or(close);
        for start in [ThinkStart::Open, ThinkStart::Adaptive] {
            let g = wrap(&json, start, tags()).unwrap();
            let (out, done) = generate(&v, &g, Some(ThinkBudget { start, budget: 5 }), |m, step| {
                if step == 0 && start == ThinkStart::Adaptive {
                    open
                } else {
                    never_closes(m, step)
                }
            });
            let (reasoning, content) = content_of(start, &out);
            assert!(done, "{start:?}: {:?}", String::from_utf8_lossy(&out));
            assert_eq!(reasoning.len(), 5, "{start:?}: five reasoning tokens, then the forced close: {reasoning:?}");
            let parsed: serde_json::Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("{e}: {content:?}"));
            assert!(parsed["ok"].is_boolean());
        }
        // Without a grammar, the budget alone.
        let mut b = Budget::new(&v, tags(), ThinkBudget { start: ThinkStart::Open, budget: 2 }, true).unwrap();
        assert_eq!(b.forced(), None);
        b.consume(&v, 5);
        b.consume(&v, 6);
        assert_eq!((b.forced(), b.spent()), (Some(close), 2));
        b.consume(&v, close);
        assert_eq!(b.forced(), None, "content is not reasoning");
    }
}
