//! OpenAI's completions and chat-completions requests as m3c reads them:
//! every field checked with an error that names it (a 400 with OpenAI's
//! error object), vLLM's extra sampling fields accepted, and fields m3c
//! cannot honour refused rather than ignored.

use m3c_constrain::Grammar;
use m3c_contract::chat_format::ToolMarkup;
use m3c_contract::sampling::{SamplingOverrides, SamplingParams};
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
    /// Choices to generate, each from its own seed (`seed + i`).
    pub n: usize,
    /// Token ids that end a choice when generated (vLLM's `stop_token_ids`).
    pub stop_ids: Vec<u32>,
    /// The stop string that ended a choice stays in its text.
    pub include_stop: bool,
    /// Special tokens are left out of the text (vLLM's default).
    pub skip_special: bool,
    /// Each token's logprob and this many alternatives (`None`: no logprobs).
    pub logprobs: Option<u8>,
    /// What the output must match (structured output), and the request
    /// field that asked for it.
    pub grammar: Option<(Grammar, &'static str)>,
    /// Tokens generated before EOS or a stop id may be drawn (vLLM's `min_tokens`).
    pub min_tokens: usize,
    /// Completions: the answer's text starts with the prompt's.
    pub echo: bool,
    /// Added to the listed tokens' logits before sampling (ids ascending).
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `prompt_logprobs`: each prompt token's logprob and this many
    /// alternatives, in the answer's `prompt_logprobs`.
    pub prompt_logprobs: Option<u8>,
    /// vLLM's `thinking_token_budget`: reasoning tokens after which the
    /// reasoning is closed (`None`: no cap asked for).
    pub thinking_budget: Option<u32>,
    /// vLLM's `return_tokens_as_token_ids`: logprobs name each token
    /// `token_id:N` instead of its text.
    pub tokens_as_ids: bool,
    /// vLLM's `include_reasoning` (chat): the reasoning is in the answer
    /// (`false`: left out, the content alone).
    pub include_reasoning: bool,
}

impl Common {
    /// Alternatives the stages report with each prompt token's logprob:
    /// `prompt_logprobs`, or completions' `logprobs` when `echo` puts the
    /// prompt's tokens in the answer (the larger if both).
    pub fn prompt_alternatives(&self) -> Option<u8> {
        let echoed = self.logprobs.filter(|_| self.echo);
        self.prompt_logprobs.max(echoed)
    }
}

/// The most choices one request may ask for: each is a sequence in the
/// running batch.
pub const MAX_N: u64 = 16;

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

fn uint(m: &Map<String, Value>, k: &str) -> Result<Option<u64>, ApiError> {
    match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| ApiError::bad(k, format!("`{k}` must be a non-negative integer"))),
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

/// The generation endpoints, for the field check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    fn route(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }

    /// Every field this endpoint reads. A field outside this list is refused:
    /// a client that asks for something m3c does not do must learn so from
    /// a 400, not from an answer that quietly lacks it.
    fn knows(self, field: &str) -> bool {
        const SHARED: &[&str] = &[
            "model",
            "stop",
            "stream",
            "stream_options",
            "ignore_eos",
            "max_tokens",
            // Checked by `common`: only their no-op values pass.
            "n",
            "logprobs",
            "logit_bias",
            "min_tokens",
            "stop_token_ids",
            "prompt_logprobs",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "response_format",
            // vLLM's structured outputs, new and legacy spellings.
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            // OpenAI's end-user id, for abuse monitoring: by definition it
            // changes no output, so taking it is honouring it.
            "user",
            "return_tokens_as_token_ids",
            // What routers add to every body (vllm-router, SGLang's
            // gateway): SGLang's spelling of include_stop_str_in_output,
            // and hidden states (only their no-op value passes).
            "no_stop_trim",
            "return_hidden_states",
        ];
        const COMPLETIONS: &[&str] = &["prompt", "echo", "best_of", "suffix"];
        const CHAT: &[&str] = &[
            "messages",
            "max_completion_tokens",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "chat_template_kwargs",
            "top_logprobs",
            "thinking_token_budget",
            // vLLM's and SGLang's reasoning and rendering switches
            // (`chat_options`).
            "include_reasoning",
            "separate_reasoning",
            "stream_reasoning",
            "continue_final_message",
            "add_generation_prompt",
        ];
        let own = match self {
            Endpoint::Completions => COMPLETIONS,
            Endpoint::ChatCompletions => CHAT,
        };
        SHARED.contains(&field) || own.contains(&field) || m3c_contract::sampling::field(field).is_some()
    }
}

