//! The ROCm device: the [`Gpu`] trait on the HIP runtime, loaded at run
//! time (see `api`), the hooks' [`Driver`] for generated code (module loads
//! of the stage's AMDGPU code object, launches, scratch memory), HIP graphs
//! of captured decode steps, and RCCL links between stages
//! ([`peer::RCCL`]). There is no GEMM library yet: prefill linears stay on
//! m3c's kernels (hipBLASLt can come later).
//!
//! No AMD GPU has run this code: CI checks the code objects it loads and
//! runs their kernels in the SIMT interpreter at wave 64, and a stage
//! without HIP is tested to fail cleanly. It mirrors the CUDA device call
//! for call.

mod api;

use super::hooks::{self, Driver};
use super::{peer, pick_ordinal, DeviceBuffer, DeviceInfo, Gpu, Graph};
use crate::error::StageError;
use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

static API: OnceLock<api::Api> = OnceLock::new();

/// The loaded runtime; only called once [`HipGpu::open`] has loaded it.
fn hip() -> &'static api::Api {
    API.get().unwrap_or_else(|| hooks::die("HIP used before the device was opened (runtime bug)"))
}

fn checked(what: &str, r: i32) -> Result<(), StageError> {
    hip().ok(what, r).map_err(StageError::Device)
}

/// The ROCm GPU this rank runs on.
pub struct HipGpu(DeviceInfo);

impl HipGpu {
    /// Loads HIP, makes `ordinal` (or the one `local_rank` falls on) this
    /// thread's device, creates the stream and loads the registered code
    /// objects.
    pub fn open(arch: &str, ordinal: Option<i32>, local_rank: i32) -> Result<HipGpu, StageError> {
        if API.get().is_none() {
            let api = api::load().map_err(|e| StageError::Device(format!("this stage was compiled for rocm {arch}, but {e}")))?;
            let _ = API.set(api);
        }
        let h = hip();
        let mut count = 0;
        // SAFETY: HIP calls in their documented order (init, count, device, stream); every out-pointer is a live local.
        let r = unsafe {
            checked("hipInit", (h.hipInit)(0))?;
            (h.hipGetDeviceCount)(&mut count)
        };
        // HIP answers "no device" (hipErrorNoDevice) rather than a count of 0.
        if r != api::NO_DEVICE {
            checked("hipGetDeviceCount", r)?;
        }
        if r == api::NO_DEVICE || count == 0 {
            return Err(StageError::Device("this stage was compiled for rocm, but HIP reports no GPU".into()));
        }
        let ordinal = pick_ordinal(ordinal, local_rank, count)?;
        let mut name = [0 as c_char; 256];
        let (mut total, mut stream) = (0usize, std::ptr::null_mut());
        // SAFETY: as above; `name` holds the 256 bytes passed.
        unsafe {
            checked("hipSetDevice", (h.hipSetDevice)(ordinal))?;
            checked("hipDeviceGetName", (h.hipDeviceGetName)(name.as_mut_ptr(), 256, ordinal))?;
            checked("hipDeviceTotalMem", (h.hipDeviceTotalMem)(&mut total, ordinal))?;
            checked("hipStreamCreate", (h.hipStreamCreate)(&mut stream))?;
        }
        // SAFETY: hipDeviceGetName wrote a NUL-terminated name into `name`.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        hooks::install(&HipDriver, stream as usize)
            .map_err(|e| StageError::Device(format!("{e}; the stage's code object is for {arch}: is device {ordinal} ({name}) one?")))?;
        Ok(HipGpu(DeviceInfo { ordinal, name, total_bytes: total }))
    }
}

/// The hooks' HIP calls, on the device `open` made current for this
/// thread, which runs every step.
struct HipDriver;

impl Driver for HipDriver {
    fn load_module(&self, image: *const c_void) -> Result<usize, String> {
        let mut m = std::ptr::null_mut();
        // SAFETY: `image` is the stage's code object, registered by its constructors and alive for the process; `m` is a live out-pointer.
        hip().ok("loading the stage's code object (hipModuleLoadData)", unsafe { (hip().hipModuleLoadData)(&mut m, image) })?;
        Ok(m as usize)
    }

    fn function(&self, module: usize, name: &CStr) -> Result<usize, String> {
        let mut f = std::ptr::null_mut();
        // SAFETY: `module` came from `load_module`; `name` is NUL-terminated and `f` a live out-pointer.
        hip().ok(&format!("hipModuleGetFunction({})", name.to_string_lossy()), unsafe {
            (hip().hipModuleGetFunction)(&mut f, module as *mut c_void, name.as_ptr())
        })?;
        Ok(f as usize)
    }

    fn launch(&self, f: usize, grid: [u32; 3], block: [u32; 3], smem: u32, stream: usize, params: *mut *mut c_void) -> Result<(), String> {
        let [gx, gy, gz] = grid;
        let [bx, by, bz] = block;
        // SAFETY: `f` is a kernel of a loaded module and `params` points to one live pointer per argument (the hooks' contract); the launch is queued on the stage's stream.
        hip().ok("hipModuleLaunchKernel", unsafe {
            (hip().hipModuleLaunchKernel)(
                f as *mut c_void,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                smem,
                stream as *mut c_void,
                params,
                std::ptr::null_mut(),
            )
        })
    }

