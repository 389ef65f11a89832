//! The HTTP routes of `m3c serve` (axum): health, models, metrics, and
//! OpenAI's completions and chat completions, streamed as server-sent
//! events or answered whole.

use super::engine::{Engine, Event, Submission, SubmitError, Ticket};
use super::openai::{self, ApiError, Common, Defaults};
use super::output::ChatOutput;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as Sse_, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use m3c_contract::images::SeqImages;
use m3c_front::text::front::StopFilter;
use m3c_front::text::{ChatTemplate, IncrementalDecoder, TextTokenizer};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;

/// What every handler shares.
pub struct Shared {
    pub engine: Arc<Engine>,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    pub defaults: Defaults,
    pub name: String,
    pub api_key: Option<String>,
    /// The model's context length (prompt + completion).
    pub context: usize,
    /// `max_tokens` of a chat request that gives none.
    pub default_max_tokens: usize,
    pub created: u64,
    /// The image placeholder id (models with a vision tower).
    pub image_token: Option<usize>,
    /// Where images may come from.
    pub media: super::media::MediaPolicy,
    /// A private folder for the requests' images files.
    pub media_dir: tempfile::TempDir,
}

type App = Arc<Shared>;

pub fn router(shared: Shared) -> Router {
    // Bodies up to the images a request may carry as data: URIs (base64:
    // 4/3 of their bytes), plus 8 MB of text.
    let body_limit = (shared.media.max_images as u64 * shared.media.max_bytes * 4 / 3 + (8 << 20)).min(usize::MAX as u64) as usize;
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(|| async { error(&ApiError::new(404, "not_found_error", "no such route")) })
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .with_state(Arc::new(shared))
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

async fn health(State(app): State<App>) -> Response {
    if app.engine.healthy() {
        (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
    } else {
        let why = app.engine.down_reason().unwrap_or_else(|| "the model is loading".into());
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "unavailable", "reason": why}))).into_response()
    }
}

async fn metrics(State(app): State<App>) -> Response {
    let text = app.engine.metrics.render(&app.engine.gauges());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn models(State(app): State<App>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return error(&e);
    }
    Json(json!({"object": "list", "data": [{
        "id": app.name, "object": "model", "created": app.created, "owned_by": "m3c", "max_model_len": app.context
    }]}))
    .into_response()
}

/// A seed for requests that give none: distinct per request, so two
/// unseeded requests draw differently (as OpenAI's API behaves).
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

async fn completions(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<(Vec<u32>, Common), ApiError> {
        authorize(&app, &headers)?;
        let m = openai::object(&body)?;
        openai::check_model(&m, &app.name)?;
        openai::check_fields(&m, openai::Endpoint::Completions)?;
        let common = openai::common(&m, &app.defaults, &["max_tokens"], fresh_seed())?;
        let ids = match openai::prompt(&m)? {
            openai::Prompt::Text(t) => app.tokenizer.encode(&t).map_err(|e| ApiError::new(500, "server_error", e.to_string()))?,
            openai::Prompt::Ids(ids) => ids,
        };
        // OpenAI's default for completions.
        let common = Common { max_tokens: common.max_tokens.or(Some(16)), ..common };
        Ok((ids, common))
    };
    match run() {
        Ok((ids, common)) => generate(app, ids, common, Kind::Completion, None).await,
        Err(e) => error(&e),
    }
}

async fn chat_completions(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<(Vec<u32>, Common, Kind, ImageUrls), ApiError> {
        authorize(&app, &headers)?;
        let m = openai::object(&body)?;
        openai::check_model(&m, &app.name)?;
        openai::check_fields(&m, openai::Endpoint::ChatCompletions)?;
        let common = openai::common(&m, &app.defaults, &["max_tokens", "max_completion_tokens"], fresh_seed())?;
        let chat = openai::chat(&m)?;
        let template = app
            .template
            .as_ref()
            .ok_or_else(|| ApiError::new(400, "invalid_request_error", "this model has no chat template; use /v1/completions"))?;
        let mut kwargs: Vec<(&str, minijinja::Value)> = vec![("add_generation_prompt", minijinja::Value::from(true))];
        if !chat.tools.is_empty() {
            kwargs.push(("tools", jinja(Value::Array(chat.tools.clone()))?));
        }
        for (k, v) in &chat.kwargs {
            if k == "add_generation_prompt" || k == "tools" || k == "messages" {
                return Err(ApiError::bad("chat_template_kwargs", format!("`chat_template_kwargs` may not set `{k}`")));
            }
            kwargs.push((k.as_str(), jinja(v.clone())?));
        }
        let messages = jinja(chat.messages.clone())?;
        let rendered = template
            .render(&messages, &kwargs)
            .map_err(|e| ApiError::bad("messages", format!("the chat template refused the messages: {e}")))?;
        let ids = app.tokenizer.encode(&rendered).map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
        // Thinking enabled leaves the prompt inside an open <mm:think>.
        let thinking = rendered.trim_end().ends_with("<mm:think>");
        Ok((ids, common, Kind::Chat { thinking, tools: chat.tools }, chat.images))
    };
    let (ids, common, kind, urls) = match run() {
        Ok(r) => r,
        Err(e) => return error(&e),
    };
    if urls.is_empty() {
        return generate(app, ids, common, kind, None).await;
    }
    match images(&app, &ids, &urls).await {
        Ok((ids, im)) => generate(app, ids, common, kind, Some(im)).await,
        Err(e) => error(&e),
    }
}

