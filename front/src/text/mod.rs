//! Text in and out: the checkpoint's tokenizer (`tokenizer.json`, read by
//! Hugging Face's `tokenizers`, the code the Python side runs) and its chat
//! template (`tokenizer_config.json`, rendered by MiniJinja configured as
//! transformers configures Jinja2, so that the rendered prompt is
//! byte-identical).

pub mod front;
pub mod generation;
pub mod messages;
pub mod pyjson;
mod template;
mod tokenizer;

pub use template::{ChatTemplate, ThinkingMode};
pub use tokenizer::{IncrementalDecoder, TextTokenizer};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("{dir}: no tokenizer.json (this checkpoint has no tokenizer; give token ids with --prompt-ids instead)")]
    NoTokenizer { dir: PathBuf },
    #[error("{file}: not a tokenizer m3c can read: {message}")]
    Tokenizer { file: PathBuf, message: String },
    #[error("{file}: {message}")]
    Config { file: PathBuf, message: String },
    /// The checkpoint's chat format (its `config.json` names the file).
    #[error("{0}")]
    ChatFormat(String),
    #[error("{file}: the chat template does not compile: {message}")]
    Template { file: PathBuf, message: String },
    #[error("rendering the chat template of {file}: {message}")]
    Render { file: PathBuf, message: String },
    #[error(transparent)]
    Input(#[from] m3c_contract::InputError),
    #[error(transparent)]
    Media(#[from] crate::vision::prompt::PromptImageError),
}