    fn alloc(&self, bytes: usize) -> Result<u64, String> {
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` is a live out-pointer for a new allocation.
        hip().ok("hipMalloc", unsafe { (hip().hipMalloc)(&mut p, bytes) })?;
        Ok(p as u64)
    }

    fn free(&self, ptr: u64) -> Result<(), String> {
        // SAFETY: the hooks free only what `alloc` gave and no one holds.
        hip().ok("hipFree", unsafe { (hip().hipFree)(ptr as *mut c_void) })
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<(), String> {
        // SAFETY: two device buffers of at least `bytes` bytes (the hooks' contract); the copy is ordered on the stage's stream.
        hip().ok("hipMemcpyAsync", unsafe {
            (hip().hipMemcpyAsync)(dst as *mut c_void, src as *const c_void, bytes, api::MEMCPY_DEVICE_TO_DEVICE, stream as *mut c_void)
        })
    }
}

/// New device memory of `bytes` (at least one byte), freed when dropped.
fn alloc(bytes: usize) -> Result<DeviceBuffer, StageError> {
    let p = HipDriver.alloc(bytes.max(1)).map_err(StageError::Device)?;
    Ok(DeviceBuffer::from_raw(p, bytes, free))
}

fn free(ptr: u64) {
    // Nothing to report to from a drop; HIP frees or the process ends.
    let _ = HipDriver.free(ptr);
}

fn destroy_graph(exec: usize) {
    // SAFETY: `exec` came from hipGraphInstantiateWithFlags and its Graph, its only owner, is being dropped.
    unsafe { (hip().hipGraphExecDestroy)(exec as *mut c_void) };
}

impl Gpu for HipGpu {
    fn info(&self) -> &DeviceInfo {
        &self.0
    }

    fn free_bytes(&self) -> Result<usize, StageError> {
        let (mut free, mut total) = (0, 0);
        // SAFETY: a query of this thread's device into two locals.
        unsafe { checked("hipMemGetInfo", (hip().hipMemGetInfo)(&mut free, &mut total))? };
        Ok(free)
    }

    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer, StageError> {
        let buf = alloc(bytes.len())?;
        if !bytes.is_empty() {
            // SAFETY: `buf` holds at least `bytes.len()` bytes, filled from a live slice of that length.
            unsafe {
                checked("hipMemcpyHtoD", (hip().hipMemcpyHtoD)(buf.ptr() as *mut c_void, bytes.as_ptr() as *const c_void, bytes.len()))?
            };
        }
        Ok(buf)
    }

    fn zeros(&self, bytes: usize) -> Result<DeviceBuffer, StageError> {
        let buf = alloc(bytes)?;
        // SAFETY: the memset writes the `bytes.max(1)` bytes `buf` holds.
        unsafe { checked("hipMemsetD8", (hip().hipMemsetD8)(buf.ptr() as *mut c_void, 0, bytes.max(1)))? };
        Ok(buf)
    }

    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), StageError> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is a live, writable slice of `dst.len()` bytes; the caller passes a device buffer of at least that size.
        unsafe { checked("hipMemcpyDtoH", (hip().hipMemcpyDtoH)(dst.as_mut_ptr() as *mut c_void, src as *mut c_void, dst.len())) }
    }

    fn copy_in(&self, dst: u64, src: &[u8]) -> Result<(), StageError> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` is a live slice of `src.len()` bytes; the caller passes a device buffer of at least that size.
        unsafe { checked("hipMemcpyHtoD", (hip().hipMemcpyHtoD)(dst as *mut c_void, src.as_ptr() as *const c_void, src.len())) }
    }

    fn sync(&self) -> Result<(), StageError> {
        // SAFETY: the stream was created in `open`.
        unsafe { checked("hipStreamSynchronize", (hip().hipStreamSynchronize)(hooks::stream() as *mut c_void)) }
    }

    /// Runs `f` (the generated step) with the stream capturing, in relaxed
    /// mode as on CUDA (a scratch pool miss may still allocate), and
    /// returns the instantiated HIP graph.
    fn capture(&self, f: &mut dyn FnMut()) -> Result<Graph, StageError> {
        let s = hooks::stream() as *mut c_void;
        // SAFETY: `s` is this process's stream, idle between steps' launches.
        unsafe { checked("hipStreamBeginCapture", (hip().hipStreamBeginCapture)(s, api::CAPTURE_MODE_RELAXED))? };
        f();
        let mut g = std::ptr::null_mut();
        // SAFETY: ends the capture begun above; `g` receives the graph.
        unsafe { checked("hipStreamEndCapture", (hip().hipStreamEndCapture)(s, &mut g))? };
        let mut exec = std::ptr::null_mut();
        // SAFETY: `g` is a valid graph; the exec keeps its own copy of it, so `g` is destroyed right after.
        let r = unsafe { (hip().hipGraphInstantiateWithFlags)(&mut exec, g, 0) };
        // SAFETY: `g` is no longer used.
        unsafe { (hip().hipGraphDestroy)(g) };
        checked("hipGraphInstantiateWithFlags", r)?;
        Ok(Graph::from_raw(exec as usize, destroy_graph))
    }

    fn replay(&self, g: &Graph) -> Result<(), StageError> {
        // SAFETY: a live exec graph, launched on this process's stream.
        unsafe { checked("hipGraphLaunch", (hip().hipGraphLaunch)(g.handle() as *mut c_void, hooks::stream() as *mut c_void)) }
    }

    fn enable_gemm(&self, _min_rows: usize) -> Result<(), StageError> {
        Err(StageError::Device("rocm stages have no GEMM library yet (hipBLASLt is planned)".into()))
    }

    fn set_prefill(&self, _prefill: bool) {}

    fn collectives(&self) -> &'static peer::Collectives {
        &peer::RCCL
    }
}
