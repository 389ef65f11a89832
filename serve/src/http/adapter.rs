//! Routes that speak another API over the chat route (Anthropic's Messages,
//! OpenAI's Responses) share one shape, written once here: authorize, read
//! the body, check the model and the known fields, turn the request into a
//! chat request, render it with the model's template, fetch its images,
//! generate, and write the answer whole or streamed. An [`Adapter`] says
//! only what differs: its fields, its checks, how its request reads as a
//! chat, its errors and its answer. Sampling fields pass through by the
//! contract's table (`sampling::FIELDS`), so a new field reaches every
//! route as it reaches `/v1/chat/completions`.

use super::{render_chat, start, with_images, App, Generation, Kind};
use crate::openai::{self, ApiError, Common};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use m3c_contract::thinking::ThinkStart;
use serde_json::{Map, Value};
use std::future::Future;

pub(super) trait Adapter {
    /// The route, for messages (`/v1/messages`).
    const ROUTE: &'static str;
    /// The fields the route reads besides the sampling table's.
    const FIELDS: &'static [&'static str];
    /// Its answers' id prefix, in place of the chat's `chatcmpl-`.
    const ID_PREFIX: &'static str;
    /// What the answer needs of the request besides its generation.
    type Asked: Send + 'static;

    fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError>;
    /// An error in the route's own shape.
    fn error(e: &ApiError) -> Response;
    /// The request as a chat request, in OpenAI's shape (its sampling
    /// fields are added after, by the table), after the route's own checks.
    fn as_chat(m: &Map<String, Value>) -> Result<Map<String, Value>, ApiError>;
    /// Once the chat is read and rendered: what the answer needs, and the
    /// tools the answer is read for (adding a forced call's grammar to
    /// `common` where the route has tools).
    fn prepared(m: &Map<String, Value>, common: &mut Common, chat: &openai::Chat) -> (Self::Asked, Vec<Value>);
    /// The answer, whole or streamed.
    fn answer(g: Generation, asked: Self::Asked, streaming: bool) -> impl Future<Output = Response> + Send;
}

/// Every field the route knows: its own and the sampling table's.
fn known<A: Adapter>() -> Vec<&'static str> {
    A::FIELDS.iter().copied().chain(m3c_contract::sampling::FIELDS.iter().map(|f| f.name)).collect()
}

/// The request's sampling fields, as the chat route reads them (same names).
fn sampling_fields(m: &Map<String, Value>, chat: &mut Map<String, Value>) {
    for f in m3c_contract::sampling::FIELDS {
        if let Some(v) = m.get(f.name).filter(|v| !v.is_null()) {
            chat.insert(f.name.into(), v.clone());
        }
    }
}

/// The route's handler.
pub(super) async fn handle<A: Adapter>(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    let run = || -> Result<_, ApiError> {
        A::authorize(&app, &headers)?;
        let m = openai::object(&body)?;
        openai::check_model(&m, &app.names)?;
        openai::check_known(&m, &known::<A>(), A::ROUTE)?;
        let mut chat = A::as_chat(&m)?;
        sampling_fields(&m, &mut chat);
        let mut common = openai::common(&chat, &app.defaults, openai::Endpoint::ChatCompletions, app.seeds.fresh())?;
        let (rendered, parts) = render_chat(&app, &chat, crate::openai::Opening::Generation)?;
        let (asked, tools) = A::prepared(&m, &mut common, &parts);
        let ids = app.tokenizer.encode(&rendered).map_err(|e| ApiError::new(500, "server_error", e.to_string()))?;
        let kind = Kind::Chat { think: ThinkStart::of_prompt(&rendered, &app.format.think), tools };
        Ok((ids, common, kind, parts.images, asked))
    };
    let (ids, common, kind, urls, asked) = match run() {
        Ok(r) => r,
        Err(e) => return A::error(&e),
    };
    let (ids, im) = match with_images(&app, ids, &urls).await {
        Ok(r) => r,
        Err(e) => return A::error(&e),
    };
    let streaming = common.stream;
    let mut gens = match start(app, ids, common, kind, im).await {
        Ok(g) => g,
        Err(r) => return r,
    };
    let mut g = gens.remove(0);
    g.id = g.id.replacen("chatcmpl-", A::ID_PREFIX, 1);
    A::answer(g, asked, streaming).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sampling_field_of_the_table_passes_through_by_its_name() {
        let mut m = Map::new();
        for (i, f) in m3c_contract::sampling::FIELDS.iter().enumerate() {
            m.insert(f.name.into(), Value::from(i));
        }
        m.insert("stream".into(), Value::Bool(true));
        m.insert("seed_but_not".into(), Value::Null);
        let mut chat = Map::new();
        sampling_fields(&m, &mut chat);
        assert_eq!(chat.len(), m3c_contract::sampling::FIELDS.len());
        assert!(m3c_contract::sampling::FIELDS.iter().all(|f| chat.contains_key(f.name)));
        assert!(!chat.contains_key("stream"), "only sampling fields");
    }
}