/// Fields clients send that m3c knows but does not serve yet, with why; each
/// is refused by name rather than answered as if it were absent.
fn unsupported(field: &str) -> Option<&'static str> {
    Some(match field {
        "guided_decoding_backend" | "guided_whitespace_pattern" => {
            "m3c's structured outputs have one back end (llguidance) and its JSON whitespace; leave this out"
        }
        "reasoning_effort" => "use `chat_template_kwargs: {\"thinking_mode\": ...}` to set MiniMax-M3's thinking",
        "functions" | "function_call" => "the legacy `functions` API is not supported; use `tools`",
        "modalities" | "audio" | "prediction" | "web_search_options" => "m3c serves text (and image input) only",
        _ => return None,
    })
}

/// The fields `/tokenize` reads.
pub const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "return_token_strs",
];

/// Refuses any field of `m` outside `known` (null counts as absent), naming it.
pub fn check_known(m: &Map<String, Value>, known: &[&str], route: &str) -> Result<(), ApiError> {
    match m.iter().find(|(k, v)| !v.is_null() && !known.contains(&k.as_str())) {
        Some((k, _)) => Err(ApiError::bad(k, format!("`{k}` is not a field m3c's {route} takes"))),
        None => Ok(()),
    }
}

/// Refuses every field `endpoint` does not honour, naming it. Null counts as
/// absent, as in OpenAI's API.
pub fn check_fields(m: &Map<String, Value>, endpoint: Endpoint) -> Result<(), ApiError> {
    for (k, v) in m {
        if v.is_null() || endpoint.knows(k) {
            continue;
        }
        let why = unsupported(k).map_or_else(
            || {
                format!(
                    "`{k}` is not a field m3c's {} takes; m3c refuses fields it cannot honour rather than ignoring them",
                    endpoint.route()
                )
            },
            |why| format!("`{k}`: {why}"),
        );
        return Err(ApiError::bad(k, why));
    }
    if let Some(o) = m.get("stream_options").and_then(Value::as_object) {
        if let Some(k) = o.keys().find(|k| k.as_str() != "include_usage" && !o[k.as_str()].is_null()) {
            return Err(ApiError::bad("stream_options", format!("`stream_options.{k}` is not supported by m3c (only include_usage)")));
        }
    }
    Ok(())
}

/// The `model` field: one of the served names, or absent (as vLLM does,
/// a request without one goes to the model this server serves).
pub fn check_model(m: &Map<String, Value>, served: &[String]) -> Result<(), ApiError> {
    match m.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if served.contains(s) => Ok(()),
        Some(Value::String(s)) => Err(ApiError {
            status: 404,
            kind: "not_found_error",
            message: format!(
                "The model `{s}` does not exist; this server serves {} (name it with --served-model-name)",
                served.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(" or ")
            ),
            param: Some("model".into()),
        }),
        Some(v) => Err(ApiError::bad("model", format!("`model` must be a string, not {}", kind(v)))),
    }
}

