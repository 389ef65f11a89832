//! A stage on a GPU (CUDA or ROCm): its weights uploaded, its KV pools in
//! device memory, each step's inputs copied in (or received through the
//! collectives library), decode steps replayed from device graphs, and only
//! what the host needs copied back.

use super::{bytes_of, bytes_of_mut, Backing, SeqArgs, StepInputs, StepOut};
use crate::device::{self, DeviceBuffer, Gpu, PeerLink, ScratchBuffer};
use crate::error::StageError;
use crate::meta::StageMeta;
use crate::weights::StageWeights;
use m3c_contract::stage::abi::VisionArgs;
use std::collections::HashMap;

/// A GPU stage's device, weights, pools and graphs.
pub(super) struct GpuBacking {
    device: Box<dyn Gpu>,
    /// The uploaded weights, owned; `table` holds their addresses in slot
    /// order, and `table_dev` is that table on the device.
    weights: Vec<DeviceBuffer>,
    table: Vec<u64>,
    table_dev: DeviceBuffer,
    /// One pool per cache slot: `blocks × kv_block` rows of the slot's width.
    pools: Vec<DeviceBuffer>,
    graphs: Graphs,
}

impl GpuBacking {
    /// Opens the GPU and uploads the stage's weights to it (reporting
    /// progress); the KV pools come with [`Backing::alloc_pools`].
    pub(super) fn open(meta: &StageMeta, weights: StageWeights, local_rank: i32, who: &str) -> Result<GpuBacking, StageError> {
        let device = device::open(&meta.target, meta.device, local_rank)?;
        let total: u64 = weights.sizes.iter().sum();
        let mut uploaded = Vec::with_capacity(weights.ptrs.len());
        let mut done = 0u64;
        let mut shown = 0;
        for (p, &n) in weights.ptrs.iter().zip(&weights.sizes) {
            // An unbound slot (an EAGLE3 head run without its draft: its
            // entries never run) gets a byte of its own.
            let bytes: &[u8] = if p.is_null() {
                &[0]
            } else {
                // SAFETY: `p` points at `n` mapped bytes of this tensor.
                unsafe { std::slice::from_raw_parts(*p, n as usize) }
            };
            uploaded
                .push(device.upload(bytes).map_err(|e| StageError::Step(format!("uploading weights to GPU {}: {e}", device.ordinal())))?);
            done += n;
            let pct = (done * 100).checked_div(total).unwrap_or(100) as usize;
            if pct / 10 > shown / 10 || done == total {
                shown = pct;
                let line = format!(
                    "{who}: weights to GPU {} ({}): {pct:>3}% ({:.2} of {:.2} GB)\n",
                    device.ordinal(),
                    device.name(),
                    done as f64 / 1e9,
                    total as f64 / 1e9
                );
                let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            }
        }
        let table: Vec<u64> = uploaded.iter().map(DeviceBuffer::ptr).collect();
        let table_dev = device.upload(bytes_of(&table))?;
        // The mapped checkpoint is no longer needed: `weights` is dropped here.
        let graphs = Graphs { on: true, ..Graphs::default() };
        Ok(GpuBacking { device, weights: uploaded, table, table_dev, pools: Vec::new(), graphs })
    }
}

impl Backing for GpuBacking {
    fn free_memory(&self) -> Result<usize, StageError> {
        self.device.free_bytes()
    }

    fn alloc_pools(&mut self, meta: &StageMeta, blocks: usize) -> Result<(), StageError> {
        for c in &meta.caches {
            let bytes = blocks * meta.kv_block * c.width * c.bytes;
            let pool = self.device.zeros(bytes).map_err(|e| {
                StageError::Device(format!(
                    "the KV pool of {blocks} blocks ({:.2} GB for layer {} {}) does not fit GPU {}: {e}",
                    bytes as f64 / 1e9,
                    c.layer,
                    c.kind,
                    self.device.ordinal()
                ))
            })?;
            self.pools.push(pool);
        }
        Ok(())
    }

