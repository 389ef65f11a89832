//! A stage on the host: its weights read in place from the mapped
//! checkpoint, its KV pools in host memory, and each step's entry reading
//! and writing the step's own buffers directly.

use super::{Backing, SeqArgs, StepInputs, StepOut};
use crate::device::{DeviceBuffer, Gpu};
use crate::error::StageError;
use crate::meta::StageMeta;
use crate::weights::StageWeights;
use m3c_contract::stage::abi::{StepArgs, STEP_VERSION};

/// The vision entry over `job` with the weight table `table`, writing the
/// merged features to `feats`. The entry reads `patches` rows of pixels,
/// positions and segment ends and `rows.len()` sizes summing to `patches`,
/// and writes `patches / 4` rows of `x_words` words to `feats`.
/// # Safety
/// Callers pass checked grids and `feats` sized so.
unsafe fn run_vision(table: &[*const u8], job: &super::VisionJob, feats: &mut [f32]) {
    // SAFETY: as the caller guarantees (above).
    unsafe {
        super::m3c_stage_vision(
            table.as_ptr(),
            table.as_ptr(),
            job.rows.len() as i64,
            job.rows.as_ptr(),
            job.patches as i64,
            job.pixels.as_ptr(),
            job.ppos.as_ptr(),
            job.segs.as_ptr(),
            feats.as_mut_ptr(),
        );
    }
}

/// A host stage's weight table, for the encoder's thread.
struct WeightTable(Vec<*const u8>);

// The encoder thread that holds this table is joined when its owner (the
// scheduler, or the encode server of the tower's rank) ends, before the
// stage can drop (`encoder::Worker`'s drop).
// SAFETY: the pointers address the stage's mapped (or owned synthetic)
// weights, which nothing writes after start-up and the stage keeps.
unsafe impl Send for WeightTable {}

/// A host stage's mapped weights and pools.
pub(super) struct HostBacking {
    weights: StageWeights,
    /// One pool per cache slot: `blocks × kv_block` rows of the slot's
    /// width, as f32 words (zeroed by the allocator, so pages of blocks
    /// never used are never touched).
    pools: Vec<Vec<f32>>,
}

impl HostBacking {
    pub(super) fn new(weights: StageWeights) -> HostBacking {
        HostBacking { weights, pools: Vec::new() }
    }
}

impl Backing for HostBacking {
    /// The memory available on this machine, shared by the ranks on it.
    fn free_memory(&self) -> Result<usize, StageError> {
        let info = std::fs::read_to_string("/proc/meminfo").map_err(|e| StageError::Device(format!("/proc/meminfo: {e}")))?;
        let kb = info
            .lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<usize>().ok())
            .ok_or_else(|| StageError::Device("/proc/meminfo has no MemAvailable line".into()))?;
        let ranks = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1).max(1);
        Ok(kb * 1024 / ranks)
    }

    fn alloc_pools(&mut self, meta: &StageMeta, blocks: usize) -> Result<(), StageError> {
        for c in &meta.caches {
            let bytes = blocks.checked_mul(meta.kv_block * c.width * c.bytes);
            let pool = bytes.and_then(|b| zeroed_words(b.div_ceil(4))).ok_or_else(|| {
                StageError::Device(format!(
                    "the KV pool of {blocks} blocks of {} positions (layer {} {}) cannot be allocated in host memory",
                    meta.kv_block, c.layer, c.kind
                ))
            })?;
            self.pools.push(pool);
        }
        Ok(())
    }

    fn open_table(&mut self, _seq: usize, _entries: usize) -> Result<Option<DeviceBuffer>, StageError> {
        Ok(None)
    }

    fn table_grew(&self, _dev: &DeviceBuffer, _from: usize, _entries: &[i64]) -> Result<(), StageError> {
        Ok(())
    }

    fn seq_ended(&mut self, _seq: usize) {}

    fn encode(&mut self, job: &super::VisionJob, feats: &mut [f32]) -> Result<(), StageError> {
        // SAFETY: the images were checked (even grid sides, sizes match) and
        // `feats` holds `patches / 4` rows of `x_words` words.
        unsafe { run_vision(&self.weights.ptrs, job, feats) };
        Ok(())
    }

    fn vision_runner(&self) -> Option<super::RunVision> {
        let table = WeightTable(self.weights.ptrs.clone());
        Some(Box::new(move |im: &m3c_contract::images::SeqImages, feats: &mut [f32]| {
            let table = &table;
            // SAFETY: the caller checked the grids and sized `feats` for
            // their tokens; the table's weights are read only, by steps too,
            // and outlive the thread (see `WeightTable`).
            unsafe { run_vision(&table.0, &super::VisionJob::of(im), feats) };
        }))
    }

    fn table_addr(&self, table: &super::SeqTable) -> u64 {
        table.table.as_ptr() as u64
    }

    fn logits_on_host(&self) -> bool {
        true
    }

    fn step(
        &mut self,
        s: super::StepContext,
        inp: &StepInputs,
        x: &mut [f32],
        out: &mut StepOut,
        _want_logits: bool,
    ) -> Result<(), StageError> {
        let pools: Vec<*mut f32> = self.pools.iter_mut().map(|p| p.as_mut_ptr()).collect();
        // The aux slots follow `x`'s rows in the step's buffer.
        let (x, aux) = x.split_at_mut(inp.tokens * s.meta.x_words());
        let aux = if s.meta.aux_slots > 0 { aux.as_mut_ptr() } else { std::ptr::null_mut() };
        host_step(Entry::Step, &self.weights, &pools, s.pool_rows, s.seqs, inp, x, aux, out)
    }

    fn draft(
        &mut self,
        s: super::StepContext,
        first: bool,
        inp: &StepInputs,
        x: &mut [f32],
        aux: &mut [f32],
        out: &mut StepOut,
    ) -> Result<(), StageError> {
        let pools: Vec<*mut f32> = self.pools.iter_mut().map(|p| p.as_mut_ptr()).collect();
        let entry = if first { Entry::DraftFirst } else { Entry::DraftNext };
        host_step(entry, &self.weights, &pools, s.pool_rows, s.seqs, inp, x, aux.as_mut_ptr(), out)
    }

    fn device(&self) -> Option<&dyn Gpu> {
        None
    }

    fn placement(&self) -> String {
        format!("{} tensors mapped ({:.2} MB)", self.weights.mapped(), self.weights.bytes as f64 / 1e6)
    }
}

