//! The HTTP routes of `m3c serve` (axum): health, models, metrics, vLLM's
//! tokenize, detokenize and version, and OpenAI's completions, chat
//! completions and (in `responses`) Responses, streamed as server-sent
//! events or answered whole.

use super::engine::{Event, SubmitError, Ticket};
use super::openai::{self, ApiError, Common, Defaults};
use super::output::{ChatOutput, Piece, Reading};
use super::replicas::Replicas;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as Sse_, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use m3c_contract::chat_format::ChatFormat;
use m3c_contract::images::SeqImages;
use m3c_contract::protocol::SeqRequest;
use m3c_contract::protocol::TokenLogprobs;
use m3c_contract::thinking::{ThinkBudget, ThinkStart};
use m3c_front::text::front::StopFilter;
use m3c_front::text::{ChatTemplate, IncrementalDecoder, TextTokenizer};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;

mod adapter;
mod messages;
mod responses;

/// What every handler shares.
pub struct Shared {
    pub engine: Arc<Replicas>,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    /// The family's markers: reasoning tags, tool-call markup, media tokens.
    pub format: &'static ChatFormat,
    pub defaults: Defaults,
    /// The name answers carry (the first served name).
    pub name: String,
    /// Every name a request may give as its `model`.
    pub names: Vec<String>,
    pub seeds: Seeds,
    pub api_key: Option<String>,
    /// The model's context length (prompt + completion).
    pub context: usize,
    /// `max_tokens` of a chat request that gives none.
    pub default_max_tokens: usize,
    pub created: u64,
    /// The image placeholder id (models with a vision tower).
    pub image_token: Option<usize>,
    /// The video placeholder id (likewise).
    pub video_token: Option<usize>,
    /// Where images may come from.
    pub media: super::media::MediaPolicy,
    /// The model's tokens as the grammar compiler sees them (structured
    /// output), or why there are none.
    pub grammars: Result<m3c_constrain::Vocabulary, String>,
    /// The ids that end a sequence (generation_config.json).
    pub eos_ids: Vec<u32>,
    /// Where `POST /debug/trace` writes timelines (`--trace-dir`).
    pub trace_dir: Option<std::path::PathBuf>,
    /// Chat template keyword arguments every chat request starts from.
    pub default_kwargs: serde_json::Map<String, Value>,
    /// `--structured-outputs-config`.
    pub structured: super::StructuredOutputs,
}

type App = Arc<Shared>;

pub fn router(shared: Shared) -> Router {
    // Bodies up to the images a request may carry as data: URIs (base64:
    // 4/3 of their bytes), plus 8 MB of text.
    let body_limit = (shared.media.max_images as u64 * shared.media.max_bytes * 4 / 3 + (8 << 20)).min(usize::MAX as u64) as usize;
    let routes = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(adapter::handle::<responses::Responses>))
        .route("/v1/messages", post(adapter::handle::<messages::Messages>))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/completions/render", post(completions_render))
        .route("/v1/chat/completions/render", post(chat_render))
        .route("/get_load", get(get_load))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/version", get(version))
        .route("/debug/trace", post(debug_trace))
        .fallback(|| async { error(&ApiError::new(404, "not_found_error", "no such route")) })
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .with_state(Arc::new(shared));
    // Around the whole router, not each route: a 405 gets its `Allow`
    // header from the routing itself.
    Router::new().fallback_service(routes).layer(axum::middleware::from_fn(json_errors))
}

/// Every error answer as OpenAI's JSON error object: axum's own (a method
/// a route does not take, a body over the limit, a body that is not the
/// type expected) come as plain text or empty, and are rewritten here with
/// what they said, the method and the path.
async fn json_errors(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let resp = next.run(req).await;
    let status = resp.status();
    let json = resp.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let said = axum::body::to_bytes(body, 64 << 10).await.unwrap_or_default();
    let said = String::from_utf8_lossy(&said).trim().to_string();
    let message = match status {
        StatusCode::METHOD_NOT_ALLOWED => {
            let allow = parts.headers.get(header::ALLOW).and_then(|v| v.to_str().ok()).unwrap_or("another method").to_string();
            format!("`{method} {path}`: this route takes {allow}")
        }
        _ if said.is_empty() => format!("`{method} {path}`: {}", status.canonical_reason().unwrap_or("error")),
        _ => format!("`{method} {path}`: {said}"),
    };
    let kind = match status.as_u16() {
        405 => "method_not_allowed",
        413 => "request_too_large",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    let body = ApiError::new(status.as_u16(), kind, message).body().to_string();
    Response::from_parts(parts, axum::body::Body::from(body))
}

fn error(e: &ApiError) -> Response {
    (StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST), Json(e.body())).into_response()
}

/// Bearer authentication of the /v1 routes, as vLLM's `--api-key`.
fn authorize(app: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else { return Ok(()) };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    // Compare every byte, so the time taken does not reveal a prefix.
    let same = given.is_some_and(|g| g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0);
    if same {
        Ok(())
    } else {
        Err(ApiError::new(401, "authentication_error", "a valid API key is required (Authorization: Bearer KEY)"))
    }
}

/// 200 while a replica takes requests, else 503 with the reason; with
/// several replicas (`--data-parallel-size`) the body gives each one's.
async fn health(State(app): State<App>) -> Response {
    let mut body = if app.engine.healthy() {
        json!({"status": "ok"})
    } else {
        json!({"status": "unavailable", "reason": app.engine.unready_reason()})
    };
    let states = app.engine.states();
    if states.len() > 1 {
        body["replicas"] = states
            .into_iter()
            .enumerate()
            .map(|(i, (up, why))| match (up, why) {
                (true, _) => json!({"replica": i, "status": "ok"}),
                (false, why) => json!({"replica": i, "status": "unavailable", "reason": why}),
            })
            .collect();
    }
    let code = if app.engine.healthy() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(body)).into_response()
}