    fn open_table(&mut self, seq: usize, entries: usize) -> Result<Option<DeviceBuffer>, StageError> {
        // Graphs of micro-batches with this sequence point at its old table.
        self.graphs.forget(seq);
        Ok(Some(self.device.zeros(entries.max(1) * 8)?))
    }

    fn table_grew(&self, dev: &DeviceBuffer, from: usize, entries: &[i64]) -> Result<(), StageError> {
        self.device.copy_in(dev.ptr() + (from * 8) as u64, bytes_of(entries))
    }

    fn seq_ended(&mut self, seq: usize) {
        self.graphs.forget(seq);
    }

    fn encode(&mut self, job: &super::VisionJob, feats: &mut [f32]) -> Result<(), StageError> {
        let device = self.device.as_ref();
        let pix = device.upload(bytes_of(job.pixels))?;
        let pp = device.upload(bytes_of(&job.ppos))?;
        let sg = device.upload(bytes_of(&job.segs))?;
        let out = device.zeros(feats.len() * 4)?;
        device.set_prefill(true);
        // SAFETY: as on the host (`HostBacking::encode`), with device
        // buffers of those sizes and the host and device weight tables.
        unsafe {
            super::run_vision(&VisionArgs {
                weights: self.table.as_ptr() as *const *const u8,
                weights_dev: self.table_dev.ptr() as *const *const u8,
                images: job.rows.len() as i64,
                rows: job.rows.as_ptr(),
                patches: job.patches as i64,
                pixels: pix.ptr() as *const f32,
                ppos: pp.ptr() as *const i64,
                segs: sg.ptr() as *const i64,
                out: out.ptr() as *mut f32,
            });
        }
        device.sync()?;
        device.download(out.ptr(), bytes_of_mut(feats))?;
        // The tower's scratch is sized by this request's patches; a pool
        // keyed by size would keep every size it ever saw.
        device.trim_scratch();
        Ok(())
    }

    fn table_addr(&self, table: &super::SeqTable) -> u64 {
        table.dev.as_ref().map_or(0, DeviceBuffer::ptr)
    }

    fn logits_on_host(&self) -> bool {
        false
    }

    fn step(
        &mut self,
        s: super::StepContext,
        inp: &StepInputs,
        x: &mut [f32],
        out: &mut StepOut,
        want_logits: bool,
    ) -> Result<(), StageError> {
        let pools: Vec<u64> = self.pools.iter().map(DeviceBuffer::ptr).collect();
        let gpu = GpuStep {
            device: self.device.as_ref(),
            table: &self.table,
            table_dev: &self.table_dev,
            pools: &pools,
            pool_rows: s.pool_rows,
            seqs: s.seqs,
            graphs: &mut self.graphs,
            collectives: s.collectives,
            meta: s.meta,
        };
        gpu.run(inp, x, out, want_logits)
    }

    fn tables<'a>(&mut self, s: &super::StepContext<'a>) -> super::StageTables<'a> {
        super::StageTables {
            weights: self.table.as_ptr() as u64,
            weights_dev: self.table_dev.ptr(),
            caches: self.pools.iter().map(DeviceBuffer::ptr).collect(),
            pool_rows: s.pool_rows,
            seqs: s.seqs,
        }
    }

    fn device(&self) -> Option<&dyn Gpu> {
        Some(self.device.as_ref())
    }

    fn set_graphs(&mut self, on: bool) {
        self.graphs.on = on;
    }

    fn graph_replays(&self) -> usize {
        self.graphs.replays
    }

    fn placement(&self) -> String {
        let d = &self.device;
        format!(
            "{} tensors on GPU {} ({}, {:.1} GB) ({:.2} MB)",
            self.weights.len(),
            d.ordinal(),
            d.name(),
            d.total_bytes() as f64 / 1e9,
            self.weights.iter().map(DeviceBuffer::len).sum::<usize>() as f64 / 1e6
        )
    }
}

