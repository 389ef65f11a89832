//! The checkpoint's tokenizer: encoding without added special tokens (the
//! chat template writes every control token), decoding with or without the
//! special ones, and streaming decode that never splits a UTF-8 character.

use super::TextError;
use m3c_contract::input::{limits, read_user_file};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

pub struct TextTokenizer {
    tk: tokenizers::Tokenizer,
    /// Ids of the added tokens flagged special (dropped by `skip_special`).
    special: BTreeSet<u32>,
    pub file: PathBuf,
}

impl TextTokenizer {
    /// `DIR/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<TextTokenizer, TextError> {
        let file = dir.join("tokenizer.json");
        if std::fs::symlink_metadata(&file).is_err() {
            return Err(TextError::NoTokenizer { dir: dir.to_path_buf() });
        }
        let text = read_user_file(&file, "tokenizer", limits::TOKENIZER)?;
        let tk = <tokenizers::Tokenizer as std::str::FromStr>::from_str(&text)
            .map_err(|e| TextError::Tokenizer { file: file.clone(), message: e.to_string() })?;
        let special = tk.get_added_tokens_decoder().iter().filter(|(_, t)| t.special).map(|(id, _)| *id).collect();
        Ok(TextTokenizer { tk, special, file })
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.encode_with(text, false)
    }

    /// Token ids of `text`, with the special tokens the tokenizer's
    /// post-processor adds (a BOS, for one that has it) when `add_special`.
    pub fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TextError> {
        let enc =
            self.tk.encode(text, add_special).map_err(|e| TextError::Tokenizer { file: self.file.clone(), message: e.to_string() })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Each id's token string (the tokenizer's symbols), `None` for an id
    /// outside the vocabulary.
    pub fn id_strings(&self, ids: &[u32]) -> Vec<Option<String>> {
        ids.iter().map(|&i| self.tk.id_to_token(i)).collect()
    }

    /// The tokens' strings (the tokenizer's symbols, e.g. `Ġwor`).
    pub fn tokens(&self, text: &str) -> Result<Vec<String>, TextError> {
        let enc = self.tk.encode(text, false).map_err(|e| TextError::Tokenizer { file: self.file.clone(), message: e.to_string() })?;
        Ok(enc.get_tokens().to_vec())
    }

    /// The text of `ids`; special tokens dropped when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        self.tk.decode(ids, skip_special).map_err(|e| TextError::Tokenizer { file: self.file.clone(), message: e.to_string() })
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tk.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.tk.get_vocab_size(true)
    }
}

/// Streams the text of a growing list of ids: each call returns the new
/// complete characters only, so a multi-byte character split over tokens
/// comes out whole once its last byte has arrived.
///
/// Each call decodes only a window, as vLLM's and TGI's detokenisers do:
/// the ids from `prefix` (a few tokens of context before the text not yet
/// returned, so a decoder that looks at neighbours sees them) to the end,
/// against the same window without the new ids. A token costs the window,
/// not the whole sequence.
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the decode window.
    prefix: usize,
    /// The ids before this have had their text returned.
    read: usize,
    skip_special: bool,
}

/// Tokens of context kept before the unreturned text.
const CONTEXT: usize = 5;

impl IncrementalDecoder {
    pub fn new(skip_special: bool) -> IncrementalDecoder {
        IncrementalDecoder { ids: Vec::new(), prefix: 0, read: 0, skip_special }
    }

    /// The window's text without and with the ids not yet returned.
    fn window(&self, tk: &TextTokenizer) -> Result<(String, String), TextError> {
        let before = tk.decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let all = tk.decode(&self.ids[self.prefix..], self.skip_special)?;
        Ok((before, all))
    }

    /// Adds `id`; returns the text it completes (possibly empty).
    pub fn push(&mut self, tk: &TextTokenizer, id: u32) -> Result<String, TextError> {
        self.ids.push(id);
        let (before, all) = self.window(tk)?;
        // A character still missing bytes decodes to U+FFFD at the end: wait for it.
        if all.ends_with('\u{FFFD}') || all.len() <= before.len() || !all.is_char_boundary(before.len()) {
            return Ok(String::new());
        }
        let new = all[before.len()..].to_string();
        self.read = self.ids.len();
        self.prefix = self.read.saturating_sub(CONTEXT);
        Ok(new)
    }

    /// The text held back at the end of the sequence: a character that
    /// will never be completed comes out as U+FFFD, as a full decode shows it.
    pub fn finish(&mut self, tk: &TextTokenizer) -> Result<String, TextError> {
        let (before, all) = self.window(tk)?;
        let rest = all.get(before.len()..).unwrap_or_default().to_string();
        self.read = self.ids.len();
        Ok(rest)
    }

    /// All the text so far.
    pub fn text(&self, tk: &TextTokenizer) -> Result<String, TextError> {
        tk.decode(&self.ids, self.skip_special)
    }
}
