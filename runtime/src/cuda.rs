//! The device layer of stages compiled with `--target cuda`, on the CUDA
//! driver API through cudarc (loaded at run time, so a stage started on a
//! machine without a driver says so and exits).
//!
//! Generated host code reaches the GPU through two small ABIs:
//! - MLIR's `mgpu*` functions (module load, function lookup, launch,
//!   streams), which `gpu.launch_func` lowers to. Every launch goes to this
//!   process's one stream, in order; the runtime synchronises once per step.
//! - `m3c_buf_alloc/free/copy`, for scratch buffers: a size-keyed pool, so
//!   a decode step allocates nothing after the first. The pool never gives
//!   memory back to the driver, so addresses baked into a captured
//!   [`Graph`] stay valid; every step runs on the one stream, so a graph
//!   replay and any other step never use a scratch buffer at once.
//!
//! Modules are registered by static constructors before `main` (MLIR emits
//! one per stage binary) and loaded only when [`Device::open`] has a context.

use cudarc::driver::sys as cu;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Whether `m3c_buf_*` hand out device memory (a CUDA stage) or host memory.
static ON_DEVICE: AtomicBool = AtomicBool::new(false);

extern "C" {
    fn malloc(n: usize) -> *mut c_void;
    fn free(p: *mut c_void);
}

/// Ends the process with `message` and exit code 1: how callbacks from
/// generated code report failure (unwinding across that boundary is not allowed).
fn die(message: &str) -> ! {
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

fn check(what: &str, r: cu::CUresult) {
    if r != cu::CUresult::CUDA_SUCCESS {
        fail(what, r)
    }
}

fn checked(what: &str, r: cu::CUresult) -> Result<(), String> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString writes a pointer to a static string, or leaves null.
        unsafe { cu::cuGetErrorString(r, &mut p) };
        let msg = if p.is_null() { format!("{r:?}") } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() };
        Err(format!("{what}: {msg}"))
    }
}

struct State {
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

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The GPU this rank runs on.
pub struct Device {
    pub ordinal: i32,
    pub name: String,
    pub total_bytes: usize,
}

impl Device {
    /// Initialises the driver, makes `ordinal`'s primary context current,
    /// creates the stream and loads the registered modules.
    pub fn open(ordinal: Option<i32>, local_rank: i32) -> Result<Device, String> {
        // SAFETY: probing for the library has no preconditions.
        if !unsafe { cu::is_culib_present() } {
            return Err("this stage was compiled for CUDA, but the NVIDIA driver (libcuda.so) is not on this machine; \
                        run it on a GPU machine, or compile with --target host"
                .into());
        }
        // SAFETY: driver calls in their documented order (init, device, primary context, stream); every out-pointer is a live local, and the images were registered by the stage's static constructors and stay alive for the process.
        unsafe {
            checked("cuInit", cu::cuInit(0))?;
            let mut count = 0;
            checked("cuDeviceGetCount", cu::cuDeviceGetCount(&mut count))?;
            if count == 0 {
                return Err("this stage was compiled for CUDA, but the driver reports no GPU".into());
            }
            let ordinal = ordinal.unwrap_or(local_rank % count);
            if ordinal >= count {
                return Err(format!("the plan puts this stage on device {ordinal}, but this machine has {count} GPU(s)"));
            }
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
            let mut st = state();
            st.stream = stream as usize;
            ON_DEVICE.store(true, Ordering::SeqCst);
            for i in 0..st.images.len() {
                let mut m = std::ptr::null_mut();
                checked(
                    "loading the stage's device code (cuModuleLoadData; a cubin for the compiled arch, or PTX)",
                    cu::cuModuleLoadData(&mut m, st.images[i] as *const c_void),
                )?;
                st.modules[i] = Some(m as usize);
            }
            Ok(Device { ordinal, name: CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned(), total_bytes: total })
        }
    }

