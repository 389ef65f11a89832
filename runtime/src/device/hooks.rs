//! The C ABIs generated code calls, for every vendor: MLIR's `mgpu*`
//! functions (module load, function lookup, launch, streams), which
//! `gpu.launch_func` lowers to for CUDA and ROCm alike, and m3c's
//! `m3c_buf_alloc/free/copy` scratch hooks. Each forwards to the [`Driver`]
//! of the GPU this stage opened; before one is installed (a host stage) the
//! scratch hooks hand out host memory.
//!
//! Every launch goes to this process's one stream, in order; the runtime
//! synchronises once per step. Scratch buffers come from a size-keyed pool,
//! so a decode step allocates nothing after the first. The pool gives
//! memory back only when asked between steps ([`trim_pool`]), so addresses
//! baked into a captured [`Graph`](super::Graph) stay valid; every step runs
//! on the one stream, so a graph replay and any other step never use a
//! scratch buffer at once.
//!
//! Device images are registered by static constructors before `main`
//! (MLIR emits one per stage binary) and loaded only when a GPU is open.
//! Callbacks from generated code cannot return errors: they end the process
//! through [`die`] with the driver's message.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Mutex, OnceLock};

/// What the hooks need of a vendor's runtime. Errors are the vendor's
/// message, prefixed with the call that failed.
pub(crate) trait Driver: Send + Sync {
    /// Loads a registered device image (PTX, cubin or AMDGPU code object).
    fn load_module(&self, image: *const c_void) -> Result<usize, String>;
    /// The kernel `name` of a loaded module.
    fn function(&self, module: usize, name: &CStr) -> Result<usize, String>;
    /// Queues a launch of `f` on `stream`. `params` points to one pointer
    /// per kernel argument, live for the call.
    fn launch(&self, f: usize, grid: [u32; 3], block: [u32; 3], smem: u32, stream: usize, params: *mut *mut c_void) -> Result<(), String>;
    /// New device memory of `bytes`.
    fn alloc(&self, bytes: usize) -> Result<u64, String>;
    /// Frees memory from [`Driver::alloc`].
    fn free(&self, ptr: u64) -> Result<(), String>;
    /// Queues a device-to-device copy on `stream`.
    fn copy(&self, dst: u64, src: u64, bytes: usize, stream: usize) -> Result<(), String>;
}

/// The open GPU's driver; unset on a host stage.
static DRIVER: OnceLock<&'static dyn Driver> = OnceLock::new();

fn driver() -> Option<&'static dyn Driver> {
    DRIVER.get().copied()
}

