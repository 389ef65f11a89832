//! `m3c plan`: write a balanced partition plan, or check one.

use crate::flags::PlanArgs;
use crate::say;
use anyhow::{bail, Context, Result};
use m3c_compiler::plan::{self, GpuProfile, Target, Workload};
use m3c_compiler::source::ModelSource;
use std::path::{Path, PathBuf};

fn gpu_profile(args: &PlanArgs) -> Result<GpuProfile> {
    let name = args.gpu_name();
    let mut gpu =
        GpuProfile::named(name).with_context(|| format!("--gpu {name}: unknown GPU; known: {}", GpuProfile::known_names().join(", ")))?;
    if let Some(gb) = args.gpu_mem {
        if !(gb.is_finite() && gb > 0.0) {
            bail!("--gpu-mem {gb}: expected a positive number of GB");
        }
        gpu.memory = gb * 1e9;
        gpu.name = format!("{} with {gb} GB", gpu.name);
    }
    Ok(gpu)
}

pub(crate) fn plan_cmd(args: PlanArgs) -> Result<()> {
    let gpu = gpu_profile(&args)?;
    if args.batch == 0 || args.context == 0 {
        bail!("--batch and --context must be at least 1");
    }
    let w = Workload { batch: args.batch, context: args.context, kv_cache: args.kv_cache.into() };
    if let Some(file) = &args.check {
        let model = match (&args.model, plan::plan_model(file)?) {
            (Some(m), _) => m.clone(),
            (None, Some(m)) => m,
            (None, None) => bail!("{}: the plan names no `model:`; pass --model", file.display()),
        };
        let src = ModelSource::open(&model)?;
        let p = plan::load_plan(file, Some(&src.config))?;
        if let Some(pp) = args.pp {
            p.check_pp(file, pp)?;
        }
        say(&format!("{}: valid plan, {} stages, target {}\n", file.display(), p.stages.len(), p.target))?;
        say(&plan::table(&src.config, &p, &gpu, w))?;
        say(&draft_lines(&args, &src.config, &p, &gpu, w)?)?;
        return write_svg(&args, &src.config, &p, &gpu, w);
    }
    let model = args.model.as_ref().context("--model is required (a checkpoint folder or config.json)")?;
    let pp = args.pp.context("--pp N is required to make a plan (or --check PLAN.yaml to check one)")?;
    let src = ModelSource::open(model)?;
    let target =
        Target::named(args.target(), args.arch.as_deref()).map_err(|e| anyhow::anyhow!("--target {} --arch: {e}", args.target()))?;
    let p = plan::make_plan(&src.config, pp, &gpu, w, target)?;
    let draft = draft_lines(&args, &src.config, &p, &gpu, w)?;
    write_svg(&args, &src.config, &p, &gpu, w)?;
    let table = plan::table(&src.config, &p, &gpu, w);
    let header = format!(
        "m3c partition plan for {}, made by `m3c plan --pp {pp} --batch {} --context {} --kv-cache {} --gpu {}`",
        model.display(),
        args.batch,
        args.context,
        args.kv_cache,
        args.gpu_name()
    );
    // An EAGLE3 draft the plan was made with is named in it (`draft:`), so
    // `m3c compile PLAN` compiles its head in.
    let draft_dir = match &args.speculative_config {
        Some(m3c_contract::speculative::SpeculativeConfig::Eagle3 { model, .. }) => Some(model.as_path()),
        _ => None,
    };
    match &args.out {
        Some(out) => {
            let base = out.parent().unwrap_or(Path::new("."));
            let model_ref = relative_to(model, base);
            let draft_ref = draft_dir.map(|d| relative_to(d, base));
            let yaml = plan::plan_yaml(&p, Some(&model_ref), draft_ref.as_deref(), &header, &table);
            // Round-trip: what we write must validate.
            plan::parse_plan(out, &yaml, Some(&src.config)).context("internal: the written plan does not validate")?;
            m3c_compiler::fsutil::write_file_atomically(out, yaml.as_bytes())?;
            say(&format!("{table}{draft}wrote {}\n", out.display()))?;
        }
        None => {
            let draft_ref = draft_dir.map(|d| d.display().to_string());
            let yaml = plan::plan_yaml(&p, Some(&model.display().to_string()), draft_ref.as_deref(), &header, &table);
            plan::parse_plan(Path::new("<stdout>"), &yaml, Some(&src.config)).context("internal: the printed plan does not validate")?;
            say(&yaml)?;
            if !draft.is_empty() {
                eprint!("{draft}");
            }
        }
    }
    Ok(())
}

