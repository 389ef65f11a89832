//! The per-stage table (`m3c plan`, `m3c plan --check`) and plan YAML output.

use super::cost::{part_costs, GpuProfile, PartCost, Workload, USABLE_MEMORY};
use super::format::{LayerRange, Placement, Plan, StagePlan, Target};
use crate::config::ModelConfig;
use std::fmt::Write;

/// The summed cost of one stage.
#[derive(Debug, Clone, PartialEq)]
pub struct StageCost {
    pub cost: PartCost,
    pub time: f64,
    pub memory: f64,
}

pub fn stage_costs(cfg: &ModelConfig, plan: &Plan, gpu: &GpuProfile, w: Workload) -> Vec<StageCost> {
    let parts = part_costs(cfg, w);
    plan.stages
        .iter()
        .map(|s| {
            let mut cost = PartCost::default();
            for p in s.parts() {
                // (A text-only model has no vision part to add.)
                if let Some(c) = parts.get(&p) {
                    cost.add(c);
                }
            }
            let time = cost.time(gpu);
            let memory = cost.memory(w);
            StageCost { cost, time, memory }
        })
        .collect()
}

/// An even split by layer count (the default of other engines), for comparison.
pub fn even_plan(cfg: &ModelConfig, pp: usize) -> Option<Plan> {
    let n = cfg.text.num_layers;
    if pp == 0 || pp > n {
        return None;
    }
    let mut first = 0;
    let stages = (0..pp)
        .map(|k| {
            let len = n / pp + usize::from(k < n % pp);
            let r = LayerRange { first, last: first + len - 1 };
            first += len;
            StagePlan {
                layers: Some(r),
                embedding: k == 0,
                final_norm: k == pp - 1,
                lm_head: k == pp - 1,
                vision: k == 0,
                vision_from: None,
                place: Placement::default(),
            }
        })
        .collect();
    Some(Plan { model: None, target: Target::Host, stages, links: Default::default(), draft: None, encoders: None })
}

fn summary(costs: &[StageCost]) -> (f64, f64, usize) {
    let slow = costs.iter().map(|c| c.time).fold(0.0, f64::max);
    let sum: f64 = costs.iter().map(|c| c.time).sum();
    let bubble = if slow > 0.0 { 1.0 - sum / (costs.len() as f64 * slow) } else { 0.0 };
    let at = costs.iter().position(|c| c.time == slow).unwrap_or(0);
    (slow, bubble, at)
}

fn counts(plan: &Plan) -> String {
    plan.stages.iter().map(|s| s.layers.map_or(0, |r| r.len()).to_string()).collect::<Vec<_>>().join("/")
}

/// Where the vision tower is and what one image costs it: a 672×672
/// image's encode (at the GPU's FLOP rate) against the stage's step.
fn vision_line(cfg: &ModelConfig, plan: &Plan, gpu: &GpuProfile, costs: &[StageCost], (tu, ts): (&str, f64)) -> Option<String> {
    let flops = super::cost::vision_encode_flops(cfg, super::cost::IMAGE_672_PATCHES)?;
    let t = flops / gpu.flops;
    let (at, place, k) = match (&plan.encoders, plan.stages.iter().position(|s| s.vision)) {
        (Some(e), _) => {
            let n = plan.stages.len();
            let w = super::cost::Workload { batch: 1, context: 1, kv_cache: Default::default() };
            let weights: f64 = super::cost::part_costs(cfg, w).get(&crate::model::Part::Vision).map_or(0.0, |c| c.weight_bytes);
            let (bu, bs) = if weights < 1e9 { ("MB", 1e6) } else { ("GB", 1e9) };
            let ranks = format!(
                "{} encoder rank(s) of their own (ranks {n}..{}, {:.2} {bu} of weights each)",
                e.ranks,
                n + e.ranks - 1,
                weights / bs
            );
            (ranks, "features go to stage 0".to_string(), 0)
        }
        (None, Some(k)) => {
            let place =
                if plan.stages[k].embedding { "beside the first stage's steps" } else { "beside its own steps; features go to stage 0" };
            (format!("stage {k}"), place.to_string(), k)
        }
        (None, None) => return None,
    };
    let steps = t / costs[k].time.max(1e-12);
    Some(format!(
        "vision tower on {at} ({place}): a 672x672 image ({} patches) is {:.1} GFLOP, {:.3} {tu} of encode = {steps:.1} of stage {k}'s steps\n",
        super::cost::IMAGE_672_PATCHES,
        flops / 1e9,
        t * ts
    ))
}