/// A chat's `image_url` parts: (the part's field, its URL).
type ImageUrls = Vec<(String, String)>;

/// A chat's images: fetched, processed as the reference processor does
/// (off the async threads), and each placeholder the template wrote
/// expanded into that image's run of tokens.
async fn images(app: &App, ids: &[u32], urls: &[(String, String)]) -> Result<(Vec<u32>, SeqImages), ApiError> {
    let Some(token) = app.image_token else {
        return Err(ApiError::bad(&urls[0].0, "this model has no vision tower: images are not accepted"));
    };
    if urls.len() > app.media.max_images {
        return Err(ApiError::bad(
            &urls[app.media.max_images].0,
            format!("{} images in one request; the server takes at most {} (--max-images-per-request)", urls.len(), app.media.max_images),
        ));
    }
    let mut processed = Vec::new();
    for (at, url) in urls {
        let bytes = super::media::fetch(url, &app.media, at).await?;
        let what = at.clone();
        let p = tokio::task::spawn_blocking(move || m3c_front::vision::processor::process(&bytes, &what))
            .await
            .map_err(|e| ApiError::new(500, "server_error", format!("processing an image: {e}")))?
            .map_err(|e| ApiError::bad(at, e.to_string()))?;
        processed.push(p);
    }
    let tokens: Vec<usize> = processed.iter().map(|p| p.tokens()).collect();
    let t = m3c_front::vision::prompt::ImageTokens::new(&app.tokenizer, token)
        .map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
    let ids = t.expand(ids, &tokens).map_err(|e| ApiError::bad("messages", e.to_string()))?;
    Ok((ids, m3c_front::vision::prompt::seq_images(&processed)))
}

/// A JSON value as the template sees it.
fn jinja(v: Value) -> Result<minijinja::Value, ApiError> {
    serde_json::from_value(v)
        .map_err(|e| ApiError::new(400, "invalid_request_error", format!("a value the chat template cannot take: {e}")))
}

/// Which API a generation answers.
#[derive(Clone)]
enum Kind {
    Completion,
    Chat { thinking: bool, tools: Vec<Value> },
}

/// One request's way from token ids to OpenAI's answer.
struct Generation {
    app: App,
    ticket: Ticket,
    kind: Kind,
    common: Common,
    decoder: IncrementalDecoder,
    filter: StopFilter,
    chat: Option<ChatOutput>,
    prompt_tokens: usize,
    completion_tokens: usize,
    id: String,
    created: u64,
    finish: Option<String>,
}

/// What one event adds: reasoning and content text, and whether it ended.
enum Step {
    Text { reasoning: String, content: String, end: bool },
    Failed(String),
}

impl Generation {
    async fn next(&mut self) -> Step {
        let Some(ev) = self.ticket.rx.recv().await else {
            return Step::Failed("the request's events ended".into());
        };
        let tk = &self.app.tokenizer;
        let (new, end) = match ev {
            Event::Token(id) => {
                self.completion_tokens += 1;
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
        };
        match &mut self.chat {
            Some(c) => {
                let mut d = c.push(&new);
                if end {
                    let e = c.finish();
                    d.reasoning += &e.reasoning;
                    d.content += &e.content;
                }
                Step::Text { reasoning: d.reasoning, content: d.content, end }
            }
            None => Step::Text { reasoning: String::new(), content: new, end },
        }
    }

    /// The tool calls (chat, at the end) and the finish reason they imply.
    fn tool_calls(&mut self) -> Vec<Value> {
        let (Kind::Chat { tools, .. }, Some(c)) = (&self.kind, &mut self.chat) else { return Vec::new() };
        let calls = c.tool_calls(tools);
        if !calls.is_empty() {
            self.finish = Some("tool_calls".into());
        }
        calls
    }

    fn usage(&self) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens})
    }

    fn chunk(&self, choice: Value) -> Value {
        let object = if self.chat.is_some() { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.app.name, "choices": [choice]})
    }
}

