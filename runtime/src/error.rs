//! The stage's errors, by what failed. Every message names its place (the
//! stage, the file, the tensor, the peer); the kind tells a caller what to do
//! about it (a server answers a lost peer differently from a bad request).
//! They are reported one way: `startup::agree` or `startup::abort_job`
//! print `who: error: MESSAGE` once.

#[derive(Debug, Clone, thiserror::Error)]
pub enum StageError {
    /// The run arguments or prompts are unusable.
    #[error("{0}")]
    Args(String),
    /// The checkpoint, its config or a tensor is not what the stage was compiled for.
    #[error("{0}")]
    Weights(String),
    /// The GPU, its driver, NCCL or cuBLAS failed.
    #[error("{0}")]
    Device(String),
    /// A peer fell silent or sent something malformed.
    #[error("{0}")]
    Peer(String),
    /// A step could not run or produced unusable results.
    #[error("{0}")]
    Step(String),
    /// A dump or `--expect` comparison failed.
    #[error("{0}")]
    Output(String),
}
