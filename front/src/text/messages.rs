//! Chat messages as every front takes them: OpenAI's shape (roles, content
//! parts, tool calls with JSON-string arguments) normalised into what the
//! chat template renders. `m3c serve` and `m3c run --prompts` both go
//! through [`normalize`], so the same messages give the same prompt ids
//! whichever path they take.

use serde_json::Value;

/// A message that cannot be rendered: the field (`messages[1].content[0]`)
/// and why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct MessageError {
    pub field: String,
    pub message: String,
}

impl MessageError {
    fn at(field: &str, message: String) -> MessageError {
        MessageError { field: field.to_string(), message }
    }
}

/// Whether a media part's field (as [`normalize`] names it) is a video's.
pub fn is_video_field(field: &str) -> bool {
    field.ends_with(".video_url")
}

/// The messages as the template takes them: `developer` becomes `system`,
/// text parts join into one string (a message with images or videos keeps
/// its parts in order, each image as `{"type": "image"}`, each video as
/// `{"type": "video"}`), and tool-call arguments sent as JSON strings become
/// objects. Also returns each `image_url` and `video_url` part's (field,
/// URL), in order; the field (`messages[i].content[j].video_url`) says which
/// kind ([`is_video_field`]).
pub fn normalize(list: &[Value]) -> Result<(Value, Vec<(String, String)>), MessageError> {
    if list.is_empty() {
        return Err(MessageError::at("messages", "`messages` is empty".into()));
    }
    let mut messages = Vec::new();
    let mut images = Vec::new();
    for (i, msg) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(o) = msg else {
            return Err(MessageError::at(&at, format!("{at} must be an object")));
        };
        let role = o.get("role").and_then(Value::as_str).ok_or_else(|| MessageError::at(&at, format!("{at}.role is required")))?;
        if !["system", "developer", "user", "assistant", "tool"].contains(&role) {
            return Err(MessageError::at(&at, format!("{at}.role `{role}` is not one of system, user, assistant, tool")));
        }
        let mut out = o.clone();
        out.insert("role".into(), Value::String(if role == "developer" { "system".into() } else { role.into() }));
        // vLLM's current name for an assistant turn's reasoning; the
        // template reads the older `reasoning_content`.
        if let (Some(r @ Value::String(_)), None) = (o.get("reasoning"), o.get("reasoning_content")) {
            out.insert("reasoning_content".into(), r.clone());
        }
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
                        (Some(kind @ ("image_url" | "video_url")), _) => {
                            let noun = if kind == "image_url" { "images" } else { "videos" };
                            if role != "user" {
                                return Err(MessageError::at(&field, format!("{field}: {noun} go in user messages")));
                            }
                            let url = match p.get(kind) {
                                Some(Value::String(u)) => u.as_str(),
                                Some(Value::Object(o)) => o.get("url").and_then(Value::as_str).unwrap_or_default(),
                                _ => "",
                            };
                            if url.is_empty() {
                                return Err(MessageError::at(
                                    &field,
                                    format!("{field} must be {{\"type\": \"{kind}\", \"{kind}\": {{\"url\": ...}}}}"),
                                ));
                            }
                            images.push((format!("{field}.{kind}"), url.to_string()));
                            kept.push(serde_json::json!({"type": if kind == "image_url" { "image" } else { "video" }}));
                        }
                        (Some(t), _) => {
                            return Err(MessageError::at(
                                &at,
                                format!("{field}: content parts of type `{t}` are not supported (text, image_url and video_url)"),
                            ))
                        }
                        _ => return Err(MessageError::at(&at, format!("{field} must be {{\"type\": \"text\", \"text\": ...}}"))),
                    }
                }
                let has_image = kept.iter().any(|k| k["type"] == "image" || k["type"] == "video");
                out.insert("content".into(), if has_image { Value::Array(kept) } else { Value::String(text) });
            }
            _ => return Err(MessageError::at(&at, format!("{at}.content must be a string or an array of content parts"))),
        }
        if role == "tool" && !o.get("content").is_some_and(Value::is_string) && !o.get("content").is_some_and(Value::is_array) {
            return Err(MessageError::at(&at, format!("{at}: a tool message needs its content")));
        }
        if let Some(calls) = o.get("tool_calls") {
            let ok = calls.as_array().is_some_and(|a| a.iter().all(|c| c["function"]["name"].is_string()));
            if !ok {
                return Err(MessageError::at(
                    &at,
                    format!("{at}.tool_calls must be an array of {{\"function\": {{\"name\", \"arguments\"}}}}"),
                ));
            }
            // The template expands arguments; OpenAI sends them as a JSON string.
            let mut fixed = calls.clone();
            for c in fixed.as_array_mut().into_iter().flatten() {
                if let Some(Value::String(a)) = c["function"].get("arguments").cloned() {
                    let parsed: Value = serde_json::from_str(&a)
                        .map_err(|_| MessageError::at(&at, format!("{at}.tool_calls: `arguments` must be a JSON object (as a string)")))?;
                    c["function"]["arguments"] = parsed;
                }
            }
            out.insert("tool_calls".into(), fixed);
        }
        messages.push(Value::Object(out));
    }
    Ok((Value::Array(messages), images))
}