async fn generate(app: App, ids: Vec<u32>, common: Common, kind: Kind, images: Option<SeqImages>) -> Response {
    if ids.is_empty() {
        return error(&ApiError::bad("prompt", "the prompt has no tokens"));
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= app.tokenizer.vocab_size()) {
        return error(&ApiError::bad("prompt", format!("token id {bad} is outside the vocabulary")));
    }
    // Image placeholders come only from image parts: the same token typed
    // into text (or sent as an id) has no image to stand for.
    if let Some(t) = app.image_token {
        let found = ids.iter().filter(|&&i| i as usize == t).count();
        let expected: usize = images.as_ref().map_or(0, |im| im.tokens().iter().sum());
        if found != expected {
            return error(&ApiError::bad(
                "messages",
                format!(
                    "the prompt holds {found} image placeholder token(s) (id {t}) for {expected} image token(s): send images as image_url content parts, not as placeholder text"
                ),
            ));
        }
    }
    let room = app.context.saturating_sub(ids.len());
    // Without max_tokens: to the end of the context, up to the server's
    // default (a request reserves its whole cache when admitted).
    let max_new = common.max_tokens.unwrap_or(room.min(app.default_max_tokens));
    if ids.len().checked_add(max_new).is_none_or(|n| n > app.context) || max_new == 0 {
        return error(&ApiError::bad(
            "max_tokens",
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {max_new} for the completion).",
                app.context,
                ids.len().saturating_add(max_new),
                ids.len()
            ),
        ));
    }
    // The images go to the first stage as a file it reads when it takes
    // the request; the file lives as long as the request.
    let images = match images {
        None => None,
        Some(im) => {
            let a = app.clone();
            match tokio::task::spawn_blocking(move || write_images(&a, im)).await {
                Ok(Ok(p)) => Some(p),
                Ok(Err(e)) => return error(&ApiError::new(500, "server_error", format!("writing the request's images: {e}"))),
                Err(e) => return error(&ApiError::new(500, "server_error", format!("writing the request's images: {e}"))),
            }
        }
    };
    let sub = Submission {
        prompt: ids.clone(),
        max_new,
        ignore_eos: common.ignore_eos,
        sampling: common.sampling,
        images,
        stops: common.stop.clone(),
    };
    let ticket = match app.engine.submit(sub) {
        Ok(t) => t,
        Err(SubmitError::QueueFull(n)) => {
            return error(&ApiError::new(503, "server_error", format!("the server is at capacity: {n} requests already wait; retry later")))
        }
        Err(SubmitError::TooLarge(m)) => return error(&ApiError::bad("max_tokens", m)),
        Err(SubmitError::Down(why)) => return error(&ApiError::new(503, "server_error", format!("the model is not available: {why}"))),
    };
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let chat = match &kind {
        Kind::Chat { thinking, .. } => Some(ChatOutput::new(*thinking)),
        Kind::Completion => None,
    };
    let prefix = if chat.is_some() { "chatcmpl" } else { "cmpl" };
    let g = Generation {
        id: format!("{prefix}-{created:x}{:x}", ticket.seq),
        app,
        ticket,
        kind,
        common,
        decoder: IncrementalDecoder::new(true),
        filter: StopFilter::default(),
        chat,
        prompt_tokens: ids.len(),
        completion_tokens: 0,
        created,
        finish: None,
    };
    if g.common.stream {
        stream(g)
    } else {
        whole(g).await
    }
}

/// A request's images file, in the server's private media folder (deleted
/// when the returned path drops).
fn write_images(app: &App, im: SeqImages) -> std::io::Result<tempfile::TempPath> {
    let f = tempfile::Builder::new().prefix("req-").suffix(".safetensors").tempfile_in(app.media_dir.path())?;
    let path = f.into_temp_path();
    m3c_front::vision::prompt::write_images_file(&path, &std::collections::BTreeMap::from([(0usize, im)]))?;
    Ok(path)
}

