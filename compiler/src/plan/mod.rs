//! Partition plans: the YAML format, its validation, the cost model, and the
//! balanced planner (`m3c plan`).

mod balance;
mod cost;
pub mod draft;
mod format;
mod links;
mod locate;
pub mod recovery;
mod report;

pub use balance::{balance, brute_force, min_stages, Item, Split};
pub use cost::{expected_experts, part_costs, GpuProfile, PartCost, Workload, USABLE_MEMORY};
pub use draft::{draft_section, DraftHead};
pub use format::{load_plan, parse_plan, plan_model, valid_arch, valid_host, LayerRange, Placement, Plan, PlanError, StagePlan, Target};
pub use links::Link;
pub use report::{even_plan, plan_svg, plan_yaml, stage_costs, table, StageCost};

use crate::config::ModelConfig;
use crate::model::Part;

#[derive(Debug, thiserror::Error)]
pub enum PlanningError {
    #[error("--pp {pp}: the model has {items} pipeline units (embedding, {layers} layers, head), so at most {items} stages")]
    TooManyStages { pp: usize, items: usize, layers: usize },
    #[error("--pp 0: a pipeline needs at least one stage")]
    NoStages,
    #[error("no split into {pp} stages fits {gpu} ({usable:.1} GB usable per GPU at batch {batch}, context {context}); {hint}")]
    DoesNotFit { pp: usize, gpu: String, usable: f64, batch: usize, context: usize, hint: String },
}

/// The pipeline units in order: embedding, each layer, then the head
/// (final norm + lm_head), which the planner keeps together.
fn items(cfg: &ModelConfig, gpu: &GpuProfile, w: Workload) -> Vec<Item> {
    let costs = part_costs(cfg, w);
    let item = |c: PartCost| Item { time: c.time(gpu), memory: c.memory(w) };
    // The vision tower sits with the embedding (the plan's default).
    let mut first = costs[&Part::Embedding].clone();
    if let Some(v) = costs.get(&Part::Vision) {
        first.add(v);
    }
    let mut out = vec![item(first)];
    for l in 0..cfg.text.num_layers {
        out.push(item(costs[&Part::Layer(l)].clone()));
    }
    let mut head = costs[&Part::FinalNorm].clone();
    head.add(&costs[&Part::LmHead]);
    out.push(item(head));
    out
}

/// The balanced plan for `pp` stages on `gpu` at workload `w`.
pub fn make_plan(cfg: &ModelConfig, pp: usize, gpu: &GpuProfile, w: Workload, target: Target) -> Result<Plan, PlanningError> {
    let items = items(cfg, gpu, w);
    if pp == 0 {
        return Err(PlanningError::NoStages);
    }
    if pp > items.len() {
        return Err(PlanningError::TooManyStages { pp, items: items.len(), layers: cfg.text.num_layers });
    }
    let cap = gpu.usable_memory();
    let split = balance(&items, pp, cap).ok_or_else(|| {
        let hint = match min_stages(&items, cap) {
            Some(k) => format!("at least --pp {k} is needed, or a GPU with more memory (--gpu, --gpu-mem), or a smaller --batch/--context"),
            None => "one layer alone is larger than a GPU: use a GPU with more memory or a smaller --batch/--context".into(),
        };
        PlanningError::DoesNotFit { pp, gpu: gpu.name.clone(), usable: cap / 1e9, batch: w.batch, context: w.context, hint }
    })?;
    let n_layers = cfg.text.num_layers;
    let stages = split
        .bounds
        .windows(2)
        .map(|b| {
            let (a, e) = (b[0], b[1]);
            // Item i ≥ 1 and ≤ n_layers is layer i − 1.
            let first = a.max(1);
            let last = e.min(n_layers + 1);
            StagePlan {
                layers: (first < last).then(|| LayerRange { first: first - 1, last: last - 2 }),
                embedding: a == 0,
                final_norm: e == n_layers + 2,
                lm_head: e == n_layers + 2,
                vision: a == 0 && cfg.vision.is_some(),
                vision_from: None,
                place: Placement::default(),
            }
        })
        .collect();
    Ok(Plan { model: None, target, stages, links: Default::default(), draft: None, encoders: None })
}