/// The per-stage table, with the bottleneck, the bubble and (for comparison)
/// what an even split by layer count would give.
pub fn table(cfg: &ModelConfig, plan: &Plan, gpu: &GpuProfile, w: Workload) -> String {
    let costs = stage_costs(cfg, plan, gpu, w);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "GPU {}: {:.0} GB ({:.0}% usable for weights and caches), {:.2} TB/s, {:.0} TFLOP/s bf16; decode step at batch {}, context {}",
        gpu.name,
        gpu.memory / 1e9,
        USABLE_MEMORY * 100.0,
        gpu.bandwidth / 1e12,
        gpu.flops / 1e12,
        w.batch,
        w.context
    );
    // Tiny models get MB and µs so that the table says something.
    let small = costs.iter().all(|c| c.memory < 1e9);
    let (bu, bs, tu, ts) = if small { ("MB", 1e6, "us", 1e6) } else { ("GB", 1e9, "ms", 1e3) };
    // The holds column fits its longest entry (32 at the least).
    let wide = plan.stages.iter().map(|s| s.describe().len()).max().unwrap_or(0).max(32);
    let _ = writeln!(
        o,
        "{:<5} {:<wide$} {:>7} {:>11} {:>13} {:>11} {:>12} {:>9}",
        "stage",
        "holds",
        "layers",
        format!("weights {bu}"),
        format!("KV {bu}/1k tok"),
        format!("memory {bu}"),
        format!("step {bu} read"),
        format!("step {tu}")
    );
    let cap = gpu.usable_memory();
    for (k, (s, c)) in plan.stages.iter().zip(&costs).enumerate() {
        let over = if c.memory > cap { "  > GPU memory" } else { "" };
        let _ = writeln!(
            o,
            "{:<5} {:<wide$} {:>7} {:>11.2} {:>13.3} {:>11.2} {:>12.3} {:>9.3}{over}",
            k,
            s.describe(),
            s.layers.map_or(0, |r| r.len()),
            c.cost.weight_bytes / bs,
            c.cost.cache_bytes_per_token * 1000.0 / bs,
            c.memory / bs,
            c.cost.step_bytes / bs,
            c.time * ts
        );
    }
    let (slow, bubble, at) = summary(&costs);
    let _ = writeln!(
        o,
        "slowest stage {at}: {:.3} {tu} per step; pipeline bubble (idle share of stage time at steady state) {:.1}%",
        slow * ts,
        bubble * 100.0
    );
    if let Some(line) = vision_line(cfg, plan, gpu, &costs, (tu, ts)) {
        o += &line;
    }
    let fits = costs.iter().all(|c| c.memory <= cap);
    if !fits {
        let _ = writeln!(o, "warning: some stage does not fit {} ({:.1} GB usable)", gpu.name, cap / 1e9);
    }
    o += &boundaries(cfg, plan, w, slow, (tu, ts));
    o += &super::recovery::prefill_line(cfg, plan, gpu, w);
    let healing = super::recovery::predict(cfg, plan, gpu, w, m3c_contract::stage_args::DEFAULT_TIMEOUT_S);
    o += &super::recovery::line(&healing, w);
    if let Some(even) = even_plan(cfg, plan.stages.len()) {
        if even.stages != plan.stages.iter().map(|s| StagePlan { place: Placement::default(), ..s.clone() }).collect::<Vec<_>>() {
            let ec = stage_costs(cfg, &even, gpu, w);
            let (eslow, ebubble, eat) = summary(&ec);
            let emax = ec.iter().map(|c| c.memory).fold(0.0, f64::max);
            let _ = writeln!(
                o,
                "even split {} would be: slowest stage {eat} ({}) {:.3} {tu}, bubble {:.1}%, largest stage {:.2} {bu}{}; this plan ({}) is {:.2}x faster per step",
                counts(&even),
                even.stages[eat].describe(),
                eslow * ts,
                ebubble * 100.0,
                emax / bs,
                if emax > cap { " (does not fit)" } else { "" },
                counts(plan),
                eslow / slow
            );
        }
    }
    o
}

