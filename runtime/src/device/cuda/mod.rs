//! The CUDA device, on the driver API through cudarc (loaded at run time,
//! so a stage started on a machine without a driver says so and exits).
//!
//! Generated host code reaches the GPU through two small ABIs:
//! - MLIR's `mgpu*` functions (module load, function lookup, launch,
//!   streams), which `gpu.launch_func` lowers to. Every launch goes to this
//!   process's one stream, in order; the runtime synchronises once per step.
//! - `m3c_buf_alloc/free/copy`, for scratch buffers: a size-keyed pool, so
//!   a decode step allocates nothing after the first. The pool never gives
//!   memory back to the driver, so addresses baked into a captured
//!   [`Graph`](super::Graph) stay valid; every step runs on the one stream,
//!   so a graph replay and any other step never use a scratch buffer at once.
//!   On a host stage the same hooks hand out host memory.
//!
//! Modules are registered by static constructors before `main` (MLIR emits
//! one per stage binary) and loaded only when [`CudaGpu::open`] has a context.
//!
//! Split by job: `driver` (the device and its [`Gpu`](super::Gpu)
//! implementation), `pool` (the `m3c_buf_*` scratch hooks), `mgpu` (MLIR's
//! launch ABI), `nccl` and `cublas` (libraries loaded by name). Failures are
//! reported one way: [`checked`] turns a driver result into a `String` error
//! for the caller; callbacks from generated code, which cannot return
//! errors, end the process through [`die`] with the same message.

use crate::error::StageError;
mod cublas;
mod driver;
mod mgpu;
mod nccl;
mod pool;

pub use driver::CudaGpu;
pub use pool::ScratchBuffer;

use cudarc::driver::sys as cu;
use std::collections::BTreeMap;
use std::ffi::{c_char, CStr};
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

/// Whether `m3c_buf_*` hand out device memory (a CUDA stage) or host memory.
pub(crate) static ON_DEVICE: AtomicBool = AtomicBool::new(false);

/// Ends the process with `message` and exit code 1: how callbacks from
/// generated code report failure (unwinding across that boundary is not allowed).
pub(crate) fn die(message: &str) -> ! {
    let line = format!("m3c stage: {message}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    std::process::exit(1)
}

/// [`die`] for a failed driver call.
fn fail(what: &str, r: cu::CUresult) -> ! {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a static string pointer or leaves null.
    unsafe { cu::cuGetErrorString(r, &mut p) };
    let msg = if p.is_null() { format!("{r:?}") } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() };
    die(&format!("CUDA error in {what}: {msg}"))
}

pub(crate) fn check(what: &str, r: cu::CUresult) {
    if r != cu::CUresult::CUDA_SUCCESS {
        fail(what, r)
    }
}

pub(crate) fn checked(what: &str, r: cu::CUresult) -> Result<(), StageError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString writes a pointer to a static string, or leaves null.
        unsafe { cu::cuGetErrorString(r, &mut p) };
        let msg = if p.is_null() { format!("{r:?}") } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() };
        Err(StageError::Device(format!("{what}: {msg}")))
    }
}

pub(crate) struct State {
    /// PTX images registered by the binaries' constructors (address of a NUL-terminated string).
    images: Vec<usize>,
    modules: Vec<Option<usize>>,
    functions: BTreeMap<(usize, String), usize>,
    stream: usize,
    /// Free device buffers by size.
    pool: BTreeMap<u64, Vec<u64>>,
    sizes: BTreeMap<u64, u64>,
    live_bytes: u64,
    peak_bytes: u64,
}

static STATE: Mutex<State> = Mutex::new(State {
    images: Vec::new(),
    modules: Vec::new(),
    functions: BTreeMap::new(),
    stream: 0,
    pool: BTreeMap::new(),
    sizes: BTreeMap::new(),
    live_bytes: 0,
    peak_bytes: 0,
});

pub(crate) fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}
