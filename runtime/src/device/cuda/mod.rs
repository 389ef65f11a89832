//! The CUDA device, on the driver API through cudarc (loaded at run time,
//! so a stage started on a machine without a driver says so and exits).
//!
//! Split by job: `driver` (the device and its [`Gpu`](super::Gpu)
//! implementation), this module's [`CudaDriver`] (what generated code's
//! hooks in [`hooks`](super::hooks) need: module loads, launches, scratch
//! memory), and `cublas` (a library loaded by name). Links between stages
//! are NCCL's, in [`peer`](super::peer). Failures are reported one way:
//! [`checked`] turns a driver result into an error for the caller.

use crate::error::StageError;
mod cublas;
mod driver;

pub use driver::CudaGpu;

use cudarc::driver::sys as cu;
use std::ffi::{c_char, c_void, CStr};

/// The driver's message for `r`, prefixed with the call that failed.
fn message(what: &str, r: cu::CUresult) -> String {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string, or leaves null.
    unsafe { cu::cuGetErrorString(r, &mut p) };
    // SAFETY: when set, `p` is the driver's static NUL-terminated string.
    let msg = if p.is_null() { format!("{r:?}") } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() };
    format!("CUDA error in {what}: {msg}")
}

fn ok(what: &str, r: cu::CUresult) -> Result<(), String> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(message(what, r))
    }
}

pub(crate) fn checked(what: &str, r: cu::CUresult) -> Result<(), StageError> {
    ok(what, r).map_err(StageError::Device)
}

/// The hooks' CUDA calls. The primary context is current on the thread
/// that opened the device, which is the thread that runs every step.
pub(crate) struct CudaDriver;

impl super::hooks::Driver for CudaDriver {
    fn load_module(&self, image: *const c_void) -> Result<usize, String> {
        let mut m = std::ptr::null_mut();
        // SAFETY: `image` is a PTX or cubin image registered by the stage's constructors, alive for the process; `m` is a live out-pointer.
        ok("loading the stage's device code (cuModuleLoadData; a cubin for the compiled arch, or PTX)", unsafe {
            cu::cuModuleLoadData(&mut m, image)
        })?;
        Ok(m as usize)
    }

    fn function(&self, module: usize, name: &CStr) -> Result<usize, String> {
        let mut f = std::ptr::null_mut();
        // SAFETY: `module` was loaded by `load_module`; `name` is NUL-terminated and `f` a live out-pointer.
        ok(&format!("cuModuleGetFunction({})", name.to_string_lossy()), unsafe {
            cu::cuModuleGetFunction(&mut f, module as cu::CUmodule, name.as_ptr())
        })?;
        Ok(f as usize)
    }

    fn launch(&self, f: usize, grid: [u32; 3], block: [u32; 3], smem: u32, stream: usize, params: *mut *mut c_void) -> Result<(), String> {
        // SAFETY: `f` is a kernel of a loaded module and `params` points to one live pointer per argument (the hooks' contract); the launch is queued on the stage's stream.
        ok("cuLaunchKernel", unsafe {
            cu::cuLaunchKernel(
                f as cu::CUfunction,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                smem,
                stream as cu::CUstream,
                params,
                std::ptr::null_mut(),
            )
        })
    }

    fn alloc(&self, bytes: usize) -> Result<u64, String> {
        let mut p = 0;
        // SAFETY: `p` is a live out-pointer for a new allocation.
        ok("cuMemAlloc", unsafe { cu::cuMemAlloc_v2(&mut p, bytes) })?;
        Ok(p)
    }

    fn free(&self, ptr: u64) -> Result<(), String> {
        // SAFETY: the hooks free only what `alloc` gave and no one holds.
        ok("cuMemFree", unsafe { cu::cuMemFree_v2(ptr) })
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<(), String> {
        // SAFETY: the generated code passes two device buffers of at least `bytes` bytes; the copy is ordered on the stage's stream.
        ok("cuMemcpyAsync", unsafe { cu::cuMemcpyAsync(dst, src, bytes, stream as cu::CUstream) })
    }
}