/// What each stage boundary that crosses a link costs: a step's
/// activation rows (hidden width × the activation storage's bytes: bf16 on
/// GPU targets, f32 on the host) sent once, for a decode step of the
/// workload's batch and for a prefill of its context. Boundaries between
/// named, different hosts without a described link are pointed out.
fn boundaries(cfg: &ModelConfig, plan: &Plan, w: Workload, slowest: f64, (tu, ts): (&str, f64)) -> String {
    let mut o = String::new();
    let row = (cfg.text.hidden_size * if plan.target.is_gpu() { 2 } else { 4 }) as f64;
    let mut lines = Vec::new();
    let (mut decode, mut prefill) = (0.0, 0.0);
    for k in 0..plan.stages.len().saturating_sub(1) {
        let (a, b) = (&plan.stages[k], &plan.stages[k + 1]);
        match plan.boundary_link(k) {
            Some((name, link)) => {
                let (d, p) = (link.time(row * w.batch as f64), link.time(row * w.context as f64));
                decode += d;
                prefill += p;
                lines.push(format!(
                    "{:<8} {:<26} {:>7} {:>9.3} {:>9.3} {:>8} {:>10.3} {:>10.3}",
                    format!("{k}->{}", k + 1),
                    format!("{name} ({link})"),
                    w.batch,
                    row * w.batch as f64 / 1e6,
                    d * ts,
                    w.context,
                    row * w.context as f64 / 1e6,
                    p * ts
                ));
            }
            None if a.place.host.is_some() && b.place.host.is_some() && a.place.host != b.place.host => lines.push(format!(
                "{:<8} stages on {} and {}: describe the link between them (`links:`) to see its cost",
                format!("{k}->{}", k + 1),
                a.place.host.as_deref().unwrap_or_default(),
                b.place.host.as_deref().unwrap_or_default()
            )),
            None => {}
        }
    }
    if lines.is_empty() {
        return o;
    }
    let _ = writeln!(
        o,
        "stage boundaries across hosts: activation rows x {} x {} B each, sent once per step",
        cfg.text.hidden_size,
        row as usize / cfg.text.hidden_size
    );
    let _ = writeln!(o, "{:<8} {:<26} {:>7} {:>9} {:>9} {:>8} {:>10} {:>10}", "boundary", "link", "decode", "MB", tu, "prefill", "MB", tu);
    for l in lines {
        let _ = writeln!(o, "{l}");
    }
    if decode > 0.0 {
        let _ = writeln!(
            o,
            "crossing hosts adds {:.3} {tu} to each decoded token's trip through the pipeline ({:.1}% of the slowest stage's step; sends overlap other micro-batches' work) and {:.3} {tu} to a {}-token prefill",
            decode * ts,
            if slowest > 0.0 { decode / slowest * 100.0 } else { 0.0 },
            prefill * ts,
            w.context
        );
    }
    o
}

