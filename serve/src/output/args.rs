//! What a tool's JSON schema says about an argument the model writes as
//! text: which JSON types it may take, the schema of a nested property or
//! array item, and the text's value (MiniMax-M3 writes leaves as plain
//! text: `3`, `true`, `Paris`). Local `$ref`s (`#/$defs/...`,
//! `#/definitions/...`, as Pydantic writes nested models), `anyOf`,
//! `oneOf`, `enum` and `const` are followed. A value that does not read
//! as any type its schema allows stays the text it is (a string), as the
//! reference parsers keep it: the call is still returned, and the client
//! sees what the model wrote.

use serde_json::{Map, Value};

/// JSON types, as a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Types(u8);

impl Types {
    pub const STRING: Types = Types(1);
    pub const INTEGER: Types = Types(2);
    pub const NUMBER: Types = Types(4);
    pub const BOOLEAN: Types = Types(8);
    pub const NULL: Types = Types(16);
    pub const OBJECT: Types = Types(32);
    pub const ARRAY: Types = Types(64);

    fn of_name(name: &str) -> Types {
        match name {
            "string" => Types::STRING,
            "integer" => Types::INTEGER,
            "number" => Types::NUMBER,
            "boolean" => Types::BOOLEAN,
            "null" => Types::NULL,
            "object" => Types::OBJECT,
            "array" => Types::ARRAY,
            _ => Types(0),
        }
    }

    fn of_value(v: &Value) -> Types {
        match v {
            Value::Null => Types::NULL,
            Value::Bool(_) => Types::BOOLEAN,
            Value::Number(n) if n.is_i64() || n.is_u64() => Types::INTEGER,
            Value::Number(_) => Types::NUMBER,
            Value::String(_) => Types::STRING,
            Value::Array(_) => Types::ARRAY,
            Value::Object(_) => Types::OBJECT,
        }
    }

    /// Nothing known: any type.
    pub fn unknown(self) -> bool {
        self.0 == 0
    }

    pub fn has(self, t: Types) -> bool {
        self.0 & t.0 != 0
    }

    /// Exactly these types (and no other).
    pub fn only(self, t: Types) -> bool {
        self.0 != 0 && self.0 & !t.0 == 0
    }

    /// Both sets.
    pub const fn with(self, t: Types) -> Types {
        Types(self.0 | t.0)
    }
}

/// The deepest chain of `$ref`s followed.
const MAX_REFS: usize = 16;

/// `schema` with its local `$ref` followed (within `root`, the tool's
/// parameters); a `$ref` that points nowhere is an unknown schema.
pub fn resolve<'a>(mut schema: &'a Value, root: &'a Value) -> &'a Value {
    for _ in 0..MAX_REFS {
        let Some(r) = schema.get("$ref").and_then(Value::as_str) else { return schema };
        let Some(path) = r.strip_prefix("#/") else { return &Value::Null };
        let mut at = root;
        for part in path.split('/') {
            let part = part.replace("~1", "/").replace("~0", "~");
            at = match at.get(part.as_str()) {
                Some(v) => v,
                None => return &Value::Null,
            };
        }
        schema = at;
    }
    &Value::Null
}

/// The alternatives of `anyOf`/`oneOf`, each resolved (or the schema itself).
fn alternatives<'a>(schema: &'a Value, root: &'a Value) -> Vec<&'a Value> {
    let s = resolve(schema, root);
    for k in ["anyOf", "oneOf"] {
        if let Some(alts) = s.get(k).and_then(Value::as_array) {
            return alts.iter().flat_map(|a| alternatives(a, root)).collect();
        }
    }
    vec![s]
}

/// The JSON types `schema` allows (none known: empty).
pub fn types(schema: &Value, root: &Value) -> Types {
    let mut t = Types::default();
    for s in alternatives(schema, root) {
        t = t.with(own_types(s));
    }
    t
}

fn own_types(s: &Value) -> Types {
    if let Some(c) = s.get("const") {
        return Types::of_value(c);
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        return e.iter().fold(Types::default(), |t, v| t.with(Types::of_value(v)));
    }
    match s.get("type") {
        Some(Value::String(n)) => Types::of_name(n),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).fold(Types::default(), |t, n| t.with(Types::of_name(n))),
        _ if s.get("properties").is_some() => Types::OBJECT,
        _ if s.get("items").is_some() => Types::ARRAY,
        _ => Types::default(),
    }
}

/// The schema of property `key` of an object under `schema` (unknown when
/// no alternative names it or allows more properties).
pub fn property(schema: &Value, key: &str, root: &Value) -> Value {
    let alts = alternatives(schema, root);
    for s in &alts {
        if let Some(p) = s.get("properties").and_then(|p| p.get(key)) {
            return resolve(p, root).clone();
        }
    }
    for s in &alts {
        if let Some(extra @ Value::Object(_)) = s.get("additionalProperties") {
            return resolve(extra, root).clone();
        }
    }
    Value::Null
}

/// Whether an object under `schema` names `key` among its properties.
pub fn names(schema: &Value, key: &str, root: &Value) -> bool {
    alternatives(schema, root).iter().any(|s| s.get("properties").and_then(|p| p.get(key)).is_some())
}

/// The schema of the items of an array under `schema`.
pub fn items(schema: &Value, root: &Value) -> Value {
    for s in alternatives(schema, root) {
        if let Some(i) = s.get("items") {
            return resolve(i, root).clone();
        }
    }
    Value::Null
}

