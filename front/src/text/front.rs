//! `m3c run`'s text front: turns `--prompt` and `--chat` text into the
//! token ids the stages take, and the ids the first stage streams back
//! (`m3c-id SEQ ID` lines) into text as they arrive.

use super::{ChatTemplate, IncrementalDecoder, TextError, TextTokenizer, ThinkingMode};
use m3c_contract::protocol::Event;
use m3c_contract::thinking::ThinkStart;
use minijinja::Value;
use std::io::{BufRead, Write};
use std::path::Path;

/// What the user asked for as text.
pub struct TextRequest<'a> {
    /// Raw completions, as they are.
    pub prompts: &'a [String],
    /// User turns through the chat template, each with the generation prompt.
    pub chats: &'a [String],
    pub system: Option<&'a str>,
    pub thinking: Option<ThinkingMode>,
    /// Images that open each chat's user turn (`{"type": "image"}` parts
    /// before its text, as the reference's processor expects).
    pub chat_images: usize,
    /// Videos, processed: a chat's user turn holds them after its images
    /// (`{"type": "video"}` parts); in a raw prompt the text holds their
    /// `]<]video[>[` tokens. Each token becomes its video's text (timestamps
    /// and placeholders) before tokenizing, as the reference processor does.
    pub videos: &'a [crate::vision::video::Video],
}

/// The encoded prompts, in the order given: `--prompt`s, then `--chat`s,
/// then the lines of a `--prompts` JSONL file.
pub struct Encoded {
    pub tokenizer: TextTokenizer,
    pub ids: Vec<Vec<u32>>,
    /// A JSONL line's own sampling fields (empty for the others).
    pub overrides: Vec<LineSampling>,
    /// A JSONL chat's images, per prompt, in order (image files; empty for
    /// the others): each left one placeholder in its prompt, expanded once
    /// the image is processed.
    pub images: Vec<Vec<std::path::PathBuf>>,
    /// A JSONL chat's videos, per prompt, in order, processed (their text is
    /// in the prompt already).
    pub videos: Vec<Vec<crate::vision::video::Video>>,
    /// Where each prompt leaves the model's reasoning (a chat's thinking
    /// mode; a raw completion's output is all content).
    pub think: Vec<ThinkStart>,
    /// Whether each prompt is a chat (its output has reasoning and content)
    /// rather than a raw completion (all of its output is the text).
    pub chat: Vec<bool>,
    /// Choices per prompt (`m3c run -n`): prompt P's choice C is entry
    /// P × choices + C.
    pub choices: usize,
}

impl Encoded {
    /// Each prompt `n` times in a row (its choices), with its sampling
    /// fields and images.
    pub fn repeat_each(&mut self, n: usize) {
        fn rep<T: Clone>(v: &mut Vec<T>, n: usize) {
            *v = std::mem::take(v).into_iter().flat_map(|x| std::iter::repeat_n(x, n)).collect();
        }
        rep(&mut self.ids, n);
        rep(&mut self.overrides, n);
        rep(&mut self.images, n);
        rep(&mut self.videos, n);
        rep(&mut self.think, n);
        rep(&mut self.chat, n);
        self.choices = n;
    }

    /// A sequence's name in headings and summaries.
    pub fn name(&self, seq: usize) -> String {
        match self.choices {
            0 | 1 => format!("prompt {seq}"),
            c => format!("prompt {} choice {}", seq / c, seq % c),
        }
    }
}

/// An image part's file: a path relative to the prompts file's folder, or
/// a `file://` URL (`m3c serve` takes other URLs; `m3c run` reads files).
fn image_file(field: &str, url: &str, base: &Path) -> Result<std::path::PathBuf, String> {
    let path = url.strip_prefix("file://").unwrap_or(url);
    if path.contains("://") || path.starts_with("data:") {
        return Err(format!("{field}: m3c run reads images from files (`m3c serve` takes URLs); found {url:?}"));
    }
    Ok(base.join(path))
}

/// `{"type": "image", "image": PATH}` parts (accepted by `--prompts` before
/// it took OpenAI's shape) as `image_url` parts.
fn image_parts_as_urls(list: &[serde_json::Value]) -> Vec<serde_json::Value> {
    let mut list = list.to_vec();
    for m in &mut list {
        for p in m.get_mut("content").and_then(|c| c.as_array_mut()).into_iter().flatten() {
            if p.get("type").and_then(|t| t.as_str()) == Some("image") {
                if let Some(path) = p.get("image").and_then(|u| u.as_str()).map(str::to_string) {
                    *p = serde_json::json!({"type": "image_url", "image_url": {"url": path}});
                }
            }
        }
    }
    list
}