/// Sampling, limits, stop strings, logprobs and streaming, shared by both
/// endpoints (each spells the token limit and logprobs its own way).
pub fn common(m: &Map<String, Value>, d: &Defaults, endpoint: Endpoint, seed_fallback: u64) -> Result<Common, ApiError> {
    let max_keys: &[&str] = match endpoint {
        Endpoint::Completions => &["max_tokens"],
        Endpoint::ChatCompletions => &["max_tokens", "max_completion_tokens"],
    };
    let n = uint(m, "n")?.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::bad("n", format!("`n` must be from 1 to {MAX_N}")));
    }
    let logprobs = logprobs(m, endpoint)?;
    let echo = boolean(m, "echo")?.unwrap_or(false);
    let prompt_logprobs = match m.get("prompt_logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n <= u64::from(m3c_contract::protocol::MAX_TOP_LOGPROBS) => Some(n as u8),
            _ => {
                let max = m3c_contract::protocol::MAX_TOP_LOGPROBS;
                return Err(ApiError::bad("prompt_logprobs", format!("`prompt_logprobs` must be from 0 to {max}")));
            }
        },
    };
    for k in ["best_of", "suffix"] {
        match m.get(k) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(Value::Number(n)) if k == "best_of" && n.as_u64() == Some(1) => {}
            Some(_) => return Err(ApiError::bad(k, format!("`{k}` is not supported by m3c"))),
        }
    }
    // Every sampling field by the contract's table; a request without a
    // seed gets a fresh one.
    let request = SamplingOverrides::from_json(m).map_err(|(k, e)| ApiError::bad(k, e))?;
    let request = SamplingOverrides { seed: request.seed.or(Some(seed_fallback)), ..request };
    let sampling = request.over(d.sampling);
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
    if boolean(m, "return_hidden_states")? == Some(true) {
        return Err(ApiError::bad(
            "return_hidden_states",
            "`return_hidden_states`: m3c does not return hidden states; leave it out or false",
        ));
    }
    // SGLang's `no_stop_trim` is vLLM's `include_stop_str_in_output`; a
    // router adds `no_stop_trim: false` to every body, so `false` of
    // either is the default, not a veto of the other's `true`.
    let include_stop = boolean(m, "include_stop_str_in_output")?.unwrap_or(false) || boolean(m, "no_stop_trim")?.unwrap_or(false);
    let include_usage = match m.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => boolean(o, "include_usage")?.unwrap_or(false),
        Some(v) => return Err(ApiError::bad("stream_options", format!("`stream_options` must be an object, not {}", kind(v)))),
    };
    let stop_ids = match m.get("stop_token_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) if a.len() <= 64 => a
            .iter()
            .map(|v| v.as_u64().and_then(|i| u32::try_from(i).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| ApiError::bad("stop_token_ids", "`stop_token_ids` must be an array of token ids"))?,
        Some(_) => return Err(ApiError::bad("stop_token_ids", "`stop_token_ids` must be an array of at most 64 token ids")),
    };
    Ok(Common {
        sampling,
        max_tokens,
        stop,
        ignore_eos: boolean(m, "ignore_eos")?.unwrap_or(false),
        stream,
        include_usage,
        n: n as usize,
        stop_ids,
        include_stop,
        skip_special: boolean(m, "skip_special_tokens")?.unwrap_or(true),
        logprobs,
        grammar: grammar(m)?,
        min_tokens: match (uint(m, "min_tokens")?, max_tokens) {
            (Some(v), Some(max)) if v as usize > max => {
                return Err(ApiError::bad("min_tokens", format!("`min_tokens` ({v}) is more than the token limit ({max})")))
            }
            (v, _) => v.map_or(0, |v| usize::try_from(v).unwrap_or(usize::MAX)),
        },
        echo,
        logit_bias: logit_bias(m)?,
        prompt_logprobs,
        thinking_budget: thinking_budget(m)?,
        tokens_as_ids: boolean(m, "return_tokens_as_token_ids")?.unwrap_or(false),
        include_reasoning: boolean(m, "include_reasoning")?.unwrap_or(true),
    })
}

/// vLLM's `thinking_token_budget`: a count of tokens, or -1 for no cap.
fn thinking_budget(m: &Map<String, Value>) -> Result<Option<u32>, ApiError> {
    const K: &str = "thinking_token_budget";
    match m.get(K) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_i64() == Some(-1) => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| ApiError::bad(K, format!("`{K}` must be a count of tokens, or -1 for no cap"))),
        Some(v) => Err(ApiError::bad(K, format!("`{K}` must be an integer, not {}", kind(v)))),
    }
}

