//! Tensor-core GEMMs for prefill through cuBLAS (`--prefill-gemm cublas`):
//! a linear with bf16 or MXFP8 weights (the latter decoded to bf16 for the
//! call) in a prefill step with at least `min_rows` rows runs as
//! `cublasGemmEx` (bf16 inputs, f32 accumulation, output as the activations
//! are stored) instead of m3c's GEMV kernel; the generated entry asks [`m3c_gemm_wanted`] per call.
//! Decode steps always use the GEMV (memory-bound: it reads each weight byte
//! once), which also keeps cuBLAS out of captured CUDA graphs. cuBLAS is
//! loaded by its file names (`$M3C_CUBLAS_LIB`, `libcublas.so.13`, `.so.12`,
//! `libcublas.so`).

use crate::error::StageError;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

type Create = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type SetStream = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
/// `cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, computeType, algo)`.
#[rustfmt::skip]
#[allow(clippy::type_complexity)]
type GemmEx = unsafe extern "C" fn(*mut c_void, c_int, c_int, c_int, c_int, c_int, *const c_void, *const c_void, c_int, c_int, *const c_void, c_int, c_int, *const c_void, *mut c_void, c_int, c_int, c_int, c_int) -> c_int;

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
pub fn enable(min_rows: usize) -> Result<(), StageError> {
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
        let (name, lib) = found
            .ok_or_else(|| StageError::Device(format!("cuBLAS not found: tried {}; set M3C_CUBLAS_LIB to its path", errors.join(", "))))?;
        // SAFETY: these symbols have these C signatures in cuBLAS 12 and 13 (cublas_api.h).
        let api = unsafe {
            let create = *lib.get::<Create>(b"cublasCreate_v2\0").map_err(|_| StageError::Device(format!("{name}: no cublasCreate_v2")))?;
            let set_stream =
                *lib.get::<SetStream>(b"cublasSetStream_v2\0").map_err(|_| StageError::Device(format!("{name}: no cublasSetStream_v2")))?;
            let gemm = *lib.get::<GemmEx>(b"cublasGemmEx\0").map_err(|_| StageError::Device(format!("{name}: no cublasGemmEx")))?;
            let mut h = std::ptr::null_mut();
            let r = create(&mut h);
            if r != 0 {
                return Err(StageError::Device(format!("{name}: cublasCreate failed (status {r})")));
            }
            let r = set_stream(h, crate::device::hooks::stream() as *mut c_void);
            if r != 0 {
                return Err(StageError::Device(format!("{name}: cublasSetStream failed (status {r})")));
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
pub unsafe extern "C" fn m3c_gemm_bf16(xb: *const c_void, w: *const c_void, y: *mut c_void, rows: i64, inp: i64, out: i64, y_bf16: i32) {
    let Some(api) = API.get() else { crate::device::hooks::die("m3c_gemm_bf16 called with cuBLAS not loaded (runtime bug)") };
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
        crate::device::hooks::die(&format!("cublasGemmEx failed (status {r}) for {rows}×{inp} · {out}×{inp}ᵀ"));
    }
}
