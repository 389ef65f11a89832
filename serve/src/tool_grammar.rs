//! The grammar of a forced tool call (`tool_choice: "required"` or a named
//! function) in the family's call markup (`ToolMarkup`; MiniMax-M3's in
//! `../shared/spec/minimax-m3-chat.md` §3–4, the names below): a
//! `<tool_call>` block of `<invoke name="…">` elements whose arguments are
//! XML elements typed by the tool's JSON schema (nested objects as nested
//! tags, arrays as `<item>` children, every tag preceded by the mark,
//! `]<]minimax[>[`). It is written
//! in llguidance's Lark, so the sampler's mask makes the model's output a
//! call that [`crate::output`] parses into arguments valid under the schema,
//! whatever the weights.
//!
//! Leaf values are text without `<` (the XML reader's delimiter), so each
//! leaf and the closing tag after it are one regular-expression terminal:
//! the lexer then needs no lookahead to see where a value ends. The
//! grammar enforces `type` (one or a list), `enum` and `const` of scalars,
//! `minLength`, `maxLength` and `pattern` of strings, `minimum`,
//! `maximum`, their exclusive forms and `multipleOf` of numbers (as
//! llguidance's JSON schemas do, through a nested `%json` rule), nested
//! `properties` with `required`, `items` with `minItems` and `maxItems`,
//! `anyOf`, and local `$ref`s into `$defs` (as Pydantic writes nested
//! models). A keyword that the grammar cannot enforce (`oneOf`'s "exactly
//! one", `uniqueItems`, a recursive `$ref`, ...) is refused by its path
//! rather than ignored, so a forced call always validates.

use m3c_contract::chat_format::ToolMarkup;
use serde_json::{Map, Value};

/// Keywords that only describe a value, and the ones the grammar enforces.
const KNOWN: &[&str] = &[
    "type",
    "properties",
    "required",
    "items",
    "enum",
    "const",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "pattern",
    "anyOf",
    "$ref",
    "$defs",
    "definitions",
    "additionalProperties",
    "description",
    "title",
    "default",
    "examples",
    "format",
    "$schema",
    "strict",
];

/// The longest `maxLength`, `minItems` or `maxItems` the grammar spells out
/// as a counted repetition.
const MAX_COUNT: u64 = 1024;

/// The numeric keywords a nested `%json` rule enforces.
const NUMERIC: &[&str] = &["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"];

/// The deepest nesting of `$ref`s and alternatives followed.
const MAX_DEPTH: usize = 32;

/// A tool schema the grammar cannot express: the path of the offending
/// part (`tools[0].function.parameters.properties.days.minimum`) and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{path}`: {why}")]
pub struct ToolGrammarError {
    pub path: String,
    pub why: String,
}

/// Which calls the output must make.
#[derive(Debug, Clone, PartialEq)]
pub enum Forced {
    /// One or more calls of any of the tools (`"required"`).
    Any,
    /// A call of this function.
    Named(String),
}

/// The Lark grammar of a block of calls of `tools` (the request's, each
/// `{"type": "function", "function": {...}}`): one call when `single`
/// (`parallel_tool_calls: false`, or a named function), else one or more.
pub fn forced_calls(m: &ToolMarkup, tools: &[Value], forced: &Forced, single: bool) -> Result<String, ToolGrammarError> {
    let mut g = Writer { mark: m.mark, item: m.item, rules: Vec::new(), root: Value::Null, refs: Vec::new() };
    let (mark, invoke, block) = (m.mark, m.invoke, m.block);
    let mut calls = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let f = &t["function"];
        let Some(name) = f["name"].as_str() else { continue };
        if matches!(forced, Forced::Named(n) if n != name) {
            continue;
        }
        let path = format!("tools[{i}].function");
        if name.is_empty() || name.contains(['"', '<', '>']) {
            return Err(ToolGrammarError {
                path: format!("{path}.name"),
                why: "a forced call's name may not be empty or hold `\"`, `<` or `>`".into(),
            });
        }
        let empty = Value::Object(Map::new());
        let params = if f["parameters"].is_null() { &empty } else { &f["parameters"] };
        g.root = params.clone();
        let args = g.object_body(params, &format!("{path}.parameters"))?;
        let rule = g.rule(format!("{} {args} {}", lit(&format!("{mark}<{invoke} name=\"{name}\">")), lit(&format!("{mark}</{invoke}>\n"))));
        calls.push(rule);
    }
    if calls.is_empty() {
        let why = match forced {
            Forced::Any => "`tool_choice: \"required\"` needs at least one tool".to_string(),
            Forced::Named(n) => format!("`tool_choice` names `{n}`, which is not among `tools`"),
        };
        return Err(ToolGrammarError { path: "tool_choice".into(), why });
    }
    let call = g.rule(calls.join(" | "));
    let repeat = if single { "" } else { "+" };
    let start = format!("start: {} {call}{repeat} {}\n", lit(&format!("{mark}<{block}>\n")), lit(&format!("{mark}</{block}>")));
    Ok(start + &g.rules.join(""))
}