/// OpenAI's `logit_bias`: token ids (as the object's keys) to a bias from
/// -100 to 100, added to the token's logit before sampling.
fn logit_bias(m: &Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    const K: &str = "logit_bias";
    const MAX_ENTRIES: usize = 1024;
    let o = match m.get(K) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(o)) if o.len() <= MAX_ENTRIES => o,
        Some(Value::Object(_)) => return Err(ApiError::bad(K, format!("`{K}`: at most {MAX_ENTRIES} tokens"))),
        Some(v) => return Err(ApiError::bad(K, format!("`{K}` must be an object of token ids to numbers, not {}", kind(v)))),
    };
    let max = m3c_contract::sampling::MAX_LOGIT_BIAS;
    let mut out = Vec::with_capacity(o.len());
    for (id, v) in o {
        let id = id.parse::<u32>().map_err(|_| ApiError::bad(K, format!("`{K}`: key `{id}` is not a token id")))?;
        let v = v
            .as_f64()
            .filter(|v| (-f64::from(max)..=f64::from(max)).contains(v))
            .ok_or_else(|| ApiError::bad(K, format!("`{K}`: the bias of token {id} must be a number from -{max} to {max}")))?;
        out.push((id, v as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}
/// The request's structured output: OpenAI's `response_format`
/// (`json_object`, `json_schema`), or vLLM's `structured_outputs` (`json`,
/// `regex`, `choice`, `grammar`) and their older `guided_*` spellings. At
/// most one may be given.
fn grammar(m: &Map<String, Value>) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    let mut found: Vec<(Grammar, &'static str)> = Vec::new();
    if let Some(g) = response_format(m)? {
        found.push((g, "response_format"));
    }
    match m.get("structured_outputs") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            let k = "structured_outputs";
            let set: Vec<(&String, &Value)> = o.iter().filter(|(_, v)| !v.is_null()).collect();
            let [(name, v)] = set.as_slice() else {
                return Err(ApiError::bad(k, "`structured_outputs` must set exactly one of json, regex, choice, grammar, json_object"));
            };
            let g = match name.as_str() {
                "json" => schema_of(k, v)?,
                "regex" => Grammar::Regex(text_of(k, v)?),
                "choice" => choice_of(k, v)?,
                "grammar" => Grammar::Lark(text_of(k, v)?),
                "json_object" if *v == &Value::Bool(true) => Grammar::JsonObject,
                other => {
                    return Err(ApiError::bad(
                        k,
                        format!("`structured_outputs.{other}` is not supported (json, regex, choice, grammar, json_object)"),
                    ))
                }
            };
            found.push((g, k));
        }
        Some(v) => return Err(ApiError::bad("structured_outputs", format!("`structured_outputs` must be an object, not {}", kind(v)))),
    }
    for k in ["guided_json", "guided_regex", "guided_choice", "guided_grammar"] {
        let Some(v) = m.get(k).filter(|v| !v.is_null()) else { continue };
        let g = match k {
            "guided_json" => schema_of(k, v)?,
            "guided_regex" => Grammar::Regex(text_of(k, v)?),
            "guided_choice" => choice_of(k, v)?,
            _ => Grammar::Lark(text_of(k, v)?),
        };
        found.push((g, k));
    }
    if found.len() > 1 {
        return Err(ApiError::bad(found[1].1, format!("`{}` and `{}` both constrain the output; give one", found[0].1, found[1].1)));
    }
    Ok(found.pop())
}

/// OpenAI's `response_format`: text (no grammar), any JSON object, or a JSON schema.
fn response_format(m: &Map<String, Value>) -> Result<Option<Grammar>, ApiError> {
    let k = "response_format";
    let o = match m.get(k) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(ApiError::bad(k, format!("`{k}` must be an object, not {}", kind(v)))),
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") if o.len() == 1 => Ok(None),
        Some("json_object") if o.len() == 1 => Ok(Some(Grammar::JsonObject)),
        Some("json_schema") => match o.get("json_schema").and_then(|j| j.get("schema")) {
            Some(schema) => schema_of(k, schema).map(Some),
            None => Err(ApiError::bad(k, "`response_format`: json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")),
        },
        _ => Err(ApiError::bad(
            k,
            "`response_format` must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", ...}",
        )),
    }
}

/// A JSON schema: an object (or `true`), or JSON text of one as vLLM takes it.
fn schema_of(k: &str, v: &Value) -> Result<Grammar, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(true) => Ok(Grammar::JsonSchema(v.clone())),
        Value::String(s) => {
            serde_json::from_str(s).map(Grammar::JsonSchema).map_err(|e| ApiError::bad(k, format!("`{k}`: the schema is not JSON: {e}")))
        }
        v => Err(ApiError::bad(k, format!("`{k}`: a JSON schema is an object, not {}", kind(v)))),
    }
}

