//! m3c's front: what turns a user's request into what the stages read, and
//! starts them. The tokenizer and chat template (`text`), the image
//! processor and image prompts (`vision`), and the compiled OUT folder
//! opened and launched under mpirun (`launch`, which first sweeps the
//! session folders killed launchers left: `mpi_sessions`, which also gives
//! each launch its own), and the pipeline's
//! timeline collected and read back (`trace`). `m3c run` and `m3c serve`
//! both build on it; it links nothing of the compiler (no MLIR, no LLVM).

pub mod launch;
pub mod mpi_sessions;
pub mod text;
pub mod trace;
pub mod vision;