/// The grammar's rules, numbered as they are made.
struct Writer {
    /// The markup's mark and array-element tag.
    mark: &'static str,
    item: &'static str,
    rules: Vec<String>,
    /// The tool's parameters schema, which `$ref`s point into.
    root: Value,
    /// The `$ref`s being followed (a recursive one is refused).
    refs: Vec<String>,
}

impl Writer {
    /// A new rule with this body; its name.
    fn rule(&mut self, body: String) -> String {
        let name = format!("r{}", self.rules.len());
        self.rules.push(format!("{name}: {body}\n"));
        name
    }

    /// A new terminal (a regular expression, or several that must all
    /// match: `&`); its name.
    fn terminal(&mut self, body: String) -> String {
        let name = format!("T{}", self.rules.len());
        self.rules.push(format!("{name}: {body}\n"));
        name
    }

    /// The schema a `$ref` points to (`#/$defs/...`, `#/definitions/...`).
    fn target(&self, r: &str, path: &str) -> Result<Value, ToolGrammarError> {
        let bad = |why: String| ToolGrammarError { path: format!("{path}.$ref"), why };
        let Some(at) = r.strip_prefix("#/") else { return Err(bad(format!("`{r}`: only local references (`#/$defs/...`) are followed"))) };
        let mut v = &self.root;
        for part in at.split('/') {
            v = v.get(part.replace("~1", "/").replace("~0", "~").as_str()).ok_or_else(|| bad(format!("`{r}` points to nothing")))?;
        }
        Ok(v.clone())
    }

    /// `schema`'s value, following a `$ref` (refused when it recurses).
    fn follow(&mut self, schema: &Value, tag: &str, path: &str) -> Result<String, ToolGrammarError> {
        let Some(r) = schema.get("$ref").and_then(Value::as_str) else { return self.value_here(schema, tag, path) };
        if let Some(k) =
            schema.as_object().and_then(|o| o.keys().find(|k| !matches!(k.as_str(), "$ref" | "description" | "title" | "default")))
        {
            return Err(ToolGrammarError {
                path: format!("{path}.{k}"),
                why: "a forced call takes nothing beside a `$ref` but annotations".into(),
            });
        }
        if self.refs.iter().any(|x| x == r) || self.refs.len() >= MAX_DEPTH {
            return Err(ToolGrammarError {
                path: format!("{path}.$ref"),
                why: format!("`{r}` is recursive, which a forced call cannot spell out"),
            });
        }
        let target = self.target(r, path)?;
        self.refs.push(r.to_string());
        let v = self.value(&target, tag, &format!("{path}<{r}>"));
        self.refs.pop();
        v
    }

