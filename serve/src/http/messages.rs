//! Anthropic's Messages API (`POST /v1/messages`, and
//! `/v1/messages/count_tokens`), which agents built on Anthropic's SDKs
//! speak. A request becomes a chat (system, turns with text, image,
//! `tool_use` and `tool_result` blocks; tools and `tool_choice`; `thinking`
//! as MiniMax-M3's thinking mode), rendered by the model's template and
//! generated as chat completions are; the answer is Anthropic's `message`
//! (`thinking`, `text` and `tool_use` blocks, `stop_reason`, usage), whole
//! or as its event stream. Errors take Anthropic's shape, and a field m3c
//! does not know is refused by name.

use super::adapter::Adapter;
use super::{render_chat, with_images, App, Generation, Piece, Step};
use crate::openai::{self, ApiError};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as Sse_, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::convert::Infallible;

/// Every field `/v1/messages` reads besides the sampling table's
/// (`temperature`, `top_p`, `top_k`, and vLLM's others, as on the chat route).
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "stream",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    // vLLM's structured outputs (a grammar beside the tools; the answer is
    // read for thinking and tool use as any other).
    "structured_outputs",
];

/// The fields `/v1/messages/count_tokens` reads.
const COUNT_FIELDS: &[&str] = &["model", "messages", "system", "tools", "tool_choice", "thinking"];

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
fn error(e: &ApiError) -> Response {
    let kind = match e.status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
    (StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST), Json(body)).into_response()
}

/// Anthropic's clients send the key as `x-api-key`; a Bearer header works too.
fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    if let Some(key) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        let mut h = HeaderMap::new();
        if let Ok(v) = format!("Bearer {key}").parse() {
            h.insert(axum::http::header::AUTHORIZATION, v);
        }
        return super::authorize(app, &h);
    }
    super::authorize(app, headers)
}

/// What the answer needs of the request besides its generation.
pub(super) struct Asked {
    stops: Vec<String>,
}

/// Anthropic's Messages API over the chat route.
pub(super) struct Messages;