    /// Copies `bytes` from the host into new device memory.
    pub fn upload(&self, bytes: &[u8]) -> Result<u64, String> {
        let mut d = 0;
        // SAFETY: `d` receives a new allocation of at least `bytes.len()` bytes, which the copy fills from a live slice of that length.
        unsafe {
            checked("cuMemAlloc", cu::cuMemAlloc_v2(&mut d, bytes.len().max(1)))?;
            if !bytes.is_empty() {
                checked("cuMemcpyHtoD", cu::cuMemcpyHtoD_v2(d, bytes.as_ptr() as *const c_void, bytes.len()))?;
            }
        }
        Ok(d)
    }

    /// Zeroed device memory of `bytes`.
    pub fn zeros(&self, bytes: usize) -> Result<u64, String> {
        let mut d = 0;
        // SAFETY: `d` receives a new allocation of `bytes.max(1)` bytes, all of which the memset writes.
        unsafe {
            checked("cuMemAlloc", cu::cuMemAlloc_v2(&mut d, bytes.max(1)))?;
            checked("cuMemsetD8", cu::cuMemsetD8_v2(d, 0, bytes.max(1)))?;
        }
        Ok(d)
    }

    pub fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is a live, writable slice of `dst.len()` bytes; the caller passes a device buffer of at least that size.
        unsafe { checked("cuMemcpyDtoH", cu::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len())) }
    }

    pub fn copy_in(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` is a live slice of `src.len()` bytes; the caller passes a device buffer of at least that size.
        unsafe { checked("cuMemcpyHtoD", cu::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len())) }
    }

    /// Waits for every launch of the step.
    pub fn sync(&self) -> Result<(), String> {
        let s = state().stream;
        // SAFETY: `s` is this process's stream, created in `Device::open`.
        unsafe { checked("cuStreamSynchronize", cu::cuStreamSynchronize(s as cu::CUstream)) }
    }

    /// Device bytes held by the scratch pool now and at most.
    pub fn scratch_bytes(&self) -> (u64, u64) {
        let st = state();
        (st.live_bytes, st.peak_bytes)
    }
}

/// A step captured from the stream as a CUDA graph: replaying it is one
/// launch instead of one per kernel.
pub struct Graph {
    exec: usize,
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: `exec` came from cuGraphInstantiateWithFlags and is destroyed once.
        unsafe { cu::cuGraphExecDestroy(self.exec as cu::CUgraphExec) };
    }
}

impl Device {
    /// Runs `f` (the generated step) with the stream capturing: its launches
    /// and copies are recorded, not run. Relaxed mode, so a scratch pool miss
    /// may still allocate. Returns the instantiated graph.
    pub fn capture(&self, f: impl FnOnce()) -> Result<Graph, String> {
        let s = state().stream as cu::CUstream;
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
        Ok(Graph { exec: exec as usize })
    }

    /// Queues a captured step on the stream.
    pub fn replay(&self, g: &Graph) -> Result<(), String> {
        let s = state().stream as cu::CUstream;
        // SAFETY: a live exec graph on this context's stream.
        unsafe { checked("cuGraphLaunch", cu::cuGraphLaunch(g.exec as cu::CUgraphExec, s)) }
    }
}

/// Scratch memory for generated code: host memory on the host, a pooled
/// device buffer on a GPU.
#[no_mangle]
pub extern "C" fn m3c_buf_alloc(bytes: i64) -> *mut c_void {
    if !ON_DEVICE.load(Ordering::Relaxed) {
        // SAFETY: plain malloc; the generated code frees it with m3c_buf_free.
        return unsafe { malloc(bytes.max(1) as usize) };
    }
    let bytes = bytes.max(1) as u64;
    let mut st = state();
    let d = match st.pool.get_mut(&bytes).and_then(|v| v.pop()) {
        Some(d) => d,
        None => {
            let mut d = 0;
            // SAFETY: `d` is a live out-pointer; the pool records the allocation and never frees it.
            check("cuMemAlloc (scratch)", unsafe { cu::cuMemAlloc_v2(&mut d, bytes as usize) });
            st.sizes.insert(d, bytes);
            d
        }
    };
    st.live_bytes += bytes;
    st.peak_bytes = st.peak_bytes.max(st.live_bytes);
    d as *mut c_void
}

/// Returns a scratch buffer to the pool; launches already queued on the one
/// stream that use it run before any later launch that reuses it.
#[no_mangle]
/// # Safety
/// `ptr` must come from [`m3c_buf_alloc`] and not be used afterwards.
pub unsafe extern "C" fn m3c_buf_free(ptr: *mut c_void) {
    if !ON_DEVICE.load(Ordering::Relaxed) {
        // SAFETY: `ptr` came from m3c_buf_alloc's malloc.
        return unsafe { free(ptr) };
    }
    let mut st = state();
    let d = ptr as u64;
    let size = st.sizes.get(&d).copied().unwrap_or(0);
    st.live_bytes = st.live_bytes.saturating_sub(size);
    st.pool.entry(size).or_default().push(d);
}

#[no_mangle]
/// # Safety
/// `dst` and `src` must be buffers of this process's memory kind (host, or
/// device on a GPU stage) of at least `bytes` bytes each.
pub unsafe extern "C" fn m3c_buf_copy(dst: *mut c_void, src: *mut c_void, bytes: i64) {
    if !ON_DEVICE.load(Ordering::Relaxed) {
        // SAFETY: the generated code copies between two buffers of `bytes`.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes as usize) };
        return;
    }
    let s = state().stream;
    // SAFETY: the generated code passes two device buffers of at least `bytes` bytes; the copy is ordered on the stage's stream.
    check("cuMemcpyAsync", unsafe { cu::cuMemcpyAsync(dst as u64, src as u64, bytes as usize, s as cu::CUstream) });
}

/// MLIR ABI: registers a PTX image (called by a static constructor, before
/// `main`; loading waits for [`Device::open`]).
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
    mgpuModuleLoadJIT(data, 0)
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
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    let mut st = state();
    if let Some(&f) = st.functions.get(&(idx, name.clone())) {
        return f as *mut c_void;
    }
    let Some(Some(m)) = st.modules.get(idx).copied() else { die("a kernel was launched before the GPU was opened (runtime bug)") };
    let cname = std::ffi::CString::new(name.clone()).unwrap_or_default();
    let mut f = std::ptr::null_mut();
    // SAFETY: `m` is a module loaded in `Device::open`; `cname` is a NUL-terminated copy of the kernel name and `f` a live out-pointer.
    check(&format!("cuModuleGetFunction({name})"), unsafe { cu::cuModuleGetFunction(&mut f, m as cu::CUmodule, cname.as_ptr()) });
    st.functions.insert((idx, name), f as usize);
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
    extra: *mut *mut c_void,
    _param_count: usize,
) {
    if grid_x == 0 || grid_y == 0 || grid_z == 0 {
        return; // an empty step (no rows)
    }
    // SAFETY: MLIR's launch lowering passes a function from mgpuModuleGetFunction and an array of pointers to each kernel argument, live for the call; the launch is queued on the stage's stream.
    check("cuLaunchKernel", unsafe {
        cu::cuLaunchKernel(
            function as cu::CUfunction,
            grid_x as u32,
            grid_y as u32,
            grid_z as u32,
            block_x as u32,
            block_y as u32,
            block_z as u32,
            smem as u32,
            stream as cu::CUstream,
            params,
            extra,
        )
    });
}

/// NCCL between GPU stages: activations go device to device on the stage's
/// stream; the small step headers and the returned ids stay on MPI. Set up
/// only when every rank is a CUDA stage on its own GPU (NCCL refuses two
/// ranks on one device) and NCCL loads; otherwise activations go through
/// host memory and MPI.
///
/// NCCL is loaded here by its real file names (`libnccl.so.2`, which the
/// libnccl2 package and the nvidia-nccl wheels install, then `libnccl.so`,
/// or `$M3C_NCCL_LIB`): a generic loader that looks only for `libnccl.so`
/// would miss it on most machines and fall back to host copies silently.
pub mod nccl {
    use std::ffi::{c_char, c_int, c_void, CStr};
    use std::sync::OnceLock;

    #[repr(C)]
    #[derive(Clone, Copy)]
    struct UniqueId {
        internal: [c_char; 128],
    }

    /// `ncclFloat32` of `ncclDataType_t`.
    const FLOAT32: c_int = 7;

    type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
    type CommInitRank = unsafe extern "C" fn(*mut *mut c_void, c_int, UniqueId, c_int) -> c_int;
    type SendFn = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, *mut c_void, *mut c_void) -> c_int;
    type RecvFn = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, *mut c_void, *mut c_void) -> c_int;
    type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

    struct Api {
        _lib: libloading::Library,
        get_unique_id: GetUniqueId,
        comm_init_rank: CommInitRank,
        send: SendFn,
        recv: RecvFn,
        error_string: ErrorString,
    }

    /// The library names tried, in order.
    fn candidates() -> Vec<String> {
        let mut v: Vec<String> = std::env::var("M3C_NCCL_LIB").ok().into_iter().collect();
        v.extend(["libnccl.so.2".to_string(), "libnccl.so".to_string()]);
        v
    }

    fn load() -> Result<Api, String> {
        let mut errors = Vec::new();
        for name in candidates() {
            // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
            match unsafe { libloading::Library::new(&name) } {
                Ok(lib) => {
                    // SAFETY: the symbols have these C signatures in every NCCL 2.x (nccl.h).
                    unsafe {
                        let sym = |n: &str| format!("{name}: no symbol {n}");
                        let api = Api {
                            get_unique_id: *lib.get::<GetUniqueId>(b"ncclGetUniqueId\0").map_err(|_| sym("ncclGetUniqueId"))?,
                            comm_init_rank: *lib.get::<CommInitRank>(b"ncclCommInitRank\0").map_err(|_| sym("ncclCommInitRank"))?,
                            send: *lib.get::<SendFn>(b"ncclSend\0").map_err(|_| sym("ncclSend"))?,
                            recv: *lib.get::<RecvFn>(b"ncclRecv\0").map_err(|_| sym("ncclRecv"))?,
                            error_string: *lib.get::<ErrorString>(b"ncclGetErrorString\0").map_err(|_| sym("ncclGetErrorString"))?,
                            _lib: lib,
                        };
                        return Ok(api);
                    }
                }
                Err(e) => errors.push(format!("{name} ({e})")),
            }
        }
        Err(format!("NCCL not found: tried {}; set M3C_NCCL_LIB to its path", errors.join(", ")))
    }

    fn api() -> Result<&'static Api, String> {
        static API: OnceLock<Result<Api, String>> = OnceLock::new();
        API.get_or_init(load).as_ref().map_err(|e| e.clone())
    }

    /// Whether NCCL loads here, and if not, why.
    pub fn availability() -> Result<(), String> {
        api().map(|_| ())
    }

    fn check(what: &str, r: c_int) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        let msg = api()
            .ok()
            // SAFETY: ncclGetErrorString returns a static string.
            .map(|a| unsafe { CStr::from_ptr((a.error_string)(r)) }.to_string_lossy().into_owned())
            .unwrap_or_default();
        Err(format!("NCCL {what}: error {r} ({msg})"))
    }

    pub struct Link {
        comm: usize,
        stream: usize,
    }

    /// A fresh unique id (rank 0 makes it; the others receive it over MPI).
    pub fn unique_id() -> Result<[u8; 128], String> {
        let a = api()?;
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes the id struct.
        check("ncclGetUniqueId", unsafe { (a.get_unique_id)(&mut id) })?;
        Ok(id.internal.map(|c| c as u8))
    }

    impl Link {
        /// Joins the communicator of all `ranks` (collective: every rank calls it).
        pub fn join(id: [u8; 128], ranks: i32, rank: i32) -> Result<Link, String> {
            let a = api()?;
            let id = UniqueId { internal: id.map(|b| b as c_char) };
            let mut comm = std::ptr::null_mut();
            // SAFETY: the device context is current (Device::open ran first).
            check("ncclCommInitRank", unsafe { (a.comm_init_rank)(&mut comm, ranks, id, rank) })?;
            Ok(Link { comm: comm as usize, stream: super::state().stream })
        }

        /// Queues sending `count` f32 at device address `buf` to `peer`.
        pub fn send(&self, buf: u64, count: usize, peer: usize) -> Result<(), String> {
            let a = api()?;
            // SAFETY: `buf` holds `count` f32 of device memory, live until the stream passes this point.
            check("ncclSend", unsafe {
                (a.send)(buf as *const c_void, count, FLOAT32, peer as c_int, self.comm as *mut c_void, self.stream as *mut c_void)
            })
        }

        /// Queues receiving `count` f32 into device address `buf` from `peer`.
        pub fn recv(&self, buf: u64, count: usize, peer: usize) -> Result<(), String> {
            let a = api()?;
            // SAFETY: as for `send`.
            check("ncclRecv", unsafe {
                (a.recv)(buf as *mut c_void, count, FLOAT32, peer as c_int, self.comm as *mut c_void, self.stream as *mut c_void)
            })
        }
    }
}

/// Tensor-core GEMMs for prefill through cuBLAS (`--prefill-gemm cublas`):
/// a linear with bf16 or MXFP8 weights (the latter decoded to bf16 for the
/// call) in a prefill step with at least `min_rows` rows runs as
/// `cublasGemmEx` (bf16 inputs, f32 accumulation, output as the activations
/// are stored) instead of m3c's GEMV kernel; the generated entry asks [`m3c_gemm_wanted`] per call.
/// Decode steps always use the GEMV (memory-bound: it reads each weight byte
/// once), which also keeps cuBLAS out of captured CUDA graphs. cuBLAS is
/// loaded by its file names (`$M3C_CUBLAS_LIB`, `libcublas.so.13`, `.so.12`,
/// `libcublas.so`).
pub mod cublas {
    use std::ffi::{c_int, c_void};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::OnceLock;

    type Create = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
    type SetStream = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
    #[allow(clippy::type_complexity)]
    type GemmEx = unsafe extern "C" fn(
        *mut c_void,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        *const c_void,
        *const c_void,
        c_int,
        c_int,
        *const c_void,
        c_int,
        c_int,
        *const c_void,
        *mut c_void,
        c_int,
        c_int,
        c_int,
        c_int,
    ) -> c_int;

    // cublas_api.h / library_types.h values.
    const OP_N: c_int = 0;
    const OP_T: c_int = 1;
    const R_32F: c_int = 0;
    const R_16BF: c_int = 14;
    const COMPUTE_32F: c_int = 68;
    const GEMM_DEFAULT: c_int = -1;

    struct Api {
        _lib: libloading::Library,
        gemm: GemmEx,
        handle: usize,
    }

    static API: OnceLock<Api> = OnceLock::new();
    /// Rows from which a prefill linear goes to cuBLAS; `usize::MAX`: never.
    static MIN_ROWS: AtomicUsize = AtomicUsize::new(usize::MAX);
    /// Whether the step running now is a prefill step (set by the stage).
    static PREFILL: AtomicBool = AtomicBool::new(false);

    fn candidates() -> Vec<String> {
        let mut v: Vec<String> = std::env::var("M3C_CUBLAS_LIB").ok().into_iter().collect();
        v.extend(["libcublas.so.13", "libcublas.so.12", "libcublas.so"].map(String::from));
        v
    }

    /// Loads cuBLAS and makes its handle on this process's stream; from then
    /// on prefill linears of at least `min_rows` rows use it.
    pub fn enable(min_rows: usize) -> Result<(), String> {
        if API.get().is_none() {
            let mut errors = Vec::new();
            let mut found = None;
            for name in candidates() {
                // SAFETY: loading cuBLAS runs its initialisers, which have no preconditions.
                match unsafe { libloading::Library::new(&name) } {
                    Ok(lib) => {
                        found = Some((name, lib));
                        break;
                    }
                    Err(e) => errors.push(format!("{name} ({e})")),
                }
            }
            let (name, lib) =
                found.ok_or_else(|| format!("cuBLAS not found: tried {}; set M3C_CUBLAS_LIB to its path", errors.join(", ")))?;
            // SAFETY: these symbols have these C signatures in cuBLAS 12 and 13 (cublas_api.h).
            let api = unsafe {
                let create = *lib.get::<Create>(b"cublasCreate_v2\0").map_err(|_| format!("{name}: no cublasCreate_v2"))?;
                let set_stream = *lib.get::<SetStream>(b"cublasSetStream_v2\0").map_err(|_| format!("{name}: no cublasSetStream_v2"))?;
                let gemm = *lib.get::<GemmEx>(b"cublasGemmEx\0").map_err(|_| format!("{name}: no cublasGemmEx"))?;
                let mut h = std::ptr::null_mut();
                let r = create(&mut h);
                if r != 0 {
                    return Err(format!("{name}: cublasCreate failed (status {r})"));
                }
                let r = set_stream(h, super::state().stream as *mut c_void);
                if r != 0 {
                    return Err(format!("{name}: cublasSetStream failed (status {r})"));
                }
                Api { _lib: lib, gemm, handle: h as usize }
            };
            let _ = API.set(api);
        }
        MIN_ROWS.store(min_rows.max(1), Ordering::SeqCst);
        Ok(())
    }

    /// Marks the step about to run as prefill (or decode).
    pub fn set_prefill(prefill: bool) {
        PREFILL.store(prefill, Ordering::SeqCst);
    }

    /// Generated code: whether this linear (of `rows` rows) runs on cuBLAS.
    #[no_mangle]
    pub extern "C" fn m3c_gemm_wanted(rows: i64) -> i32 {
        (PREFILL.load(Ordering::Relaxed) && API.get().is_some() && rows as usize >= MIN_ROWS.load(Ordering::Relaxed)) as i32
    }

    /// Generated code: `y[rows, out] = xb[rows, inp] · w[out, inp]ᵀ` with bf16
    /// `xb` and `w` (row-major), f32 accumulation, and `y` f32 or (`y_bf16`
    /// ≠ 0) rounded to bf16, queued on the stage's stream.
    /// In cuBLAS's column-major terms: `yᵀ (out × rows) = op_T(w) · xb`.
    #[no_mangle]
    /// # Safety
    /// The pointers must be device buffers of `rows × inp`, `out × inp` and
    /// `rows × out` elements as the generated entry passes them.
    pub unsafe extern "C" fn m3c_gemm_bf16(
        xb: *const c_void,
        w: *const c_void,
        y: *mut c_void,
        rows: i64,
        inp: i64,
        out: i64,
        y_bf16: i32,
    ) {
        let Some(api) = API.get() else { super::die("m3c_gemm_bf16 called with cuBLAS not loaded (runtime bug)") };
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the generated entry passes device buffers of these shapes.
        let r = unsafe {
            (api.gemm)(
                api.handle as *mut c_void,
                OP_T,
                OP_N,
                out as c_int,
                rows as c_int,
                inp as c_int,
                &alpha as *const f32 as *const c_void,
                w,
                R_16BF,
                inp as c_int,
                xb,
                R_16BF,
                inp as c_int,
                &beta as *const f32 as *const c_void,
                y,
                if y_bf16 != 0 { R_16BF } else { R_32F },
                out as c_int,
                COMPUTE_32F,
                GEMM_DEFAULT,
            )
        };
        if r != 0 {
            super::die(&format!("cublasGemmEx failed (status {r}) for {rows}×{inp} · {out}×{inp}ᵀ"));
        }
    }
}