    /// The elements of an object's properties, in the schema's order:
    /// required ones always, the others optionally.
    fn object_body(&mut self, schema: &Value, path: &str) -> Result<String, ToolGrammarError> {
        check_keywords(schema, path)?;
        match schema.get("type") {
            None => {}
            Some(Value::String(t)) if t == "object" => {}
            Some(_) => return Err(ToolGrammarError { path: format!("{path}.type"), why: "a tool's parameters must be an object".into() }),
        }
        let required: Vec<&str> = schema["required"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        let empty = Map::new();
        let props = schema["properties"].as_object().unwrap_or(&empty);
        if let Some(r) = required.iter().find(|r| !props.contains_key(**r)) {
            return Err(ToolGrammarError {
                path: format!("{path}.required"),
                why: format!("`{r}` is required but not among the properties"),
            });
        }
        let mut parts = Vec::new();
        for (k, sub) in props {
            let here = format!("{path}.properties.{k}");
            if k.is_empty() || !k.chars().all(|c| c.is_alphanumeric() || "_-.:".contains(c)) {
                return Err(ToolGrammarError {
                    path: here,
                    why: "a forced call's argument names are letters, digits, `_`, `-`, `.` and `:`".into(),
                });
            }
            let element = format!("{} {}", lit(&format!("{}<{k}>", self.mark)), self.value(sub, k, &here)?);
            parts.push(if required.contains(&k.as_str()) { element } else { format!("({element})?") });
        }
        Ok(parts.join(" "))
    }

    /// A value under `schema` and then its closing tag `</tag>`.
    fn value(&mut self, schema: &Value, tag: &str, path: &str) -> Result<String, ToolGrammarError> {
        check_keywords(schema, path)?;
        self.follow(schema, tag, path)
    }

    /// The same, for a schema that is not a `$ref`.
    fn value_here(&mut self, schema: &Value, tag: &str, path: &str) -> Result<String, ToolGrammarError> {
        if let Some(alts) = schema.get("anyOf") {
            return self.any_of(schema, alts, tag, path);
        }
        let close = format!("{}</{tag}>", self.mark);
        if let Some(values) = schema.get("enum").or(schema.get("const")) {
            let list: Vec<&Value> = match values {
                Value::Array(a) if schema.get("enum").is_some() => a.iter().collect(),
                v => vec![v],
            };
            let mut texts = Vec::with_capacity(list.len());
            for v in list {
                texts.push(leaf_text(v).ok_or_else(|| ToolGrammarError {
                    path: path.into(),
                    why: "a forced call's enum values are strings without `<`, numbers, booleans or null".into(),
                })?);
            }
            return Ok(format!("/(?:{}){}/", texts.iter().map(|t| escape(t)).collect::<Vec<_>>().join("|"), escape(&close)));
        }
        let types: Vec<&str> = match schema.get("type") {
            None => vec!["string"],
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            Some(_) => return Err(ToolGrammarError { path: format!("{path}.type"), why: "expected a type name or a list of them".into() }),
        };
        let mut alts = Vec::new();
        for t in types {
            alts.push(match t {
                "string" => self.string(schema, &close, path)?,
                "integer" | "number" if NUMERIC.iter().any(|k| schema.get(*k).is_some()) => {
                    // The bounds as llguidance's JSON schemas enforce them:
                    // a nested JSON number, which MiniMax-M3 writes as is.
                    let mut num = Map::new();
                    num.insert("type".into(), Value::String(t.into()));
                    for k in NUMERIC {
                        if let Some(v) = schema.get(*k) {
                            num.insert((*k).into(), v.clone());
                        }
                    }
                    format!("%json {} {}", Value::Object(num), lit(&close))
                }
                "integer" => format!("/-?(?:0|[1-9][0-9]{{0,17}}){}/", escape(&close)),
                "number" => format!("/-?(?:0|[1-9][0-9]{{0,17}})(?:\\.[0-9]{{1,17}})?(?:[eE][+-]?[0-9]{{1,2}})?{}/", escape(&close)),
                "boolean" => format!("/(?:true|false){}/", escape(&close)),
                "null" => format!("/{}/", escape(&close)),
                "object" => {
                    let body = self.object_body(schema, path)?;
                    self.rule(format!("{body} {}", lit(&close)))
                }
                "array" => {
                    let empty = Value::Object(Map::new());
                    let items = schema.get("items").unwrap_or(&empty);
                    let item = self.item;
                    let item = format!("{} {}", lit(&format!("{}<{item}>", self.mark)), self.value(items, item, &format!("{path}.items"))?);
                    let item = self.rule(item);
                    let min = count(schema, "minItems", path)?.unwrap_or(0);
                    let max = count(schema, "maxItems", path)?.map_or(String::new(), |m| m.to_string());
                    self.rule(format!("{item}{{{min},{max}}} {}", lit(&close)))
                }
                other => {
                    return Err(ToolGrammarError { path: format!("{path}.type"), why: format!("`{other}` is not a JSON schema type") })
                }
            });
        }
        Ok(if alts.len() == 1 { alts.remove(0) } else { format!("({})", alts.join(" | ")) })
    }

    /// A string: text without `<` (the value's delimiter) of the allowed
    /// length, matching the `pattern` if there is one, then the closing tag.
    fn string(&mut self, schema: &Value, close: &str, path: &str) -> Result<String, ToolGrammarError> {
        let min = count(schema, "minLength", path)?.unwrap_or(0);
        let max = count(schema, "maxLength", path)?.map_or(String::new(), |m| m.to_string());
        let text = format!("/[^<]{{{min},{max}}}{}/", escape(close));
        match schema.get("pattern") {
            None => Ok(text),
            Some(Value::String(p)) => {
                let rx = m3c_constrain::pattern_regex(p).map_err(|why| ToolGrammarError { path: format!("{path}.pattern"), why })?;
                Ok(self.terminal(format!("{text} & /{rx}{}/", escape(close))))
            }
            Some(_) => Err(ToolGrammarError { path: format!("{path}.pattern"), why: "expected a regular expression (a string)".into() }),
        }
    }

    /// `anyOf`: any of the alternatives (nothing beside them but annotations).
    fn any_of(&mut self, schema: &Value, alts: &Value, tag: &str, path: &str) -> Result<String, ToolGrammarError> {
        let annotations = ["anyOf", "description", "title", "default", "examples", "$defs", "definitions"];
        if let Some(k) = schema.as_object().and_then(|o| o.keys().find(|k| !annotations.contains(&k.as_str()))) {
            return Err(ToolGrammarError {
                path: format!("{path}.{k}"),
                why: "a forced call takes nothing beside `anyOf` but annotations".into(),
            });
        }
        let list = alts
            .as_array()
            .filter(|a| !a.is_empty())
            .ok_or_else(|| ToolGrammarError { path: format!("{path}.anyOf"), why: "expected a non-empty list of schemas".into() })?;
        if self.refs.len() >= MAX_DEPTH {
            return Err(ToolGrammarError { path: format!("{path}.anyOf"), why: "nested too deeply".into() });
        }
        let mut out = Vec::with_capacity(list.len());
        for (i, a) in list.iter().enumerate() {
            self.refs.push(String::new());
            let v = self.value(a, tag, &format!("{path}.anyOf[{i}]"));
            self.refs.pop();
            out.push(v?);
        }
        Ok(format!("({})", out.join(" | ")))
    }
}

/// Refuses a keyword the grammar would not enforce.
fn check_keywords(schema: &Value, path: &str) -> Result<(), ToolGrammarError> {
    let Some(o) = schema.as_object() else {
        return Err(ToolGrammarError { path: path.into(), why: "expected a JSON schema object".into() });
    };
    if let Some(k) = o.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(ToolGrammarError { path: format!("{path}.{k}"), why: format!("a forced tool call cannot enforce `{k}`") });
    }
    if matches!(o.get("additionalProperties"), Some(v) if !v.is_boolean()) {
        return Err(ToolGrammarError {
            path: format!("{path}.additionalProperties"),
            why: "a forced tool call takes only `true` or `false` here (it writes the listed properties only)".into(),
        });
    }
    Ok(())
}

