//! The CUDA GPU this rank runs on: the [`Gpu`] trait on the driver API,
//! device memory that frees itself, and CUDA graphs of captured steps.

use super::{checked, cu, CudaDriver};
use crate::device::{hooks, peer, pick_ordinal, DeviceBuffer, DeviceInfo, Gpu, Graph};
use crate::error::StageError;
use std::ffi::{c_char, c_void, CStr};

/// The CUDA GPU this rank runs on.
pub struct CudaGpu(DeviceInfo);

impl CudaGpu {
    /// Initialises the driver, makes `ordinal`'s primary context current,
    /// creates the stream and loads the registered modules.
    pub fn open(ordinal: Option<i32>, local_rank: i32) -> Result<CudaGpu, StageError> {
        // SAFETY: probing for the library has no preconditions.
        if !unsafe { cu::is_culib_present() } {
            return Err(StageError::Device(
                "this stage was compiled for CUDA, but the NVIDIA driver (libcuda.so) is not on this machine; \
                 run it on a GPU machine, or compile with --target host"
                    .into(),
            ));
        }
        // SAFETY: driver calls in their documented order (init, device, primary context, stream); every out-pointer is a live local.
        unsafe {
            checked("cuInit", cu::cuInit(0))?;
            let mut count = 0;
            checked("cuDeviceGetCount", cu::cuDeviceGetCount(&mut count))?;
            if count == 0 {
                return Err(StageError::Device("this stage was compiled for CUDA, but the driver reports no GPU".into()));
            }
            let ordinal = pick_ordinal(ordinal, local_rank, count)?;
            let mut dev = 0;
            checked("cuDeviceGet", cu::cuDeviceGet(&mut dev, ordinal))?;
            let mut name = [0 as c_char; 128];
            checked("cuDeviceGetName", cu::cuDeviceGetName(name.as_mut_ptr(), 128, dev))?;
            let mut ctx = std::ptr::null_mut();
            checked("cuDevicePrimaryCtxRetain", cu::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
            checked("cuCtxSetCurrent", cu::cuCtxSetCurrent(ctx))?;
            let mut stream = std::ptr::null_mut();
            checked("cuStreamCreate", cu::cuStreamCreate(&mut stream, 0))?;
            let (mut free, mut total) = (0, 0);
            checked("cuMemGetInfo", cu::cuMemGetInfo_v2(&mut free, &mut total))?;
            hooks::install(&CudaDriver, stream as usize).map_err(StageError::Device)?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            Ok(CudaGpu(DeviceInfo { ordinal, name, total_bytes: total }))
        }
    }
}

/// New device memory of `bytes` (at least one byte), freed when dropped.
fn alloc(bytes: usize) -> Result<DeviceBuffer, StageError> {
    let mut ptr = 0;
    // SAFETY: `ptr` is a live out-pointer for a new allocation of `bytes.max(1)` bytes.
    unsafe { checked("cuMemAlloc", cu::cuMemAlloc_v2(&mut ptr, bytes.max(1)))? };
    Ok(DeviceBuffer::from_raw(ptr, bytes, free))
}

fn free(ptr: u64) {
    // SAFETY: `ptr` came from cuMemAlloc in `alloc` and its DeviceBuffer,
    // its only owner, is being dropped; the primary context it was
    // allocated in stays retained for the process.
    unsafe { cu::cuMemFree_v2(ptr) };
}

fn destroy_graph(exec: usize) {
    // SAFETY: `exec` came from cuGraphInstantiateWithFlags and its Graph, its only owner, is being dropped.
    unsafe { cu::cuGraphExecDestroy(exec as cu::CUgraphExec) };
}

impl Gpu for CudaGpu {
    fn info(&self) -> &DeviceInfo {
        &self.0
    }

    fn free_bytes(&self) -> Result<usize, StageError> {
        let (mut free, mut total) = (0, 0);
        // SAFETY: a query of the current context (this device's, set when it was opened) into two locals.
        unsafe { checked("cuMemGetInfo", cu::cuMemGetInfo_v2(&mut free, &mut total))? };
        Ok(free)
    }

    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer, StageError> {
        let buf = alloc(bytes.len())?;
        if !bytes.is_empty() {
            // SAFETY: `buf` holds at least `bytes.len()` bytes, filled from a live slice of that length.
            unsafe { checked("cuMemcpyHtoD", cu::cuMemcpyHtoD_v2(buf.ptr(), bytes.as_ptr() as *const c_void, bytes.len()))? };
        }
        Ok(buf)
    }

    fn zeros(&self, bytes: usize) -> Result<DeviceBuffer, StageError> {
        let buf = alloc(bytes)?;
        // SAFETY: the memset writes the `bytes.max(1)` bytes `buf` holds.
        unsafe { checked("cuMemsetD8", cu::cuMemsetD8_v2(buf.ptr(), 0, bytes.max(1)))? };
        Ok(buf)
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), StageError> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is a live, writable slice of `dst.len()` bytes; the caller passes a device buffer of at least that size.
        unsafe { checked("cuMemcpyDtoH", cu::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len())) }
    }

    fn copy_in(&self, dst: u64, src: &[u8]) -> Result<(), StageError> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` is a live slice of `src.len()` bytes; the caller passes a device buffer of at least that size.
        unsafe { checked("cuMemcpyHtoD", cu::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len())) }
    }

    fn sync(&self) -> Result<(), StageError> {
        let s = hooks::stream();
        // SAFETY: `s` is this process's stream, created in `CudaGpu::open`.
        unsafe { checked("cuStreamSynchronize", cu::cuStreamSynchronize(s as cu::CUstream)) }
    }

    /// Runs `f` (the generated step) with the stream capturing: its launches
    /// and copies are recorded, not run. Relaxed mode, so a scratch pool miss
    /// may still allocate. Returns the instantiated graph.
    fn capture(&self, f: &mut dyn FnMut()) -> Result<Graph, StageError> {
        let s = hooks::stream() as cu::CUstream;
        // SAFETY: `s` is this process's stream, idle between steps' launches.
        unsafe {
            checked("cuStreamBeginCapture", cu::cuStreamBeginCapture_v2(s, cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED))?
        };
        f();
        let mut g = std::ptr::null_mut();
        // SAFETY: ends the capture begun above; `g` receives the graph.
        unsafe { checked("cuStreamEndCapture", cu::cuStreamEndCapture(s, &mut g))? };
        let mut exec = std::ptr::null_mut();
        // SAFETY: `g` is a valid graph; the exec keeps its own copy of it.
        let r = unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, g, 0) };
        unsafe { cu::cuGraphDestroy(g) };
        checked("cuGraphInstantiate", r)?;
        Ok(Graph::from_raw(exec as usize, destroy_graph))
    }

    fn replay(&self, g: &Graph) -> Result<(), StageError> {
        let s = hooks::stream() as cu::CUstream;
        // SAFETY: a live exec graph on this context's stream.
        unsafe { checked("cuGraphLaunch", cu::cuGraphLaunch(g.handle() as cu::CUgraphExec, s)) }
    }

    fn enable_gemm(&self, min_rows: usize) -> Result<(), StageError> {
        super::cublas::enable(min_rows)
    }

    fn set_prefill(&self, prefill: bool) {
        super::cublas::set_prefill(prefill)
    }

    fn collectives(&self) -> &'static peer::Collectives {
        &peer::NCCL
    }
}
