//! OpenAI's Responses API (`POST /v1/responses`), which recent clients
//! default to, for text in and text out, whole or streamed: the `input`
//! (a string, or messages with text and image parts) and `instructions`
//! become a chat, rendered by the model's template and generated as chat
//! completions are; the answer is a `message` output item (and a
//! `reasoning` item for the model's thinking). Fields m3c cannot honour
//! here (tools, stored responses, structured text formats) are refused by
//! name, as everywhere.

use super::adapter::Adapter;
use super::{authorize, error, App, Generation, Piece, Step};
use crate::openai::{self, ApiError};
use axum::http::HeaderMap;
use axum::response::sse::{Event as Sse_, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::convert::Infallible;

/// Every field `/v1/responses` reads besides the sampling table's
/// (`temperature`, `top_p`, and vLLM's others, as on the chat route).
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "stream",
    "store",
    "metadata",
    "user",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "truncation",
    // vLLM's extra fields, as on the chat route.
    "ignore_eos",
    "chat_template_kwargs",
    "skip_special_tokens",
    // vLLM's structured outputs, as on the chat route.
    "structured_outputs",
];

/// What the answer echoes of the request.
pub(super) struct Echo {
    instructions: Value,
    metadata: Value,
    temperature: Value,
    top_p: Value,
    max_output_tokens: Value,
    user: Value,
}

/// OpenAI's Responses API over the chat route.
pub(super) struct Responses;

impl Adapter for Responses {
    const ROUTE: &'static str = "/v1/responses";
    const FIELDS: &'static [&'static str] = FIELDS;
    const ID_PREFIX: &'static str = "resp_";
    type Asked = Echo;

    fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
        authorize(app, headers)
    }

    fn error(e: &ApiError) -> Response {
        error(e)
    }

    fn as_chat(m: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
        refuse_unhonoured(m)?;
        as_chat(m)
    }

    fn prepared(m: &Map<String, Value>, common: &mut openai::Common, _: &openai::Chat) -> (Echo, Vec<Value>) {
        let get = |k: &str| m.get(k).cloned().unwrap_or(Value::Null);
        let echo = Echo {
            instructions: get("instructions"),
            metadata: get("metadata"),
            temperature: json!(common.sampling.temperature),
            top_p: json!(common.sampling.top_p),
            max_output_tokens: get("max_output_tokens"),
            user: get("user"),
        };
        // Text only: no tools to read the answer for.
        (echo, Vec::new())
    }

    async fn answer(g: Generation, echo: Echo, streaming: bool) -> Response {
        if streaming {
            stream(g, echo)
        } else {
            whole(g, echo).await
        }
    }
}

/// Values of known fields that m3c cannot honour on this route.
fn refuse_unhonoured(m: &Map<String, Value>) -> Result<(), ApiError> {
    let refuse = |k: &str, why: &str| Err(ApiError::bad(k, format!("`{k}`: {why}")));
    if m.get("store").is_some_and(|v| v == &Value::Bool(true)) {
        return refuse("store", "m3c keeps no responses (only false)");
    }
    if m.get("tools").is_some_and(|v| !(v.is_null() || v.as_array().is_some_and(Vec::is_empty))) {
        return refuse("tools", "tools are served on /v1/chat/completions; /v1/responses takes text only");
    }
    if m.get("tool_choice").is_some_and(|v| !(v.is_null() || v == "none" || v == "auto")) {
        return refuse("tool_choice", "only \"none\" or \"auto\" (no tools)");
    }
    if m.get("truncation").is_some_and(|v| !(v.is_null() || v == "disabled")) {
        return refuse("truncation", "m3c does not drop input to fit (only \"disabled\")");
    }
    if let Some(t) = m.get("text").filter(|v| !v.is_null()) {
        let plain = t.as_object().is_some_and(|o| {
            o.iter().all(|(k, v)| {
                k == "format" && v.get("type").and_then(Value::as_str) == Some("text") && v.as_object().is_some_and(|f| f.len() == 1)
            })
        });
        if !plain {
            return refuse("text", "only {\"format\": {\"type\": \"text\"}}: m3c cannot constrain the output yet");
        }
    }
    if m.get("metadata").is_some_and(|v| !(v.is_null() || v.is_object())) {
        return Err(ApiError::bad("metadata", "`metadata` must be an object"));
    }
    Ok(())
}

/// The request as a chat request: `instructions` as the system message,
/// `input` as the messages, the limits and sampling under chat's names.
fn as_chat(m: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let mut messages = Vec::new();
    match m.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(v) => return Err(ApiError::bad("instructions", format!("`instructions` must be a string, not {}", openai::kind(v)))),
    }
    match m.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                messages.push(input_message(item).map_err(|why| ApiError::bad("input", format!("input[{i}]: {why}")))?);
            }
        }
        Some(v) => {
            return Err(ApiError::bad("input", format!("`input` must be a string or an array of messages, not {}", openai::kind(v))))
        }
        None => return Err(ApiError::bad("input", "`input` is required")),
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    for (from, to) in [
        ("max_output_tokens", "max_tokens"),
        ("stream", "stream"),
        ("ignore_eos", "ignore_eos"),
        ("chat_template_kwargs", "chat_template_kwargs"),
        ("skip_special_tokens", "skip_special_tokens"),
        ("structured_outputs", "structured_outputs"),
    ] {
        if let Some(v) = m.get(from).filter(|v| !v.is_null()) {
            chat.insert(to.into(), v.clone());
        }
    }
    Ok(chat)
}

