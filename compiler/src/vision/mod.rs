//! Images in: MiniMax-M3's image processor (`processor.rs`). The vision
//! tower, projector and merge are compiled like the text model (not yet:
//! see the vision issue); this module is what turns a user's image file into
//! the `pixel_values` and grid they take.

pub mod processor;