async fn metrics(State(app): State<App>) -> Response {
    let text = app.engine.render_metrics(&app.name);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The longest timeline window `POST /debug/trace` records.
const MAX_TRACE_SECONDS: f64 = 300.0;

/// `POST /debug/trace {"seconds": N}`: every stage's timeline over the
/// next N seconds (default 5), written into `--trace-dir` as a Chrome
/// trace; the answer names the file once it is written.
async fn debug_trace(State(app): State<App>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return error(&e);
    }
    let Some(dir) = app.trace_dir.clone() else {
        return error(&ApiError::new(404, "not_found_error", "tracing is off: start the server with --trace-dir DIR"));
    };
    let req: Value = if body.is_empty() {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return error(&ApiError::bad("body", format!("not JSON: {e}"))),
        }
    };
    let seconds = match req.get("seconds") {
        None => 5.0,
        Some(v) => match v.as_f64().filter(|s| *s > 0.0 && *s <= MAX_TRACE_SECONDS) {
            Some(s) => s,
            None => return error(&ApiError::bad("seconds", format!("`seconds` must be a number above 0 and at most {MAX_TRACE_SECONDS}"))),
        },
    };
    if let Some(k) = req.as_object().and_then(|o| o.keys().find(|k| *k != "seconds")) {
        return error(&ApiError::bad(k, format!("unknown field `{k}`: this endpoint takes `seconds`")));
    }
    // A task of its own: a client that goes away mid-window must not leave
    // the stages recording and the window taken.
    let engine = app.engine.clone();
    let window = tokio::spawn(async move { engine.record_trace(std::time::Duration::from_secs_f64(seconds)).await });
    let collected = match window.await.unwrap_or_else(|e| Err(crate::engine::TraceError::Down(e.to_string()))) {
        Ok(c) => c,
        Err(crate::engine::TraceError::Busy) => {
            return error(&ApiError::new(409, "conflict_error", "a trace is being recorded; try again when it ends"))
        }
        Err(crate::engine::TraceError::Down(why)) => return error(&ApiError::new(503, "server_error", why)),
    };
    let events = collected.events.len();
    let written = tokio::task::spawn_blocking(move || -> anyhow::Result<std::path::PathBuf> {
        let bytes = m3c_front::trace::chrome_json(&collected)?;
        let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let file = dir.join(format!("m3c-trace-{ms}.json"));
        let tmp = dir.join(format!(".m3c-trace-{ms}.json.tmp"));
        std::fs::write(&tmp, &bytes).and_then(|_| std::fs::rename(&tmp, &file)).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            anyhow::anyhow!("writing {}: {e}", file.display())
        })?;
        Ok(file)
    })
    .await;
    match written {
        Ok(Ok(file)) => Json(json!({"trace": file, "events": events, "seconds": seconds})).into_response(),
        Ok(Err(e)) => error(&ApiError::new(500, "server_error", format!("{e:#}"))),
        Err(e) => error(&ApiError::new(500, "server_error", e.to_string())),
    }
}

async fn models(State(app): State<App>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return error(&e);
    }
    let cards: Vec<Value> = app
        .names
        .iter()
        .map(|n| json!({"id": n, "object": "model", "created": app.created, "owned_by": "m3c", "max_model_len": app.context}))
        .collect();
    Json(json!({"object": "list", "data": cards})).into_response()
}

/// Seeds for requests that give none: distinct per request, so two
/// unseeded requests draw differently (as OpenAI's API behaves); with
/// `--seed`, the n-th such request's seed is a function of the server's
/// seed and n, so a restarted server draws the same (vLLM's `--seed`).
pub struct Seeds {
    base: Option<u64>,
    next: std::sync::atomic::AtomicU64,
}

impl Seeds {
    pub fn new(base: Option<u64>) -> Seeds {
        Seeds { base, next: std::sync::atomic::AtomicU64::new(0) }
    }

    fn fresh(&self) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.base {
            Some(b) => splitmix64(b ^ splitmix64(n)),
            None => {
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
                h.write_u64(n);
                h.finish()
            }
        }
    }
}

/// SplitMix64's finaliser: distinct inputs give well-spread seeds.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

async fn completions(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<(Vec<u32>, Common), ApiError> {
        authorize(&app, &headers)?;
        let m = openai::object(&body)?;
        openai::check_model(&m, &app.names)?;
        openai::check_fields(&m, openai::Endpoint::Completions)?;
        let common = openai::common(&m, &app.defaults, openai::Endpoint::Completions, app.seeds.fresh())?;
        let ids = prompt_ids(&app, &m)?;
        // OpenAI's default for completions.
        let common = Common { max_tokens: common.max_tokens.or(Some(16)), ..common };
        Ok((ids, common))
    };
    let (ids, common) = match run() {
        Ok(r) => r,
        Err(e) => return error(&e),
    };
    let echo = match common.echo.then(|| app.tokenizer.decode(&ids, common.skip_special)) {
        None => None,
        Some(Ok(t)) => Some(t),
        Some(Err(e)) => return error(&ApiError::new(500, "server_error", e.to_string())),
    };
    let stream_it = common.stream;
    match start(app, ids, common, Kind::Completion, None).await {
        Ok(mut gens) => {
            for g in &mut gens {
                g.echo.clone_from(&echo);
            }
            if stream_it {
                stream(gens)
            } else {
                whole(gens).await
            }
        }
        Err(r) => r,
    }
}

async fn chat_completions(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<(Vec<u32>, Common, Kind, ImageUrls, String), ApiError> {
        authorize(&app, &headers)?;
        let m = openai::object(&body)?;
        openai::check_model(&m, &app.names)?;
        openai::check_fields(&m, openai::Endpoint::ChatCompletions)?;
        let mut common = openai::common(&m, &app.defaults, openai::Endpoint::ChatCompletions, app.seeds.fresh())?;
        let (rendered, chat) = render_chat(&app, &m, openai::chat_opening(&m)?)?;
        // A forced tool call is the request's grammar (one per request).
        if let Some(g) = chat.forced.clone() {
            if let Some((_, field)) = &common.grammar {
                return Err(ApiError::bad(
                    "tool_choice",
                    format!("a forced `tool_choice` constrains the output, and so does `{field}`: a request takes one of them"),
                ));
            }
            common.grammar = Some((g, "tool_choice"));
        }
        let ids = app.tokenizer.encode(&rendered).map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
        // Where the template left the model's reasoning (its thinking mode).
        let think = ThinkStart::of_prompt(&rendered, &app.format.think);
        Ok((ids, common, Kind::Chat { think, tools: chat.tools }, chat.images, rendered))
    };
    let (ids, common, kind, urls, rendered) = match run() {
        Ok(r) => r,
        Err(e) => return error(&e),
    };
    if urls.is_empty() {
        return generate(app, ids, common, kind, None).await;
    }
    match media(&app, Some(&rendered), &ids, &urls).await {
        Ok((ids, im)) => generate(app, ids, common, kind, Some(im)).await,
        Err(e) => error(&e),
    }
}

