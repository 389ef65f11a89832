//! The GPU a stage runs on, behind one trait: what the stage needs of a
//! vendor's runtime (memory, copies, the one stream, graphs of captured
//! steps, the vendor's GEMM library and the links between stages' GPUs).
//! `Stage` holds a `Box<dyn Gpu>` chosen by the manifest's target; only
//! [`open`] names a vendor.
//!
//! Generated code reaches the device through C ABIs of its own: MLIR's
//! `mgpu*` launch functions and the `m3c_buf_*` scratch hooks, defined once
//! in [`hooks`] and forwarded to the open GPU's [`hooks::Driver`]. Links
//! between stages' GPUs are NCCL's or RCCL's ([`peer`]).

pub mod cuda;
pub mod hip;
pub mod hooks;
pub mod peer;

use crate::error::StageError;
use m3c_contract::target::Target;

pub use hooks::ScratchBuffer;

/// A GPU as a stage uses it. Addresses are the device's (`u64`); every
/// operation is ordered on the device's one stream.
pub trait Gpu {
    /// What `open` learned of the device.
    fn info(&self) -> &DeviceInfo;
    /// The device's index on this machine.
    fn ordinal(&self) -> i32 {
        self.info().ordinal
    }
    /// Its product name.
    fn name(&self) -> &str {
        &self.info().name
    }
    /// Its memory in bytes.
    fn total_bytes(&self) -> usize {
        self.info().total_bytes
    }
    /// Its memory free now, in bytes.
    fn free_bytes(&self) -> Result<usize, StageError>;
    /// New device memory holding a copy of `bytes`.
    fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer, StageError>;
    /// New zeroed device memory of `bytes`.
    fn zeros(&self, bytes: usize) -> Result<DeviceBuffer, StageError>;
    /// Copies `dst.len()` bytes from device address `src` to the host.
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<(), StageError>;
    /// Copies `src` to device address `dst`.
    fn copy_in(&self, dst: u64, src: &[u8]) -> Result<(), StageError>;
    /// Waits for everything queued on the stream.
    fn sync(&self) -> Result<(), StageError>;
    /// Scratch bytes the generated code holds now and at most.
    fn scratch_bytes(&self) -> (u64, u64) {
        hooks::scratch_bytes()
    }
    /// Gives idle scratch back to the device (after a step whose scratch
    /// sizes will not recur).
    fn trim_scratch(&self) {
        hooks::trim_pool()
    }
    /// Runs `f` (a generated step) with the stream capturing, and returns
    /// the captured work as a graph to replay.
    fn capture(&self, f: &mut dyn FnMut()) -> Result<Graph, StageError>;
    /// Queues a captured graph on the stream.
    fn replay(&self, g: &Graph) -> Result<(), StageError>;
    /// Loads the vendor's GEMM library for prefill linears of `min_rows`
    /// rows or more; an error says why it cannot (the GEMV kernels stay).
    fn enable_gemm(&self, min_rows: usize) -> Result<(), StageError>;
    /// Whether the coming step is a prefill (the GEMM library takes only those).
    fn set_prefill(&self, prefill: bool);
    /// The vendor's library for links between GPUs (NCCL, RCCL).
    fn collectives(&self) -> &'static peer::Collectives;
    /// Whether that library loads here.
    fn links_available(&self) -> Result<(), StageError> {
        self.collectives().availability()
    }
    /// A new link id, made by one rank and broadcast to the others.
    fn link_id(&self) -> Result<[u8; 128], StageError> {
        self.collectives().unique_id()
    }
    /// Joins the link `id` of `ranks` ranks as `rank`.
    fn join_link(&self, id: [u8; 128], ranks: i32, rank: i32) -> Result<Box<dyn PeerLink>, StageError> {
        Ok(Box::new(self.collectives().join(id, ranks, rank)?))
    }
}

/// Device-to-device transfers between stages' GPUs (NCCL on CUDA).
pub trait PeerLink {
    /// Sends `count` f32 words at device address `buf` to rank `peer`.
    fn send(&self, buf: u64, count: usize, peer: usize) -> Result<(), StageError>;
    /// Receives `count` f32 words from rank `peer` into device address `buf`.
    fn recv(&self, buf: u64, count: usize, peer: usize) -> Result<(), StageError>;
}

/// Opens the GPU of a stage compiled for `target`: device `ordinal` when
/// the plan names one, else the one this machine's `local_rank` falls on.
pub fn open(target: &Target, ordinal: Option<i32>, local_rank: i32) -> Result<Box<dyn Gpu>, StageError> {
    match target {
        Target::Cuda { .. } => Ok(Box::new(cuda::CudaGpu::open(ordinal, local_rank)?)),
        Target::Host => Err(StageError::Device("runtime bug: opening a GPU for a host stage".into())),
        Target::Rocm { arch } => Ok(Box::new(hip::HipGpu::open(arch, ordinal, local_rank)?)),
    }
}

/// A GPU as `open` found it.
pub struct DeviceInfo {
    /// Its index on this machine.
    pub ordinal: i32,
    /// Its product name.
    pub name: String,
    /// Its memory in bytes.
    pub total_bytes: usize,
}

/// The device a stage runs on among the `count` this machine has: the
/// plan's `requested` one, else the one this machine's `local_rank` falls on.
pub(crate) fn pick_ordinal(requested: Option<i32>, local_rank: i32, count: i32) -> Result<i32, StageError> {
    let ordinal = requested.unwrap_or(local_rank % count.max(1));
    if ordinal >= count {
        return Err(StageError::Device(format!("the plan puts this stage on device {ordinal}, but this machine has {count} GPU(s)")));
    }
    Ok(ordinal)
}

/// Device memory with one owner, given back to its device when dropped
/// (weights, caches, step inputs).
pub struct DeviceBuffer {
    ptr: u64,
    bytes: usize,
    /// The device's free for `ptr`.
    release: fn(u64),
}

impl DeviceBuffer {
    /// Takes ownership of `bytes` at `ptr`, to be freed by `release`.
    pub(crate) fn from_raw(ptr: u64, bytes: usize, release: fn(u64)) -> DeviceBuffer {
        DeviceBuffer { ptr, bytes, release }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        (self.release)(self.ptr)
    }
}

/// A captured step: replaying it is one launch instead of one per kernel.
pub struct Graph {
    handle: usize,
    /// The device's destroy for `handle`.
    release: fn(usize),
}

impl Graph {
    /// Takes ownership of the device's graph `handle`, destroyed by `release`.
    pub(crate) fn from_raw(handle: usize, release: fn(usize)) -> Graph {
        Graph { handle, release }
    }

    /// The device's handle.
    pub(crate) fn handle(&self) -> usize {
        self.handle
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        (self.release)(self.handle)
    }
}
