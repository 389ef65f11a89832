//! The chat template of `tokenizer_config.json`, rendered by MiniJinja set
//! up the way transformers sets up Jinja2 (`trim_blocks`, `lstrip_blocks`,
//! loop controls, `raise_exception`, Python's string and dict methods, and
//! Python's `tojson` and float spelling), so that the prompt is the same
//! bytes the reference renders.

use super::pyjson;
use super::TextError;
use m3c_contract::chat_format::ChatFormat;
use m3c_contract::input::{limits, read_user_file};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use std::path::{Path, PathBuf};

/// How a chat turn asks the model to think (`thinking_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkingMode {
    Enabled,
    Disabled,
    Adaptive,
}

impl ThinkingMode {
    pub fn name(self) -> &'static str {
        match self {
            ThinkingMode::Enabled => "enabled",
            ThinkingMode::Disabled => "disabled",
            ThinkingMode::Adaptive => "adaptive",
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// The family's markers (reasoning tags, tool-call markup, media
    /// tokens), by the checkpoint's `config.json`.
    pub format: &'static ChatFormat,
    /// The tokenizer's special tokens as template variables (`bos_token`, ...).
    specials: Vec<(String, Value)>,
    pub file: PathBuf,
}

/// A token entry of tokenizer_config.json: a string or `{"content": ...}`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    v.as_str().map(str::to_string).or_else(|| v.get("content").and_then(|c| c.as_str()).map(str::to_string))
}

impl ChatTemplate {
    /// The chat template of `DIR/tokenizer_config.json`, and the chat
    /// format `DIR/config.json`'s architecture uses; `None` when the
    /// checkpoint has no such file or it has no template.
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>, TextError> {
        let file = dir.join("tokenizer_config.json");
        if std::fs::symlink_metadata(&file).is_err() {
            return Ok(None);
        }
        let text = read_user_file(&file, "tokenizer config", limits::TOKENIZER)?;
        let bad = |message: String| TextError::Config { file: file.clone(), message };
        let cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let source = match cfg.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            // The list form: `[{"name": "default", "template": ...}, ...]`.
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_string)
                .ok_or_else(|| bad("`chat_template` is a list without a \"default\" template".into()))?,
            Some(_) => return Err(bad("`chat_template` must be a string".into())),
        };
        let specials = ["bos_token", "eos_token", "unk_token", "pad_token"]
            .iter()
            .filter_map(|k| cfg.get(*k).and_then(token_text).map(|t| (k.to_string(), Value::from(t))))
            .collect();
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| TextError::Template { file: file.clone(), message: e.to_string() })?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
        env.add_filter("tojson", tojson);
        env.set_formatter(format_value);
        env.add_template_owned("chat", source).map_err(|e| TextError::Template { file: file.clone(), message: e.to_string() })?;
        let format = ChatFormat::of_model_dir(dir).map_err(TextError::ChatFormat)?;
        Ok(Some(ChatTemplate { env, format, specials, file }))
    }

    /// Renders `messages` (a list of `{role, content, ...}`, in the OpenAI
    /// shape) with the template's other variables in `kwargs`
    /// (`add_generation_prompt`, `thinking_mode`, `tools`, ...). A variable
    /// left out stays undefined, as in transformers.
    /// [`ChatTemplate::render`] of JSON values (the messages and keyword
    /// arguments as a request carries them), so that callers never build
    /// the template engine's own values.
    pub fn render_json(&self, messages: &serde_json::Value, kwargs: &[(&str, serde_json::Value)]) -> Result<String, TextError> {
        let value = |v: &serde_json::Value| {
            serde_json::from_value::<Value>(v.clone())
                .map_err(|e| TextError::Render { file: self.file.clone(), message: format!("a value the chat template cannot take: {e}") })
        };
        let kwargs = kwargs.iter().map(|(k, v)| Ok((*k, value(v)?))).collect::<Result<Vec<_>, TextError>>()?;
        self.render(&value(messages)?, &kwargs)
    }

    pub fn render(&self, messages: &Value, kwargs: &[(&str, Value)]) -> Result<String, TextError> {
        let mut ctx: std::collections::BTreeMap<String, Value> = self.specials.iter().cloned().collect();
        ctx.insert("messages".into(), messages.clone());
        ctx.extend(kwargs.iter().map(|(k, v)| (k.to_string(), v.clone())));
        let tmpl = self.env.get_template("chat").map_err(|e| TextError::Render { file: self.file.clone(), message: e.to_string() })?;
        tmpl.render(Value::from(ctx)).map_err(|e| TextError::Render { file: self.file.clone(), message: render_error(&e) })
    }
}

/// The message of a template error (`raise_exception`'s text as it is).
fn render_error(e: &Error) -> String {
    match e.detail() {
        Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_string(),
        _ => e.to_string(),
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False)` (its keyword
/// arguments are accepted; `indent` is not supported).
fn tojson(v: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("sort_keys")?;
    if let Some(indent) = kwargs.get::<Option<Value>>("indent")? {
        if !indent.is_none() {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson(indent=...) is not supported"));
        }
    }
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(pyjson::dumps(&v)?))
}

/// `{{ value }}`: floats as Python prints them, everything else as usual.
fn format_value(out: &mut minijinja::Output, state: &mut minijinja::State, value: &Value) -> Result<(), Error> {
    if value.kind() == ValueKind::Number && !value.is_integer() {
        if let Ok(x) = f64::try_from(value.clone()) {
            return out.write_str(&pyjson::py_float(x)).map_err(Error::from);
        }
    }
    minijinja::escape_formatter(out, state, value)
}
