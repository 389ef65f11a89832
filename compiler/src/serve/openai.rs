//! OpenAI's completions and chat-completions requests as m3c reads them:
//! every field checked with an error that names it (a 400 with OpenAI's
//! error object), vLLM's extra sampling fields accepted, and fields m3c
//! cannot honour refused rather than ignored.

use m3c_contract::sampling::SamplingParams;
use serde_json::{json, Map, Value};

/// A request error: HTTP status, OpenAI error type, message, offending field.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError { status: 400, kind: "invalid_request_error", message: message.into(), param: Some(param.to_string()) }
    }
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, message: message.into(), param: None }
    }
    /// OpenAI's error object.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}})
    }
}

/// The parts of a request that both endpoints share.
#[derive(Debug, Clone, PartialEq)]
pub struct Common {
    pub sampling: SamplingParams,
    /// `None`: until the context is full.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
}

/// Sampling defaults (the checkpoint's generation_config.json, as vLLM).
#[derive(Debug, Clone, Copy)]
pub struct Defaults {
    pub sampling: SamplingParams,
}

/// A JSON object body, or the error for one that is not.
pub fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::new(400, "invalid_request_error", "the request body must be a JSON object")),
        Err(e) => Err(ApiError::new(400, "invalid_request_error", format!("the request body is not valid JSON: {e}"))),
    }
}

fn num(m: &Map<String, Value>, k: &str) -> Result<Option<f64>, ApiError> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            n.as_f64().filter(|v| v.is_finite()).map(Some).ok_or_else(|| ApiError::bad(k, format!("`{k}` must be a finite number")))
        }
        Some(v) => Err(ApiError::bad(k, format!("`{k}` must be a number, not {}", kind(v)))),
    }
}

fn uint(m: &Map<String, Value>, k: &str) -> Result<Option<u64>, ApiError> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(v), _) => Ok(Some(v)),
            // vLLM's "no top-k".
            (None, Some(-1)) if k == "top_k" => Ok(Some(0)),
            _ => Err(ApiError::bad(k, format!("`{k}` must be a non-negative integer"))),
        },
        Some(v) => Err(ApiError::bad(k, format!("`{k}` must be an integer, not {}", kind(v)))),
    }
}

fn boolean(m: &Map<String, Value>, k: &str) -> Result<Option<bool>, ApiError> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::bad(k, format!("`{k}` must be true or false, not {}", kind(v)))),
    }
}

pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The `model` field: required, and the served name.
pub fn check_model(m: &Map<String, Value>, served: &str) -> Result<(), ApiError> {
    match m.get("model") {
        Some(Value::String(s)) if s == served => Ok(()),
        Some(Value::String(s)) => Err(ApiError {
            status: 404,
            kind: "not_found_error",
            message: format!("The model `{s}` does not exist; this server serves `{served}`."),
            param: Some("model".into()),
        }),
        Some(v) => Err(ApiError::bad("model", format!("`model` must be a string, not {}", kind(v)))),
        None => Err(ApiError::bad("model", "`model` is required")),
    }
}