/// A length or count keyword, when given: an integer up to [`MAX_COUNT`].
fn count(schema: &Value, key: &str, path: &str) -> Result<Option<u64>, ToolGrammarError> {
    match schema.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|&n| n <= MAX_COUNT)
            .map(Some)
            .ok_or_else(|| ToolGrammarError { path: format!("{path}.{key}"), why: format!("expected an integer from 0 to {MAX_COUNT}") }),
    }
}

/// The text an enum value is written as in a call (what the reader types
/// back by the schema), if it can be written.
fn leaf_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.contains('<') => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Null => Some(String::new()),
        _ => None,
    }
}

/// A Lark string literal of `s`.
fn lit(s: &str) -> String {
    Value::String(s.into()).to_string()
}

/// `s` as a literal inside a `/…/` terminal: regex metacharacters and the
/// delimiter escaped (`<` and `>` are not: `\<` is a word boundary in Rust's
/// regex syntax).
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        match c {
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$' | '#' | '&' | '-' | '~' | '/' => {
                out.push('\\');
                out.push(c);
            }
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn markup() -> &'static ToolMarkup {
        &m3c_contract::chat_format::ChatFormat::of_family("minimax_m3").unwrap().tools
    }
    use serde_json::json;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer"},
                "unit": {"enum": ["c", "f"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                "options": {"type": "object", "properties": {"hourly": {"type": "boolean"}}},
            },
            "required": ["city", "days"],
        }}})
    }

    #[test]
    fn a_forced_call_is_a_lark_grammar_over_the_tools() {
        let g =
            forced_calls(markup(), &[weather(), json!({"type": "function", "function": {"name": "noop"}})], &Forced::Any, false).unwrap();
        assert!(g.starts_with("start: \"]<]minimax[>[<tool_call>\\n\" r"), "{g}");
        assert!(g.contains("+ \"]<]minimax[>[</tool_call>\""), "one or more calls: {g}");
        assert!(g.contains("\"]<]minimax[>[<invoke name=\\\"get_weather\\\">\""), "{g}");
        assert!(g.contains("/[^<]{0,12}\\]<\\]minimax\\[>\\[<\\/city>/"), "a bounded string and its closing tag: {g}");
        assert!(g.contains("(\"]<]minimax[>[<unit>\" /(?:c|f)\\]<\\]minimax\\[>\\[<\\/unit>/)?"), "an optional enum: {g}");
        assert!(g.contains("{0,2} \"]<]minimax[>[</tags>\""), "maxItems: {g}");
        let one = forced_calls(markup(), &[weather()], &Forced::Named("get_weather".into()), true).unwrap();
        assert!(!one.contains("r1+") && !one.contains(") +"), "a named call is one call: {one}");
    }

    #[test]
    fn what_the_grammar_cannot_enforce_is_refused_by_path() {
        let mut t = weather();
        t["function"]["parameters"]["properties"]["tags"]["uniqueItems"] = json!(true);
        let e = forced_calls(markup(), &[t], &Forced::Any, false).unwrap_err();
        assert_eq!(e.path, "tools[0].function.parameters.properties.tags.uniqueItems");
        let mut t = weather();
        t["function"]["parameters"]["properties"]["city"]["oneOf"] = json!([{"type": "string"}]);
        assert!(forced_calls(markup(), &[t], &Forced::Any, false).unwrap_err().path.ends_with("city.oneOf"));
        let mut t = weather();
        t["function"]["parameters"]["properties"]["city"]["pattern"] = json!("^a|^b");
        assert!(forced_calls(markup(), &[t], &Forced::Any, false).unwrap_err().path.ends_with("city.pattern"));
        // A model that contains itself cannot be spelled out.
        let mut t = weather();
        t["function"]["parameters"]["$defs"] = json!({"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}});
        t["function"]["parameters"]["properties"]["tree"] = json!({"$ref": "#/$defs/Node"});
        let e = forced_calls(markup(), &[t], &Forced::Any, false).unwrap_err();
        assert!(e.path.ends_with(".$ref") && e.why.contains("recursive"), "{e}");
        let e = forced_calls(markup(), &[weather()], &Forced::Named("search".into()), true).unwrap_err();
        assert_eq!(e.path, "tool_choice");
        assert!(forced_calls(markup(), &[], &Forced::Any, false).is_err());
        let mut t = weather();
        t["function"]["parameters"]["required"] = json!(["zip"]);
        assert_eq!(forced_calls(markup(), &[t], &Forced::Any, false).unwrap_err().path, "tools[0].function.parameters.required");
        let mut t = weather();
        t["function"]["parameters"]["properties"]["a b"] = json!({"type": "string"});
        assert!(forced_calls(markup(), &[t], &Forced::Any, false).unwrap_err().path.ends_with("properties.a b"));
    }

    /// Every keyword the grammar takes, sampled: random tokens among those
    /// the mask allows, through the fixture's real tokenizer, read back by
    /// the chat reader; each call satisfies its schema.
    #[test]
    fn sampled_forced_calls_satisfy_every_keyword() {
        use crate::output::{ChatOutput, Reading};
        use m3c_constrain::thinking::ThinkStart;
        let tool = json!({"type": "function", "function": {"name": "book", "parameters": {
            "type": "object",
            "properties": {
                "seats": {"type": "integer", "minimum": 1, "maximum": 9},
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5},
                "step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
                "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
                "note": {"type": "string", "pattern": "ok", "maxLength": 6},
                "name": {"type": "string", "minLength": 2, "maxLength": 4},
                "class": {"enum": ["eco", "biz"]},
                "fixed": {"const": 7},
                "who": {"$ref": "#/$defs/Person"},
                "maybe": {"anyOf": [{"type": "integer", "minimum": 100}, {"type": "null"}]},
                "legs": {"type": "array", "items": {"$ref": "#/$defs/Leg"}, "minItems": 1, "maxItems": 2},
            },
            "required": ["seats", "price", "step", "code", "note", "name", "class", "fixed", "who", "maybe", "legs"],
            "$defs": {
                "Person": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}}, "required": ["age"]},
                "Leg": {"type": "object", "properties": {"to": {"type": "string", "minLength": 3, "maxLength": 3}}, "required": ["to"]},
            },
        }}});
        let grammar = forced_calls(markup(), std::slice::from_ref(&tool), &Forced::Any, true).unwrap();
        let tokenizer = include_str!("../../tests/fixtures/tiny-m3/tokenizer.json");
        let eos = 494;
        let v = m3c_constrain::Vocabulary::from_tokenizer_json(tokenizer, Some(512), &[eos]).unwrap();
        let table = m3c_contract::token_bytes::byte_level_table(tokenizer).unwrap();
        let mut calls = 0;
        for seed in 0..12u64 {
            let mut c = v.compile(&m3c_constrain::Grammar::Lark(grammar.clone()).to_text()).unwrap();
            let mut out = Vec::new();
            let mut st = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            for _ in 0..3000 {
                let m = c.mask().unwrap();
                if c.is_done() {
                    break;
                }
                let allowed: Vec<u32> = (0..512u32).filter(|&i| m[i as usize / 32] >> (i % 32) & 1 == 1).collect();
                st ^= st << 13;
                st ^= st >> 7;
                st ^= st << 17;
                // Now and then the shortest way on (the highest-numbered
                // tokens are the tags), so values end.
                let id = if st % 4 == 0 { *allowed.last().unwrap() } else { allowed[(st >> 8) as usize % allowed.len()] };
                c.consume(id).unwrap();
                out.extend_from_slice(&table[id as usize]);
            }
            assert!(c.is_done(), "seed {seed}: {:?}", String::from_utf8_lossy(&out));
            let text = String::from_utf8(out).unwrap();
            let mut o = ChatOutput::new(
                m3c_contract::chat_format::ChatFormat::of_family("minimax_m3").unwrap(),
                ThinkStart::Closed,
                Reading::ForcedCalls,
                std::slice::from_ref(&tool),
            );
            o.push(&text);
            o.finish();
            assert!(o.content.is_empty() && o.tool_calls.len() == 1 && !o.cut(), "seed {seed}: {text:?}");
            let a: Value = serde_json::from_str(&o.tool_calls[0].arguments).unwrap();
            let n = |k: &str| a[k].as_f64().unwrap_or_else(|| panic!("seed {seed}: {k} in {a}"));
            let s = |k: &str| a[k].as_str().unwrap_or_else(|| panic!("seed {seed}: {k} in {a}")).to_string();
            assert!(a["seats"].is_i64() && (1.0..=9.0).contains(&n("seats")), "{a}");
            assert!(n("price") > 0.0 && n("price") <= 2.5, "{a}");
            assert!(a["step"].is_i64() && n("step") as i64 % 5 == 0 && (0.0..=50.0).contains(&n("step")), "{a}");
            let code = s("code");
            assert!(
                code.len() == 3 && code[..2].chars().all(|c| c.is_ascii_uppercase()) && code[2..].chars().all(|c| c.is_ascii_digit()),
                "{a}"
            );
            assert!(s("note").contains("ok") && s("note").chars().count() <= 6, "{a}");
            assert!((2..=4).contains(&s("name").chars().count()), "{a}");
            assert!(s("class") == "eco" || s("class") == "biz", "{a}");
            assert_eq!(a["fixed"], json!(7));
            assert!((18.0..=99.0).contains(&a["who"]["age"].as_f64().unwrap()), "{a}");
            assert!(a["maybe"].is_null() || a["maybe"].as_i64().is_some_and(|m| m >= 100), "{a}");
            let legs = a["legs"].as_array().unwrap();
            assert!((1..=2).contains(&legs.len()) && legs.iter().all(|l| l["to"].as_str().unwrap().chars().count() == 3), "{a}");
            calls += 1;
        }
        assert_eq!(calls, 12);
    }
}
