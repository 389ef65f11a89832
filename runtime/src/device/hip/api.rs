//! The HIP runtime (`libamdhip64`), loaded at run time by its file names so
//! that a stage binary starts on any machine and a rocm stage without ROCm
//! says so instead of failing to link. Only the C API that has been stable
//! since ROCm 5 is used (`hip_runtime_api.h`; ROCm 7 adds a `const` to
//! `hipMemcpyHtoD`'s source, the same ABI); every handle is a pointer.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

/// `hipMemcpyDeviceToDevice` of `hipMemcpyKind`.
pub const MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
/// `hipStreamCaptureModeRelaxed` of `hipStreamCaptureMode`.
pub const CAPTURE_MODE_RELAXED: c_int = 2;
/// `hipErrorNoDevice`: what `hipGetDeviceCount` returns on a machine without an AMD GPU.
pub const NO_DEVICE: c_int = 100;

type Ptr = *mut c_void;

/// Declares the table of HIP functions and its loader: each field is the
/// symbol of the same name, with its C signature (all return `hipError_t`).
macro_rules! hip_api {
    ($($name:ident: fn($($arg:ty),*);)*) => {
        #[allow(non_snake_case)]
        pub struct Api {
            _lib: libloading::Library,
            $(pub $name: unsafe extern "C" fn($($arg),*) -> c_int,)*
            pub hipGetErrorString: unsafe extern "C" fn(c_int) -> *const c_char,
        }

        impl Api {
            /// The table from an opened library; the error names a missing symbol.
            fn from(lib: libloading::Library, file: &str) -> Result<Api, String> {
                let missing = |s: &str| format!("{file} is not the HIP runtime of ROCm 6 or later: it has no {s}");
                // SAFETY: each symbol has the declared C signature in every HIP since ROCm 5 (hip_runtime_api.h).
                unsafe {
                    Ok(Api {
                        $($name: *lib.get(concat!(stringify!($name), "\0").as_bytes()).map_err(|_| missing(stringify!($name)))?,)*
                        hipGetErrorString: *lib.get(b"hipGetErrorString\0").map_err(|_| missing("hipGetErrorString"))?,
                        _lib: lib,
                    })
                }
            }
        }
    };
}

hip_api! {
    hipInit: fn(c_uint);
    hipGetDeviceCount: fn(*mut c_int);
    hipSetDevice: fn(c_int);
    hipDeviceGetName: fn(*mut c_char, c_int, c_int);
    hipDeviceTotalMem: fn(*mut usize, c_int);
    hipMemGetInfo: fn(*mut usize, *mut usize);
    hipMalloc: fn(*mut Ptr, usize);
    hipFree: fn(Ptr);
    hipMemcpyHtoD: fn(Ptr, *const c_void, usize);
    hipMemcpyDtoH: fn(Ptr, Ptr, usize);
    hipMemsetD8: fn(Ptr, u8, usize);
    hipMemcpyAsync: fn(Ptr, *const c_void, usize, c_int, Ptr);
    hipStreamCreate: fn(*mut Ptr);
    hipStreamSynchronize: fn(Ptr);
    hipModuleLoadData: fn(*mut Ptr, *const c_void);
    hipModuleGetFunction: fn(*mut Ptr, Ptr, *const c_char);
    hipModuleLaunchKernel: fn(Ptr, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Ptr, *mut Ptr, *mut Ptr);
    hipStreamBeginCapture: fn(Ptr, c_int);
    hipStreamEndCapture: fn(Ptr, *mut Ptr);
    hipGraphInstantiateWithFlags: fn(*mut Ptr, Ptr, u64);
    hipGraphLaunch: fn(Ptr, Ptr);
    hipGraphExecDestroy: fn(Ptr);
    hipGraphDestroy: fn(Ptr);
}

/// The file names tried, in order: `$M3C_HIP_LIB`, the names the loader
/// finds through the system's library path (ROCm 7, then 6), then ROCm's
/// default install folder.
pub fn candidates() -> Vec<String> {
    let names = ["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"];
    let mut v: Vec<String> = std::env::var("M3C_HIP_LIB").ok().into_iter().collect();
    v.extend(names.iter().map(|n| n.to_string()));
    v.extend(names.iter().map(|n| format!("/opt/rocm/lib/{n}")));
    v
}

/// Loads the first candidate that opens; the error lists every try.
pub fn load() -> Result<Api, String> {
    let mut tried = Vec::new();
    for file in candidates() {
        // SAFETY: loading the HIP runtime runs its initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(&file) } {
            Ok(lib) => return Api::from(lib, &file),
            Err(e) => tried.push(format!("{file} ({e})")),
        }
    }
    Err(format!(
        "the HIP runtime is not on this machine (tried {}); install ROCm 6 or later, or set M3C_HIP_LIB to its libamdhip64.so",
        tried.join(", ")
    ))
}

impl Api {
    /// `Ok` for `hipSuccess`, else HIP's message prefixed with `what`.
    pub fn ok(&self, what: &str, r: c_int) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: hipGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.hipGetErrorString)(r) };
        // SAFETY: checked for null; otherwise HIP's static string.
        let msg = if p.is_null() { String::new() } else { unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned() };
        Err(format!("HIP error in {what}: {msg} (error {r})"))
    }
}
