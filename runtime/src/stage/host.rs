//! A stage on the host: its weights read in place from the mapped
//! checkpoint, its KV pools in host memory, and each step's entry reading
//! and writing the step's own buffers directly.

use super::entry_io::Entry;
use super::{Backing, StepInputs, StepOut};
use crate::device::{DeviceBuffer, Gpu};
use crate::error::StageError;
use crate::meta::StageMeta;
use crate::weights::StageWeights;
use m3c_contract::stage::abi::VisionArgs;

/// The vision entry over `job` with the weight table `table`, writing the
/// merged features to `feats`. The entry reads `patches` rows of pixels,
/// positions and segment ends and `rows.len()` sizes summing to `patches`,
/// and writes `patches / 4` rows of `x_words` words to `feats`.
/// # Safety
/// Callers pass checked grids and `feats` sized so.
unsafe fn run_vision(table: &[*const u8], job: &super::VisionJob, feats: &mut [f32]) {
    // SAFETY: as the caller guarantees (above).
    unsafe {
        super::run_vision(&VisionArgs {
            weights: table.as_ptr(),
            weights_dev: table.as_ptr(),
            images: job.rows.len() as i64,
            rows: job.rows.as_ptr(),
            patches: job.patches as i64,
            pixels: job.pixels.as_ptr(),
            ppos: job.ppos.as_ptr(),
            segs: job.segs.as_ptr(),
            out: feats.as_mut_ptr(),
        });
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
        Ok(kb * 1024 / crate::node::local().1)
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
        let tables = self.tables(&s);
        // The aux slots follow `x`'s rows in the step's buffer.
        let (x, aux) = x.split_at_mut(inp.tokens * s.meta.x_words());
        let aux = if s.meta.aux_slots > 0 { aux.as_mut_ptr() as u64 } else { 0 };
        let buffers = super::RowBuffers {
            ids: inp.ids.as_ptr() as u64,
            x: x.as_mut_ptr() as u64,
            logits: out.logits.as_mut_ptr() as u64,
            out_ids: out.ids.as_mut_ptr() as u64,
            table: out.table.as_mut_ptr() as u64,
            seen: inp.seen.as_ptr() as u64,
            bitmap_rows: inp.bitmap_rows,
            bias: inp.bias.as_ptr() as u64,
            bias_rows: inp.bias_rows,
            pos: inp.pos.as_ptr() as u64,
            img: inp.img.as_ptr() as u64,
            img_rows: inp.img_rows.as_ptr() as u64,
            nimg: inp.img_rows.len(),
            aux,
        };
        // (Seen holds one bitmap per sequence, or nothing on a stage that
        // does not sample, whose entry never reads it.) Each pool holds
        // `pool_rows` rows of its slot; each block table `caps / kv_block`
        // entries, all in the pool, covering its segment's positions
        // (`seq_tables`). `aux` is null where the entry has no aux slots,
        // else the split of the step's buffer that holds them.
        // SAFETY: every pointer covers what the compiled step reads or writes:
        // the weights have the compiled shapes, pools, tables and aux are as
        // above, and x, ids, logits, out_ids, table and pos hold `tokens` rows.
        unsafe { Entry::Step.run(&inp.args(&tables, &buffers)) };
        Ok(())
    }

    fn tables<'a>(&mut self, s: &super::StepContext<'a>) -> super::StageTables<'a> {
        super::StageTables {
            weights: self.weights.ptrs.as_ptr() as u64,
            weights_dev: self.weights.ptrs.as_ptr() as u64,
            caches: self.pools.iter_mut().map(|p| p.as_mut_ptr() as u64).collect(),
            pool_rows: s.pool_rows,
            seqs: s.seqs,
        }
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
