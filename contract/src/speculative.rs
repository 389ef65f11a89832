//! Speculative decoding's settings: vLLM's `--speculative-config` JSON, read
//! and checked once for `m3c run` and `m3c serve`, and the text forms a
//! stage takes them in (`--speculative ngram:K:MIN:MAX[:BATCH]`, or
//! `--eagle3 K[:BATCH] --draft-model DIR`). The n-gram lookup itself is
//! `m3c_engine`'s.
//!
//! Whatever the method, speculation changes no bit of a request's output:
//! the last stage draws each row of a verify step exactly as plain decoding
//! draws that position, and a draft token is kept only when it equals that
//! draw. The method only decides how many steps a sequence takes.

use std::path::PathBuf;

/// The most draft tokens one verify step may carry.
pub const MAX_SPECULATIVE_TOKENS: usize = 32;
/// The longest n-gram prompt lookup matches.
pub const MAX_LOOKUP: usize = 1024;

/// Prompt lookup (vLLM's `ngram`): the longest suffix of a sequence's ids,
/// between `min` and `max` tokens, that occurred before proposes the
/// `tokens` ids that followed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ngram {
    pub tokens: usize,
    pub min: usize,
    pub max: usize,
    /// vLLM's `disable_by_batch_size`: no drafts while more sequences than
    /// this are running (a big batch is compute-bound: verify rows cost).
    pub disable_by_batch_size: Option<usize>,
}

/// EAGLE3 at run time: `tokens` drafts per step from the head compiled
/// into the last stage, whose weights are in `model`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eagle3Run {
    pub tokens: usize,
    pub model: PathBuf,
    /// vLLM's `disable_by_batch_size`: no drafts while more sequences run.
    pub disable_by_batch_size: Option<usize>,
}

impl Eagle3Run {
    /// `K[:BATCH]`, the stage argument's form.
    pub fn encode_tokens(&self) -> String {
        match self.disable_by_batch_size {
            Some(b) => format!("{}:{b}", self.tokens),
            None => self.tokens.to_string(),
        }
    }
}

/// `K[:BATCH]` as a stage argument: a draft length of 1 to
/// [`MAX_SPECULATIVE_TOKENS`], and the batch size above which no drafts are made.
pub fn parse_draft_tokens(v: &str) -> Result<(usize, Option<usize>), String> {
    let bad = || format!("`{v}` is not K[:BATCH] (a draft length of 1 to {MAX_SPECULATIVE_TOKENS}, then a batch size)");
    let (k, batch) = match v.split_once(':') {
        Some((k, b)) => (k, Some(b.parse::<usize>().ok().filter(|&b| b > 0).ok_or_else(bad)?)),
        None => (v, None),
    };
    let k = k.parse::<usize>().ok().filter(|k| (1..=MAX_SPECULATIVE_TOKENS).contains(k)).ok_or_else(bad)?;
    Ok((k, batch))
}

/// A `--speculative-config`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpeculativeConfig {
    Ngram(Ngram),
    /// An EAGLE3 draft head (vLLM's `eagle3`): its checkpoint folder.
    Eagle3 {
        model: PathBuf,
        tokens: usize,
        disable_by_batch_size: Option<usize>,
    },
}

impl SpeculativeConfig {
    /// Reads vLLM's JSON form. Every key is known or an error, so a
    /// setting m3c would not honour is never dropped silently.
    pub fn from_json(text: &str) -> Result<SpeculativeConfig, String> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| format!("--speculative-config: not JSON ({e}); expected an object such as {EXAMPLE}"))?;
        let obj = v.as_object().ok_or_else(|| format!("--speculative-config: expected a JSON object such as {EXAMPLE}"))?;
        let method = match obj.get("method") {
            Some(serde_json::Value::String(m)) => m.as_str(),
            Some(_) => return Err("--speculative-config: `method` must be a string (\"ngram\" or \"eagle3\")".into()),
            None => return Err("--speculative-config: `method` is missing (\"ngram\" or \"eagle3\")".into()),
        };
        let known: &[&str] = match method {
            "ngram" => &["method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"],
            "eagle3" => &["method", "num_speculative_tokens", "model", "disable_by_batch_size"],
            other => return Err(format!("--speculative-config: unknown method `{other}`; m3c speculates with \"ngram\" or \"eagle3\"")),
        };
        if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(format!("--speculative-config: unknown key `{k}` for method `{method}`; known: {}", known.join(", ")));
        }
        let count = |key: &str, lo: usize, hi: usize| -> Result<Option<usize>, String> {
            match obj.get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|n| (lo..=hi).contains(n))
                    .map(Some)
                    .ok_or_else(|| format!("--speculative-config: `{key}` must be an integer from {lo} to {hi}, not {v}")),
            }
        };
        let tokens = count("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)?
            .ok_or("--speculative-config: `num_speculative_tokens` is missing (draft tokens per step)")?;
        let disable_by_batch_size = count("disable_by_batch_size", 1, 1 << 20)?;
        match method {
            "ngram" => {
                let (min, max) = match (count("prompt_lookup_min", 1, MAX_LOOKUP)?, count("prompt_lookup_max", 1, MAX_LOOKUP)?) {
                    // vLLM's defaults: 5 and 5, or the one given for both.
                    (None, None) => (DEFAULT_LOOKUP, DEFAULT_LOOKUP),
                    (Some(min), None) => (min, min),
                    (None, Some(max)) => (max, max),
                    (Some(min), Some(max)) => (min, max),
                };
                if min > max {
                    return Err(format!("--speculative-config: prompt_lookup_min ({min}) is larger than prompt_lookup_max ({max})"));
                }
                Ok(SpeculativeConfig::Ngram(Ngram { tokens, min, max, disable_by_batch_size }))
            }
            _ => {
                let model = match obj.get("model") {
                    Some(serde_json::Value::String(m)) if !m.is_empty() => PathBuf::from(m),
                    _ => return Err("--speculative-config: method `eagle3` needs `model`, the draft's checkpoint folder".into()),
                };
                Ok(SpeculativeConfig::Eagle3 { model, tokens, disable_by_batch_size })
            }
        }
    }

    /// vLLM's name of the method (`ngram`, `eagle3`).
    pub fn method(&self) -> &'static str {
        match self {
            SpeculativeConfig::Ngram(_) => "ngram",
            SpeculativeConfig::Eagle3 { .. } => "eagle3",
        }
    }

    /// Draft tokens per verify step.
    pub fn tokens(&self) -> usize {
        match self {
            SpeculativeConfig::Ngram(n) => n.tokens,
            SpeculativeConfig::Eagle3 { tokens, .. } => *tokens,
        }
    }
}