impl Adapter for Messages {
    const ROUTE: &'static str = "/v1/messages";
    const FIELDS: &'static [&'static str] = FIELDS;
    const ID_PREFIX: &'static str = "msg_";
    type Asked = Asked;

    fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
        authorize(app, headers)
    }

    fn error(e: &ApiError) -> Response {
        error(e)
    }

    fn as_chat(m: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
        if m.get("max_tokens").is_none_or(Value::is_null) {
            return Err(ApiError::bad("max_tokens", "`max_tokens` is required"));
        }
        as_chat(m)
    }

    fn prepared(_: &Map<String, Value>, common: &mut openai::Common, chat: &openai::Chat) -> (Asked, Vec<Value>) {
        if let Some(g) = chat.forced.clone() {
            common.grammar = Some((g, "tool_choice"));
        }
        (Asked { stops: common.stop.clone() }, chat.tools.clone())
    }

    async fn answer(g: Generation, asked: Asked, streaming: bool) -> Response {
        if streaming {
            stream(g, asked)
        } else {
            whole(g, asked).await
        }
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the model's
/// template renders the conversation (tools and thinking included), each
/// image as the tokens its size makes (so its images are read).
pub(super) async fn count_tokens(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<_, ApiError> {
        authorize(&app, &headers)?;
        let m = openai::object(&body)?;
        openai::check_model(&m, &app.names)?;
        openai::check_known(&m, COUNT_FIELDS, "/v1/messages/count_tokens")?;
        let chat = as_chat(&m)?;
        let (rendered, parts) = render_chat(&app, &chat, crate::openai::Opening::Generation)?;
        let ids = app.tokenizer.encode(&rendered).map_err(|e| ApiError::new(500, "api_error", e.to_string()))?;
        Ok((ids, parts.images))
    };
    let (ids, urls) = match run() {
        Ok(r) => r,
        Err(e) => return error(&e),
    };
    match with_images(&app, ids, &urls).await {
        Ok((ids, _)) => Json(json!({"input_tokens": ids.len()})).into_response(),
        Err(e) => error(&e),
    }
}

/// The request as a chat request (OpenAI's shape, which the chat route's
/// checks, template and tool grammar then read).
fn as_chat(m: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let mut messages = Vec::new();
    match m.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            let text = blocks
                .iter()
                .map(|b| match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => Ok(t.to_string()),
                    _ => Err(ApiError::bad("system", "`system` blocks must be text blocks")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            messages.push(json!({"role": "system", "content": text.join("\n")}));
        }
        Some(v) => return Err(ApiError::bad("system", format!("`system` must be a string or text blocks, not {}", openai::kind(v)))),
    }
    let turns = m.get("messages").and_then(Value::as_array).ok_or_else(|| ApiError::bad("messages", "`messages` must be an array"))?;
    if turns.is_empty() {
        return Err(ApiError::bad("messages", "`messages` must hold at least one message"));
    }
    for (i, t) in turns.iter().enumerate() {
        turn(t, &mut messages).map_err(|why| ApiError::bad("messages", format!("messages[{i}]: {why}")))?;
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    for key in ["max_tokens", "stream", "structured_outputs"] {
        if let Some(v) = m.get(key).filter(|v| !v.is_null()) {
            chat.insert(key.into(), v.clone());
        }
    }
    if let Some(v) = m.get("stop_sequences").filter(|v| !v.is_null()) {
        if !v.as_array().is_some_and(|a| a.iter().all(Value::is_string)) {
            return Err(ApiError::bad("stop_sequences", "`stop_sequences` must be an array of strings"));
        }
        chat.insert("stop".into(), v.clone());
    }
    if let Some(v) = m.get("metadata").filter(|v| !v.is_null()) {
        if !v.as_object().is_some_and(|o| o.keys().all(|k| k == "user_id")) {
            return Err(ApiError::bad("metadata", "`metadata` may hold only `user_id`"));
        }
    }
    tools(m, &mut chat)?;
    thinking(m, &mut chat)?;
    Ok(chat)
}

/// One turn as chat messages: text and images as content parts, an
/// assistant's `tool_use` blocks as its tool calls, a user's `tool_result`
/// blocks as tool messages (before the rest of the turn), thinking blocks
/// left out (the template drops past reasoning).
fn turn(t: &Value, out: &mut Vec<Value>) -> Result<(), String> {
    let o = t.as_object().ok_or("each message must be an object")?;
    if let Some(k) = o.keys().find(|k| *k != "role" && *k != "content") {
        return Err(format!("unknown field `{k}` (a message has `role` and `content`)"));
    }
    let role = match o.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        Some(r) => return Err(format!("role `{r}`: a message is from `user` or `assistant` (the system prompt is `system`)")),
        None => return Err("a message needs a `role`".into()),
    };
    let blocks = match o.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => return Err("`content` must be a string or an array of blocks".into()),
    };
    let (mut parts, mut calls) = (Vec::new(), Vec::new());
    for b in blocks {
        let kind = b.get("type").and_then(Value::as_str).unwrap_or("");
        match (kind, role) {
            ("text", _) => {
                let text = b.get("text").and_then(Value::as_str).ok_or("a `text` block needs `text`")?;
                parts.push(json!({"type": "text", "text": text}));
            }
            ("image", "user") => parts.push(json!({"type": "image_url", "image_url": {"url": image_url(b)?}})),
            ("tool_use", "assistant") => {
                let id = b.get("id").and_then(Value::as_str).ok_or("a `tool_use` block needs `id`")?;
                let name = b.get("name").and_then(Value::as_str).ok_or("a `tool_use` block needs `name`")?;
                let input = b.get("input").filter(|v| v.is_object()).ok_or("a `tool_use` block's `input` must be an object")?;
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
            }
            ("tool_result", "user") => {
                let id = b.get("tool_use_id").and_then(Value::as_str).ok_or("a `tool_result` block needs `tool_use_id`")?;
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(items)) => items
                        .iter()
                        .map(|i| i.get("text").and_then(Value::as_str).map(str::to_string).ok_or("tool result blocks must be text blocks"))
                        .collect::<Result<Vec<_>, _>>()?
                        .join("\n"),
                    Some(_) => return Err("a `tool_result`'s `content` must be a string or text blocks".into()),
                };
                let content = if b.get("is_error") == Some(&Value::Bool(true)) { format!("Error: {content}") } else { content };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            ("thinking" | "redacted_thinking", "assistant") => {}
            (k, r) => return Err(format!("`{k}` blocks are not taken in a `{r}` message")),
        }
    }
    if !parts.is_empty() || !calls.is_empty() {
        let mut msg = json!({"role": role, "content": if parts.is_empty() { Value::Null } else { Value::Array(parts) }});
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        out.push(msg);
    } else if role == "assistant" {
        // A turn of thinking alone is still the assistant's turn.
        out.push(json!({"role": "assistant", "content": ""}));
    }
    Ok(())
}