fn text_of(k: &str, v: &Value) -> Result<String, ApiError> {
    v.as_str().map(str::to_string).ok_or_else(|| ApiError::bad(k, format!("`{k}` must be a string, not {}", kind(v))))
}

fn choice_of(k: &str, v: &Value) -> Result<Grammar, ApiError> {
    let list = v.as_array().filter(|a| !a.is_empty() && a.len() <= 1024);
    let strings: Option<Vec<String>> = list.and_then(|a| a.iter().map(|c| c.as_str().map(str::to_string)).collect());
    strings.map(Grammar::Choice).ok_or_else(|| ApiError::bad(k, format!("`{k}` must be an array of 1 to 1024 strings")))
}

/// The alternatives to report with each token's logprob: chat's
/// `logprobs: true` with `top_logprobs: N`, or completions' `logprobs: N`.
fn logprobs(m: &Map<String, Value>, endpoint: Endpoint) -> Result<Option<u8>, ApiError> {
    use m3c_contract::protocol::MAX_TOP_LOGPROBS;
    let count = |k: &str| -> Result<Option<u8>, ApiError> {
        match uint(m, k)? {
            Some(n) if n <= u64::from(MAX_TOP_LOGPROBS) => Ok(Some(n as u8)),
            Some(_) => Err(ApiError::bad(k, format!("`{k}` must be from 0 to {MAX_TOP_LOGPROBS}"))),
            None => Ok(None),
        }
    };
    match endpoint {
        Endpoint::Completions => match m.get("logprobs") {
            Some(Value::Bool(_)) => Err(ApiError::bad("logprobs", "`logprobs` of completions is a count of alternatives (0 to 20)")),
            _ => count("logprobs"),
        },
        Endpoint::ChatCompletions => {
            let on = boolean(m, "logprobs")?.unwrap_or(false);
            match (on, count("top_logprobs")?) {
                (true, top) => Ok(Some(top.unwrap_or(0))),
                (false, Some(_)) => Err(ApiError::bad("top_logprobs", "`top_logprobs` needs `logprobs: true`")),
                (false, None) => Ok(None),
            }
        }
    }
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
    /// The grammar of the call block `tool_choice` forces (`"required"` or
    /// a named function), if it forces one.
    pub forced: Option<Grammar>,
}

/// How a chat's prompt is rendered: with the assistant's turn opened
/// (`add_generation_prompt`, vLLM's default), or continuing the final
/// assistant message (`continue_final_message`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening {
    Generation,
    Continue,
    Neither,
}

/// vLLM's `add_generation_prompt` and `continue_final_message`, and
/// SGLang's reasoning switches, whose other values m3c refuses by name:
/// `separate_reasoning: false` (m3c's reader always splits the family's
/// reasoning tags off) and `stream_reasoning: false` (reasoning streams as
/// it is generated).
pub fn chat_opening(m: &Map<String, Value>) -> Result<Opening, ApiError> {
    if boolean(m, "separate_reasoning")? == Some(false) {
        return Err(ApiError::bad(
            "separate_reasoning",
            "`separate_reasoning: false`: m3c always reads the reasoning apart from the content (`reasoning`); `include_reasoning: false` leaves it out",
        ));
    }
    if boolean(m, "stream_reasoning")? == Some(false) {
        return Err(ApiError::bad(
            "stream_reasoning",
            "`stream_reasoning: false`: m3c streams the reasoning as it is generated; leave it out or true",
        ));
    }
    match (boolean(m, "add_generation_prompt")?, boolean(m, "continue_final_message")?.unwrap_or(false)) {
        (Some(true), true) => Err(ApiError::bad(
            "continue_final_message",
            "`continue_final_message` continues the last assistant message, and `add_generation_prompt` opens a new one: give one of them",
        )),
        (_, true) => Ok(Opening::Continue),
        (Some(false), false) => Ok(Opening::Neither),
        (None | Some(true), false) => Ok(Opening::Generation),
    }
}