const EXAMPLE: &str = r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}"#;
/// vLLM's n-gram length when the config names neither bound.
pub const DEFAULT_LOOKUP: usize = 5;

impl Ngram {
    /// The stage argument's text (`ngram:K:MIN:MAX`, then `:B` with a
    /// `disable_by_batch_size`).
    pub fn encode(&self) -> String {
        let base = format!("ngram:{}:{}:{}", self.tokens, self.min, self.max);
        match self.disable_by_batch_size {
            Some(b) => format!("{base}:{b}"),
            None => base,
        }
    }

    /// The inverse of [`Ngram::encode`].
    pub fn parse(text: &str) -> Result<Ngram, String> {
        let bad = || format!("--speculative `{text}`: expected ngram:TOKENS:MIN:MAX[:BATCH]");
        let parts: Vec<&str> = text.split(':').collect();
        let (method, k, min, max, batch) = match parts[..] {
            [method, k, min, max] => (method, k, min, max, None),
            [method, k, min, max, b] => (method, k, min, max, Some(b)),
            _ => return Err(bad()),
        };
        let n = |s: &str| s.parse::<usize>().ok();
        let disable_by_batch_size = match batch.map(n) {
            None => None,
            Some(Some(b)) if b >= 1 => Some(b),
            Some(_) => return Err(bad()),
        };
        match (method, n(k), n(min), n(max)) {
            ("ngram", Some(tokens), Some(min), Some(max))
                if (1..=MAX_SPECULATIVE_TOKENS).contains(&tokens) && 1 <= min && min <= max && max <= MAX_LOOKUP =>
            {
                Ok(Ngram { tokens, min, max, disable_by_batch_size })
            }
            _ => Err(bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_configs_are_read_and_every_mistake_is_named() {
        let ng = |t: &str| SpeculativeConfig::from_json(t);
        assert_eq!(
            ng(r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}"#),
            Ok(SpeculativeConfig::Ngram(Ngram { tokens: 3, min: 2, max: 4, disable_by_batch_size: None }))
        );
        assert_eq!(
            ng(r#"{"method": "ngram", "num_speculative_tokens": 5}"#),
            Ok(SpeculativeConfig::Ngram(Ngram { tokens: 5, min: 5, max: 5, disable_by_batch_size: None }))
        );
        assert_eq!(
            ng(r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "disable_by_batch_size": 4}"#),
            Ok(SpeculativeConfig::Ngram(Ngram { tokens: 2, min: 3, max: 3, disable_by_batch_size: Some(4) }))
        );
        assert_eq!(
            ng(r#"{"method": "eagle3", "model": "d", "num_speculative_tokens": 3}"#),
            Ok(SpeculativeConfig::Eagle3 { model: "d".into(), tokens: 3, disable_by_batch_size: None })
        );
        for (text, says) in [
            ("[1]", "JSON object"),
            ("{", "not JSON"),
            (r#"{"num_speculative_tokens": 3}"#, "`method` is missing"),
            (r#"{"method": "medusa", "num_speculative_tokens": 3}"#, "unknown method `medusa`"),
            (r#"{"method": "ngram"}"#, "`num_speculative_tokens` is missing"),
            (r#"{"method": "ngram", "num_speculative_tokens": 0}"#, "from 1 to 32"),
            (r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_mn": 2}"#, "unknown key `prompt_lookup_mn`"),
            (r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}"#, "larger than"),
            (r#"{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}"#, "unknown key `model`"),
            (r#"{"method": "eagle3", "num_speculative_tokens": 3}"#, "needs `model`"),
        ] {
            let e = ng(text).expect_err(text);
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    #[test]
    fn stage_text_round_trips() {
        let n = Ngram { tokens: 4, min: 2, max: 7, disable_by_batch_size: None };
        assert_eq!(Ngram::parse(&n.encode()), Ok(n));
        let b = Ngram { disable_by_batch_size: Some(16), ..n };
        assert_eq!(Ngram::parse(&b.encode()), Ok(b));
        for bad in ["", "ngram:1:2", "ngram:0:1:1", "ngram:3:4:2", "eagle3:1:1:1", "ngram:1:0:1", "ngram:1:1:1:0", "ngram:1:1:1:2:3"] {
            assert!(Ngram::parse(bad).is_err(), "{bad}");
        }
    }
}