/// An image block's source as the URL the chat route fetches or decodes.
fn image_url(b: &Value) -> Result<String, String> {
    let s = b.get("source").ok_or("an `image` block needs `source`")?;
    match s.get("type").and_then(Value::as_str) {
        Some("base64") => {
            let media = s.get("media_type").and_then(Value::as_str).ok_or("a base64 image source needs `media_type`")?;
            let data = s.get("data").and_then(Value::as_str).ok_or("a base64 image source needs `data`")?;
            Ok(format!("data:{media};base64,{data}"))
        }
        Some("url") => Ok(s.get("url").and_then(Value::as_str).ok_or("a url image source needs `url`")?.to_string()),
        other => Err(format!("image sources of type {other:?} are not taken (base64, url)")),
    }
}

/// `tools` (name, description, input_schema) and `tool_choice` (auto, any,
/// tool, none) under the chat route's names.
fn tools(m: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    if let Some(list) = m.get("tools").filter(|v| !v.is_null()) {
        let list = list.as_array().ok_or_else(|| ApiError::bad("tools", "`tools` must be an array"))?;
        let mut out = Vec::new();
        for (i, t) in list.iter().enumerate() {
            let bad = |why: &str| ApiError::bad("tools", format!("tools[{i}]: {why}"));
            let o = t.as_object().ok_or_else(|| bad("a tool must be an object"))?;
            if let Some(k) = o.keys().find(|k| !["name", "description", "input_schema", "type"].contains(&k.as_str())) {
                return Err(bad(&format!("unknown field `{k}`")));
            }
            if o.get("type").is_some_and(|t| t != "custom") {
                return Err(bad("server tools are not served; a tool has `name`, `description` and `input_schema`"));
            }
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| bad("a tool needs a `name`"))?;
            let schema = o.get("input_schema").filter(|v| v.is_object()).ok_or_else(|| bad("a tool needs an `input_schema` object"))?;
            let mut f = json!({"name": name, "parameters": schema});
            if let Some(d) = o.get("description") {
                f["description"] = d.clone();
            }
            out.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(out));
    }
    if let Some(c) = m.get("tool_choice").filter(|v| !v.is_null()) {
        let bad = |why: &str| ApiError::bad("tool_choice", format!("`tool_choice`: {why}"));
        let o = c.as_object().ok_or_else(|| bad("must be an object such as {\"type\": \"auto\"}"))?;
        if let Some(k) = o.keys().find(|k| !["type", "name", "disable_parallel_tool_use"].contains(&k.as_str())) {
            return Err(bad(&format!("unknown field `{k}`")));
        }
        let choice = match o.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                let name = o.get("name").and_then(Value::as_str).ok_or_else(|| bad("type `tool` needs a `name`"))?;
                json!({"type": "function", "function": {"name": name}})
            }
            _ => return Err(bad("`type` is auto, any, tool or none")),
        };
        let one = o.get("disable_parallel_tool_use") == Some(&Value::Bool(true));
        chat.insert("tool_choice".into(), choice);
        if one {
            chat.insert("parallel_tool_calls".into(), Value::Bool(false));
        }
    }
    Ok(())
}