/// `markup`: the family's call tags, which a forced call's grammar writes.
pub fn chat(m: &Map<String, Value>, markup: &ToolMarkup) -> Result<Chat, ApiError> {
    let Some(Value::Array(list)) = m.get("messages") else {
        return Err(ApiError::bad("messages", "`messages` is required: an array of messages"));
    };
    if list.is_empty() {
        return Err(ApiError::bad("messages", "`messages` is empty"));
    }
    let (messages, images) = m3c_front::text::messages::normalize(list).map_err(|e| ApiError::bad(&e.field, e.message))?;
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
    use crate::tool_grammar::{forced_calls, Forced};
    let choice = match m.get("tool_choice") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "none" || s == "auto" => None,
        Some(Value::String(s)) if s == "required" => Some(Forced::Any),
        Some(Value::Object(o)) if o.get("type") == Some(&json!("function")) && o["function"]["name"].is_string() => {
            Some(Forced::Named(o["function"]["name"].as_str().unwrap_or_default().to_string()))
        }
        Some(_) => {
            return Err(ApiError::bad(
                "tool_choice",
                "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ))
        }
    };
    let single = match m.get("parallel_tool_calls") {
        None | Some(Value::Null) | Some(Value::Bool(true)) => false,
        Some(Value::Bool(false)) if choice.is_some() => true,
        Some(Value::Bool(false)) => {
            return Err(ApiError::bad(
                "parallel_tool_calls",
                "`parallel_tool_calls: false` is honoured only with a forced `tool_choice` (m3c cannot limit a free answer to one call)",
            ))
        }
        Some(v) => return Err(ApiError::bad("parallel_tool_calls", format!("`parallel_tool_calls` must be a boolean, not {}", kind(v)))),
    };
    let forced = match &choice {
        None => None,
        Some(c) => {
            let text = forced_calls(markup, &tools, c, single || matches!(c, Forced::Named(_)))
                .map_err(|e| ApiError::bad(if e.path == "tool_choice" { "tool_choice" } else { "tools" }, e.to_string()))?;
            Some(Grammar::Lark(text))
        }
    };
    let none = matches!(m.get("tool_choice"), Some(Value::String(s)) if s == "none");
    let tools = if none { Vec::new() } else { tools };
    let kwargs = match m.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(v) => return Err(ApiError::bad("chat_template_kwargs", format!("`chat_template_kwargs` must be an object, not {}", kind(v)))),
    };
    Ok(Chat { messages, tools, kwargs, images, forced })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(extra: Value, endpoint: Endpoint) -> Map<String, Value> {
        let mut m = match endpoint {
            Endpoint::Completions => json!({"model": "m", "prompt": "x"}),
            Endpoint::ChatCompletions => json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
        };
        for (k, v) in extra.as_object().unwrap() {
            m[k] = v.clone();
        }
        m.as_object().unwrap().clone()
    }

    fn param(extra: Value, endpoint: Endpoint) -> Option<String> {
        let m = body(extra, endpoint);
        let d = Defaults { sampling: SamplingParams::GREEDY };
        let e = check_fields(&m, endpoint).and_then(|()| common(&m, &d, endpoint, 0).map(|_| ()));
        let e = e.and_then(|()| {
            if endpoint == Endpoint::ChatCompletions {
                chat_opening(&m)?;
                chat(&m, &m3c_contract::chat_format::ChatFormat::of_family("minimax_m3").unwrap().tools).map(|_| ())
            } else {
                Ok(())
            }
        });
        e.err().map(|e| {
            assert_eq!(e.status, 400, "{e:?}");
            assert!(e.message.contains(e.param.as_deref().unwrap()), "the message names the field: {e:?}");
            e.param.unwrap()
        })
    }

    /// Every field a client may send is honoured or refused by name; none
    /// is answered as if it were absent.
    #[test]
    fn fields_m3c_cannot_honour_are_refused_by_name() {
        use Endpoint::*;
        let refused = [
            (json!({"response_format": {"type": "json_schema"}}), ChatCompletions, "response_format"),
            (json!({"response_format": {"type": "xml"}}), Completions, "response_format"),
            (json!({"structured_outputs": {"choice": []}}), ChatCompletions, "structured_outputs"),
            (json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}), Completions, "structured_outputs"),
            (json!({"structured_outputs": {"whitespace_pattern": " "}}), Completions, "structured_outputs"),
            (json!({"guided_json": "{not json"}), ChatCompletions, "guided_json"),
            (json!({"guided_choice": [1]}), Completions, "guided_choice"),
            (json!({"guided_regex": "a", "response_format": {"type": "json_object"}}), Completions, "guided_regex"),
            (json!({"guided_decoding_backend": "xgrammar"}), Completions, "guided_decoding_backend"),
            (json!({"tool_choice": "required"}), ChatCompletions, "tool_choice"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                ChatCompletions,
                "tool_choice",
            ),
            (json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}), ChatCompletions, "tool_choice"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": true}}}}}], "tool_choice": "required"}),
                ChatCompletions,
                "tools",
            ),
            (json!({"tool_choice": "auto"}), Completions, "tool_choice"),
            (json!({"parallel_tool_calls": false}), ChatCompletions, "parallel_tool_calls"),
            (json!({"min_tokens": 4, "max_tokens": 2}), Completions, "min_tokens"),
            (json!({"min_tokens": -1}), Completions, "min_tokens"),
            (json!({"stop_token_ids": [-7]}), ChatCompletions, "stop_token_ids"),
            (json!({"stop_token_ids": 7}), Completions, "stop_token_ids"),
            (json!({"include_stop_str_in_output": "yes"}), Completions, "include_stop_str_in_output"),
            (json!({"skip_special_tokens": 0}), ChatCompletions, "skip_special_tokens"),
            (json!({"logprobs": 3}), ChatCompletions, "logprobs"),
            (json!({"logprobs": true}), Completions, "logprobs"),
            (json!({"logprobs": 21}), Completions, "logprobs"),
            (json!({"top_logprobs": 2}), ChatCompletions, "top_logprobs"),
            (json!({"logprobs": true, "top_logprobs": 21}), ChatCompletions, "top_logprobs"),
            (json!({"prompt_logprobs": 21}), Completions, "prompt_logprobs"),
            (json!({"prompt_logprobs": -1}), ChatCompletions, "prompt_logprobs"),
            (json!({"echo": 1}), Completions, "echo"),
            (json!({"echo": true}), ChatCompletions, "echo"),
            (json!({"n": 0}), ChatCompletions, "n"),
            (json!({"n": 17}), Completions, "n"),
            (json!({"presence_penalty": 2.5}), ChatCompletions, "presence_penalty"),
            (json!({"frequency_penalty": -3}), Completions, "frequency_penalty"),
            (json!({"frequency_penalty": "high"}), Completions, "frequency_penalty"),
            (json!({"logit_bias": {"5": 101}}), ChatCompletions, "logit_bias"),
            (json!({"logit_bias": {"x": 1}}), ChatCompletions, "logit_bias"),
            (json!({"logit_bias": {"-1": 1}}), Completions, "logit_bias"),
            (json!({"logit_bias": [[5, 1]]}), Completions, "logit_bias"),
            (json!({"logit_bias": {"5": "1"}}), Completions, "logit_bias"),
            (json!({"reasoning_effort": "low"}), ChatCompletions, "reasoning_effort"),
            (json!({"functions": []}), ChatCompletions, "functions"),
            (json!({"stream_options": {"include_usage": true, "continuous_usage_stats": true}}), Completions, "stream_options"),
            (json!({"messages": []}), Completions, "messages"),
            (json!({"prompt": "x"}), ChatCompletions, "prompt"),
            (json!({"some_new_field": 1}), ChatCompletions, "some_new_field"),
            (json!({"extra_body": {"top_k": 1}}), Completions, "extra_body"),
            // Router-added fields' values m3c cannot honour.
            (json!({"return_hidden_states": true}), Completions, "return_hidden_states"),
            (json!({"separate_reasoning": false}), ChatCompletions, "separate_reasoning"),
            (json!({"stream_reasoning": false}), ChatCompletions, "stream_reasoning"),
            (json!({"continue_final_message": true, "add_generation_prompt": true}), ChatCompletions, "continue_final_message"),
            (json!({"no_stop_trim": "no"}), Completions, "no_stop_trim"),
            (json!({"include_reasoning": 1}), ChatCompletions, "include_reasoning"),
            (json!({"include_reasoning": false}), Completions, "include_reasoning"),
        ];
        for (extra, endpoint, want) in refused {
            assert_eq!(param(extra.clone(), endpoint).as_deref(), Some(want), "{endpoint:?} {extra}");
        }
        // Their no-op values, and fields m3c honours, pass.
        let honoured = [
            (json!({"response_format": {"type": "text"}}), ChatCompletions),
            (json!({"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}]}), ChatCompletions),
            (json!({"tool_choice": "auto", "parallel_tool_calls": true}), ChatCompletions),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "parallel_tool_calls": false}),
                ChatCompletions,
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
                ChatCompletions,
            ),
            (json!({"min_tokens": 0, "stop_token_ids": [], "include_stop_str_in_output": false, "skip_special_tokens": true}), Completions),
            (json!({"stop_token_ids": [7, 9], "include_stop_str_in_output": true, "skip_special_tokens": false, "n": 3}), ChatCompletions),
            (json!({"n": 1, "best_of": 1, "logprobs": null, "echo": false, "presence_penalty": 0, "frequency_penalty": 0}), Completions),
            (json!({"logprobs": false, "top_logprobs": null, "user": "alice", "max_completion_tokens": 5}), ChatCompletions),
            (json!({"logprobs": true, "top_logprobs": 20}), ChatCompletions),
            (json!({"presence_penalty": 0.5, "frequency_penalty": -2, "logit_bias": {"5": 10, "7": -100}}), ChatCompletions),
            (json!({"presence_penalty": 2, "frequency_penalty": 1.5, "logit_bias": {}}), Completions),
            (json!({"logprobs": 0}), Completions),
            (json!({"echo": true}), Completions),
            (json!({"logprobs": 5}), Completions),
            (json!({"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": true, "seed": 3, "stop": ["x"]}), Completions),
            (json!({"stream": true, "stream_options": {"include_usage": true}, "chat_template_kwargs": {}}), ChatCompletions),
            (json!({"structured_outputs": null, "guided_json": null}), ChatCompletions),
            (json!({"response_format": {"type": "json_object"}}), ChatCompletions),
            (json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}}), Completions),
            (json!({"structured_outputs": {"choice": ["a", "b"]}}), ChatCompletions),
            (json!({"structured_outputs": {"regex": "[0-9]+"}}), Completions),
            (json!({"guided_json": {"type": "integer"}}), ChatCompletions),
            (json!({"guided_grammar": "start: \"x\""}), Completions),
            // What vllm-router adds to every chat and completion body.
            (
                json!({"logprobs": false, "no_stop_trim": false, "ignore_eos": false, "continue_final_message": false,
                       "skip_special_tokens": true, "separate_reasoning": true, "stream_reasoning": true,
                       "return_hidden_states": false, "include_reasoning": true}),
                ChatCompletions,
            ),
            (
                json!({"echo": false, "no_stop_trim": false, "ignore_eos": false, "skip_special_tokens": true, "return_hidden_states": false}),
                Completions,
            ),
            (json!({"include_reasoning": false, "continue_final_message": true, "add_generation_prompt": false}), ChatCompletions),
        ];
        for (extra, endpoint) in honoured {
            assert_eq!(param(extra.clone(), endpoint), None, "{endpoint:?} {extra}");
        }
    }

    /// SGLang's `no_stop_trim` keeps the stop string as vLLM's
    /// `include_stop_str_in_output` does; the `false` a router adds to every
    /// body does not undo a client's `true` of the other.
    #[test]
    fn no_stop_trim_is_include_stop_str_in_output() {
        let d = Defaults { sampling: SamplingParams::GREEDY };
        let include = |extra: Value| common(&body(extra, Endpoint::Completions), &d, Endpoint::Completions, 0).unwrap().include_stop;
        assert!(!include(json!({})));
        assert!(include(json!({"no_stop_trim": true})));
        assert!(include(json!({"include_stop_str_in_output": true, "no_stop_trim": false})));
        assert!(!include(json!({"include_stop_str_in_output": false, "no_stop_trim": false})));
        let opening = |extra: Value| chat_opening(&body(extra, Endpoint::ChatCompletions)).unwrap();
        assert_eq!(opening(json!({})), Opening::Generation);
        assert_eq!(opening(json!({"continue_final_message": true})), Opening::Continue);
        assert_eq!(opening(json!({"add_generation_prompt": false})), Opening::Neither);
    }
}