/// The device buffers a step's entry reads and writes besides weights,
/// caches and scratch: ids, positions, activations, logits, sampled ids,
/// the sampling table and the seen-id bitmaps. Owned: they go back to the
/// scratch pool when dropped.
struct Io {
    ids: ScratchBuffer,
    pos: ScratchBuffer,
    x: ScratchBuffer,
    logits: ScratchBuffer,
    out: ScratchBuffer,
    table: ScratchBuffer,
    seen: ScratchBuffer,
    /// Rows `seen` holds (`BITMAP_ROWS` per drawing slot).
    bitmap_rows: usize,
    bias: ScratchBuffer,
    /// Rows `bias` holds.
    bias_rows: usize,
}

/// The addresses of an [`Io`], for one step.
#[derive(Clone, Copy)]
struct IoPtrs {
    ids: u64,
    pos: u64,
    x: u64,
    logits: u64,
    out: u64,
    table: u64,
    seen: u64,
    bitmap_rows: usize,
    bias: u64,
    bias_rows: usize,
}

impl Io {
    /// Buffers for a step of `tokens` rows with `bitmap_rows` bitmap rows
    /// and `bias_rows` bias rows (`vocab` 0 unless this is the last stage).
    fn alloc(tokens: usize, bitmap_rows: usize, bias_rows: usize, x_words: usize, vocab: usize) -> Io {
        let a = |n: usize| ScratchBuffer::new(n);
        let last = vocab > 0;
        let words = if last { m3c_contract::sampling::seen_words(vocab) } else { 0 };
        Io {
            ids: a(tokens * 8),
            pos: a(tokens * 8),
            x: a(tokens * x_words * 4),
            logits: a(tokens * vocab * 4),
            out: a(tokens * 8),
            table: a(if last { tokens * m3c_contract::sampling::ROW_WORDS * 8 } else { 0 }),
            seen: a(bitmap_rows * words * 4),
            bitmap_rows,
            bias: a(bias_rows * vocab * 4),
            bias_rows,
        }
    }

    fn ptrs(&self) -> IoPtrs {
        IoPtrs {
            ids: self.ids.ptr(),
            pos: self.pos.ptr(),
            x: self.x.ptr(),
            logits: self.logits.ptr(),
            out: self.out.ptr(),
            table: self.table.ptr(),
            seen: self.seen.ptr(),
            bitmap_rows: self.bitmap_rows,
            bias: self.bias.ptr(),
            bias_rows: self.bias_rows,
        }
    }
}

/// Decode steps captured as device graphs (CUDA or HIP), by micro-batch: its sequences, one
/// row each. Kernels read positions from memory (`pos`), so a micro-batch's
/// decode step launches the same kernels with the same arguments at every
/// position; the graph owns its `Io` buffers and the runtime writes each
/// step's inputs into them.
///
/// Under `m3c serve` micro-batches change as requests come and go, so the
/// table keeps the most recently used [`MAX_GRAPHS`] and evicts the least
/// recently used (its buffers go back to the pool).
#[derive(Default)]
pub struct Graphs {
    on: bool,
    /// Each micro-batch's slot and when it was last used.
    by_batch: HashMap<Vec<usize>, (GraphSlot, u64)>,
    clock: u64,
    /// Steps run by replaying a graph.
    replays: usize,
}

impl Graphs {
    /// Drops the graphs of micro-batches that hold sequence `seq` (their
    /// buffers go back to the pool): they point at its old block table.
    fn forget(&mut self, seq: usize) {
        self.by_batch.retain(|k, _| !k.contains(&seq));
    }

    /// How a step of the micro-batch `key` (its sequences; `None`: not a
    /// graph candidate) runs, the addresses of the I/O buffers it uses, and
    /// the fresh buffers when they are not a graph's own (dropped after the
    /// step unless a capture keeps them). A micro-batch's first decode step
    /// runs eagerly, its second is captured, later ones replay.
    fn plan(&mut self, key: Option<Vec<usize>>, fresh: impl Fn() -> Io) -> (Plan, IoPtrs, Option<Io>) {
        let new = |plan| {
            let io = fresh();
            (plan, io.ptrs(), Some(io))
        };
        self.clock += 1;
        let now = self.clock;
        match key {
            None => new(Plan::Eager),
            Some(k) => match self.by_batch.get_mut(&k) {
                Some((slot, used)) => {
                    *used = now;
                    match slot {
                        GraphSlot::Ready(_, io) => (Plan::Replay(k), io.ptrs(), None),
                        GraphSlot::Seen => new(Plan::Capture(k)),
                        GraphSlot::Eager => new(Plan::Eager),
                    }
                }
                None => {
                    self.set(k, GraphSlot::Seen);
                    new(Plan::Eager)
                }
            },
        }
    }

