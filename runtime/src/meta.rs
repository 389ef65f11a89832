//! What `m3c compile` tells a stage about itself: the contract's
//! [`StageMeta`], embedded in the executable as JSON (the `m3c_stage_meta`
//! symbol), so a stage binary is self-describing.

pub use m3c_contract::StageMeta;