/// The value of a leaf the model wrote as `text`, by the types `schema`
/// allows: a number, boolean or null when the (trimmed) text reads as
/// one, an object or array when it is that JSON, a string (untrimmed)
/// when strings are allowed; with nothing known, JSON if it parses, else
/// the string. Text that reads as no allowed type stays a string.
pub fn typed(text: &str, schema: &Value, root: &Value) -> Value {
    let t = types(schema, root);
    let trimmed = text.trim();
    if t.unknown() {
        return serde_json::from_str(trimmed).unwrap_or_else(|_| Value::String(text.to_string()));
    }
    let nullish = trimmed.is_empty() || (!t.has(Types::STRING) && (trimmed == "null" || trimmed == "None"));
    if t.has(Types::NULL) && nullish {
        return Value::Null;
    }
    if t.has(Types::BOOLEAN) {
        match trimmed {
            "true" | "True" => return Value::Bool(true),
            "false" | "False" => return Value::Bool(false),
            _ => {}
        }
    }
    if t.has(Types::INTEGER) || t.has(Types::NUMBER) {
        if let Ok(Value::Number(n)) = serde_json::from_str::<Value>(trimmed) {
            let integral = n.is_i64() || n.is_u64();
            if t.has(Types::NUMBER) || integral {
                return Value::Number(n);
            }
            // `3.0` for an integer: the integer it is.
            if let Some(i) = n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15) {
                return Value::from(i as i64);
            }
        }
    }
    if t.has(Types::OBJECT) || t.has(Types::ARRAY) {
        match serde_json::from_str::<Value>(trimmed) {
            Ok(v @ Value::Object(_)) if t.has(Types::OBJECT) => return v,
            Ok(v @ Value::Array(_)) if t.has(Types::ARRAY) => return v,
            _ => {}
        }
        if trimmed.is_empty() && !t.has(Types::STRING) {
            return if t.has(Types::OBJECT) { Value::Object(Map::new()) } else { Value::Array(Vec::new()) };
        }
    }
    if trimmed.is_empty() && !t.has(Types::STRING) {
        return Value::Null;
    }
    Value::String(text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn leaves_are_typed_by_their_schema_and_kept_as_text_when_they_do_not_read() {
        let root = json!({});
        let t = |text: &str, s: Value| typed(text, &s, &root);
        assert_eq!(t("3", json!({"type": "integer"})), json!(3));
        assert_eq!(t(" 3 ", json!({"type": "integer"})), json!(3));
        assert_eq!(t("3.0", json!({"type": "integer"})), json!(3));
        assert_eq!(t("2.5", json!({"type": "integer"})), json!("2.5"), "not an integer: the text");
        assert_eq!(t("1e-07", json!({"type": "number"})), json!(1e-07));
        assert_eq!(t("three", json!({"type": "integer"})), json!("three"));
        assert_eq!(t("True", json!({"type": "boolean"})), json!(true));
        assert_eq!(t(" Paris ", json!({"type": "string"})), json!(" Paris "), "strings are kept whole");
        assert_eq!(t("", json!({"type": "string"})), json!(""));
        assert_eq!(t("", json!({"type": "integer"})), Value::Null);
        assert_eq!(t("", json!({"anyOf": [{"type": "string"}, {"type": "null"}]})), Value::Null);
        assert_eq!(t("x", json!({"anyOf": [{"type": "string"}, {"type": "null"}]})), json!("x"));
        assert_eq!(t("[1, 2]", json!({"type": "array"})), json!([1, 2]));
        assert_eq!(t("", json!({"type": "array"})), json!([]));
        assert_eq!(t("{\"a\": 1}", json!({"type": "object"})), json!({"a": 1}));
        assert_eq!(t("3", json!({"enum": ["3", "4"]})), json!("3"), "a string enum keeps its text");
        assert_eq!(t("3", json!({"enum": [3, 4]})), json!(3));
        assert_eq!(t("3", Value::Null), json!(3), "unknown: JSON if it parses");
        assert_eq!(t("Paris", Value::Null), json!("Paris"));
    }

    #[test]
    fn refs_alternatives_properties_and_items_are_followed() {
        let root = json!({
            "type": "object",
            "properties": {"opts": {"$ref": "#/$defs/Opts"}, "maybe": {"anyOf": [{"$ref": "#/$defs/Opts"}, {"type": "null"}]}},
            "$defs": {"Opts": {"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": false}},
        });
        let opts = property(&root, "opts", &root);
        assert!(types(&opts, &root).only(Types::OBJECT));
        assert_eq!(property(&opts, "n", &root), json!({"type": "integer"}));
        let maybe = property(&root, "maybe", &root);
        assert!(types(&maybe, &root).has(Types::NULL) && types(&maybe, &root).has(Types::OBJECT));
        assert_eq!(property(&maybe, "n", &root), json!({"type": "integer"}));
        assert!(names(&root, "opts", &root) && !names(&root, "zzz", &root));
        assert_eq!(property(&root, "zzz", &root), Value::Null);
        let list = json!({"type": "array", "items": {"type": "string"}});
        assert!(types(&items(&list, &root), &root).only(Types::STRING));
        assert_eq!(resolve(&json!({"$ref": "#/nowhere"}), &root), &Value::Null);
    }
}