/// The sampling fields a `--prompts` JSONL line may set (over the run's).
pub type LineSampling = m3c_contract::sampling::SamplingOverrides;

/// One line of a `--prompts` JSONL file.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt: Option<String>,
    messages: Option<serde_json::Value>,
    thinking: Option<String>,
    #[serde(flatten)]
    sampling: LineSampling,
}

/// Whether a `--prompts` file is JSONL (its first non-blank byte is `{`)
/// rather than lines of comma-separated ids.
pub fn is_jsonl(text: &str) -> bool {
    text.trim_start().starts_with('{')
}

/// Encodes the lines of a JSONL file: `{"prompt": TEXT}` or
/// `{"messages": [...], "thinking": MODE}`, each with optional sampling
/// fields. Errors name the file, the line and the field.
pub fn encode_jsonl(model: &Path, file: &Path, text: &str, enc: &mut Encoded) -> Result<(), TextError> {
    let mut template = None;
    for (n, raw) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |message: String| TextError::Config { file: file.to_path_buf(), message: format!("line {}: {message}", n + 1) };
        let line: Line = serde_json::from_str(raw).map_err(|e| bad(e.to_string()))?;
        let (mut line_images, mut line_videos) = (Vec::new(), Vec::new());
        let mut think = ThinkStart::Closed;
        let is_chat = line.messages.is_some();
        let ids = match (line.prompt, line.messages) {
            (Some(p), None) if line.thinking.is_none() => enc.tokenizer.encode(&p)?,
            (None, Some(m)) => {
                if !m.is_array() {
                    return Err(bad("`messages`: expected a list of {role, content}".into()));
                }
                let kwargs_thinking = match line.thinking.as_deref() {
                    None => None,
                    Some(t @ ("enabled" | "disabled" | "adaptive")) => Some(t.to_string()),
                    Some(t) => return Err(bad(format!("`thinking`: {t:?} is not enabled, disabled or adaptive"))),
                };
                if template.is_none() {
                    template = Some(
                        ChatTemplate::from_dir(model)?
                            .ok_or_else(|| bad("`messages` need a chat template, and the checkpoint has none".into()))?,
                    );
                }
                let t = template.as_ref().expect("set just above");
                let mut kwargs = vec![("add_generation_prompt", Value::from(true))];
                if let Some(k) = kwargs_thinking {
                    kwargs.push(("thinking_mode", Value::from(k)));
                }
                // The one normaliser `m3c serve` uses too: same messages, same prompt.
                let list = image_parts_as_urls(m.as_array().map_or(&[][..], Vec::as_slice));
                let (normalized, urls) = super::messages::normalize(&list).map_err(|e| bad(e.message))?;
                let base = file.parent().unwrap_or(Path::new("."));
                let (videos, images): (Vec<_>, Vec<_>) = urls.iter().partition(|(field, _)| super::messages::is_video_field(field));
                line_images = images.iter().map(|(field, url)| image_file(field, url, base)).collect::<Result<_, _>>().map_err(bad)?;
                for (field, url) in videos {
                    let path = image_file(field, url, base).map_err(bad)?;
                    let what = format!("{field} ({})", path.display());
                    let limits = crate::vision::video::VideoLimits::default();
                    line_videos.push(crate::vision::video::process_file(&path, &limits, &what).map_err(|e| bad(e.to_string()))?);
                }
                let messages: Value = serde_json::from_value(normalized).map_err(|e| bad(format!("`messages`: {e}")))?;
                let rendered = t.render(&messages, &kwargs)?;
                think = ThinkStart::of_prompt(&rendered, &t.format.think);
                let rendered = if line_videos.is_empty() {
                    rendered
                } else {
                    crate::vision::video::expand_text(&rendered, &line_videos, &t.format.media)?
                };
                enc.tokenizer.encode(&rendered)?
            }
            _ => {
                return Err(bad(
                    "expected `prompt` (text) or `messages` (a chat), not both or neither; `thinking` goes with `messages`".into()
                ))
            }
        };
        enc.ids.push(ids);
        enc.chat.push(is_chat);
        enc.think.push(think);
        enc.overrides.push(line.sampling);
        enc.images.push(line_images);
        enc.videos.push(line_videos);
    }
    Ok(())
}

