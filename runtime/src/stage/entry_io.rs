//! The EAGLE3 draft head's entries, run the same way on every backing: the
//! row buffers an entry reads and writes are the host slices themselves on
//! a host stage, or device copies brought back after it runs on a GPU
//! stage ([`EntryIo`]), so the one thing a backing supplies is its tables.

use super::{bytes_of, bytes_of_mut, Backing, RowBuffers, StepContext, StepInputs, StepOut};
use crate::device::{DeviceBuffer, Gpu, ScratchBuffer};
use crate::error::StageError;

/// Which generated entry a step runs.
#[derive(Clone, Copy)]
pub(super) enum Entry {
    Step,
    DraftFirst,
    DraftNext,
}

impl Entry {
    /// Runs the entry over `args`.
    /// # Safety
    /// Every pointer of `args` covers what the compiled entry reads or
    /// writes (`abi::STEP_FIELDS`), in host or device memory as the stage's
    /// target has it.
    pub(super) unsafe fn run(self, args: &m3c_contract::stage::abi::StepArgs) {
        // SAFETY: as the caller guarantees.
        unsafe {
            match self {
                Entry::Step => super::m3c_stage_step(args),
                Entry::DraftFirst => super::m3c_draft_first(args),
                Entry::DraftNext => super::m3c_draft_next(args),
            }
        }
    }
}

/// An entry's row buffers where it reads them.
struct EntryIo<'a> {
    device: Option<&'a dyn Gpu>,
    /// Device copies the entry reads, kept until it has run.
    inputs: Vec<DeviceBuffer>,
    scratch: Vec<ScratchBuffer>,
    /// Device buffers the entry writes, and the host slices they go back to.
    back: Vec<(u64, &'a mut [u8])>,
}

impl<'a> EntryIo<'a> {
    fn new(device: Option<&'a dyn Gpu>) -> EntryIo<'a> {
        EntryIo { device, inputs: Vec::new(), scratch: Vec::new(), back: Vec::new() }
    }

    /// `data`, which the entry only reads.
    fn read(&mut self, data: &[u8]) -> Result<u64, StageError> {
        match self.device {
            None => Ok(data.as_ptr() as u64),
            Some(d) => {
                let b = d.upload(data)?;
                let at = b.ptr();
                self.inputs.push(b);
                Ok(at)
            }
        }
    }

    /// `data`, which the entry reads and writes (`fetch`: its result comes
    /// back into `data`).
    fn read_write(&mut self, data: &'a mut [u8], fetch: bool) -> Result<u64, StageError> {
        match self.device {
            None => Ok(data.as_mut_ptr() as u64),
            Some(d) => {
                let b = d.upload(data)?;
                let at = b.ptr();
                self.inputs.push(b);
                if fetch {
                    self.back.push((at, data));
                }
                Ok(at)
            }
        }
    }

    /// A buffer of `data`'s size that the entry only writes (`fetch`: its
    /// result comes back into `data`).
    fn write(&mut self, data: &'a mut [u8], fetch: bool) -> u64 {
        match self.device {
            None => data.as_mut_ptr() as u64,
            Some(_) => {
                let b = ScratchBuffer::new(data.len());
                let at = b.ptr();
                self.scratch.push(b);
                if fetch {
                    self.back.push((at, data));
                }
                at
            }
        }
    }

    /// After the entry: what it wrote, back in the host slices.
    fn finish(self) -> Result<(), StageError> {
        if let Some(d) = self.device {
            d.sync()?;
            for (at, data) in self.back {
                d.download(at, data)?;
            }
        }
        Ok(())
    }
}

/// Runs one entry of the EAGLE3 draft head on `backing` (`first`: from
/// the aux rows `aux`, `[S, slots·hidden]`; else from `x`), leaving its
/// hidden state in `x`, its greedy ids in `out.ids` and `out.table`'s rows
/// as it wrote them. Its rows are few (a step's accepted rows, then one per
/// drafting sequence), so it runs eagerly, on buffers of its own.
pub(super) fn run_draft(
    backing: &mut dyn Backing,
    s: StepContext,
    first: bool,
    inp: &StepInputs,
    x: &mut [f32],
    aux: &mut [f32],
    out: &mut StepOut,
) -> Result<(), StageError> {
    let tables = backing.tables(&s);
    let device = backing.device();
    if let Some(d) = device {
        d.set_prefill(inp.segments.iter().any(|s| s.rows > 1));
    }
    let mut io = EntryIo::new(device);
    // No bias or image rows: a draft's logits are its own vocabulary's.
    let buffers = RowBuffers {
        ids: io.read(bytes_of(inp.ids))?,
        pos: io.read(bytes_of(&inp.pos))?,
        seen: io.read(bytes_of(&inp.seen))?,
        bitmap_rows: inp.bitmap_rows,
        x: io.read_write(bytes_of_mut(x), true)?,
        aux: if first { io.read_write(bytes_of_mut(aux), false)? } else { 0 },
        table: io.read_write(bytes_of_mut(&mut out.table), true)?,
        logits: io.write(bytes_of_mut(&mut out.logits), false),
        out_ids: io.write(bytes_of_mut(&mut out.ids), true),
        ..Default::default()
    };
    let entry = if first { Entry::DraftFirst } else { Entry::DraftNext };
    // The tables are the stage's (weights of the compiled shapes, pools of
    // `pool_rows` rows, block tables covering every segment's positions,
    // `seq_tables`); on a GPU stage the buffers are the device copies
    // above, alive until `finish`.
    // SAFETY: as above, and every row buffer holds `tokens` rows of its
    // kind (the draft's vocabulary for the logits), the bitmaps the caller
    // sized, and, for the first entry, the aux rows.
    unsafe { entry.run(&inp.args(&tables, &buffers)) };
    io.finish()
}
