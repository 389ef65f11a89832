//! Structured output: what a request constrains its output to (a JSON
//! schema, any JSON object, a regular expression, a choice of strings or a
//! Lark grammar), compiled by llguidance (the structured-output engine
//! vLLM and SGLang use) against the model's own tokens, and the
//! allowed-token bitmap of each step that the last stage's sampler applies
//! (`m3c_contract::sampling::row::TOKEN_MASK`).
//!
//! The front checks a request's grammar here before it is admitted (a bad
//! schema is the client's 400); the last stage compiles it again for the
//! sequence and, at every step the sequence draws, asks for the mask, then
//! feeds the drawn token back. The grammar crosses the process boundary as
//! llguidance's own JSON form ([`Grammar::to_text`]).
//!
//! - [`Grammar`]: what the output must match. JSON is compact unless the
//!   schema's `x-guidance` says otherwise; [`pattern_regex`] reads a JSON
//!   schema's `pattern` as a Lark regex (for the server's tool-call grammar).
//! - [`Vocabulary`]: the model's tokens as llguidance sees them, built once
//!   per process. Every EOS id is special to it, whatever the tokenizer
//!   says, so a grammar allows it only once complete.
//! - [`Constraint`]: one sequence's matcher: the allowed-token bitmap of
//!   its next draw (EOS once complete, a request's stop ids never), the
//!   drawn token fed back, drafts followed and rolled back.
//! - [`thinking`]: a chat's reasoning block as one rule (the splitter, the
//!   grammar wrapper and the reasoning budget).
//!
//! `examples/mask_bench.rs` measures the mask and logprob cost per token
//! at a 200,064-id vocabulary.

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

pub mod thinking;

/// Why a grammar or a vocabulary could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConstrainError {
    #[error("{0}")]
    Tokenizer(String),
    #[error("the grammar does not compile: {0}")]
    Grammar(String),
    #[error("the grammar's matcher failed: {0}")]
    Matcher(String),
}

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// A JSON value valid under this JSON schema.
    JsonSchema(Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A string the whole of which matches this regular expression.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect, which vLLM's `grammar` takes).
    Lark(String),
}

impl Grammar {
    /// llguidance's JSON form of the grammar: the one text form it travels in.
    pub fn to_text(&self) -> String {
        let g = match self {
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"}))),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Choice(c) => {
                let alts: Vec<String> = c.iter().map(|s| regex_literal(s)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alts.join("|")))
            }
            Grammar::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
        };
        serde_json::to_string(&g).unwrap_or_default()
    }
}

/// A schema whose JSON is written compactly (`{"a":1}`), as OpenAI's
/// structured outputs are, unless the schema says otherwise (llguidance's
/// `x-guidance` options): free whitespace would let a model pad forever.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// A JSON schema's `pattern` (which matches anywhere in a string unless it
/// is anchored with `^` and `$`) as the text of a Lark regular expression
/// that matches a whole string: `\d`, `\w` and `\s` as ASCII classes, as
/// llguidance's JSON schemas read them. An anchor anywhere but at the ends
/// is an error: the grammar could not say what it means.
pub fn pattern_regex(pattern: &str) -> Result<String, String> {
    let start = pattern.starts_with('^');
    let core = if start { &pattern[1..] } else { pattern };
    // A trailing `$` that is not escaped (an odd count of backslashes before it escapes it).
    let slashes = core.strip_suffix('$').map(|c| c.len() - c.trim_end_matches('\\').len());
    let end = slashes.is_some_and(|n| n % 2 == 0);
    let core = if end { &core[..core.len() - 1] } else { core };
    let (mut escaped, mut class) = (false, false);
    for (i, c) in core.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '[' if !class => class = true,
            ']' if class => class = false,
            '^' if class && core[..i].ends_with('[') => {}
            '^' | '$' if !class => return Err("anchors (`^`, `$`) are supported only at the ends of a pattern".into()),
            _ => {}
        }
    }
    let any = "(?s:.*)";
    let lark = llguidance::regex_to_lark(core, "dws");
    Ok(format!("{}(?:{lark}){}", if start { "" } else { any }, if end { "" } else { any }))
}

