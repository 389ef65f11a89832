//! Back ends: MLIR modules of kernels in, target code out. Everything
//! target-specific lives here, at the end of the pipeline.

pub mod cuda;
pub mod host;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("generated MLIR does not parse (a compiler bug); first lines:\n{head}")]
    Parse { head: String },
    #[error("MLIR pass pipeline `{pipeline}` failed: {message}")]
    Passes { pipeline: String, message: String },
    #[error("translating to LLVM IR failed")]
    Translate,
    #[error("LLVM code generation failed: {0}")]
    Codegen(String),
    #[error("CUDA toolkit: {0}")]
    Toolkit(String),
}