/// A chat request's prompt as the model's template writes it, and the
/// request's chat parts; `opening`: the assistant's turn opened, the final
/// assistant message continued, or neither.
pub(crate) fn render_chat(
    app: &Shared,
    m: &serde_json::Map<String, Value>,
    opening: openai::Opening,
) -> Result<(String, openai::Chat), ApiError> {
    let generation_prompt = opening == openai::Opening::Generation;
    let chat = openai::chat(m, &app.format.tools)?;
    let template = app
        .template
        .as_ref()
        .ok_or_else(|| ApiError::new(400, "invalid_request_error", "this model has no chat template; use /v1/completions"))?;
    let mut kwargs: Vec<(&str, Value)> = vec![("add_generation_prompt", Value::Bool(generation_prompt))];
    if !chat.tools.is_empty() {
        kwargs.push(("tools", Value::Array(chat.tools.clone())));
    }
    for (k, v) in &chat.kwargs {
        if k == "add_generation_prompt" || k == "tools" || k == "messages" {
            return Err(ApiError::bad("chat_template_kwargs", format!("`chat_template_kwargs` may not set `{k}`")));
        }
        kwargs.push((k.as_str(), v.clone()));
    }
    // The server's defaults (`--default-chat-template-kwargs`) under the request's own.
    for (k, v) in &app.default_kwargs {
        if !chat.kwargs.contains_key(k) {
            kwargs.push((k.as_str(), v.clone()));
        }
    }
    let rendered = template
        .render_json(&chat.messages, &kwargs)
        .map_err(|e| ApiError::bad("messages", format!("the chat template refused the messages: {e}")))?;
    let rendered = if opening == openai::Opening::Continue { continue_final(&rendered, &chat.messages)? } else { rendered };
    Ok((rendered, chat))
}

/// vLLM's `continue_final_message`: the prompt ends where the final
/// assistant message's text ends in the rendered chat, so the model goes on
/// writing that message (the template's end of turn after it is cut).
fn continue_final(rendered: &str, messages: &Value) -> Result<String, ApiError> {
    const K: &str = "continue_final_message";
    let last = messages.as_array().and_then(|a| a.last()).cloned().unwrap_or(Value::Null);
    if last["role"] != "assistant" {
        return Err(ApiError::bad(K, "`continue_final_message` continues the last message, which must be the assistant's"));
    }
    let text = match &last["content"] {
        Value::String(t) => t.clone(),
        Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
        _ => String::new(),
    };
    if text.is_empty() {
        return Err(ApiError::bad(K, "`continue_final_message`: the last assistant message has no text to continue"));
    }
    // As transformers does: the text's last occurrence, or, when the
    // template trimmed it, the trimmed text's.
    let found = rendered.rfind(&text).map(|at| at + text.len()).or_else(|| {
        let t = text.trim();
        (!t.is_empty()).then(|| rendered.rfind(t).map(|at| at + t.len())).flatten()
    });
    let end = found
        .ok_or_else(|| ApiError::bad(K, "`continue_final_message`: the chat template does not write the last message's text as given"))?;
    Ok(rendered[..end].to_string())
}

/// A completions request's `prompt` as token ids (text through the tokenizer).
fn prompt_ids(app: &Shared, m: &serde_json::Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    match openai::prompt(m)? {
        openai::Prompt::Text(t) => app.tokenizer.encode(&t).map_err(|e| ApiError::new(500, "server_error", e.to_string())),
        openai::Prompt::Ids(ids) => Ok(ids),
    }
}

/// vLLM's `/v1/completions/render`: the request's prompt as the token ids
/// generation would take, in vLLM's shape (a list, one entry per prompt).
/// Prefix-aware routers (vllm-router's `cache_aware` and `kv_aware`) call
/// it on every replica before routing.
async fn completions_render(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        authorize(&app, &headers)?;
        let m = openai::object(&body)?;
        openai::check_model(&m, &app.names)?;
        openai::check_fields(&m, openai::Endpoint::Completions)?;
        let ids = prompt_ids(&app, &m)?;
        Ok(json!([{"request_id": format!("cmpl-render-{}", app.seeds.fresh()), "model": app.name, "token_ids": ids}]))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(&e),
    }
}

/// vLLM's `/v1/chat/completions/render`: the chat's prompt as the token
/// ids generation would take (`{"token_ids": [...]}`), rendered as the
/// request asks (generation prompt, or the final message continued). A chat
/// with images is refused, as by `/tokenize`: an image's tokens depend on
/// its size, which rendering does not fetch.
async fn chat_render(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        authorize(&app, &headers)?;
        let m = openai::object(&body)?;
        openai::check_model(&m, &app.names)?;
        openai::check_fields(&m, openai::Endpoint::ChatCompletions)?;
        let (rendered, chat) = render_chat(&app, &m, openai::chat_opening(&m)?)?;
        if !chat.images.is_empty() {
            return Err(ApiError::bad("messages", "rendering takes text messages (an image's tokens depend on its size)"));
        }
        let ids = app.tokenizer.encode(&rendered).map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
        Ok(json!({"model": app.name, "token_ids": ids}))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(&e),
    }
}

/// SGLang's `/get_load`, which vllm-router's `power_of_two` policy reads:
/// the requests running and waiting here.
async fn get_load(State(app): State<App>) -> Response {
    let g = app.engine.gauges();
    Json(json!({"load": g.running + g.waiting})).into_response()
}

/// vLLM's `/tokenize`: a completions `prompt` or chat `messages` (with
/// `tools`, `chat_template_kwargs`, `add_generation_prompt`) as the token
/// ids the generation routes would use.
async fn tokenize(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        authorize(&app, &headers)?;
        let m = openai::object(&body)?;
        openai::check_known(&m, openai::TOKENIZE_FIELDS, "/tokenize")?;
        if m.get("model").is_some_and(|v| !v.is_null()) {
            openai::check_model(&m, &app.names)?;
        }
        let flag = |k: &str, default: bool| match m.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(ApiError::bad(k, format!("`{k}` must be true or false, not {}", openai::kind(v)))),
        };
        let add_special = flag("add_special_tokens", false)?;
        let encode =
            |text: &str| app.tokenizer.encode_with(text, add_special).map_err(|e| ApiError::new(500, "server_error", e.to_string()));
        let ids = match (m.get("prompt"), m.get("messages")) {
            (Some(_), Some(_)) => return Err(ApiError::bad("messages", "give `prompt` or `messages`, not both")),
            (_, Some(_)) => {
                let (rendered, chat) = render_chat(&app, &m, openai::chat_opening(&m)?)?;
                if !chat.images.is_empty() {
                    return Err(ApiError::bad("messages", "/tokenize takes text messages (an image's tokens depend on its size)"));
                }
                encode(&rendered)?
            }
            (Some(_), None) => match openai::prompt(&m)? {
                openai::Prompt::Text(t) => encode(&t)?,
                openai::Prompt::Ids(ids) => ids,
            },
            (None, None) => return Err(ApiError::bad("prompt", "`prompt` or `messages` is required")),
        };
        let strs = if flag("return_token_strs", false)? { json!(app.tokenizer.id_strings(&ids)) } else { Value::Null };
        Ok(json!({"count": ids.len(), "max_model_len": app.context, "tokens": ids, "token_strs": strs}))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(&e),
    }
}