/// Tokenizes every prompt of `req` with the checkpoint's tokenizer (and
/// chat template for `--chat`).
pub fn encode(model: &Path, req: &TextRequest) -> Result<Encoded, TextError> {
    let tokenizer = TextTokenizer::from_dir(model)?;
    let (mut ids, mut think, mut chat) = (Vec::new(), Vec::new(), Vec::new());
    let with_videos = |text: &str| -> Result<String, TextError> {
        if req.videos.is_empty() {
            Ok(text.to_string())
        } else {
            let format = m3c_contract::chat_format::ChatFormat::of_model_dir(model).map_err(TextError::ChatFormat)?;
            Ok(crate::vision::video::expand_text(text, req.videos, &format.media)?)
        }
    };
    for p in req.prompts {
        ids.push(tokenizer.encode(&with_videos(p)?)?);
        think.push(ThinkStart::Closed);
        chat.push(false);
    }
    if !req.chats.is_empty() {
        let template = ChatTemplate::from_dir(model)?.ok_or_else(|| TextError::Config {
            file: model.join("tokenizer_config.json"),
            message: "no chat_template (this checkpoint has no chat format; use --prompt for a raw completion)".into(),
        })?;
        for user in req.chats {
            let mut messages = Vec::new();
            if let Some(s) = req.system {
                messages.push(serde_json::json!({"role": "system", "content": s}));
            }
            if req.chat_images == 0 && req.videos.is_empty() {
                messages.push(serde_json::json!({"role": "user", "content": user}));
            } else {
                let mut parts = vec![serde_json::json!({"type": "image"}); req.chat_images];
                parts.extend(std::iter::repeat_n(serde_json::json!({"type": "video"}), req.videos.len()));
                parts.push(serde_json::json!({"type": "text", "text": user}));
                messages.push(serde_json::json!({"role": "user", "content": parts}));
            }
            let mut kwargs = vec![("add_generation_prompt", Value::from(true))];
            if let Some(t) = req.thinking {
                kwargs.push(("thinking_mode", Value::from(t.name())));
            }
            let messages: Value = serde_json::from_value(serde_json::Value::Array(messages))
                .map_err(|e| TextError::Render { file: template.file.clone(), message: format!("the messages: {e}") })?;
            let rendered = template.render(&messages, &kwargs)?;
            ids.push(tokenizer.encode(&with_videos(&rendered)?)?);
            think.push(ThinkStart::of_prompt(&rendered, &template.format.think));
            chat.push(true);
        }
    }
    let overrides = vec![LineSampling::default(); ids.len()];
    let images = vec![Vec::new(); ids.len()];
    let videos = vec![Vec::new(); ids.len()];
    Ok(Encoded { tokenizer, ids, overrides, images, videos, think, chat, choices: 1 })
}

/// A sequence's text on its way out: cut before the first stop string (or
/// after it, when the request includes it), and holding back an end that
/// may yet become one (a stop string can span tokens), so no part of a stop
/// string is ever printed unless asked for.
#[derive(Default)]
pub struct StopFilter {
    text: String,
    released: usize,
    cut: bool,
    /// vLLM's `include_stop_str_in_output`: the text ends after the stop string.
    include: bool,
    /// The stop string it stopped on.
    hit: Option<String>,
}

impl StopFilter {
    /// A filter that keeps the stop string it stops on (`include`) or cuts it.
    pub fn new(include: bool) -> StopFilter {
        StopFilter { include, ..StopFilter::default() }
    }

    /// A stop string has been found: nothing more will be released.
    pub fn stopped(&self) -> bool {
        self.cut
    }

    /// The stop string it stopped on (Anthropic's `stop_sequence`).
    pub fn hit(&self) -> Option<&str> {
        self.hit.as_deref()
    }

