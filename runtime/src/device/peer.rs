//! Links between GPU stages: NCCL on CUDA, RCCL (the same API and symbol
//! names) on ROCm. Activations go device to device on the stage's stream;
//! the small step headers and the returned ids stay on MPI. Set up only
//! when every rank is a GPU stage on its own device (NCCL refuses two ranks
//! on one device) and the library loads; otherwise activations go through
//! host memory and MPI.
//!
//! Each library is loaded by its real file names (`libnccl.so.2`, which the
//! libnccl2 package and the nvidia-nccl wheels install; `librccl.so.1`,
//! which ROCm installs), then the unversioned name, or the path in an
//! environment variable: a generic loader that looks only for `libnccl.so`
//! would miss it on most machines and fall back to host copies silently.

use crate::error::StageError;
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

/// One vendor's collective library: what to call it, where to look.
pub struct Collectives {
    /// Its name in messages.
    name: &'static str,
    /// The variable that names its path, tried first.
    env: &'static str,
    /// File names tried after it, in order.
    files: &'static [&'static str],
    api: OnceLock<Result<Api, StageError>>,
}

/// NCCL, for CUDA stages.
pub static NCCL: Collectives =
    Collectives { name: "NCCL", env: "M3C_NCCL_LIB", files: &["libnccl.so.2", "libnccl.so"], api: OnceLock::new() };
/// RCCL, for ROCm stages.
pub static RCCL: Collectives =
    Collectives { name: "RCCL", env: "M3C_RCCL_LIB", files: &["librccl.so.1", "librccl.so"], api: OnceLock::new() };

struct Api {
    _lib: libloading::Library,
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    send: SendFn,
    recv: RecvFn,
    error_string: ErrorString,
}

/// Loads the first of `names` that opens and has every symbol.
fn load(what: &str, env: &str, names: Vec<String>) -> Result<Api, StageError> {
    let mut errors = Vec::new();
    for name in names {
        // SAFETY: loading NCCL or RCCL runs its initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(&name) } {
            Ok(lib) => {
                // SAFETY: the symbols have these C signatures in every NCCL 2.x (nccl.h) and RCCL (rccl.h, the same API).
                unsafe {
                    let sym = |n: &str| StageError::Device(format!("{name}: no symbol {n}"));
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
    Err(StageError::Device(format!("{what} not found: tried {}; set {env} to its path", errors.join(", "))))
}

impl Collectives {
    fn api(&'static self) -> Result<&'static Api, StageError> {
        let names = || std::env::var(self.env).ok().into_iter().chain(self.files.iter().map(|f| f.to_string())).collect();
        self.api.get_or_init(|| load(self.name, self.env, names())).as_ref().map_err(|e| e.clone())
    }

    /// Whether the library loads here, and if not, why.
    pub fn availability(&'static self) -> Result<(), StageError> {
        self.api().map(|_| ())
    }

    fn check(&'static self, what: &str, r: c_int) -> Result<(), StageError> {
        if r == 0 {
            return Ok(());
        }
        let msg = self
            .api()
            .ok()
            // SAFETY: ncclGetErrorString returns a static string.
            .map(|a| unsafe { CStr::from_ptr((a.error_string)(r)) }.to_string_lossy().into_owned())
            .unwrap_or_default();
        Err(StageError::Device(format!("{} {what}: error {r} ({msg})", self.name)))
    }

    /// A fresh unique id (rank 0 makes it; the others receive it over MPI).
    pub fn unique_id(&'static self) -> Result<[u8; 128], StageError> {
        let a = self.api()?;
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes the id struct.
        self.check("ncclGetUniqueId", unsafe { (a.get_unique_id)(&mut id) })?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the communicator of all `ranks` (collective: every rank calls it).
    pub fn join(&'static self, id: [u8; 128], ranks: i32, rank: i32) -> Result<Link, StageError> {
        let a = self.api()?;
        let id = UniqueId { internal: id.map(|b| b as c_char) };
        let mut comm = std::ptr::null_mut();
        // SAFETY: the device is current on this thread (the GPU's `open` ran first).
        self.check("ncclCommInitRank", unsafe { (a.comm_init_rank)(&mut comm, ranks, id, rank) })?;
        Ok(Link { lib: self, comm: comm as usize, stream: super::hooks::stream() })
    }
}

/// This rank's membership of a communicator, sending on the stage's stream.
pub struct Link {
    lib: &'static Collectives,
    comm: usize,
    stream: usize,
}

impl crate::device::PeerLink for Link {
    /// Queues sending `count` f32 at device address `buf` to `peer`.
    fn send(&self, buf: u64, count: usize, peer: usize) -> Result<(), StageError> {
        let a = self.lib.api()?;
        // SAFETY: `buf` holds `count` f32 of device memory, live until the stream passes this point.
        self.lib.check("ncclSend", unsafe {
            (a.send)(buf as *const c_void, count, FLOAT32, peer as c_int, self.comm as *mut c_void, self.stream as *mut c_void)
        })
    }

    /// Queues receiving `count` f32 into device address `buf` from `peer`.
    fn recv(&self, buf: u64, count: usize, peer: usize) -> Result<(), StageError> {
        let a = self.lib.api()?;
        // SAFETY: as for `send`.
        self.lib.check("ncclRecv", unsafe {
            (a.recv)(buf as *mut c_void, count, FLOAT32, peer as c_int, self.comm as *mut c_void, self.stream as *mut c_void)
        })
    }
}