    /// Records `slot` for micro-batch `k`, evicting the least recently used
    /// entry when the table is full.
    fn set(&mut self, k: Vec<usize>, slot: GraphSlot) {
        if !self.by_batch.contains_key(&k) && self.by_batch.len() >= MAX_GRAPHS {
            if let Some(old) = self.by_batch.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k.clone()) {
                self.by_batch.remove(&old);
            }
        }
        self.by_batch.insert(k, (slot, self.clock));
    }

    /// The captured graph of micro-batch `k`.
    fn ready(&self, k: &[usize]) -> Option<&device::Graph> {
        match self.by_batch.get(k) {
            Some((GraphSlot::Ready(g, _), _)) => Some(g),
            _ => None,
        }
    }
}

enum GraphSlot {
    /// Seen once, run eagerly (which also fills the scratch pool).
    Seen,
    Ready(device::Graph, Io),
    /// Capture failed once (the message was reported): always eager.
    Eager,
}

/// At most this many micro-batches' graphs per stage (least recently used
/// evicted). Each holds its step's buffers: the last stage's logits are
/// rows × vocab × 4 bytes (13 MB at 16 rows of MiniMax-M3).
const MAX_GRAPHS: usize = 64;

/// How a GPU step runs: launches as they come, or through its micro-batch's graph.
enum Plan {
    Eager,
    Capture(Vec<usize>),
    Replay(Vec<usize>),
}

/// A GPU stage's parts that one step uses.
struct GpuStep<'a> {
    device: &'a dyn Gpu,
    table: &'a [u64],
    table_dev: &'a DeviceBuffer,
    pools: &'a [u64],
    pool_rows: usize,
    seqs: &'a SeqArgs,
    graphs: &'a mut Graphs,
    collectives: Option<&'a dyn PeerLink>,
    meta: &'a StageMeta,
}