/// vLLM's `/detokenize`: `tokens` back to text (special tokens kept, as vLLM).
async fn detokenize(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        authorize(&app, &headers)?;
        let m = openai::object(&body)?;
        openai::check_known(&m, &["model", "tokens"], "/detokenize")?;
        if m.get("model").is_some_and(|v| !v.is_null()) {
            openai::check_model(&m, &app.names)?;
        }
        let bad = || ApiError::bad("tokens", "`tokens` must be an array of token ids in the vocabulary");
        let ids: Vec<u32> = match m.get("tokens") {
            Some(Value::Array(a)) => {
                a.iter().map(|v| v.as_u64().and_then(|i| u32::try_from(i).ok())).collect::<Option<_>>().ok_or_else(bad)?
            }
            _ => return Err(bad()),
        };
        if ids.iter().any(|&i| i as usize >= app.tokenizer.vocab_size()) {
            return Err(bad());
        }
        let text = app.tokenizer.decode(&ids, false).map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
        Ok(json!({"prompt": text}))
    };
    match run() {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(&e),
    }
}

/// The server's version, as vLLM's `/version`.
async fn version() -> Response {
    Json(json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

/// A chat's `image_url` and `video_url` parts: (the part's field, its URL).
type ImageUrls = Vec<(String, String)>;

/// The prompt's ids with each image's placeholder expanded, and the images
/// (none when the prompt has no image parts). Videos come through
/// `/v1/chat/completions` only ([`media`] with the rendered prompt).
async fn with_images(app: &App, ids: Vec<u32>, urls: &[(String, String)]) -> Result<(Vec<u32>, Option<SeqImages>), ApiError> {
    if urls.is_empty() {
        return Ok((ids, None));
    }
    let (ids, im) = media(app, None, &ids, urls).await?;
    Ok((ids, Some(im)))
}

/// A chat's images and videos: fetched, processed as the reference
/// processors do (off the async threads); each video's token in the
/// `rendered` prompt replaced by its text (timestamps and placeholders)
/// and the prompt tokenized again, as the reference processor does; then
/// each image placeholder expanded into its run of tokens. The media go to
/// the stage in the order their placeholders take in the prompt.
async fn media(app: &App, rendered: Option<&str>, ids: &[u32], urls: &[(String, String)]) -> Result<(Vec<u32>, SeqImages), ApiError> {
    use m3c_front::text::messages::is_video_field;
    use m3c_front::vision::{processor, prompt, video};
    let Some(token) = app.image_token else {
        return Err(ApiError::bad(&urls[0].0, "this model has no vision tower: images and videos are not accepted"));
    };
    let count = |video: bool| urls.iter().filter(move |(at, _)| is_video_field(at) == video);
    for (video, most, flag) in [(false, app.media.max_images, "images"), (true, app.media.max_videos, "videos")] {
        if let Some((at, _)) = count(video).nth(most) {
            return Err(ApiError::bad(
                at,
                format!("{} {flag} in one request; the server takes at most {most} (--max-{flag}-per-request)", count(video).count()),
            ));
        }
    }
    let (mut images, mut videos) = (Vec::new(), Vec::new());
    for (at, url) in urls {
        let is_video = is_video_field(at);
        let what = at.clone();
        let failed = |e: tokio::task::JoinError| ApiError::new(500, "server_error", format!("processing {at}: {e}"));
        if is_video {
            let policy = super::media::MediaPolicy { max_bytes: app.media.max_video_bytes, ..app.media.clone() };
            let bytes = super::media::fetch(url, &policy, at).await?;
            let v = tokio::task::spawn_blocking(move || video::process_bytes(&bytes, &video::VideoLimits::default(), &what))
                .await
                .map_err(failed)?
                .map_err(|e| ApiError::bad(at, e.to_string()))?;
            videos.push(v);
        } else {
            let bytes = super::media::fetch(url, &app.media, at).await?;
            let p = tokio::task::spawn_blocking(move || processor::process(&bytes, &what))
                .await
                .map_err(failed)?
                .map_err(|e| ApiError::bad(at, e.to_string()))?;
            images.push(p);
        }
    }
    let ids = if videos.is_empty() {
        ids.to_vec()
    } else {
        let at = &urls.iter().find(|(at, _)| is_video_field(at)).expect("a video is there").0;
        let text = rendered.ok_or_else(|| ApiError::bad(at, "videos are taken by /v1/chat/completions"))?;
        let text = video::expand_text(text, &videos, &app.format.media).map_err(|e| ApiError::bad("messages", e.to_string()))?;
        app.tokenizer.encode(&text).map_err(|e| ApiError::new(500, "server_error", e.to_string()))?
    };
    let tokens: Vec<usize> = images.iter().map(|p| p.tokens()).collect();
    let t = prompt::ImageTokens::new(|t| app.tokenizer.token_id(t), token, &app.format.media)
        .map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
    let ids = t.expand(&ids, &tokens).map_err(|e| ApiError::bad("messages", e.to_string()))?;
    let video_token = app.video_token.map_or(u32::MAX, |v| v as u32);
    let seq = prompt::seq_media_in_order(&ids, token as u32, video_token, images, videos)
        .map_err(|e| ApiError::bad("messages", e.to_string()))?;
    Ok((ids, seq))
}

/// Which API a generation answers.
#[derive(Clone)]
enum Kind {
    Completion,
    /// `think`: where the prompt left the model's reasoning.
    Chat {
        think: ThinkStart,
        tools: Vec<Value>,
    },
}

/// One choice's way from token ids to OpenAI's answer.
struct Generation {
    app: App,
    ticket: Ticket,
    common: Common,
    /// Which of the request's choices this is.
    index: usize,
    decoder: IncrementalDecoder,
    filter: StopFilter,
    chat: Option<ChatOutput>,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Tokens generated by all of the request's choices (for its usage).
    all_tokens: Arc<std::sync::atomic::AtomicUsize>,
    /// Logprobs of tokens not yet sent (streaming), or of every token (whole).
    logprobs: Vec<(u32, TokenLogprobs)>,
    /// Characters of the tokens whose logprobs were sent (completions' `text_offset`).
    lp_offset: usize,
    /// The prompt's text, which the answer starts with (completions' `echo`).
    echo: Option<String>,
    /// The prompt's first token, and the logprobs of the others as the
    /// stages report them (prompt logprobs, or `echo` with `logprobs`).
    prompt_first: Option<u32>,
    prompt_lps: Vec<(u32, TokenLogprobs)>,
    /// The prompt's tokens went out with the logprobs already (`echo`).
    prompt_lps_sent: bool,
    /// The `prompt_logprobs` field went out already (streaming).
    prompt_field_sent: bool,
    id: String,
    created: u64,
    finish: Option<String>,
}

/// What one event adds (reasoning, content and tool calls, in order), and
/// whether the answer ended.
enum Step {
    Text { pieces: Vec<Piece>, end: bool },
    Failed(String),
}

impl Generation {
    async fn next(&mut self) -> Step {
        let ev = loop {
            match self.ticket.rx.recv().await {
                None => return Step::Failed("the request's events ended".into()),
                Some(Event::Prompt(_, id, lp)) => self.prompt_lps.push((id, lp)),
                Some(ev) => break ev,
            }
        };
        let tk = &self.app.tokenizer;
        let (new, end) = match ev {
            Event::Token(id, lp) => {
                if let Some(lp) = lp {
                    self.logprobs.push((id, lp));
                }
                self.completion_tokens += 1;
                self.all_tokens.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if self.common.stop_ids.contains(&id) {
                    // A stop id ends the choice; its text is left out
                    // unless the request includes stops (as vLLM does), and
                    // the text before it ends as at any other end.
                    self.finish = Some("stop".into());
                    let mut piece = if self.common.include_stop { self.decoder.push(tk, id).unwrap_or_default() } else { String::new() };
                    piece += &self.decoder.finish(tk).unwrap_or_default();
                    let text = self.filter.push(&piece, &self.common.stop, true);
                    return self.shown(text, true);
                }
                let piece = self.decoder.push(tk, id).unwrap_or_default();
                let text = self.filter.push(&piece, &self.common.stop, false);
                if self.filter.stopped() {
                    // A stop string: the rest is not wanted (the first
                    // stage ends the sequence on the same token).
                    self.finish = Some("stop".into());
                }
                (text, self.filter.stopped())
            }
            Event::End(reason) => {
                self.ticket.done();
                let piece = self.decoder.finish(tk).unwrap_or_default();
                let text = self.filter.push(&piece, &self.common.stop, true);
                self.finish = Some(if reason == "length" { "length".into() } else { "stop".into() });
                (text, true)
            }
            Event::Failed(why) => {
                self.ticket.done();
                return Step::Failed(why);
            }
            Event::Prompt(..) => unreachable!("taken in the loop above"),
        };
        self.shown(new, end)
    }

    /// What the client sees of `new` text: for chat, read into reasoning,
    /// content and tool calls.
    fn shown(&mut self, new: String, end: bool) -> Step {
        match &mut self.chat {
            Some(c) => {
                let mut pieces = c.push(&new);
                if end {
                    pieces.extend(c.finish());
                }
                Step::Text { pieces, end }
            }
            None => Step::Text { pieces: vec![Piece::Content(new)], end },
        }
    }

    /// The id of the choice's call `index`: unique in the server's run
    /// (the request's id, the choice, the call).
    fn call_id(&self, prefix: &str, index: usize) -> String {
        let request = self.id.rsplit(['-', '_']).next().unwrap_or_default();
        format!("{prefix}_{request}_{}_{index}", self.index)
    }

    /// The calls read so far, in OpenAI's shape.
    fn tool_calls(&self) -> Vec<Value> {
        let calls = self.chat.as_ref().map_or(&[][..], |c| &c.tool_calls[..]);
        calls
            .iter()
            .enumerate()
            .map(
                |(i, c)| json!({"id": self.call_id("call", i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}),
            )
            .collect()
    }

    /// The finish reason: `length` when the tokens ran out (a call it cut
    /// is returned as far as it went), `tool_calls` when the answer
    /// called tools, else `stop`.
    fn finish_reason(&self) -> String {
        match self.finish.as_deref() {
            Some("length") => "length".into(),
            _ if self.chat.as_ref().is_some_and(|c| !c.tool_calls.is_empty()) => "tool_calls".into(),
            f => f.unwrap_or("stop").into(),
        }
    }

    /// The logprobs gathered since the last call, in OpenAI's shape for this
    /// endpoint (null when the request asked for none). Each token is its
    /// own text; a log-probability of −∞ is sent as −9999, as vLLM does
    /// (JSON has no infinity).
    fn take_logprobs(&mut self) -> Value {
        if self.common.logprobs.is_none() {
            return Value::Null;
        }
        let entries = std::mem::take(&mut self.logprobs);
        let tk = &self.app.tokenizer;
        // `return_tokens_as_token_ids`: vLLM's spelling of a token by its id.
        let as_ids = self.common.tokens_as_ids;
        let text = |id: u32| if as_ids { format!("token_id:{id}") } else { tk.decode(&[id], false).unwrap_or_default() };
        let num = |v: f32| if v.is_finite() { f64::from(v) } else { -9999.0 };
        if self.chat.is_some() {
            let item = |id: u32, v: f32| {
                let t = text(id);
                json!({"token": t, "logprob": num(v), "bytes": t.as_bytes()})
            };
            let content: Vec<Value> = entries
                .iter()
                .map(|(id, lp)| {
                    let mut v = item(*id, lp.logprob);
                    v["top_logprobs"] = lp.top.iter().map(|&(i, l)| item(i, l)).collect();
                    v
                })
                .collect();
            return json!({"content": content});
        }
        // `echo` with logprobs: the prompt's tokens come first, the first
        // without a logprob (nothing comes before it), as vLLM answers.
        let mut all: Vec<(u32, Option<&TokenLogprobs>)> = Vec::new();
        if self.echo_logprobs() && !self.prompt_lps_sent {
            self.prompt_lps_sent = true;
            all.extend(self.prompt_first.map(|id| (id, None)));
            all.extend(self.prompt_lps.iter().map(|(id, lp)| (*id, Some(lp))));
        }
        all.extend(entries.iter().map(|(id, lp)| (*id, Some(lp))));
        let (mut tokens, mut lps, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (id, lp) in all {
            let t = text(id);
            offsets.push(self.lp_offset);
            self.lp_offset += t.chars().count();
            tokens.push(t);
            lps.push(lp.map_or(Value::Null, |lp| json!(num(lp.logprob))));
            tops.push(lp.map_or(Value::Null, |lp| Value::Object(lp.top.iter().map(|&(i, l)| (text(i), json!(num(l)))).collect())));
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }

    /// The `prompt_logprobs` field, the first time it is asked for
    /// (streaming sends it once).
    fn prompt_field(&mut self) -> Option<Value> {
        (self.common.prompt_logprobs.is_some() && !std::mem::replace(&mut self.prompt_field_sent, true)).then(|| self.prompt_logprobs())
    }

    /// Completions' `echo` with `logprobs`: the prompt's tokens are in the logprobs.
    fn echo_logprobs(&self) -> bool {
        self.chat.is_none() && self.common.echo && self.common.logprobs.is_some()
    }

    /// vLLM's `prompt_logprobs` answer: null for the first token, then per
    /// token its id's entry and its alternatives' (`logprob`, `rank`,
    /// `decoded_token`); null when the request asked for none.
    fn prompt_logprobs(&self) -> Value {
        if self.common.prompt_logprobs.is_none() {
            return Value::Null;
        }
        let tk = &self.app.tokenizer;
        let text = |id: u32| tk.decode(&[id], false).unwrap_or_default();
        let num = |v: f32| if v.is_finite() { f64::from(v) } else { -9999.0 };
        let entry = |v: f32, rank: usize, id: u32| json!({"logprob": num(v), "rank": rank, "decoded_token": text(id)});
        let mut out = vec![Value::Null];
        for (id, lp) in &self.prompt_lps {
            let mut m = serde_json::Map::new();
            for (r, &(i, v)) in lp.top.iter().enumerate() {
                m.insert(i.to_string(), entry(v, r + 1, i));
            }
            m.insert(id.to_string(), entry(lp.logprob, lp.rank as usize, *id));
            out.push(Value::Object(m));
        }
        Value::Array(out)
    }

    /// The usage of the whole request: its prompt once, every choice's tokens.
    fn usage(&self) -> Value {
        let done = self.all_tokens.load(std::sync::atomic::Ordering::Relaxed);
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": done, "total_tokens": self.prompt_tokens + done})
    }

    fn chunk(&self, choice: Value) -> Value {
        let object = if self.chat.is_some() { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.app.name, "choices": [choice]})
    }
}

async fn generate(app: App, ids: Vec<u32>, common: Common, kind: Kind, images: Option<SeqImages>) -> Response {
    let stream_it = common.stream;
    match start(app, ids, common, kind, images).await {
        Ok(gens) if stream_it => stream(gens),
        Ok(gens) => whole(gens).await,
        Err(r) => r,
    }
}

/// A request's checks and admission: its choices, submitted to the
/// engine, as generations to read; or the error response.
async fn start(app: App, ids: Vec<u32>, common: Common, kind: Kind, images: Option<SeqImages>) -> Result<Vec<Generation>, Response> {
    if ids.is_empty() {
        return Err(error(&ApiError::bad("prompt", "the prompt has no tokens")));
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= app.tokenizer.vocab_size()) {
        return Err(error(&ApiError::bad("prompt", format!("token id {bad} is outside the vocabulary"))));
    }
    if let Some(&(bad, _)) = common.logit_bias.iter().find(|&&(i, _)| i as usize >= app.tokenizer.vocab_size()) {
        return Err(error(&ApiError::bad("logit_bias", format!("`logit_bias`: token id {bad} is outside the vocabulary"))));
    }
    if let Some(&bad) = common.stop_ids.iter().find(|&&i| i as usize >= app.tokenizer.vocab_size()) {
        return Err(error(&ApiError::bad("stop_token_ids", format!("`stop_token_ids`: token id {bad} is outside the vocabulary"))));
    }
    // Image and video placeholders come only from image and video parts:
    // the same tokens typed into text (or sent as ids) have nothing to
    // stand for.
    if let Some(t) = app.image_token {
        let v = app.video_token.unwrap_or(usize::MAX);
        let found = ids.iter().filter(|&&i| i as usize == t || i as usize == v).count();
        let expected: usize = images.as_ref().map_or(0, |im| im.tokens().iter().sum());
        if found != expected {
            return Err(error(&ApiError::bad(
                "messages",
                format!(
                    "the prompt holds {found} image and video placeholder token(s) (ids {t} and {v}) for {expected} image and video token(s): send images and videos as image_url and video_url content parts, not as placeholder text"
                ),
            )));
        }
    }
    let room = app.context.saturating_sub(ids.len());
    // Without max_tokens: to the end of the context (or of the KV pool),
    // up to the server's default.
    let max_new = common.max_tokens.unwrap_or(room.min(app.default_max_tokens));
    if ids.len().checked_add(max_new).is_none_or(|n| n > app.context) || max_new == 0 {
        return Err(error(&ApiError::bad(
            "max_tokens",
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {max_new} for the completion).",
                app.context,
                ids.len().saturating_add(max_new),
                ids.len()
            ),
        )));
    }
    // The images go to the first stage with the request, over its input
    // (it may run on another host): an images file's bytes.
    let images = match images {
        None => None,
        Some(im) => {
            match tokio::task::spawn_blocking(move || m3c_contract::images::encode(&std::collections::BTreeMap::from([(0usize, im)]))).await
            {
                Ok(bytes) => Some(Arc::<[u8]>::from(bytes)),
                Err(e) => return Err(error(&ApiError::new(500, "server_error", format!("encoding the request's images: {e}")))),
            }
        }
    };
    // Each choice is its own sequence, drawing from its own seed, so
    // choice i of a request is what the same request with n = 1 and seed
    // `seed + i` gives.
    let think = match &kind {
        Kind::Chat { think, .. } => *think,
        Kind::Completion => ThinkStart::Closed,
    };
    let grammar = match &common.grammar {
        None => None,
        Some((g, field)) => Some(check_grammar(&app, g, field, think).map_err(|e| error(&e))?),
    };
    let budget = thinking_budget(&app, &common, grammar.is_some(), think, max_new).map_err(|e| error(&e))?;
    // A grammar's end is an EOS the sequence must stop on, whatever
    // `ignore_eos` says, and whose text is not the answer's. The grammar
    // decides where the answer ends: stop strings do not apply (one could
    // cut a call or a JSON value short), and the stage holds the stop ids
    // back until the grammar is complete.
    let mut common = common;
    if grammar.is_some() {
        common.stop_ids.extend(&app.eos_ids);
        common.stop.clear();
    }
    let mut tickets = Vec::with_capacity(common.n);
    for i in 0..common.n {
        let mut sampling = common.sampling;
        sampling.seed = sampling.seed.wrapping_add(i as u64);
        let sub = SeqRequest {
            ignore_eos: common.ignore_eos,
            images: images.clone(),
            stops: common.stop.iter().map(|t| t.as_bytes().to_vec()).collect(),
            stop_ids: common.stop_ids.iter().map(|&i| i64::from(i)).collect(),
            logprobs: common.logprobs,
            grammar: grammar.clone(),
            think: budget,
            min_tokens: common.min_tokens,
            logit_bias: common.logit_bias.clone(),
            prompt_logprobs: common.prompt_alternatives(),
            // `submit` gives it its sequence number.
            ..SeqRequest::new(0, ids.iter().map(|&i| i64::from(i)).collect(), max_new, sampling)
        };
        // A refused choice drops the tickets taken so far, which cancels them.
        tickets.push(match app.engine.submit(sub) {
            Ok(t) => t,
            Err(SubmitError::QueueFull(n)) => {
                return Err(error(&ApiError::new(
                    503,
                    "server_error",
                    format!("the server is at capacity: {n} requests already wait; retry later"),
                )))
            }
            Err(SubmitError::TooLarge(m)) => return Err(error(&ApiError::bad("max_tokens", m))),
            Err(SubmitError::Down(why)) => {
                return Err(error(&ApiError::new(503, "server_error", format!("the model is not available: {why}"))))
            }
        });
    }
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let prefix = if matches!(kind, Kind::Chat { .. }) { "chatcmpl" } else { "cmpl" };
    let id = format!("{prefix}-{created:x}{:x}", tickets[0].number());
    let all_tokens = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let gens: Vec<Generation> = tickets
        .into_iter()
        .enumerate()
        .map(|(index, ticket)| Generation {
            id: id.clone(),
            app: app.clone(),
            ticket,
            chat: match &kind {
                Kind::Chat { think, tools } => Some(ChatOutput::new(app.format, *think, reading(&app, &common, !tools.is_empty()), tools)),
                Kind::Completion => None,
            },
            common: common.clone(),
            index,
            decoder: IncrementalDecoder::new(common.skip_special),
            filter: StopFilter::new(common.include_stop),
            prompt_tokens: ids.len(),
            completion_tokens: 0,
            all_tokens: all_tokens.clone(),
            logprobs: Vec::new(),
            lp_offset: 0,
            echo: None,
            prompt_first: ids.first().copied(),
            prompt_lps: Vec::new(),
            prompt_lps_sent: false,
            prompt_field_sent: false,
            created,
            finish: None,
        })
        .collect();
    Ok(gens)
}

/// A request's grammar behind the reasoning its prompt allows
/// (`m3c_constrain::thinking::wrap`: what the reader then calls content is
/// what the grammar matched), compiled once here so that a bad one is the
/// client's 400 (naming the field that gave it), as its text for the
/// stages. Completions constrain from the first token.
fn check_grammar(app: &Shared, g: &m3c_constrain::Grammar, field: &str, think: ThinkStart) -> Result<String, ApiError> {
    let v = app.grammars.as_ref().map_err(|why| ApiError::bad(field, format!("`{field}`: structured output is not available: {why}")))?;
    // `enable_in_reasoning`: the request's grammar binds the reasoning too
    // (a forced call's, which m3c writes, always follows it).
    let think = if binds_reasoning(app, field) { ThinkStart::Closed } else { think };
    let text = m3c_constrain::thinking::wrap(&g.to_text(), think, &app.format.think)
        .map_err(|e| ApiError::bad(field, format!("`{field}`: {e}")))?;
    v.compile(&text).map_err(|e| ApiError::bad(field, format!("`{field}`: {e}")))?;
    Ok(text)
}

/// The cap on a chat's reasoning: the request's `thinking_token_budget`;
/// under a constraint without one, half the request's tokens, so that a
/// model that never closes its reasoning still leaves the other half to the
/// constrained answer. Nothing to cap when the prompt closed the reasoning.
/// A budget needs the closing tag as one token of the model's vocabulary:
/// asked for without one it is a 400; the default one is then left out
/// (the grammar alone still binds the content).
fn thinking_budget(
    app: &Shared,
    common: &Common,
    constrained: bool,
    start: ThinkStart,
    max_new: usize,
) -> Result<Option<ThinkBudget>, ApiError> {
    if start == ThinkStart::Closed {
        return Ok(None);
    }
    let closes = app.grammars.as_ref().ok().is_some_and(|v| v.token_of(app.format.think.close.as_bytes()).is_some());
    let budget = match (common.thinking_budget, closes) {
        (Some(b), true) => Some(b),
        (Some(_), false) => {
            return Err(ApiError::bad(
                "thinking_token_budget",
                format!(
                    "`thinking_token_budget` needs `{}` as one token of the model's tokenizer, and it has none",
                    app.format.think.close
                ),
            ))
        }
        (None, true) if constrained => Some(u32::try_from(max_new / 2).unwrap_or(u32::MAX)),
        (None, _) => None,
    };
    Ok(budget.map(|budget| ThinkBudget { start, budget }))
}

/// Whether the grammar a request's `field` gave binds the whole output,
/// reasoning included (`--structured-outputs-config
/// '{"enable_in_reasoning": true}'`).
fn binds_reasoning(app: &Shared, field: &str) -> bool {
    app.structured.in_reasoning && field != "tool_choice"
}

/// How a chat's output is read: by the grammar that binds it, if any. A
/// grammar beside tools (with `tool_choice` auto) is read for calls and
/// reasoning like any other answer, as vLLM does; so is one that binds the
/// reasoning too.
fn reading(app: &Shared, common: &Common, tools: bool) -> Reading {
    match &common.grammar {
        None => Reading::Free,
        Some((_, "tool_choice")) => Reading::ForcedCalls,
        Some((_, field)) if tools || binds_reasoning(app, field) => Reading::Free,
        Some(_) => Reading::Constrained,
    }
}

/// The answer in one response: every choice, generated side by side.
async fn whole(gens: Vec<Generation>) -> Response {
    let done = futures_util::future::join_all(gens.into_iter().map(whole_choice)).await;
    let mut choices = Vec::with_capacity(done.len());
    let mut last = None;
    for d in done {
        match d {
            Ok((choice, g)) => {
                choices.push(choice);
                last = Some(g);
            }
            Err(why) => return error(&ApiError::new(503, "server_error", format!("the request could not finish: {why}"))),
        }
    }
    let Some(g) = last else { return error(&ApiError::new(500, "server_error", "a request without choices")) };
    let object = if g.chat.is_some() { "chat.completion" } else { "text_completion" };
    let mut body = json!({"id": g.id, "object": object, "created": g.created, "model": g.app.name, "choices": choices, "usage": g.usage()});
    // vLLM answers a chat's prompt logprobs beside its choices.
    if g.chat.is_some() && g.common.prompt_logprobs.is_some() {
        body["prompt_logprobs"] = g.prompt_logprobs();
    }
    Json(body).into_response()
}

/// One choice to its end, as the choice object of a whole answer.
async fn whole_choice(mut g: Generation) -> Result<(Value, Generation), String> {
    let mut content = String::new();
    loop {
        match g.next().await {
            Step::Text { pieces, end } => {
                // A completion's text (a chat's is the reader's, below).
                for p in pieces {
                    if let Piece::Content(t) = p {
                        content += &t;
                    }
                }
                if end {
                    break;
                }
            }
            Step::Failed(why) => return Err(why),
        }
    }
    let calls = g.tool_calls();
    let mut reasoning = String::new();
    if let Some(c) = &g.chat {
        content = c.content.clone();
        reasoning = c.reasoning.clone();
    }
    let finish = g.finish_reason();
    let choice = if g.chat.is_some() {
        let mut message = json!({"role": "assistant", "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(content) }});
        if !reasoning.is_empty() && g.common.include_reasoning {
            // vLLM's name, and the older one its clients still read.
            message["reasoning"] = Value::String(reasoning.clone());
            message["reasoning_content"] = Value::String(reasoning);
        }
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        json!({"index": g.index, "message": message, "logprobs": g.take_logprobs(), "finish_reason": finish})
    } else {
        let text = g.echo.take().unwrap_or_default() + &content;
        let mut c = json!({"index": g.index, "text": text, "logprobs": g.take_logprobs(), "finish_reason": finish});
        if g.common.prompt_logprobs.is_some() {
            c["prompt_logprobs"] = g.prompt_logprobs();
        }
        c
    };
    Ok((choice, g))
}

/// The answer as server-sent events: every choice's chunks as they come
/// (each names its index), then the usage when asked for, then `[DONE]`.
/// A client that goes away drops the stream, and with it the tickets, which
/// cancels the sequences.
fn stream(gens: Vec<Generation>) -> Response {
    let data = |v: &Value| Ok::<_, Infallible>(Sse_::default().data(v.to_string()));
    // What the closing events need, taken before the choices move.
    let Some(first) = gens.first() else { return error(&ApiError::new(500, "server_error", "a request without choices")) };
    let (include_usage, mut tail_chunk) = (first.common.include_usage, first.chunk(Value::Null));
    let (all_tokens, prompt_tokens) = (first.all_tokens.clone(), first.prompt_tokens);
    let choices = futures_util::stream::select_all(gens.into_iter().map(|g| Box::pin(choice_events(g))));
    let tail = futures_util::stream::once(async move {
        let mut out = Vec::new();
        if include_usage {
            let done = all_tokens.load(std::sync::atomic::Ordering::Relaxed);
            tail_chunk["choices"] = json!([]);
            tail_chunk["usage"] = json!({"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done});
            out.push(data(&tail_chunk));
        }
        out.push(Ok(Sse_::default().data("[DONE]")));
        futures_util::stream::iter(out)
    });
    let flat = futures_util::StreamExt::chain(choices, futures_util::StreamExt::flatten(tail));
    Sse::new(flat).keep_alive(KeepAlive::default()).into_response()
}

/// A chat's pieces as OpenAI's stream deltas, in order: reasoning and
/// content in one delta, tool calls in another (a call's first entry has
/// its `index`, `id`, `type` and `function.name`, later ones its
/// `function.arguments` fragments).
fn chat_deltas(g: &Generation, pieces: Vec<Piece>) -> Vec<Value> {
    let mut deltas: Vec<serde_json::Map<String, Value>> = Vec::new();
    for p in pieces {
        let calls = matches!(p, Piece::Call { .. } | Piece::Args { .. });
        if deltas.last().is_none_or(|d| d.contains_key("tool_calls") != calls) {
            deltas.push(serde_json::Map::new());
        }
        let Some(d) = deltas.last_mut() else { continue };
        let mut append = |k: &str, t: &str| {
            let v = d.entry(k.to_string()).or_insert_with(|| Value::String(String::new()));
            if let Value::String(s) = v {
                s.push_str(t);
            }
        };
        match p {
            // `include_reasoning: false` leaves it out of the stream too.
            Piece::Reasoning(_) if !g.common.include_reasoning => {}
            Piece::Reasoning(t) => {
                // vLLM's name, and the older one its clients still read.
                append("reasoning", &t);
                append("reasoning_content", &t);
            }
            Piece::Content(t) => append("content", &t),
            Piece::Call { index, name } => {
                let entry = json!({"index": index, "id": g.call_id("call", index), "type": "function",
                                   "function": {"name": name, "arguments": ""}});
                if let Some(a) = d.entry("tool_calls").or_insert_with(|| json!([])).as_array_mut() {
                    a.push(entry);
                }
            }
            Piece::Args { index, json } => {
                let list = d.entry("tool_calls").or_insert_with(|| json!([]));
                match list.as_array_mut().and_then(|a| a.last_mut()).filter(|e| e["index"] == index) {
                    Some(e) => {
                        let was = e["function"]["arguments"].as_str().unwrap_or_default().to_string();
                        e["function"]["arguments"] = Value::String(was + &json);
                    }
                    None => {
                        if let Some(a) = list.as_array_mut() {
                            a.push(json!({"index": index, "function": {"arguments": json}}));
                        }
                    }
                }
            }
        }
    }
    // (A delta left empty: reasoning left out.)
    deltas.into_iter().filter(|d| !d.is_empty()).map(Value::Object).collect()
}

/// One choice's server-sent events, up to its finish reason.
fn choice_events(g: Generation) -> impl futures_util::Stream<Item = Result<Sse_, Infallible>> {
    let data = |v: &Value| Ok::<_, Infallible>(Sse_::default().data(v.to_string()));
    let events = futures_util::stream::unfold((g, 0u8), move |(mut g, phase)| async move {
        // Phase 0: the role (chat); 1: text; 2: done.
        if phase == 0 && g.chat.is_none() {
            // Completions' `echo`: the prompt's text comes first (with
            // logprobs, in the first chunk after the prompt's logprobs came).
            if let Some(text) = g.echo.take_if(|t| !(t.is_empty() || g.common.logprobs.is_some())) {
                let c = g.chunk(json!({"index": g.index, "text": text, "logprobs": null, "finish_reason": null}));
                return Some((vec![data(&c)], (g, 1)));
            }
        }
        if phase == 0 && g.chat.is_some() {
            let c =
                g.chunk(json!({"index": g.index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}));
            return Some((vec![data(&c)], (g, 1)));
        }
        if phase == 2 {
            return None;
        }
        let mut out = Vec::new();
        match g.next().await {
            Step::Text { pieces, end } => {
                if g.chat.is_some() {
                    for delta in chat_deltas(&g, pieces) {
                        let lp = g.take_logprobs();
                        let mut c = g.chunk(json!({"index": g.index, "delta": delta, "logprobs": lp, "finish_reason": null}));
                        if let Some(p) = g.prompt_field() {
                            c["prompt_logprobs"] = p;
                        }
                        out.push(data(&c));
                    }
                } else {
                    let text: String = pieces.into_iter().map(|p| if let Piece::Content(t) = p { t } else { String::new() }).collect();
                    let content = g.echo.take().unwrap_or_default() + &text;
                    if !content.is_empty() {
                        let lp = g.take_logprobs();
                        let mut c = json!({"index": g.index, "text": content, "logprobs": lp, "finish_reason": null});
                        if let Some(p) = g.prompt_field() {
                            c["prompt_logprobs"] = p;
                        }
                        out.push(data(&g.chunk(c)));
                    }
                }
                if !end {
                    return Some((out, (g, 1)));
                }
                let finish = g.finish_reason();
                // The logprobs of tokens whose text never came out (held, or cut).
                let lp = g.take_logprobs();
                let last = if g.chat.is_some() {
                    json!({"index": g.index, "delta": {}, "logprobs": lp, "finish_reason": finish})
                } else {
                    let mut c =
                        json!({"index": g.index, "text": g.echo.take().unwrap_or_default(), "logprobs": lp, "finish_reason": finish});
                    if let Some(p) = g.prompt_field() {
                        c["prompt_logprobs"] = p;
                    }
                    c
                };
                let mut last = g.chunk(last);
                if let Some(p) = g.prompt_field() {
                    last["prompt_logprobs"] = p;
                }
                out.push(data(&last));
                Some((out, (g, 2)))
            }
            Step::Failed(why) => {
                let e = ApiError::new(503, "server_error", format!("the request could not finish: {why}"));
                out.push(data(&e.body()));
                Some((out, (g, 2)))
            }
        }
    });
    futures_util::StreamExt::flat_map(events, futures_util::stream::iter)
}
