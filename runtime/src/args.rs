//! The stage's command line: the contract's [`StageArgs`] (one encoder, in
//! the front; one parser, here).

pub use m3c_contract::stage_args::{StageArgs as RunArgs, DEFAULT_TIMEOUT_S};

use crate::error::StageError;

/// Parses the stage arguments.
pub fn parse(args: &[String]) -> Result<RunArgs, StageError> {
    RunArgs::parse(args).map_err(StageError::Args)
}