/// One `input` item as a chat message: `{role, content}` (with or without
/// `"type": "message"`), its content a string or `input_text`,
/// `output_text` and `input_image` parts.
fn input_message(item: &Value) -> Result<Value, String> {
    let o = item.as_object().ok_or("each item must be a message object")?;
    if let Some(t) = o.get("type").and_then(Value::as_str).filter(|t| *t != "message") {
        return Err(format!("items of type `{t}` are not taken; m3c's /v1/responses takes messages"));
    }
    let role = o.get("role").and_then(Value::as_str).ok_or("a message needs a `role`")?;
    let content = match o.get("content") {
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = Vec::new();
            for p in parts {
                let text = p.get("text").and_then(Value::as_str);
                match (p.get("type").and_then(Value::as_str), text) {
                    (Some("input_text" | "output_text"), Some(t)) => out.push(json!({"type": "text", "text": t})),
                    (Some("input_image"), _) => {
                        let url = p.get("image_url").and_then(Value::as_str).ok_or("an `input_image` part needs an `image_url`")?;
                        out.push(json!({"type": "image_url", "image_url": {"url": url}}));
                    }
                    (t, _) => return Err(format!("content parts of type {t:?} are not taken (input_text, output_text, input_image)")),
                }
            }
            Value::Array(out)
        }
        _ => return Err("`content` must be a string or an array of parts".into()),
    };
    Ok(json!({"role": role, "content": content}))
}