    /// Adds `new`; returns the text now safe to print. `end`: nothing follows.
    pub fn push(&mut self, new: &str, stops: &[String], end: bool) -> String {
        if self.cut {
            return String::new();
        }
        self.text.push_str(new);
        // A stop string not found before can only end in the new text: the
        // search starts a stop string's length back from what was held.
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.released.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        // The earliest stop string, the longest of those found there.
        let first = stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| (i + from, std::cmp::Reverse(s.len()))))
            .min();
        let upto = match first {
            Some((i, std::cmp::Reverse(len))) => {
                self.cut = true;
                self.hit = Some(self.text[i..i + len].to_string());
                if self.include {
                    i + len
                } else {
                    i
                }
            }
            None if end => self.text.len(),
            None => {
                // The longest end of the text that begins some stop string.
                let hold = stops
                    .iter()
                    .filter_map(|s| (1..s.len()).rev().find(|&k| s.is_char_boundary(k) && self.text.ends_with(&s[..k])))
                    .max()
                    .unwrap_or(0);
                self.text.len() - hold
            }
        };
        let upto = upto.max(self.released);
        let out = self.text[self.released..upto].to_string();
        self.released = upto;
        out
    }
}

/// Tells a chat output's reasoning from its content, piece by piece (the
/// CLI gives it the chat format's splitter, `m3c_constrain::thinking`).
pub trait ReasoningReader {
    /// Adds text; returns the (reasoning, content) it decides now.
    fn push(&mut self, text: &str) -> (Vec<u8>, Vec<u8>);
    /// The end of the output: whatever was held back.
    fn finish(&mut self) -> (Vec<u8>, Vec<u8>);
}

/// Where reasoning goes, and which prompts have any to split off (one
/// entry per prompt; `None`: all of it is content).
pub struct Reasoning<'a> {
    pub readers: Vec<Option<Box<dyn ReasoningReader + 'a>>>,
    pub out: Box<dyn Write + 'a>,
}

/// The answer's writer and, with reasoning split off, the reasoning's:
/// each flushed before the other is written, so a terminal showing both
/// shows them in the order generated.
struct Sides<'a, W: Write> {
    out: W,
    reasoning: Option<Reasoning<'a>>,
    /// The reasoning side's last line is unfinished: ended with a newline
    /// when the content starts, so the stats lines after it stand apart.
    open_line: bool,
}

impl<W: Write> Sides<'_, W> {
    /// Prompt `seq`'s next text; `end`: its last.
    fn text(&mut self, seq: usize, text: &str, end: bool) -> std::io::Result<()> {
        let reader = self.reasoning.as_mut().and_then(|r| r.readers.get_mut(seq)?.as_mut().map(|x| (x, &mut r.out)));
        let Some((reader, side)) = reader else { return self.out.write_all(text.as_bytes()) };
        let (mut thought, mut said) = reader.push(text);
        if end {
            let (t, s) = reader.finish();
            thought.extend(t);
            said.extend(s);
        }
        if !thought.is_empty() {
            self.out.flush()?;
            side.write_all(&thought)?;
            side.flush()?;
            self.open_line = !thought.ends_with(b"\n");
        }
        if self.open_line && (end || !said.is_empty()) {
            side.write_all(b"\n")?;
            self.open_line = false;
        }
        self.out.write_all(&said)
    }
}

impl<W: Write> Write for Sides<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.out.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// How one prompt's generation went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub prompt_tokens: usize,
    pub generated: Vec<u32>,
    /// `stop` (an EOS id), `length` (--max-new-tokens), or `unfinished`
    /// (the run ended first).
    pub reason: String,
}