/// The answer in one response.
async fn whole(mut g: Generation) -> Response {
    let (mut reasoning, mut content) = (String::new(), String::new());
    loop {
        match g.next().await {
            Step::Text { reasoning: r, content: c, end } => {
                reasoning += &r;
                content += &c;
                if end {
                    break;
                }
            }
            Step::Failed(why) => return error(&ApiError::new(503, "server_error", format!("the request could not finish: {why}"))),
        }
    }
    let calls = g.tool_calls();
    if let Some(c) = &g.chat {
        content = c.content.clone();
        reasoning = c.reasoning.clone();
    }
    let finish = g.finish.clone().unwrap_or_else(|| "stop".into());
    let body = if g.chat.is_some() {
        let mut message = json!({"role": "assistant", "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(content) }});
        if !reasoning.is_empty() {
            message["reasoning_content"] = Value::String(reasoning);
        }
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        json!({"id": g.id, "object": "chat.completion", "created": g.created, "model": g.app.name,
               "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}], "usage": g.usage()})
    } else {
        json!({"id": g.id, "object": "text_completion", "created": g.created, "model": g.app.name,
               "choices": [{"index": 0, "text": content, "logprobs": null, "finish_reason": finish}], "usage": g.usage()})
    };
    Json(body).into_response()
}

/// The answer as server-sent events, chunk by chunk, then `[DONE]`. A
/// client that goes away drops the stream, and with it the ticket, which
/// cancels the sequence.
fn stream(g: Generation) -> Response {
    let data = |v: &Value| Ok::<_, Infallible>(Sse_::default().data(v.to_string()));
    let events = futures_util::stream::unfold((g, 0u8), move |(mut g, phase)| async move {
        // Phase 0: the role (chat); 1: text; 2: done.
        if phase == 0 && g.chat.is_some() {
            let c = g.chunk(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}));
            return Some((vec![data(&c)], (g, 1)));
        }
        if phase == 2 {
            return None;
        }
        let mut out = Vec::new();
        match g.next().await {
            Step::Text { reasoning, content, end } => {
                let chat = g.chat.is_some();
                if chat {
                    let mut delta = serde_json::Map::new();
                    if !reasoning.is_empty() {
                        delta.insert("reasoning_content".into(), Value::String(reasoning));
                    }
                    if !content.is_empty() {
                        delta.insert("content".into(), Value::String(content));
                    }
                    if !delta.is_empty() {
                        out.push(data(&g.chunk(json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}))));
                    }
                } else if !content.is_empty() {
                    out.push(data(&g.chunk(json!({"index": 0, "text": content, "logprobs": null, "finish_reason": null}))));
                }
                if !end {
                    return Some((out, (g, 1)));
                }
                let shown = g.chat.as_ref().map_or(0, |c| c.content.len());
                let calls = g.tool_calls();
                // A block that was not a call comes back as text.
                if let Some(rest) = g.chat.as_ref().and_then(|c| c.content.get(shown..)).filter(|r| !r.is_empty()) {
                    let rest = rest.to_string();
                    out.push(data(&g.chunk(json!({"index": 0, "delta": {"content": rest}, "logprobs": null, "finish_reason": null}))));
                }
                if chat && !calls.is_empty() {
                    let indexed: Vec<Value> = calls
                        .into_iter()
                        .enumerate()
                        .map(|(i, mut c)| {
                            c["index"] = json!(i);
                            c
                        })
                        .collect();
                    out.push(data(
                        &g.chunk(json!({"index": 0, "delta": {"tool_calls": indexed}, "logprobs": null, "finish_reason": null})),
                    ));
                }
                let finish = g.finish.clone().unwrap_or_else(|| "stop".into());
                let last = if chat {
                    json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish})
                };
                out.push(data(&g.chunk(last)));
                if g.common.include_usage {
                    let mut u = g.chunk(Value::Null);
                    u["choices"] = json!([]);
                    u["usage"] = g.usage();
                    out.push(data(&u));
                }
                out.push(Ok(Sse_::default().data("[DONE]")));
                Some((out, (g, 2)))
            }
            Step::Failed(why) => {
                let e = ApiError::new(503, "server_error", format!("the request could not finish: {why}"));
                out.push(data(&e.body()));
                out.push(Ok(Sse_::default().data("[DONE]")));
                Some((out, (g, 2)))
            }
        }
    });
    let flat = futures_util::StreamExt::flat_map(events, futures_util::stream::iter);
    Sse::new(flat).keep_alive(KeepAlive::default()).into_response()
}