/// The response object, as OpenAI's `Response`.
fn response(g: &Generation, echo: &Echo, status: &str, output: Vec<Value>) -> Value {
    let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
    let usage = (status != "in_progress").then(|| {
        json!({"input_tokens": g.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
               "output_tokens": g.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": g.prompt_tokens + g.completion_tokens})
    });
    json!({
        "id": g.id, "object": "response", "created_at": g.created, "model": g.app.name, "status": status,
        "error": null, "incomplete_details": incomplete, "instructions": echo.instructions, "metadata": echo.metadata,
        "max_output_tokens": echo.max_output_tokens, "temperature": echo.temperature, "top_p": echo.top_p,
        "user": echo.user, "output": output, "parallel_tool_calls": false, "tool_choice": "none", "tools": [],
        "store": false, "truncation": "disabled", "usage": usage
    })
}

/// The status an ended generation gives.
fn status(g: &Generation) -> &'static str {
    if g.finish.as_deref() == Some("length") {
        "incomplete"
    } else {
        "completed"
    }
}

/// The output items as the answer's pieces open them (a `reasoning` item
/// for the model's thinking, a `message` item for its text, in the order
/// they began), with the stream's events on the way: the whole answer and
/// the stream are made by this one builder, so they cannot differ.
struct Items {
    rs_id: String,
    msg_id: String,
    /// Each item's output index and text so far.
    reasoning: Option<(usize, String)>,
    message: Option<(usize, String)>,
    next: usize,
}

impl Items {
    fn new(g: &Generation) -> Items {
        Items { rs_id: format!("rs_{}", g.id), msg_id: format!("msg_{}", g.id), reasoning: None, message: None, next: 0 }
    }

    /// Opens the message item when it is not open.
    fn open_message(&mut self, out: &mut Vec<Value>) -> usize {
        if let Some((i, _)) = &self.message {
            return *i;
        }
        let i = self.next;
        self.next += 1;
        self.message = Some((i, String::new()));
        out.push(json!({"type": "response.output_item.added", "output_index": i,
                        "item": {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}}));
        out.push(json!({"type": "response.content_part.added", "item_id": self.msg_id, "output_index": i, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}));
        i
    }

    /// The events of a piece of the answer.
    fn piece(&mut self, p: Piece, out: &mut Vec<Value>) {
        match p {
            Piece::Reasoning(t) => {
                let i = match &mut self.reasoning {
                    Some((i, text)) => {
                        text.push_str(&t);
                        *i
                    }
                    None => {
                        let i = self.next;
                        self.next += 1;
                        self.reasoning = Some((i, t.clone()));
                        out.push(json!({"type": "response.output_item.added", "output_index": i,
                                        "item": {"type": "reasoning", "id": self.rs_id, "summary": [], "content": [], "status": "in_progress"}}));
                        out.push(
                            json!({"type": "response.content_part.added", "item_id": self.rs_id, "output_index": i, "content_index": 0,
                                        "part": {"type": "reasoning_text", "text": ""}}),
                        );
                        i
                    }
                };
                out.push(json!({"type": "response.reasoning_text.delta", "item_id": self.rs_id, "output_index": i,
                                "content_index": 0, "delta": t}));
            }
            Piece::Content(t) => {
                let i = self.open_message(out);
                if let Some((_, text)) = &mut self.message {
                    text.push_str(&t);
                }
                out.push(json!({"type": "response.output_text.delta", "item_id": self.msg_id, "output_index": i,
                                "content_index": 0, "delta": t, "logprobs": []}));
            }
            // /v1/responses offers no tools, so the reader makes no calls.
            Piece::Call { .. } | Piece::Args { .. } => {}
        }
    }

    /// Every item closed (the message opened if nothing did), in output order.
    fn finish(&mut self, status: &str, out: &mut Vec<Value>) -> Vec<Value> {
        self.open_message(out);
        let mut items = Vec::new();
        if let Some((i, text)) = &self.reasoning {
            let item = json!({"type": "reasoning", "id": self.rs_id, "summary": [],
                              "content": [{"type": "reasoning_text", "text": text}], "status": "completed"});
            out.push(
                json!({"type": "response.reasoning_text.done", "item_id": self.rs_id, "output_index": i, "content_index": 0, "text": text}),
            );
            out.push(json!({"type": "response.content_part.done", "item_id": self.rs_id, "output_index": i, "content_index": 0,
                            "part": {"type": "reasoning_text", "text": text}}));
            out.push(json!({"type": "response.output_item.done", "output_index": i, "item": item}));
            items.push((*i, item));
        }
        if let Some((i, text)) = &self.message {
            let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
            let item = json!({"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": [part]});
            out.push(json!({"type": "response.output_text.done", "item_id": self.msg_id, "output_index": i, "content_index": 0,
                            "text": text, "logprobs": []}));
            out.push(
                json!({"type": "response.content_part.done", "item_id": self.msg_id, "output_index": i, "content_index": 0, "part": part}),
            );
            out.push(json!({"type": "response.output_item.done", "output_index": i, "item": item}));
            items.push((*i, item));
        }
        items.sort_by_key(|(i, _)| *i);
        items.into_iter().map(|(_, item)| item).collect()
    }
}

async fn whole(mut g: Generation, echo: Echo) -> Response {
    let mut items = Items::new(&g);
    let mut events = Vec::new();
    loop {
        match g.next().await {
            Step::Text { pieces, end } => {
                for p in pieces {
                    items.piece(p, &mut events);
                }
                if end {
                    break;
                }
            }
            Step::Failed(why) => return error(&ApiError::new(503, "server_error", format!("the request could not finish: {why}"))),
        }
    }
    let out = items.finish(status(&g), &mut events);
    Json(response(&g, &echo, status(&g), out)).into_response()
}

/// The answer as Responses' server-sent events: `response.created`; a
/// reasoning item streamed as `response.reasoning_text.delta` while the
/// model thinks, the message item as `response.output_text.delta` once it
/// answers; their closing events; `response.completed` with the whole
/// response. Each event names its type and carries a rising
/// `sequence_number`.
fn stream(g: Generation, echo: Echo) -> Response {
    let items = Items::new(&g);
    let events = futures_util::stream::unfold((g, echo, items, 0u8, 0u64), |(mut g, echo, mut items, phase, seq)| async move {
        let mut out: Vec<Value> = Vec::new();
        let next_phase = match phase {
            0 => {
                out.push(json!({"type": "response.created", "response": response(&g, &echo, "in_progress", Vec::new())}));
                1
            }
            1 => match g.next().await {
                Step::Text { pieces, end } => {
                    for p in pieces {
                        items.piece(p, &mut out);
                    }
                    if end {
                        let done = items.finish(status(&g), &mut out);
                        // `response.completed` whatever the status, as the
                        // official client's stream helper expects.
                        out.push(json!({"type": "response.completed", "response": response(&g, &echo, status(&g), done)}));
                        2
                    } else {
                        1
                    }
                }
                Step::Failed(why) => {
                    let mut r = response(&g, &echo, "failed", Vec::new());
                    r["error"] = json!({"code": "server_error", "message": format!("the request could not finish: {why}")});
                    out.push(json!({"type": "response.failed", "response": r}));
                    2
                }
            },
            _ => return None,
        };
        let mut seq = seq;
        let sse: Vec<Result<Sse_, Infallible>> = out
            .into_iter()
            .map(|mut v| {
                v["sequence_number"] = json!(seq);
                seq += 1;
                let kind = v["type"].as_str().unwrap_or_default().to_string();
                Ok(Sse_::default().event(kind).data(v.to_string()))
            })
            .collect();
        Some((sse, (g, echo, items, next_phase, seq)))
    });
    let flat = futures_util::StreamExt::flat_map(events, futures_util::stream::iter);
    Sse::new(flat).keep_alive(KeepAlive::default()).into_response()
}