/// `words` zeroed f32 words, or None when the memory is not there. The
/// allocator zeroes them (fresh pages from the OS are zero already), so the
/// pages of pool blocks that are never used are never touched.
fn zeroed_words(words: usize) -> Option<Vec<f32>> {
    if words == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f32>(words).ok()?;
    // SAFETY: the layout's size is not zero.
    let p = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` comes from the global allocator with the layout of
    // `words` f32 (so capacity = length = `words`), and all-zero bytes are
    // a valid f32.
    Some(unsafe { Vec::from_raw_parts(p, words, words) })
}

/// Which generated entry a step runs.
#[derive(Clone, Copy)]
enum Entry {
    Step,
    DraftFirst,
    DraftNext,
}

/// One step on the host: the entry reads and writes host memory directly.
#[allow(clippy::too_many_arguments)]
fn host_step(
    entry: Entry,
    weights: &StageWeights,
    pools: &[*mut f32],
    pool_rows: usize,
    seqs: &SeqArgs,
    inp: &StepInputs,
    x: &mut [f32],
    aux: *mut f32,
    out: &mut StepOut,
) -> Result<(), StageError> {
    let run = match entry {
        Entry::Step => super::m3c_stage_step,
        Entry::DraftFirst => super::m3c_draft_first,
        Entry::DraftNext => super::m3c_draft_next,
    };
    // (Seen holds one bitmap per sequence, or nothing on a stage that does
    // not sample, whose entry never reads it.) Each pool holds `pool_rows`
    // rows of its slot; each block table `caps / kv_block` entries, all in
    // the pool, covering its segment's positions (`seq_tables`). `aux` is
    // null where the entry has no aux slots, else holds them (the caller's
    // split of the step's buffer, or the draft's gathered rows).
    // SAFETY: every pointer covers what the compiled step reads or writes:
    // the weights have the compiled shapes, pools, tables and aux are as
    // above, and x, ids, logits, out_ids, table and pos hold `tokens` rows.
    unsafe {
        run(&StepArgs {
            version: STEP_VERSION,
            weights: weights.ptrs.as_ptr(),
            weights_dev: weights.ptrs.as_ptr(),
            caches: pools.as_ptr(),
            pool_rows: pool_rows as i64,
            blocks: seqs.tables.as_ptr() as *const *const i64,
            sequences: inp.segments.len() as i64,
            rows: inp.rows.as_ptr(),
            caps: seqs.caps.as_ptr(),
            tokens: inp.tokens as i64,
            ids: inp.ids.as_ptr(),
            x: x.as_mut_ptr(),
            logits: out.logits.as_mut_ptr(),
            out_ids: out.ids.as_mut_ptr(),
            table: out.table.as_mut_ptr(),
            seen: inp.seen.as_ptr(),
            bitmap_rows: inp.bitmap_rows as i64,
            bias: inp.bias.as_ptr(),
            bias_rows: inp.bias_rows as i64,
            pos: inp.pos.as_ptr(),
            nimg: inp.img_rows.len() as i64,
            img: inp.img.as_ptr(),
            img_rows: inp.img_rows.as_ptr(),
            aux,
        });
    }
    Ok(())
}
