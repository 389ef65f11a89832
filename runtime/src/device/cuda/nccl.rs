//! NCCL between GPU stages: activations go device to device on the stage's
//! stream; the small step headers and the returned ids stay on MPI. Set up
//! only when every rank is a CUDA stage on its own GPU (NCCL refuses two
//! ranks on one device) and NCCL loads; otherwise activations go through
//! host memory and MPI.
//!
//! NCCL is loaded here by its real file names (`libnccl.so.2`, which the
//! libnccl2 package and the nvidia-nccl wheels install, then `libnccl.so`,
//! or `$M3C_NCCL_LIB`): a generic loader that looks only for `libnccl.so`
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

fn load() -> Result<Api, StageError> {
    let mut errors = Vec::new();
    for name in candidates() {
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(&name) } {
            Ok(lib) => {
                // SAFETY: the symbols have these C signatures in every NCCL 2.x (nccl.h).
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
    Err(StageError::Device(format!("NCCL not found: tried {}; set M3C_NCCL_LIB to its path", errors.join(", "))))
}

fn api() -> Result<&'static Api, StageError> {
    static API: OnceLock<Result<Api, StageError>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(|e| e.clone())
}

/// Whether NCCL loads here, and if not, why.
pub fn availability() -> Result<(), StageError> {
    api().map(|_| ())
}

fn check(what: &str, r: c_int) -> Result<(), StageError> {
    if r == 0 {
        return Ok(());
    }
    let msg = api()
        .ok()
        // SAFETY: ncclGetErrorString returns a static string.
        .map(|a| unsafe { CStr::from_ptr((a.error_string)(r)) }.to_string_lossy().into_owned())
        .unwrap_or_default();
    Err(StageError::Device(format!("NCCL {what}: error {r} ({msg})")))
}

pub struct Link {
    comm: usize,
    stream: usize,
}

/// A fresh unique id (rank 0 makes it; the others receive it over MPI).
pub fn unique_id() -> Result<[u8; 128], StageError> {
    let a = api()?;
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: writes the id struct.
    check("ncclGetUniqueId", unsafe { (a.get_unique_id)(&mut id) })?;
    Ok(id.internal.map(|c| c as u8))
}

impl Link {
    /// Joins the communicator of all `ranks` (collective: every rank calls it).
    pub fn join(id: [u8; 128], ranks: i32, rank: i32) -> Result<Link, StageError> {
        let a = api()?;
        let id = UniqueId { internal: id.map(|b| b as c_char) };
        let mut comm = std::ptr::null_mut();
        // SAFETY: the device context is current (CudaGpu::open ran first).
        check("ncclCommInitRank", unsafe { (a.comm_init_rank)(&mut comm, ranks, id, rank) })?;
        Ok(Link { comm: comm as usize, stream: super::state().stream })
    }
}

impl crate::device::PeerLink for Link {
    /// Queues sending `count` f32 at device address `buf` to `peer`.
    fn send(&self, buf: u64, count: usize, peer: usize) -> Result<(), StageError> {
        let a = api()?;
        // SAFETY: `buf` holds `count` f32 of device memory, live until the stream passes this point.
        check("ncclSend", unsafe {
            (a.send)(buf as *const c_void, count, FLOAT32, peer as c_int, self.comm as *mut c_void, self.stream as *mut c_void)
        })
    }

    /// Queues receiving `count` f32 into device address `buf` from `peer`.
    fn recv(&self, buf: u64, count: usize, peer: usize) -> Result<(), StageError> {
        let a = api()?;
        // SAFETY: as for `send`.
        check("ncclRecv", unsafe {
            (a.recv)(buf as *mut c_void, count, FLOAT32, peer as c_int, self.comm as *mut c_void, self.stream as *mut c_void)
        })
    }
}
