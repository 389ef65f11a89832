//! A model family's chat format: the markers its prompts and outputs are
//! written in, which the readers of reasoning, tool calls and media take
//! as a value instead of spelling them.
//!
//! - the reasoning tags (`m3c_constrain::thinking` splits and budgets
//!   reasoning by them, [`crate::thinking::ThinkStart`] reads a prompt's
//!   end by them);
//! - the tool-call markup (`m3c_serve`'s output reader and its tool-call
//!   grammar);
//! - the media placeholders (`m3c_front::vision`);
//! - the parser names vLLM's `--tool-call-parser` and `--reasoning-parser`
//!   take for the family.
//!
//! A family is found by its `config.json`'s `architectures`, as the
//! compiler's family registry finds it. A new family with its own markers
//! is one file here, its `mod` line and its entry in [`FORMATS`]; one whose
//! tool calls are not MiniMax's XML (`<invoke>` and `<parameter>`-style tags
//! behind a mark) also brings a reader for them (in `m3c_serve::output`).

mod minimax_m3;

/// Every chat format m3c reads.
const FORMATS: &[&ChatFormat] = &[&minimax_m3::FORMAT];

/// The markers of one family's chats.
#[derive(Debug, PartialEq, Eq)]
pub struct ChatFormat {
    /// The family's id (`minimax_m3`), as the compiler's registry names it.
    pub family: &'static str,
    /// The `architectures` of the `config.json` files that use it.
    pub architectures: &'static [&'static str],
    /// The names vLLM's `--tool-call-parser` and `--reasoning-parser`
    /// take for it.
    pub parsers: &'static [&'static str],
    pub think: ThinkTags,
    pub tools: ToolMarkup,
    pub media: MediaTokens,
}

/// The tags around the model's reasoning (each one token).
#[derive(Debug, PartialEq, Eq)]
pub struct ThinkTags {
    /// Opens the reasoning.
    pub open: &'static str,
    /// Closes it; content starts after it.
    pub close: &'static str,
}

/// Tool calls as XML-like tags, each behind a mark token: a block holds one
/// or more invokes, an invoke holds one tag per argument, nested tags for
/// objects, item tags for arrays.
#[derive(Debug, PartialEq, Eq)]
pub struct ToolMarkup {
    /// Written before every tag of a call block (one token).
    pub mark: &'static str,
    /// The block's tag (`tool_call`).
    pub block: &'static str,
    /// One call's tag (`invoke`), whose `name` attribute is the function.
    pub invoke: &'static str,
    /// An array element's tag (`item`).
    pub item: &'static str,
}

/// The placeholders of images and videos in a prompt.
#[derive(Debug, PartialEq, Eq)]
pub struct MediaTokens {
    pub start_of_image: &'static str,
    pub end_of_image: &'static str,
    /// One video patch (a run of them per frame group).
    pub video: &'static str,
    /// What comes before and after a frame group's time in seconds.
    pub frame_time: [&'static str; 2],
}

impl ChatFormat {
    /// The format of a model whose `config.json` names `architecture`.
    pub fn of_architecture(architecture: &str) -> Option<&'static ChatFormat> {
        FORMATS.iter().copied().find(|f| f.architectures.contains(&architecture))
    }

    /// The format of the model whose `config.json` text is `config`: its
    /// first `architectures` entry, named in the error when m3c has none.
    pub fn of_config(config: &str) -> Result<&'static ChatFormat, String> {
        let v: serde_json::Value = serde_json::from_str(config).map_err(|e| format!("not JSON: {e}"))?;
        let arch = v["architectures"].as_array().and_then(|a| a.first()).and_then(|a| a.as_str());
        let arch = arch.ok_or("no `architectures` list, so its chat format is unknown")?;
        ChatFormat::of_architecture(arch).ok_or_else(|| {
            let known: Vec<&str> = FORMATS.iter().flat_map(|f| f.architectures.iter().copied()).collect();
            format!("`architectures`: `{arch}` has no chat format in m3c (it reads {})", known.join(", "))
        })
    }

    /// The format of the model in folder `dir` (its `config.json`, which
    /// every error names).
    pub fn of_model_dir(dir: &std::path::Path) -> Result<&'static ChatFormat, String> {
        let file = dir.join("config.json");
        let text = crate::input::read_user_file(&file, "config", crate::input::limits::CONFIG).map_err(|e| e.to_string())?;
        ChatFormat::of_config(&text).map_err(|e| format!("{}: {e}", file.display()))
    }

    /// Every parser name vLLM's `--tool-call-parser` and
    /// `--reasoning-parser` may take for a model m3c serves.
    pub fn all_parsers() -> Vec<&'static str> {
        FORMATS.iter().flat_map(|f| f.parsers.iter().copied()).collect()
    }

    /// The format of the family with id `family` (`minimax_m3`).
    pub fn of_family(family: &str) -> Option<&'static ChatFormat> {
        FORMATS.iter().copied().find(|f| f.family == family)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_names_its_format_by_architecture() {
        let f = ChatFormat::of_config(r#"{"architectures": ["MiniMaxM3SparseForConditionalGeneration"]}"#).unwrap();
        assert_eq!(f.family, "minimax_m3");
        assert_eq!(f.think.close, "</mm:think>");
        let e = ChatFormat::of_config(r#"{"architectures": ["LlamaForCausalLM"]}"#).unwrap_err();
        assert!(e.contains("LlamaForCausalLM") && e.contains("MiniMaxM3"), "{e}");
        assert!(ChatFormat::of_config("{}").unwrap_err().contains("architectures"));
    }
}
