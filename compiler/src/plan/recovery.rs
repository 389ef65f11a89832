//! What a lost stage costs a serving pipeline that heals (`m3c serve
//! --max-restarts`), predicted for `m3c plan`'s table: detection, the lost
//! job's teardown, the new job's start (its weights copied again from the
//! page cache, the build reused), and the re-prefill of the requests in
//! flight, after which the next token comes.
//!
//! The tiny fixture's measured recovery (README, "A pipeline that heals")
//! is the check on the parts that do not scale with the model: the
//! teardown and the job's start. What scales, the weights' copy and the
//! re-prefill, comes from the cost model.

use super::cost::{GpuProfile, Workload};
use super::format::Plan;
use super::report::stage_costs;
use crate::config::ModelConfig;

/// Bytes a second a stage's weights reach its GPU from the page cache:
/// pageable host memory over PCIe 5 (the stages copy in parallel, one GPU
/// each). Pinned copies run at about four times this.
pub const PAGE_CACHE_TO_GPU: f64 = 12e9;

/// A restarted job's start besides its weights: processes, MPI's wire-up,
/// the CUDA context and the collectives library's communicators.
pub const JOB_START_S: f64 = 3.0;

/// The longest a lost job's teardown takes: mpirun's grace before it is
/// told to stop (`m3c serve` gives it 2 s; a killed stage ends the job at
/// once).
pub const TEARDOWN_S: f64 = 2.0;

/// A prediction of the parts of a recovery, in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// A stage that died is seen at once; a host that went silent after
    /// `--timeout-s`.
    pub detect_silent: f64,
    pub teardown: f64,
    pub start: f64,
    /// The largest stage's weights copied again from the page cache.
    pub weights: f64,
    /// The workload's sequences prefilled again (prompt and tokens sent),
    /// stage after stage: an upper bound, as chunks overlap across stages.
    pub reprefill: f64,
}

impl Recovery {
    /// From the fault to the next token, for a stage that died.
    pub fn after_a_death(&self) -> f64 {
        self.teardown + self.start + self.weights + self.reprefill
    }
}

/// The recovery of `plan` on `gpu` with the workload's sequences in flight
/// at its context, under `--timeout-s timeout_s`.
pub fn predict(cfg: &ModelConfig, plan: &Plan, gpu: &GpuProfile, w: Workload, timeout_s: f64) -> Recovery {
    let weights = stage_costs(cfg, plan, gpu, w).iter().map(|c| c.cost.weight_bytes).fold(0.0, f64::max);
    let reprefill = prefill_seconds(cfg, plan, gpu, w).iter().sum();
    Recovery { detect_silent: timeout_s, teardown: TEARDOWN_S, start: JOB_START_S, weights: weights / PAGE_CACHE_TO_GPU, reprefill }
}

/// Each stage's seconds to prefill the workload's sequences, every one
/// `w.context` tokens long, in one pass: the stage reads its weights once
/// and computes every row, a roofline of the two (its cache reads overlap
/// its compute in a tiled prefill). A row at position p attends to p keys
/// (to MSA's selected blocks on sparse layers): half the context on average.
pub fn prefill_seconds(cfg: &ModelConfig, plan: &Plan, gpu: &GpuProfile, w: Workload) -> Vec<f64> {
    let prefill = Workload { batch: w.batch * w.context, context: w.context.div_ceil(2), ..w };
    stage_costs(cfg, plan, gpu, prefill).iter().map(|c| (c.cost.weight_bytes / gpu.bandwidth).max(c.cost.step_flops / gpu.flops)).collect()
}

/// The table's line for a prefill of one prompt of the workload's context.
pub fn prefill_line(cfg: &ModelConfig, plan: &Plan, gpu: &GpuProfile, w: Workload) -> String {
    let stages = prefill_seconds(cfg, plan, gpu, Workload { batch: 1, ..w });
    let slowest = stages.iter().copied().fold(0.0, f64::max);
    let total: f64 = stages.iter().sum();
    format!(
        "prefill of one {}-token prompt, predicted: {:.3} s stage after stage (slowest stage {:.3} s; chunks overlap across stages, so between the two), {:.0} tok/s\n",
        w.context,
        total,
        slowest,
        w.context as f64 / total.max(f64::MIN_POSITIVE)
    )
}

/// The table's line for a recovery.
pub fn line(r: &Recovery, w: Workload) -> String {
    format!(
        "recovery of a lost stage (m3c serve --max-restarts), predicted: teardown <= {:.1} s, start {:.1} s + weights from the page cache {:.1} s (largest stage, {:.0} GB/s), re-prefill of {} sequence(s) at context {} {:.2} s: next token {:.1} s after a stage dies ({:.0} s more for a silent host, --timeout-s)\n",
        r.teardown,
        r.start,
        r.weights,
        PAGE_CACHE_TO_GPU / 1e9,
        w.batch,
        w.context,
        r.reprefill,
        r.after_a_death(),
        r.detect_silent
    )
}