/// Ends the process with `message` and exit code 1: how callbacks from
/// generated code report failure (unwinding across that boundary is not allowed).
pub(crate) fn die(message: &str) -> ! {
    let line = format!("m3c stage: {message}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    std::process::exit(1)
}

struct State {
    /// Device images registered by the binaries' constructors (addresses).
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

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Makes `driver` the hooks' device, with `stream` as the one stream, and
/// loads every registered image. Called once, by the GPU's `open`.
pub(crate) fn install(driver: &'static dyn Driver, stream: usize) -> Result<(), String> {
    DRIVER.set(driver).map_err(|_| "a GPU is already open in this process (runtime bug)".to_string())?;
    let mut st = state();
    st.stream = stream;
    for i in 0..st.images.len() {
        let image = st.images[i] as *const c_void;
        st.modules[i] = Some(driver.load_module(image)?);
    }
    Ok(())
}

/// The one stream (0 before a GPU is open).
pub(crate) fn stream() -> usize {
    state().stream
}

/// Scratch bytes held now and at most.
pub(crate) fn scratch_bytes() -> (u64, u64) {
    let st = state();
    (st.live_bytes, st.peak_bytes)
}

/// MLIR ABI: registers a device image (called by a static constructor,
/// before `main`; loading waits for [`install`]).
#[no_mangle]
/// # Safety
/// `data` must be a device image registered by the stage's constructors.
pub unsafe extern "C" fn mgpuModuleLoadJIT(data: *mut c_void, _opt_level: c_int) -> *mut c_void {
    let mut st = state();
    st.images.push(data as usize);
    st.modules.push(None);
    st.images.len() as *mut c_void
}

#[no_mangle]
/// # Safety
/// `data` must be a device image registered by the stage's constructors.
pub unsafe extern "C" fn mgpuModuleLoad(data: *mut c_void, _size: usize) -> *mut c_void {
    // SAFETY: the same contract as mgpuModuleLoadJIT's.
    unsafe { mgpuModuleLoadJIT(data, 0) }
}

/// MLIR ABI: modules live as long as the process.
#[no_mangle]
pub extern "C" fn mgpuModuleUnload(_module: *mut c_void) {}

#[no_mangle]
/// # Safety
/// `module` must come from `mgpuModuleLoad`, `name` must be NUL-terminated.
pub unsafe extern "C" fn mgpuModuleGetFunction(module: *mut c_void, name: *const c_char) -> *mut c_void {
    let idx = (module as usize).wrapping_sub(1);
    // SAFETY: MLIR passes a NUL-terminated kernel name.
    let cname = unsafe { CStr::from_ptr(name) };
    let name = cname.to_string_lossy().into_owned();
    let mut st = state();
    if let Some(&f) = st.functions.get(&(idx, name.clone())) {
        return f as *mut c_void;
    }
    let (Some(d), Some(Some(m))) = (driver(), st.modules.get(idx).copied()) else {
        die("a kernel was launched before the GPU was opened (runtime bug)")
    };
    let f = d.function(m, cname).unwrap_or_else(|e| die(&e));
    st.functions.insert((idx, name), f);
    f as *mut c_void
}

/// MLIR ABI: every "new" stream is this process's one stream.
#[no_mangle]
pub extern "C" fn mgpuStreamCreate() -> *mut c_void {
    state().stream as *mut c_void
}

/// MLIR ABI: launches stay queued in order; the step synchronises once.
#[no_mangle]
pub extern "C" fn mgpuStreamSynchronize(_stream: *mut c_void) {}

#[no_mangle]
pub extern "C" fn mgpuStreamDestroy(_stream: *mut c_void) {}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
/// # Safety
/// `function` must come from `mgpuModuleGetFunction` and `params` must point
/// to one live pointer per kernel argument, as MLIR's launch lowering passes.
pub unsafe extern "C" fn mgpuLaunchKernel(
    function: *mut c_void,
    grid_x: isize,
    grid_y: isize,
    grid_z: isize,
    block_x: isize,
    block_y: isize,
    block_z: isize,
    smem: i32,
    stream: *mut c_void,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
    _param_count: usize,
) {
    if grid_x == 0 || grid_y == 0 || grid_z == 0 {
        return; // an empty step (no rows)
    }
    let Some(d) = driver() else { die("a kernel was launched before the GPU was opened (runtime bug)") };
    let (grid, block) = ([grid_x as u32, grid_y as u32, grid_z as u32], [block_x as u32, block_y as u32, block_z as u32]);
    d.launch(function as usize, grid, block, smem as u32, stream as usize, params).unwrap_or_else(|e| die(&e));
}

extern "C" {
    fn malloc(n: usize) -> *mut c_void;
    fn free(p: *mut c_void);
}

/// Scratch memory for generated code: host memory on the host, a pooled
/// device buffer on a GPU.
#[no_mangle]
pub extern "C" fn m3c_buf_alloc(bytes: i64) -> *mut c_void {
    let Some(d) = driver() else {
        // SAFETY: plain malloc; the generated code frees it with m3c_buf_free.
        let p = unsafe { malloc(bytes.max(1) as usize) };
        if p.is_null() {
            // The generated code cannot take an error: end the stage with
            // a message rather than write through a null pointer.
            die(&format!("out of host memory: {bytes} bytes of scratch (a long prompt or many image patches in one step)"));
        }
        return p;
    };
    let bytes = bytes.max(1) as u64;
    let mut st = state();
    let p = match st.pool.get_mut(&bytes).and_then(|v| v.pop()) {
        Some(p) => p,
        None => {
            let p = d.alloc(bytes as usize).unwrap_or_else(|e| die(&format!("{e} (scratch of {bytes} bytes)")));
            st.sizes.insert(p, bytes);
            p
        }
    };
    st.live_bytes += bytes;
    st.peak_bytes = st.peak_bytes.max(st.live_bytes);
    p as *mut c_void
}

/// Frees the pooled buffers no one holds (after a synchronised step whose
/// scratch sizes will not recur, such as an image encode sized by its
/// patches). Buffers in use stay.
pub(crate) fn trim_pool() {
    let Some(d) = driver() else { return };
    let mut st = state();
    let idle: Vec<u64> = std::mem::take(&mut st.pool).into_values().flatten().collect();
    for p in idle {
        st.sizes.remove(&p);
        d.free(p).unwrap_or_else(|e| die(&format!("{e} (scratch)")));
    }
}

/// Returns a scratch buffer to the pool; launches already queued on the one
/// stream that use it run before any later launch that reuses it.
#[no_mangle]
/// # Safety
/// `ptr` must come from [`m3c_buf_alloc`] and not be used afterwards.
pub unsafe extern "C" fn m3c_buf_free(ptr: *mut c_void) {
    if driver().is_none() {
        // SAFETY: `ptr` came from m3c_buf_alloc's malloc.
        return unsafe { free(ptr) };
    }
    let mut st = state();
    let p = ptr as u64;
    let size = st.sizes.get(&p).copied().unwrap_or(0);
    st.live_bytes = st.live_bytes.saturating_sub(size);
    st.pool.entry(size).or_default().push(p);
}

#[no_mangle]
/// # Safety
/// `dst` and `src` must be buffers of this process's memory kind (host, or
/// device on a GPU stage) of at least `bytes` bytes each.
pub unsafe extern "C" fn m3c_buf_copy(dst: *mut c_void, src: *mut c_void, bytes: i64) {
    let Some(d) = driver() else {
        // SAFETY: the generated code copies between two buffers of `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes as usize) };
        return;
    };
    let s = state().stream;
    d.copy(dst as u64, src as u64, bytes as usize, s).unwrap_or_else(|e| die(&e));
}

/// A scratch buffer of the pool that goes back to it when dropped (the
/// step I/O buffers of a GPU stage, and those a captured graph keeps).
pub struct ScratchBuffer {
    ptr: u64,
}

impl ScratchBuffer {
    pub fn new(bytes: usize) -> ScratchBuffer {
        ScratchBuffer { ptr: m3c_buf_alloc(bytes as i64) as u64 }
    }

    /// The buffer's address (device memory on a GPU stage).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for ScratchBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from m3c_buf_alloc and this is its only owner.
        unsafe { m3c_buf_free(self.ptr as *mut c_void) };
    }
}