/// `s` as a regular expression that matches exactly `s`.
fn regex_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~/\"".contains(c) || c.is_whitespace() && c != ' ' {
            // Escaped, or (for control whitespace) by its code.
            if c.is_whitespace() {
                out.push_str(&format!("\\x{{{:x}}}", c as u32));
                continue;
            }
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The model's tokens as llguidance sees them, and its grammar compiler:
/// built once per process.
pub struct Vocabulary {
    factory: ParserFactory,
    env: TokEnv,
    /// The sampler's vocabulary (the logits' width; may exceed the tokenizer's).
    vocab: usize,
    /// The ids that end a sequence (special to every grammar).
    ends: Vec<u32>,
}

impl Vocabulary {
    /// From the tokenizer of the checkpoint folder `model` (its
    /// `tokenizer.json`), for logits `vocab` wide (`None`: the tokenizer's
    /// own ids), ending on `ends` (the model's EOS ids; see
    /// [`Vocabulary::from_tokenizer_json`]).
    pub fn load(model: &Path, vocab: Option<usize>, ends: &[u32]) -> Result<Vocabulary, ConstrainError> {
        let file = model.join("tokenizer.json");
        let json = m3c_contract::read_user_file(&file, "tokenizer", m3c_contract::input::limits::TOKENIZER)
            .map_err(|e| ConstrainError::Tokenizer(format!("structured output: {e}")))?;
        Vocabulary::from_tokenizer_json(&json, vocab, ends).map_err(|e| ConstrainError::Tokenizer(format!("{}: {e}", file.display())))
    }

    /// From a byte-level `tokenizer.json`'s text. `ends` are the ids that
    /// end a sequence: the first is the EOS a finished grammar allows, and
    /// every one of them is a special token to the grammar, whatever the
    /// tokenizer says. A checkpoint whose EOS is an ordinary token (the
    /// tiny fixture's config names id 2, `#`) would otherwise let a grammar
    /// spell it as text, and the stage would end the answer on it before
    /// the grammar is satisfied. Without any, id 0 stands in for the EOS.
    pub fn from_tokenizer_json(json: &str, vocab: Option<usize>, ends: &[u32]) -> Result<Vocabulary, ConstrainError> {
        let mut words = m3c_contract::token_bytes::byte_level_table(json).map_err(ConstrainError::Tokenizer)?;
        let vocab = vocab.unwrap_or(words.len());
        let eos = ends.first().copied().unwrap_or(0);
        // llguidance indexes its trie by the EOS id: one outside the ids is the config's error.
        if let Some(bad) = [eos].iter().chain(ends).find(|&&e| e as usize >= vocab.max(words.len())) {
            return Err(ConstrainError::Tokenizer(format!("the EOS id {bad} is outside the tokenizer's {} ids", vocab.max(words.len()))));
        }
        let t: Value = serde_json::from_str(json).map_err(|e| ConstrainError::Tokenizer(e.to_string()))?;
        // Special tokens are llguidance's 0xFF-marked words: never text a
        // grammar's string could spell.
        for a in t.get("added_tokens").and_then(Value::as_array).into_iter().flatten() {
            let (Some(id), Some(content)) = (a.get("id").and_then(Value::as_u64), a.get("content").and_then(Value::as_str)) else {
                continue;
            };
            if a.get("special").and_then(Value::as_bool) == Some(true) {
                if let Some(w) = words.get_mut(id as usize) {
                    *w = [&[TokTrie::SPECIAL_TOKEN_MARKER][..], content.as_bytes()].concat();
                }
            }
        }
        // Ids the tokenizer lacks (the logits may be wider): unreachable specials.
        if words.len() > vocab {
            return Err(ConstrainError::Tokenizer(format!("the tokenizer has {} ids, past the model's {vocab}", words.len())));
        }
        let first_missing = words.len();
        words.extend((first_missing..vocab).map(|i| format!("\u{ff}<[{i}]>").into_bytes()));
        for w in words.iter_mut().filter(|w| w.is_empty()) {
            *w = vec![TokTrie::SPECIAL_TOKEN_MARKER, b'<', b'>'];
        }
        for &end in ends {
            let w = &mut words[end as usize];
            if w.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                w.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
        }
        let info = TokRxInfo::new(vocab as u32, eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| ConstrainError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(Vocabulary { factory, env, vocab, ends: ends.to_vec() })
    }

    /// The token whose text is exactly `bytes`, if one is.
    pub fn token_of(&self, bytes: &[u8]) -> Option<u32> {
        let trie = self.env.tok_trie();
        trie.token_id(bytes).filter(|&id| trie.token(id) == bytes)
    }

    /// A token's text as decoding without special tokens gives it (a
    /// special token's is empty).
    pub fn text_of(&self, id: u32) -> &[u8] {
        let trie = self.env.tok_trie();
        if (id as usize) >= self.vocab || trie.is_special_token(id) {
            return &[];
        }
        trie.token(id)
    }

    /// The matcher of a grammar given as [`Grammar::to_text`] (or any of
    /// llguidance's grammar JSON).
    pub fn compile(&self, text: &str) -> Result<Constraint, ConstrainError> {
        self.compile_stopping(text, &[])
    }

    /// The matcher of a grammar for a sequence that also stops on `stops`
    /// (a request's `stop_token_ids`): the grammar decides where the output
    /// ends, so those ids are never allowed while it runs (drawing one
    /// would end the output before the grammar is satisfied), and once it
    /// is complete only the EOS is.
    pub fn compile_stopping(&self, text: &str, stops: &[u32]) -> Result<Constraint, ConstrainError> {
        let grammar: TopLevelGrammar = serde_json::from_str(text).map_err(|e| ConstrainError::Grammar(e.to_string()))?;
        let parser = self.factory.create_parser(grammar).map_err(|e| ConstrainError::Grammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstrainError::Grammar(e));
        }
        // The ends are special tokens to the grammar already: only the EOS
        // is ever allowed, and only once the grammar is complete.
        let forbidden = stops.iter().copied().filter(|s| !self.ends.contains(s) && (*s as usize) < self.vocab).collect();
        Ok(Constraint { matcher, words: m3c_contract::sampling::seen_words(self.vocab), forbidden })
    }
}

/// One sequence's grammar, as far as its output has gone.
pub struct Constraint {
    matcher: Matcher,
    words: usize,
    /// Stop ids the grammar never allows ([`Vocabulary::compile_stopping`]).
    forbidden: Vec<u32>,
}

impl Constraint {
    /// The tokens the next draw may take, as the sampler's bitmap (bit
    /// `i % 32` of word `i / 32`); EOS once the output is complete.
    pub fn mask(&mut self) -> Result<Vec<u32>, ConstrainError> {
        let v = self.matcher.compute_mask_or_eos().map_err(|e| ConstrainError::Matcher(e.to_string()))?;
        let mut out = v.as_slice().to_vec();
        out.resize(self.words, 0);
        for &f in &self.forbidden {
            out[f as usize / 32] &= !(1 << (f % 32));
        }
        Ok(out)
    }

    /// The token the sequence drew.
    pub fn consume(&mut self, id: u32) -> Result<(), ConstrainError> {
        self.matcher.consume_token(id).map_err(|e| ConstrainError::Matcher(e.to_string()))
    }

    /// Consumes `id` if the grammar allows it here (`false`, and nothing
    /// changes, if not): a verify step follows its drafts this way.
    pub fn try_consume(&mut self, id: u32) -> Result<bool, ConstrainError> {
        self.matcher.try_consume_tokens(&[id]).map(|n| n == 1).map_err(|e| ConstrainError::Matcher(e.to_string()))
    }

    /// Takes back the last `n` tokens consumed (a verify step's drafts,
    /// followed to compute each row's mask).
    pub fn rollback(&mut self, n: usize) -> Result<(), ConstrainError> {
        self.matcher.rollback(n).map_err(|e| ConstrainError::Matcher(e.to_string()))
    }

    /// Whether the output is complete (only EOS may follow).
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level tokenizer.json of single printable bytes and a few
    /// merges' worth of longer tokens, with one special EOS.
    pub(crate) fn tokenizer() -> String {
        let mut vocab = serde_json::Map::new();
        // GPT-2's byte alphabet maps printable ASCII to itself.
        for (i, b) in (b'!'..=b'~').enumerate() {
            vocab.insert((b as char).to_string(), serde_json::json!(i));
        }
        let n = vocab.len();
        vocab.insert("Ġ".into(), serde_json::json!(n)); // a space
        vocab.insert("true".into(), serde_json::json!(n + 1));
        vocab.insert("\"a".into(), serde_json::json!(n + 2));
        serde_json::json!({
            "model": {"type": "BPE", "vocab": vocab, "merges": []},
            "decoder": {"type": "ByteLevel"},
            "added_tokens": [{"id": n + 3, "content": "<eos>", "special": true}]
        })
        .to_string()
    }

    fn drive(v: &Vocabulary, g: &Grammar, pick: impl Fn(&[u32]) -> u32) -> (Vec<u32>, bool) {
        let mut c = v.compile(&g.to_text()).unwrap();
        let mut ids = Vec::new();
        for _ in 0..40 {
            let m = c.mask().unwrap();
            let id = pick(&m);
            assert!(m[id as usize / 32] >> (id % 32) & 1 == 1, "picked a disallowed token");
            ids.push(id);
            if c.is_done() {
                break;
            }
            c.consume(id).unwrap();
        }
        (ids, c.is_done())
    }

    #[test]
    fn masks_allow_only_what_the_grammar_can_still_become() {
        let t = tokenizer();
        let eos = 97;
        let v = Vocabulary::from_tokenizer_json(&t, Some(100), &[eos]).unwrap();
        // A choice: the highest allowed id each time spells one of them.
        let g = Grammar::Choice(vec!["yes".into(), "no".into()]);
        let (ids, _) = drive(&v, &g, |m| (0..100u32).rev().find(|&i| m[i as usize / 32] >> (i % 32) & 1 == 1).unwrap());
        let table = m3c_contract::token_bytes::byte_level_table(&t).unwrap();
        let text: Vec<u8> = ids.iter().filter(|&&i| i != eos).flat_map(|&i| table[i as usize].clone()).collect();
        assert!(text == b"yes" || text == b"no", "{:?}", String::from_utf8_lossy(&text));
        assert_eq!(*ids.last().unwrap(), eos, "EOS once complete");
        // A regex, lowest allowed ids.
        let (ids, _) =
            drive(&v, &Grammar::Regex("[0-9]{3}".into()), |m| (0..100u32).find(|&i| m[i as usize / 32] >> (i % 32) & 1 == 1).unwrap());
        let text: Vec<u8> = ids.iter().filter(|&&i| i != eos).flat_map(|&i| table[i as usize].clone()).collect();
        assert_eq!(text, b"000");
        // A JSON schema: the output parses and validates.
        let schema = serde_json::json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
        // (Highest allowed id, but never the space while anything else is
        // allowed; compact JSON has no spaces outside strings anyway.)
        let allowed = |m: &[u32], i: u32| m[i as usize / 32] >> (i % 32) & 1 == 1;
        let (ids, done) = drive(&v, &Grammar::JsonSchema(schema), |m| (0..100u32).rev().find(|&i| i != 94 && allowed(m, i)).unwrap_or(94));
        let text: Vec<u8> = ids.iter().filter(|&&i| i != eos).flat_map(|&i| table[i as usize].clone()).collect();
        let parsed: Value = serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&text)));
        assert!(parsed["ok"].is_boolean() && done, "{parsed}");
    }

    #[test]
    fn bad_grammars_are_errors_that_say_why() {
        let v = Vocabulary::from_tokenizer_json(&tokenizer(), Some(100), &[97]).unwrap();
        let e = v.compile(&Grammar::Regex("(".into()).to_text()).err().expect("an unclosed group");
        assert!(e.to_string().contains("does not compile"), "{e}");
        assert!(v.compile("{not json").is_err());
        assert!(Vocabulary::from_tokenizer_json(&tokenizer(), Some(10), &[9]).is_err(), "a vocabulary narrower than the tokenizer");
        let e = Vocabulary::from_tokenizer_json(&tokenizer(), Some(100), &[100]).err().expect("an EOS past the ids");
        assert!(e.to_string().contains("EOS id 100"), "{e}");
    }

    #[test]
    fn schema_patterns_match_anywhere_unless_anchored() {
        assert_eq!(pattern_regex("a+").unwrap(), "(?s:.*)(?:a+)(?s:.*)");
        assert_eq!(pattern_regex("^a+$").unwrap(), "(?:a+)");
        assert_eq!(pattern_regex("^[^a]\\d$").unwrap(), "(?:[^a][0-9])");
        assert_eq!(pattern_regex("a\\$").unwrap(), "(?s:.*)(?:a\\$)(?s:.*)", "an escaped dollar is a dollar");
        assert!(pattern_regex("^a|^b").is_err());
        assert!(pattern_regex("a$b").is_err());
    }

    #[test]
    fn choices_are_literal() {
        assert_eq!(regex_literal("a.b|c"), "a\\.b\\|c");
        assert_eq!(regex_literal("x\ny"), "x\\x{a}y");
    }
}