impl GpuStep<'_> {
    /// One step on the device: inputs copied in (or received through the collectives library),
    /// the entry run eagerly, captured or replayed as a device graph, and only
    /// what the host needs copied back.
    fn run(self, inp: &StepInputs, x: &mut [f32], out: &mut StepOut, want_logits: bool) -> Result<(), StageError> {
        let GpuStep { device, table, table_dev, pools, pool_rows, seqs, graphs, collectives, meta: m } = self;
        let (segments, tokens) = (inp.segments, inp.tokens);
        let nimg = inp.img_rows.len() as i64;
        device.set_prefill(segments.iter().any(|s| s.rows > 1));
        // Decode steps (one row per sequence) go through a graph from their
        // micro-batch's second step on; everything else runs eagerly.
        // (A step with image rows is never a graph: its inputs differ.)
        let key: Option<Vec<usize>> =
            (graphs.on && nimg == 0 && segments.iter().all(|s| s.rows == 1)).then(|| segments.iter().map(|s| s.seq).collect());
        let img_dev = if nimg > 0 { Some((device.upload(bytes_of(&inp.img))?, device.upload(bytes_of(&inp.img_rows))?)) } else { None };
        let (img_p, img_rows_p) = img_dev.as_ref().map_or((0, 0), |(a, b)| (a.ptr(), b.ptr()));
        // `x` holds the activations and, with an EAGLE3 head, its aux slots after them.
        let fresh = || Io::alloc(tokens, inp.bitmap_rows, inp.bias_rows, m.carry_words(), if m.last_stage { m.vocab } else { 0 });
        let aux_at = (tokens * m.x_words() * 4) as u64;
        let (plan, io, mut fresh_io) = graphs.plan(key, fresh);
        // A graph's micro-batch is a fixed set of sequences, and whether a
        // sequence has a bias row is fixed for its life: the count matches.
        if io.bias_rows != inp.bias_rows || (m.last_stage && io.bitmap_rows != inp.bitmap_rows) {
            return Err(StageError::Step(format!(
                "runtime bug: a step with {} bias and {} bitmap rows on buffers for {} and {}",
                inp.bias_rows, inp.bitmap_rows, io.bias_rows, io.bitmap_rows
            )));
        }
        device.copy_in(io.pos, bytes_of(&inp.pos))?;
        if m.last_stage {
            device.copy_in(io.table, bytes_of(&out.table))?;
            // The bitmaps matter only to penalised rows.
            if inp.penalised {
                device.copy_in(io.seen, bytes_of(&inp.seen))?;
            }
            if inp.bias_rows > 0 {
                device.copy_in(io.bias, bytes_of(&inp.bias))?;
            }
        }
        if m.first_stage {
            device.copy_in(io.ids, bytes_of(inp.ids))?;
        } else if let Some(link) = collectives {
            // (What the stage before passes on: `x` and the aux slots made there.)
            link.recv(io.x, tokens * m.carry_in_words(), m.stage - 1)?;
        } else {
            device.copy_in(io.x, bytes_of(x))?;
        }
        let tables =
            super::StageTables { weights: table.as_ptr() as u64, weights_dev: table_dev.ptr(), caches: pools.to_vec(), pool_rows, seqs };
        let buffers = super::RowBuffers {
            ids: io.ids,
            x: io.x,
            logits: io.logits,
            out_ids: io.out,
            table: io.table,
            seen: io.seen,
            bitmap_rows: io.bitmap_rows,
            bias: io.bias,
            bias_rows: io.bias_rows,
            pos: io.pos,
            img: img_p,
            img_rows: img_rows_p,
            nimg: nimg as usize,
            aux: if m.aux_slots > 0 { io.x + aux_at } else { 0 },
        };
        let run = || {
            // SAFETY: as on the host, with device buffers of the same sizes
            // and host tables of device pointers.
            unsafe {
                super::m3c_stage_step(&inp.args(&tables, &buffers));
            }
        };
        // The graph's own buffers stay with it; fresh ones go back to
        // the pool when `fresh_io` drops, unless a capture keeps them.
        match plan {
            Plan::Eager => run(),
            Plan::Replay(k) => {
                let Some(g) = graphs.ready(&k) else {
                    return Err(StageError::Step("runtime bug: a graph replay without a graph".into()));
                };
                device.replay(g)?;
                graphs.replays += 1;
            }
            Plan::Capture(k) => match device.capture(&mut || run()) {
                Ok(g) => {
                    device.replay(&g)?;
                    graphs.replays += 1;
                    let own = fresh_io.take().ok_or_else(|| StageError::Step("runtime bug: a capture without its buffers".into()))?;
                    graphs.set(k, GraphSlot::Ready(g, own));
                }
                Err(e) => {
                    let line = format!("m3c stage {}: graph capture failed ({e}); this micro-batch runs without a graph\n", m.stage);
                    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
                    graphs.set(k, GraphSlot::Eager);
                    run();
                }
            },
        }
        if !m.last_stage {
            if let Some(link) = collectives {
                link.send(io.x, x.len(), m.stage + 1)?;
            }
        }
        device.sync()?;
        if m.last_stage {
            // Only the ids and the table leave the device, unless the
            // logits are wanted.
            if want_logits {
                device.download(io.logits, bytes_of_mut(&mut out.logits))?;
            } else {
                out.logits = Vec::new();
            }
            device.download(io.out, bytes_of_mut(&mut out.ids))?;
            device.download(io.table, bytes_of_mut(&mut out.table))?;
            if m.draft.is_some() {
                // The EAGLE3 head's first entry reads them, gathered by row.
                device.download(io.x, bytes_of_mut(x))?;
            }
        } else if collectives.is_none() {
            device.download(io.x, bytes_of_mut(x))?;
        }
        Ok(())
    }
}