/// `--speculative-config`: an EAGLE3 draft's costs under the plan (an
/// n-gram draft has no weights and adds nothing).
fn draft_lines(args: &PlanArgs, cfg: &m3c_compiler::config::ModelConfig, p: &plan::Plan, gpu: &GpuProfile, w: Workload) -> Result<String> {
    use m3c_contract::speculative::SpeculativeConfig;
    match &args.speculative_config {
        None => Ok(String::new()),
        Some(SpeculativeConfig::Ngram(_)) => {
            Ok("n-gram drafts have no weights and send nothing between stages: the plan is unchanged\n".into())
        }
        Some(SpeculativeConfig::Eagle3 { model, tokens, .. }) => {
            let draft = plan::DraftHead::load(model)?.for_target(cfg).map_err(anyhow::Error::msg)?;
            // Activations cross stages in f32 on the host, bf16 on a GPU (the defaults).
            let act_bytes = if p.target == Target::Host { 4 } else { 2 };
            Ok(plan::draft_section(cfg, p, &draft, *tokens, gpu, w, act_bytes))
        }
    }
}

/// `target` written relative to `base` (both made absolute first), so a plan
/// names its model relative to the plan file's folder and the two can move
/// together; absolute when they share nothing but the root (a plan in
/// `/tmp` names `/work/model`, not `../../work/model`).
fn relative_to(target: &Path, base: &Path) -> String {
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let (t, b) = (abs(target), abs(if base.as_os_str().is_empty() { Path::new(".") } else { base }));
    let tc: Vec<_> = t.components().collect();
    let bc: Vec<_> = b.components().collect();
    let common = tc.iter().zip(&bc).take_while(|(a, b)| a == b).count();
    if common <= 1 {
        return t.display().to_string();
    }
    let mut r = PathBuf::new();
    for _ in common..bc.len() {
        r.push("..");
    }
    for c in &tc[common..] {
        r.push(c);
    }
    r.display().to_string()
}

/// `--svg`: the plan's picture.
fn write_svg(args: &PlanArgs, cfg: &m3c_compiler::config::ModelConfig, p: &plan::Plan, gpu: &GpuProfile, w: Workload) -> Result<()> {
    if let Some(out) = &args.svg {
        m3c_compiler::fsutil::write_file_atomically(out, plan::plan_svg(cfg, p, gpu, w).as_bytes())?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

/// The plan's predicted decode step per stage (its cost model on `gpu` at
/// `batch` and `context`) beside the trace's measured mean decode step.
pub(crate) fn predicted_beside(
    plan_file: &Path,
    t: &m3c_front::trace::Timeline,
    gpu: &str,
    batch: usize,
    context: usize,
) -> Result<String> {
    let gpu =
        GpuProfile::named(gpu).with_context(|| format!("--gpu {gpu}: unknown GPU; known: {}", GpuProfile::known_names().join(", ")))?;
    let model = plan::plan_model(plan_file)?.with_context(|| format!("{}: the plan names no `model:`", plan_file.display()))?;
    let src = ModelSource::open(&model)?;
    let p = plan::load_plan(plan_file, Some(&src.config))?;
    if p.stages.len() != t.stages.len() {
        bail!("{}: {} stages, but the trace has {}", plan_file.display(), p.stages.len(), t.stages.len());
    }
    let w = Workload { batch: batch.max(1), context: context.max(1), kv_cache: m3c_compiler::lower::Storage::F32 };
    let predicted = plan::stage_costs(&src.config, &p, &gpu, w);
    let measured = t.mean_steps("decode");
    let mut o = format!("predicted ({} at batch {batch}, context {context}) beside measured decode steps:\n", gpu.name);
    o += &format!("{:<6} {:<32} {:>14} {:>13} {:>8}\n", "stage", "holds", "predicted ms", "measured ms", "ratio");
    for (k, (s, c)) in p.stages.iter().zip(&predicted).enumerate() {
        let m = measured.get(&k).map(|us| us / 1e3);
        o += &format!(
            "{:<6} {:<32} {:>14.4} {:>13} {:>8}\n",
            k,
            s.describe(),
            c.time * 1e3,
            m.map_or("-".into(), |m| format!("{m:.4}")),
            m.map_or("-".into(), |m| format!("{:.2}", m / (c.time * 1e3).max(1e-12)))
        );
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::relative_to;
    use std::path::Path;

    #[test]
    fn a_plan_names_its_model_relative_only_when_they_share_a_folder() {
        assert_eq!(relative_to(Path::new("/work/models/m3"), Path::new("/work/plans")), "../models/m3");
        assert_eq!(relative_to(Path::new("/work/m3"), Path::new("/work")), "m3");
        assert_eq!(relative_to(Path::new("/work/m3"), Path::new("/tmp/x")), "/work/m3");
    }
}
