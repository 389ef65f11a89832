//! The contract between `m3c` (the compiler) and the stage runtime it links
//! into every executable: what both sides must read the same way.
//!
//! - [`blocks`]: the KV block pool's formats: block ids and the content
//!   hash chains its prefix cache is keyed by (the allocator is
//!   `m3c_kvpool`).
//! - [`dtype`]: the one table of checkpoint element types and their sizes
//!   (no default for an unknown name: it is an error).
//! - [`chat_format`]: a family's chat markers (reasoning tags, tool-call
//!   markup, media tokens), found by `config.json`'s `architectures`.
//! - [`checkpoint`]: the one safetensors reader (single file or sharded),
//!   which rejects exactly the same damaged or hostile files on both sides.
//! - [`input`]: reading user files with a size limit, regular files only,
//!   a UTF-8 byte-order mark tolerated.
//! - [`stage`]: the stage metadata the compiler embeds in each executable
//!   and the runtime reads, and the C ABI between them.
//! - [`manifest`]: `OUT/manifest.json`, written by `m3c compile` and read
//!   back typed by `m3c run` and `m3c serve`.
//! - [`images`]: the images file the front writes and the stage that
//!   encodes images reads (patch rows and grids per sequence).
//! - [`prompts`]: token-id prompts (`--prompt-ids`, prompts files) and the
//!   numbers of the run command line.
//! - [`target`]: what stages are compiled for (`host`, `cuda ARCH`), one
//!   type from the plan to the manifest and the stage metadata.
//! - [`cpu`]: the x86-64 features a stage's host code may use, recorded
//!   when it is compiled and checked when it starts.
//! - [`stage_args`]: a stage executable's command line, as a type with one
//!   encoder (the front's) and one parser (the stage's).
//! - [`protocol`]: the commands and events between the front and the first
//!   stage (`add`, `cancel`; `m3c-ready`, `m3c-id`, `m3c-end`, ...).
//! - [`thinking`]: where a chat's output starts relative to the model's
//!   reasoning (`<mm:think>`), and the reasoning budget.
//! - [`sampling`]: sampling parameters (with their one text form) and the
//!   sampling table's layout (the host sampler, which every target's
//!   sampler must agree with, is `m3c_sampler`).
//! - [`speculative`]: `--speculative-config` (vLLM's JSON) and the text
//!   forms a stage takes it in (n-gram prompt lookup, an EAGLE3 head).
//! - [`lost_peer`]: the words a stage ends with when a peer fell silent,
//!   from which the fronts read the lost host.
//! - [`token_bytes`]: each token id's bytes, from a byte-level
//!   `tokenizer.json`, for stop strings that span tokens.
//!
//! This crate does no MPI, no mmap and no printing: it is plain parsing, so
//! its parsers can be property-tested on arbitrary input.

pub mod blocks;
pub mod chat_format;
pub mod checkpoint;
pub mod cpu;
pub mod dtype;
pub mod images;
pub mod input;
pub mod lost_peer;
pub mod manifest;
pub mod prompts;
pub mod protocol;
pub mod sampling;
pub mod speculative;
pub mod stage;
pub mod stage_args;
pub mod target;
pub mod thinking;
pub mod token_bytes;
mod unique_map;

pub use checkpoint::{CheckpointError, CheckpointLayout, TensorLocation};
pub use dtype::DType;
pub use input::{read_user_file, InputError};
pub use stage::{CacheSlot, DraftMeta, StageMeta, TensorSlot};