/// Reads the stages' output, writes each prompt's continuation to `out` as
/// it is generated, and passes any other line through. One prompt streams
/// at a time, in order; the others' text waits in a buffer until their turn
/// (so several prompts never interleave mid-line). With several prompts each
/// continuation gets a `### prompt N` heading. The text of an id in `silent`
/// is never shown (the EOS that ends a grammar's output, as serving leaves
/// it out). A prompt given a [`ReasoningReader`] in `reasoning` has its
/// reasoning written to that side's writer and only its content to `out`:
/// `m3c run --chat … | jq` reads the answer alone.
pub fn stream(
    stages: impl BufRead,
    enc: &Encoded,
    stops: &[String],
    silent: &[u32],
    out: impl Write,
    reasoning: Option<Reasoning<'_>>,
) -> Result<Vec<Finished>, anyhow::Error> {
    let mut out = Sides { out, reasoning, open_line: false };
    let n = enc.ids.len();
    let mut decoders: Vec<IncrementalDecoder> = (0..n).map(|_| IncrementalDecoder::new(true)).collect();
    let mut filters: Vec<StopFilter> = (0..n).map(|_| StopFilter::default()).collect();
    let mut generated: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut pending: Vec<String> = vec![String::new(); n];
    let mut reasons: Vec<Option<String>> = vec![None; n];
    let mut logprobs: Vec<Vec<(u32, m3c_contract::protocol::TokenLogprobs)>> = vec![Vec::new(); n];
    let mut current = 0;
    let heading = |i: usize| if n > 1 { format!("### {}\n", enc.name(i)) } else { String::new() };
    if n > 0 {
        out.write_all(heading(0).as_bytes())?;
    }
    for line in stages.lines() {
        let line = line?;
        let malformed = || anyhow::anyhow!("the first stage printed a malformed line: {line:?}");
        let seq_of = |s: usize| (s < n).then_some(s).ok_or_else(malformed);
        match Event::parse(&line) {
            Some(Ok(Event::Id { seq, id })) => {
                let seq = seq_of(seq)?;
                generated[seq].push(id);
                if silent.contains(&id) {
                    continue;
                }
                let new = decoders[seq].push(&enc.tokenizer, id)?;
                pending[seq].push_str(&filters[seq].push(&new, stops, false));
            }
            Some(Ok(Event::Logprobs { seq, id, lp })) => {
                logprobs[seq_of(seq)?].push((id, lp));
                continue;
            }
            Some(Ok(Event::End { seq, reason })) => {
                let seq = seq_of(seq)?;
                reasons[seq] = Some(reason.as_str().to_string());
                let new = decoders[seq].finish(&enc.tokenizer)?;
                pending[seq].push_str(&filters[seq].push(&new, stops, true));
            }
            Some(Err(e)) => return Err(anyhow::anyhow!("the first stage printed {e}")),
            Some(Ok(_)) | None => {
                writeln!(out, "{line}")?;
                continue;
            }
        }
        // Write what the current prompt has; move on past finished ones.
        loop {
            out.text(current, &std::mem::take(&mut pending[current]), reasons[current].is_some())?;
            if reasons[current].is_none() || current + 1 == n {
                break;
            }
            current += 1;
            out.write_all(format!("\n{}", heading(current)).as_bytes())?;
        }
        out.flush()?;
    }
    // The run ended (with sequences unfinished only if it failed): the rest.
    for ((d, f), text) in decoders.iter_mut().zip(filters.iter_mut()).zip(pending.iter_mut()).skip(current) {
        let new = d.finish(&enc.tokenizer)?;
        text.push_str(&f.push(&new, stops, true));
    }
    for (i, text) in pending.iter_mut().enumerate().skip(current) {
        if i > current {
            out.write_all(format!("\n{}", heading(i)).as_bytes())?;
        }
        out.text(i, &std::mem::take(text), true)?;
    }
    if n > 0 {
        out.write_all(b"\n")?;
    }
    // `--logprobs`: each prompt's, after all the text.
    for (i, l) in logprobs.iter().enumerate().filter(|(_, l)| !l.is_empty()) {
        writeln!(out, "logprobs {i}: {}", m3c_contract::protocol::logprobs_json(l))?;
    }
    out.flush()?;
    Ok(enc
        .ids
        .iter()
        .zip(generated)
        .zip(reasons)
        .map(|((p, g), r)| Finished { prompt_tokens: p.len(), generated: g, reason: r.unwrap_or_else(|| "unfinished".into()) })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    #[test]
    fn a_stop_string_split_over_pieces_is_never_printed() {
        let stops = ["\n\nUser:".to_string(), "END".to_string()];
        let mut f = StopFilter::default();
        let mut shown = String::new();
        for piece in ["Hello", " world", "\n", "\nUs", "er: more"] {
            shown += &f.push(piece, &stops, false);
        }
        shown += &f.push("", &stops, true);
        assert_eq!(shown, "Hello world");
        // A held-back start that does not become a stop string comes out.
        let mut f = StopFilter::default();
        let shown = f.push("a\n\nUs", &stops, false) + &f.push("ed", &stops, false) + &f.push("", &stops, true);
        assert_eq!(shown, "a\n\nUsed");
        let mut f = StopFilter::default();
        assert_eq!(f.push("xEN", &stops, false), "x");
        assert_eq!(f.push("", &stops, true), "EN");
        // Included, the text ends right after the stop string.
        let mut f = StopFilter::new(true);
        let shown = f.push("Hello\n\nUs", &stops, false) + &f.push("er: more", &stops, false);
        assert_eq!(shown, "Hello\n\nUser:");
        assert!(f.stopped());
    }
}
