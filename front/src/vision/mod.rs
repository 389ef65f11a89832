//! Images and videos in: MiniMax-M3's image processor (`processor.rs`),
//! its video processor (`video.rs`: FFmpeg decoding, sampling, chunks) and image
//! prompts (`prompt.rs`: placeholders expanded or checked, the images file
//! the stage that encodes them reads). The tower, projector and merge are
//! compiled like the text model (m3c-compiler's `graph::build`, `lower`): the embedding's
//! stage has a second entry, `m3c_stage_vision`.

pub mod processor;
pub mod prompt;
pub mod video;