/// `thinking`: MiniMax-M3's thinking mode through its template, and a
/// budget as the chat route's `thinking_token_budget`.
fn thinking(m: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(t) = m.get("thinking").filter(|v| !v.is_null()) else { return Ok(()) };
    let bad = |why: &str| ApiError::bad("thinking", format!("`thinking`: {why}"));
    let o = t.as_object().ok_or_else(|| bad("must be an object such as {\"type\": \"enabled\", \"budget_tokens\": 1024}"))?;
    if let Some(k) = o.keys().find(|k| !["type", "budget_tokens", "display"].contains(&k.as_str())) {
        return Err(bad(&format!("unknown field `{k}`")));
    }
    if o.get("display").is_some_and(|d| !(d.is_null() || d == "summarized")) {
        return Err(bad("`display`: m3c returns the model's thinking as it is (only \"summarized\")"));
    }
    // MiniMax-M3's template knows the three modes Anthropic's API names.
    let mode = match o.get("type").and_then(Value::as_str) {
        Some("enabled") => "enabled",
        Some("disabled") => "disabled",
        Some("adaptive") => "adaptive",
        _ => return Err(bad("`type` is enabled, disabled or adaptive")),
    };
    chat.insert("chat_template_kwargs".into(), json!({"thinking_mode": mode}));
    if let (Some(b), "enabled" | "adaptive") = (o.get("budget_tokens"), mode) {
        chat.insert("thinking_token_budget".into(), b.clone());
    }
    Ok(())
}

/// Anthropic's `stop_reason` and `stop_sequence` of an ended generation.
fn stop_reason(g: &Generation, asked: &Asked) -> (&'static str, Value) {
    match (g.finish_reason().as_str(), g.filter.hit()) {
        ("length", _) => ("max_tokens", Value::Null),
        ("tool_calls", _) => ("tool_use", Value::Null),
        (_, Some(s)) if asked.stops.iter().any(|x| x == s) => ("stop_sequence", json!(s)),
        _ => ("end_turn", Value::Null),
    }
}

fn message(g: &Generation, content: Vec<Value>, stop: (&str, Value), output_tokens: usize) -> Value {
    json!({
        "id": g.id, "type": "message", "role": "assistant", "model": g.app.name, "content": content,
        "stop_reason": if stop.0.is_empty() { Value::Null } else { json!(stop.0) }, "stop_sequence": stop.1,
        "usage": {"input_tokens": g.prompt_tokens, "output_tokens": output_tokens}
    })
}

/// Which content block is open.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    None,
    Thinking,
    Text,
    /// The `tool_use` block of this call.
    Tool(usize),
}

/// The content blocks as the answer's pieces open them (thinking, text and
/// `tool_use` blocks, in the order the model wrote them), with Anthropic's
/// stream events on the way: the whole message and the stream are made by
/// this one builder, so they cannot differ.
struct Blocks {
    /// Every block so far; a `tool_use` block's input is its JSON text
    /// until the end.
    blocks: Vec<Value>,
    open: Open,
}

impl Blocks {
    fn new() -> Blocks {
        Blocks { blocks: Vec::new(), open: Open::None }
    }

    /// Closes the open block and opens `start` as `to`.
    fn switch(&mut self, to: Open, start: Option<Value>, out: &mut Vec<Value>) {
        if self.open == to {
            return;
        }
        if self.open != Open::None {
            out.push(json!({"type": "content_block_stop", "index": self.blocks.len() - 1}));
        }
        self.open = to;
        if let Some(block) = start {
            let mut shown = block.clone();
            if let Open::Tool(_) = to {
                shown["input"] = json!({});
            }
            out.push(json!({"type": "content_block_start", "index": self.blocks.len(), "content_block": shown}));
            self.blocks.push(block);
        }
    }

    /// Appends to the open block's field `key`, and says so in a delta.
    fn add(&mut self, key: &str, text: &str, delta: Value, out: &mut Vec<Value>) {
        if let Some(Value::String(t)) = self.blocks.last_mut().and_then(|b| b.get_mut(key)) {
            t.push_str(text);
        }
        out.push(json!({"type": "content_block_delta", "index": self.blocks.len() - 1, "delta": delta}));
    }