/// Sampling, limits, stop strings and streaming, shared by both endpoints;
/// `max_keys` are the names the endpoint accepts for the token limit.
pub fn common(m: &Map<String, Value>, d: &Defaults, max_keys: &[&str], seed_fallback: u64) -> Result<Common, ApiError> {
    for k in ["presence_penalty", "frequency_penalty"] {
        if num(m, k)?.is_some_and(|v| v != 0.0) {
            return Err(ApiError::bad(k, format!("`{k}` is not supported by m3c (use `repetition_penalty`)")));
        }
    }
    if uint(m, "n")?.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("n", "m3c returns one choice per request (`n` must be 1)"));
    }
    for k in ["logprobs", "top_logprobs", "logit_bias", "echo", "best_of", "suffix"] {
        match m.get(k) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(Value::Number(n)) if k == "best_of" && n.as_u64() == Some(1) => {}
            Some(_) => return Err(ApiError::bad(k, format!("`{k}` is not supported by m3c"))),
        }
    }
    let base = d.sampling;
    let f32_of = |k: &str, dflt: f32| -> Result<f32, ApiError> { Ok(num(m, k)?.map_or(dflt, |v| v as f32)) };
    let sampling = SamplingParams {
        temperature: f32_of("temperature", base.temperature)?,
        top_p: f32_of("top_p", base.top_p)?,
        min_p: f32_of("min_p", base.min_p)?,
        repetition_penalty: f32_of("repetition_penalty", base.repetition_penalty)?,
        top_k: uint(m, "top_k")?.map_or(base.top_k, |v| v as usize),
        seed: uint(m, "seed")?.unwrap_or(seed_fallback),
    };
    if let Err(e) = sampling.check() {
        let field = e.split_whitespace().next().unwrap_or("temperature").to_string();
        return Err(ApiError::bad(&field, e));
    }
    let mut max_tokens = None;
    for k in max_keys {
        if let Some(v) = uint(m, k)? {
            if v == 0 {
                return Err(ApiError::bad(k, format!("`{k}` must be at least 1")));
            }
            // Past any context; the length check names the numbers.
            max_tokens = Some(usize::try_from(v).unwrap_or(usize::MAX));
        }
    }
    let stop = match m.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(|| ApiError::bad("stop", "`stop` must be a string or an array of strings")))
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(ApiError::bad("stop", format!("`stop` must be a string or an array of strings, not {}", kind(v)))),
    };
    if stop.len() > 16 || stop.iter().any(|s| s.is_empty() || s.len() > 1024) {
        return Err(ApiError::bad("stop", "`stop`: at most 16 strings of 1 to 1024 bytes"));
    }
    let stream = boolean(m, "stream")?.unwrap_or(false);
    let include_usage = match m.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => boolean(o, "include_usage")?.unwrap_or(false),
        Some(v) => return Err(ApiError::bad("stream_options", format!("`stream_options` must be an object, not {}", kind(v)))),
    };
    Ok(Common { sampling, max_tokens, stop, ignore_eos: boolean(m, "ignore_eos")?.unwrap_or(false), stream, include_usage })
}

/// A completions `prompt`: a string, a one-string array, or token ids.
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

pub fn prompt(m: &Map<String, Value>) -> Result<Prompt, ApiError> {
    let ids = |a: &[Value]| -> Option<Vec<u32>> { a.iter().map(|v| v.as_u64().and_then(|i| u32::try_from(i).ok())).collect() };
    match m.get("prompt") {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => Ok(Prompt::Text(a[0].as_str().unwrap_or_default().to_string())),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => {
            ids(a).map(Prompt::Ids).ok_or_else(|| ApiError::bad("prompt", "`prompt` token ids must be non-negative integers"))
        }
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_array() => ids(a[0].as_array().map_or(&[][..], |v| v.as_slice()))
            .map(Prompt::Ids)
            .ok_or_else(|| ApiError::bad("prompt", "`prompt` token ids must be non-negative integers")),
        Some(Value::Array(_)) => Err(ApiError::bad("prompt", "m3c takes one prompt per request: a string, or one list of token ids")),
        Some(v) => Err(ApiError::bad("prompt", format!("`prompt` must be a string or token ids, not {}", kind(v)))),
        None => Err(ApiError::bad("prompt", "`prompt` is required")),
    }
}

/// The chat request's template inputs: the messages (content parts joined
/// into text), the tools when the model may call them, and the template
/// keyword arguments (`chat_template_kwargs`, e.g. `thinking_mode`).
pub struct Chat {
    pub messages: Value,
    pub tools: Vec<Value>,
    pub kwargs: Map<String, Value>,
    /// The `image_url` parts, in order: (the part's field, its URL). Each
    /// became an `{"type": "image"}` part the template writes as the image
    /// placeholder.
    pub images: Vec<(String, String)>,
}