/// The plan as a picture (SVG): per stage a bar of its memory at the
/// workload, weights then caches, against the GPU's usable memory (a
/// dashed line; a stage over it is drawn red), its layers, and its
/// predicted step time, the slowest marked.
pub fn plan_svg(cfg: &ModelConfig, plan: &Plan, gpu: &GpuProfile, w: Workload) -> String {
    let costs = stage_costs(cfg, plan, gpu, w);
    let cap = gpu.usable_memory();
    let top = costs.iter().map(|c| c.memory).fold(cap, f64::max) * 1.1;
    let (slow, _, at) = summary(&costs);
    let small = costs.iter().all(|c| c.memory < 1e9);
    let (bu, bs, tu, ts) = if small { ("MB", 1e6, "us", 1e6) } else { ("GB", 1e9, "ms", 1e3) };
    let (left, bar, gap, chart_h, base) = (60.0, 90.0, 30.0, 300.0, 360.0);
    let width = left + (bar + gap) * costs.len() as f64 + 40.0;
    let y = |bytes: f64| base - bytes / top * chart_h;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="440" viewBox="0 0 {width} 440" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{left}" y="20">{} stages on {}: memory at batch {}, context {} (weights, KV); predicted step time</text>"#,
        plan.stages.len(),
        gpu.name,
        w.batch,
        w.context
    );
    let _ = writeln!(
        o,
        r##"<line x1="{left}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#d62728" stroke-dasharray="6 4"/><text x="4" y="{:.1}">{:.1} {bu}</text>"##,
        width - 20.0,
        y(cap),
        y(cap),
        y(cap) + 4.0,
        cap / bs
    );
    for (k, (s, c)) in plan.stages.iter().zip(&costs).enumerate() {
        let x = left + gap / 2.0 + (bar + gap) * k as f64;
        let kv = c.memory - c.cost.weight_bytes;
        let over = c.memory > cap;
        let (wy, ky) = (y(c.cost.weight_bytes), y(c.memory));
        let _ = writeln!(
            o,
            r##"<rect x="{x:.1}" y="{wy:.1}" width="{bar}" height="{:.1}" fill="{}"><title>stage {k} weights {:.2} {bu}</title></rect>"##,
            base - wy,
            if over { "#d62728" } else { "#4e79a7" },
            c.cost.weight_bytes / bs
        );
        let _ = writeln!(
            o,
            r##"<rect x="{x:.1}" y="{ky:.1}" width="{bar}" height="{:.1}" fill="#f28e2b"><title>stage {k} KV {:.2} {bu}</title></rect>"##,
            wy - ky,
            kv / bs
        );
        let mid = x + bar / 2.0;
        let _ = writeln!(o, r#"<text x="{mid:.1}" y="{:.1}" text-anchor="middle">{:.1} {bu}</text>"#, ky - 6.0, c.memory / bs);
        let _ = writeln!(o, r#"<text x="{mid:.1}" y="{:.1}" text-anchor="middle">stage {k}</text>"#, base + 16.0);
        let mut layers = s.layers.map_or("no layers".to_string(), |r| format!("layers {r}"));
        if s.vision {
            layers.push_str(" + vision");
        }
        let _ = writeln!(o, r#"<text x="{mid:.1}" y="{:.1}" text-anchor="middle">{layers}</text>"#, base + 32.0);
        let mark = if k == at { " (slowest)" } else { "" };
        let _ = writeln!(o, r#"<text x="{mid:.1}" y="{:.1}" text-anchor="middle">{:.3} {tu}{mark}</text>"#, base + 48.0, c.time * ts);
    }
    let ranks = plan.encoders.as_ref().map_or(String::new(), |e| format!("; vision tower on {} encoder rank(s) of their own", e.ranks));
    let _ = writeln!(o, r#"<text x="{left}" y="434">slowest stage {at}: {:.3} {tu} per step{ranks}</text>"#, slow * ts);
    o.push_str("</svg>\n");
    o
}

/// The plan as YAML, with the table as comments. `model` (and `draft`, an
/// EAGLE3 head's folder) are written as given.
pub fn plan_yaml(plan: &Plan, model: Option<&str>, draft: Option<&str>, header: &str, table: &str) -> String {
    let mut o = String::new();
    for line in header.lines().chain(table.lines()) {
        let _ = writeln!(o, "# {line}");
    }
    let _ = writeln!(o, "version: 1");
    if let Some(m) = model {
        let _ = writeln!(o, "model: {}", yaml_str(m));
    }
    if let Some(d) = draft {
        let _ = writeln!(o, "draft: {}", yaml_str(d));
    }
    match &plan.target {
        Target::Host => {
            let _ = writeln!(o, "target: host");
        }
        Target::Cuda { arch } | Target::Rocm { arch } => {
            let _ = writeln!(o, "target: {}\narch: {arch}", plan.target.name());
        }
    }
    if !plan.links.is_empty() {
        let _ = writeln!(o, "links:");
        for (name, link) in &plan.links {
            let _ = writeln!(o, "  {name}: \"{link}\"");
        }
    }
    let _ = writeln!(o, "stages:");
    for (k, s) in plan.stages.iter().enumerate() {
        let mut fields: Vec<String> = Vec::new();
        if let Some(r) = s.layers {
            fields.push(format!("layers: \"{r}\""));
        }
        // The parts a stage holds, where they differ from a key's default.
        let parts = [
            ("embedding: true", s.embedding),
            ("final_norm: true", s.final_norm),
            ("lm_head: true", s.lm_head),
            ("vision: false", s.embedding && !s.vision && s.vision_from.is_none()),
            ("vision: true", !s.embedding && s.vision),
        ];
        fields.extend(parts.iter().filter(|(_, set)| *set).map(|(field, _)| field.to_string()));
        if let Some(d) = s.place.device {
            fields.push(format!("device: {d}"));
        }
        if let Some(h) = &s.place.host {
            fields.push(format!("host: {}", yaml_str(h)));
        }
        if let Some(l) = &s.place.link {
            fields.push(format!("link: {}", yaml_str(l)));
        }
        for (i, f) in fields.iter().enumerate() {
            let lead = if i == 0 { "  - " } else { "    " };
            let note = if i == 0 { format!("   # stage {k}") } else { String::new() };
            let _ = writeln!(o, "{lead}{f}{note}");
        }
    }
    o
}

fn yaml_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""))
}