    fn piece(&mut self, g: &Generation, p: Piece, out: &mut Vec<Value>) {
        match p {
            Piece::Reasoning(t) => {
                self.switch(Open::Thinking, Some(json!({"type": "thinking", "thinking": "", "signature": ""})), out);
                self.add("thinking", &t, json!({"type": "thinking_delta", "thinking": t}), out);
            }
            Piece::Content(t) => {
                self.switch(Open::Text, Some(json!({"type": "text", "text": ""})), out);
                self.add("text", &t, json!({"type": "text_delta", "text": t}), out);
            }
            Piece::Call { index, name } => {
                let block = json!({"type": "tool_use", "id": g.call_id("toolu", index), "name": name, "input": ""});
                self.switch(Open::Tool(index), Some(block), out);
            }
            Piece::Args { index, json } if self.open == Open::Tool(index) => {
                self.add("input", &json, json!({"type": "input_json_delta", "partial_json": json}), out);
            }
            Piece::Args { .. } => {}
        }
    }

    /// Every block closed (an answer with none is one empty text block);
    /// the message's content.
    fn finish(&mut self, out: &mut Vec<Value>) -> Vec<Value> {
        if self.blocks.is_empty() {
            self.switch(Open::Text, Some(json!({"type": "text", "text": ""})), out);
        }
        self.switch(Open::None, None, out);
        self.blocks
            .iter()
            .map(|b| {
                let mut b = b.clone();
                if b["type"] == "tool_use" {
                    b["input"] = b["input"].as_str().and_then(|a| serde_json::from_str::<Value>(a).ok()).unwrap_or_else(|| json!({}));
                }
                b
            })
            .collect()
    }
}

async fn whole(mut g: Generation, asked: Asked) -> Response {
    let mut blocks = Blocks::new();
    let mut events = Vec::new();
    loop {
        match g.next().await {
            Step::Text { pieces, end } => {
                for p in pieces {
                    blocks.piece(&g, p, &mut events);
                }
                if end {
                    break;
                }
            }
            Step::Failed(why) => return error(&ApiError::new(500, "api_error", format!("the request could not finish: {why}"))),
        }
    }
    let content = blocks.finish(&mut events);
    let stop = stop_reason(&g, &asked);
    let tokens = g.completion_tokens;
    Json(message(&g, content, stop, tokens)).into_response()
}

/// The stream's state between events.
struct Streaming {
    g: Generation,
    asked: Asked,
    blocks: Blocks,
    done: bool,
    started: bool,
}

impl Streaming {
    fn event(v: Value) -> Result<Sse_, Infallible> {
        let kind = v["type"].as_str().unwrap_or_default().to_string();
        Ok(Sse_::default().event(kind).data(v.to_string()))
    }

    /// The events of the next piece of the answer (none once it ended).
    async fn next(&mut self) -> Option<Vec<Value>> {
        if self.done {
            return None;
        }
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            out.push(json!({"type": "message_start", "message": message(&self.g, Vec::new(), ("", Value::Null), 0)}));
            return Some(out);
        }
        match self.g.next().await {
            Step::Text { pieces, end } => {
                for p in pieces {
                    self.blocks.piece(&self.g, p, &mut out);
                }
                if end {
                    self.done = true;
                    self.blocks.finish(&mut out);
                    let (reason, seq) = stop_reason(&self.g, &self.asked);
                    out.push(json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                    "usage": {"output_tokens": self.g.completion_tokens}}));
                    out.push(json!({"type": "message_stop"}));
                }
            }
            Step::Failed(why) => {
                self.done = true;
                out.push(
                    json!({"type": "error", "error": {"type": "api_error", "message": format!("the request could not finish: {why}")}}),
                );
            }
        }
        Some(out)
    }
}

/// The answer as Anthropic's event stream: `message_start`, each content
/// block's `content_block_start`, deltas (`thinking_delta`, `text_delta`,
/// a tool use's `input_json_delta` as its arguments are written) and
/// `content_block_stop`, in the order the model wrote them;
/// `message_delta` with the stop reason and usage; `message_stop`.
fn stream(g: Generation, asked: Asked) -> Response {
    let s = Streaming { g, asked, blocks: Blocks::new(), done: false, started: false };
    let events = futures_util::stream::unfold(s, |mut s| async move {
        let out = s.next().await?;
        let sse: Vec<Result<Sse_, Infallible>> = out.into_iter().map(Streaming::event).collect();
        Some((sse, s))
    });
    let flat = futures_util::StreamExt::flat_map(events, futures_util::stream::iter);
    Sse::new(flat).keep_alive(KeepAlive::default()).into_response()
}