pub fn chat(m: &Map<String, Value>) -> Result<Chat, ApiError> {
    let Some(Value::Array(list)) = m.get("messages") else {
        return Err(ApiError::bad("messages", "`messages` is required: an array of messages"));
    };
    if list.is_empty() {
        return Err(ApiError::bad("messages", "`messages` is empty"));
    }
    let mut messages = Vec::new();
    let mut images = Vec::new();
    for (i, msg) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(o) = msg else {
            return Err(ApiError::bad(&at, format!("{at} must be an object")));
        };
        let role = o.get("role").and_then(Value::as_str).ok_or_else(|| ApiError::bad(&at, format!("{at}.role is required")))?;
        if !["system", "developer", "user", "assistant", "tool"].contains(&role) {
            return Err(ApiError::bad(&at, format!("{at}.role `{role}` is not one of system, user, assistant, tool")));
        }
        let mut out = o.clone();
        out.insert("role".into(), Value::String(if role == "developer" { "system".into() } else { role.into() }));
        match o.get("content") {
            None | Some(Value::Null) if role == "assistant" => {}
            Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                // Text parts join into one string, unless the message has
                // images: then the parts stay a list of text and image parts
                // in order, as the template takes them.
                let mut text = String::new();
                let mut kept = Vec::new();
                for (j, p) in parts.iter().enumerate() {
                    let field = format!("{at}.content[{j}]");
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => {
                            text.push_str(t);
                            kept.push(serde_json::json!({"type": "text", "text": t}));
                        }
                        (Some("image_url"), _) => {
                            if role != "user" {
                                return Err(ApiError::bad(&field, format!("{field}: images go in user messages")));
                            }
                            let url = match p.get("image_url") {
                                Some(Value::String(u)) => u.as_str(),
                                Some(Value::Object(o)) => o.get("url").and_then(Value::as_str).unwrap_or_default(),
                                _ => "",
                            };
                            if url.is_empty() {
                                return Err(ApiError::bad(
                                    &field,
                                    format!("{field} must be {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}"),
                                ));
                            }
                            images.push((format!("{field}.image_url"), url.to_string()));
                            kept.push(serde_json::json!({"type": "image"}));
                        }
                        (Some(t), _) => {
                            return Err(ApiError::bad(
                                &at,
                                format!("{field}: content parts of type `{t}` are not supported (text and image_url)"),
                            ))
                        }
                        _ => return Err(ApiError::bad(&at, format!("{field} must be {{\"type\": \"text\", \"text\": ...}}"))),
                    }
                }
                let has_image = kept.iter().any(|k| k["type"] == "image");
                out.insert("content".into(), if has_image { Value::Array(kept) } else { Value::String(text) });
            }
            _ => return Err(ApiError::bad(&at, format!("{at}.content must be a string or an array of content parts"))),
        }
        if role == "tool" && !o.get("content").is_some_and(Value::is_string) && !o.get("content").is_some_and(Value::is_array) {
            return Err(ApiError::bad(&at, format!("{at}: a tool message needs its content")));
        }
        if let Some(calls) = o.get("tool_calls") {
            let ok = calls.as_array().is_some_and(|a| a.iter().all(|c| c["function"]["name"].is_string()));
            if !ok {
                return Err(ApiError::bad(
                    &at,
                    format!("{at}.tool_calls must be an array of {{\"function\": {{\"name\", \"arguments\"}}}}"),
                ));
            }
            // The template expands arguments; OpenAI sends them as a JSON string.
            let mut fixed = calls.clone();
            for c in fixed.as_array_mut().into_iter().flatten() {
                if let Some(Value::String(a)) = c["function"].get("arguments").cloned() {
                    let parsed: Value = serde_json::from_str(&a)
                        .map_err(|_| ApiError::bad(&at, format!("{at}.tool_calls: `arguments` must be a JSON object (as a string)")))?;
                    c["function"]["arguments"] = parsed;
                }
            }
            out.insert("tool_calls".into(), fixed);
        }
        messages.push(Value::Object(out));
    }
    let tools = match m.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => {
            for (i, t) in a.iter().enumerate() {
                if !t["function"]["name"].is_string() {
                    return Err(ApiError::bad(
                        "tools",
                        format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}"),
                    ));
                }
            }
            a.clone()
        }
        Some(v) => return Err(ApiError::bad("tools", format!("`tools` must be an array, not {}", kind(v)))),
    };
    let tools = match m.get("tool_choice") {
        None | Some(Value::Null) => tools,
        Some(Value::String(s)) if s == "none" => Vec::new(),
        Some(Value::String(s)) if s == "auto" || s == "required" => tools,
        Some(Value::Object(o)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            let chosen: Vec<Value> = tools.into_iter().filter(|t| t["function"]["name"].as_str() == name).collect();
            if chosen.is_empty() {
                return Err(ApiError::bad("tool_choice", "`tool_choice` names a function that is not in `tools`"));
            }
            chosen
        }
        Some(_) => return Err(ApiError::bad("tool_choice", "`tool_choice` must be none, auto, required or {\"function\": {\"name\"}}")),
    };
    let kwargs = match m.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(v) => return Err(ApiError::bad("chat_template_kwargs", format!("`chat_template_kwargs` must be an object, not {}", kind(v)))),
    };
    Ok(Chat { messages: Value::Array(messages), tools, kwargs, images })
}
