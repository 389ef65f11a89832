//! MLIR's `mgpu*` ABI, which `gpu.launch_func` lowers to: module load,
//! function lookup and launches, all on this process's one stream.

use super::{check, cu, die, state};
use std::ffi::{c_char, c_int, c_void, CStr};

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
