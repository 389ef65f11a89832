//! The scratch hooks generated code calls (`m3c_buf_alloc/free/copy`):
//! host memory on a host stage, a size-keyed device pool on a GPU stage.

use super::{check, cu, state, ON_DEVICE};
use std::ffi::c_void;
use std::sync::atomic::Ordering;

extern "C" {
    fn malloc(n: usize) -> *mut c_void;
    fn free(p: *mut c_void);
}

/// Scratch memory for generated code: host memory on the host, a pooled
/// device buffer on a GPU.
#[no_mangle]
pub extern "C" fn m3c_buf_alloc(bytes: i64) -> *mut c_void {
    if !ON_DEVICE.load(Ordering::Relaxed) {
        // SAFETY: plain malloc; the generated code frees it with m3c_buf_free.
        let p = unsafe { malloc(bytes.max(1) as usize) };
        if p.is_null() {
            // The generated code cannot take an error: end the stage with
            // a message rather than write through a null pointer.
            super::die(&format!("out of host memory: {bytes} bytes of scratch (a long prompt or many image patches in one step)"));
        }
        return p;
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

/// Frees the pooled buffers no one holds (after a synchronised step whose
/// scratch sizes will not recur, such as an image encode sized by its
/// patches). Buffers in use stay.
pub fn trim_pool() {
    if !ON_DEVICE.load(Ordering::Relaxed) {
        return;
    }
    let mut st = state();
    let idle: Vec<u64> = std::mem::take(&mut st.pool).into_values().flatten().collect();
    for d in idle {
        st.sizes.remove(&d);
        // SAFETY: `d` came from cuMemAlloc, is in the pool (no one holds it) and the stream was synchronised.
        check("cuMemFree (scratch)", unsafe { cu::cuMemFree_v2(d) });
    }
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
