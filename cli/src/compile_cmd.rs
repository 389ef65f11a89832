//! `m3c compile`: one executable per stage, a manifest and a launcher.

use crate::flags::CompileArgs;
use crate::say;
use anyhow::{bail, Context, Result};
use m3c_compiler::plan::{self, GpuProfile, Target, Workload};
use m3c_compiler::source::ModelSource;

/// Everything a compile request borrows, read and checked from the flags.
pub(crate) struct Inputs {
    pub(crate) model: std::path::PathBuf,
    pub(crate) src: ModelSource,
    pub(crate) plan: plan::Plan,
    emit: Vec<m3c_compiler::compile::Emit>,
    cpu: String,
    storages: m3c_compiler::lower::Storages,
    runtime_lib: std::path::PathBuf,
    cache: Option<std::path::PathBuf>,
    draft: Option<plan::DraftHead>,
}

impl Inputs {
    /// What the flags chose besides the model and plan files: the plan as
    /// read, the storages and the CPU (a build folder's key).
    pub(crate) fn choices(&self) -> String {
        format!("{:?} {:?} {}", self.plan, self.storages, self.cpu)
    }

    /// The EAGLE3 draft's config.json, when a head is compiled in.
    pub(crate) fn draft_config(&self) -> Option<std::path::PathBuf> {
        self.draft.as_ref().map(|d| d.source.join("config.json"))
    }

    /// The request that compiles these inputs into `out`.
    pub(crate) fn request<'a>(&'a self, out: &'a std::path::Path) -> m3c_compiler::compile::CompileRequest<'a> {
        m3c_compiler::compile::CompileRequest {
            config: &self.src.config,
            plan: &self.plan,
            out,
            emit: self.emit.clone(),
            cpu: self.cpu.clone(),
            storages: self.storages,
            runtime_lib: self.runtime_lib.clone(),
            cache: self.cache.clone(),
            draft: self.draft.as_ref(),
        }
    }
}

pub(crate) fn compile_cmd(args: CompileArgs) -> Result<()> {
    let t0 = std::time::Instant::now();
    let inputs = inputs(&args)?;
    m3c_compiler::compile::check_out_path(&args.out, &inputs.model)?;
    let compiled = m3c_compiler::compile::compile(&inputs.request(&args.out)).map_err(|e| match (&args.plan, &inputs.plan.target) {
        // A GPU plan on a machine without the toolkit: say where the target came from.
        (Some(file), t @ (Target::Cuda { .. } | Target::Rocm { .. })) => anyhow::anyhow!(
            "{}: compiling its `target: {t}` (what `m3c plan --gpu` writes): {e:#}\n(give --target host to compile the plan's split for this machine)",
            file.display()
        ),
        _ => e,
    })?;
    say(&compiled_lines(&compiled, &args.out, &inputs.model, t0))
}

/// What `m3c compile` says of a finished compile.
pub(crate) fn compiled_lines(
    compiled: &m3c_compiler::compile::Compiled,
    out: &std::path::Path,
    model: &std::path::Path,
    t0: std::time::Instant,
) -> String {
    let m = &compiled.manifest;
    let mut text = String::new();
    for s in &m.stages {
        text += &format!("{}/{}: {} ({} kernels, {} tensors)\n", out.display(), s.executable, s.holds, s.kernels.len(), s.tensors.len());
    }
    if let Some(e) = &m.encoder {
        text +=
            &format!("{}/{}: the vision tower, run by {} encoder rank(s) after the stages\n", out.display(), e.executable, e.hosts.len());
    }
    // The hint shows text prompts where the checkpoint can read them.
    let prompt = if model.is_dir() && model.join("tokenizer.json").is_file() { "--prompt \"Hello\"" } else { "--prompt-ids 1,2,3" };
    text += &format!(
        "compiled {} stage(s) for {} in {:.1} s ({} units, {} from the object cache); run: m3c run {} --model DIR {prompt} --max-new-tokens 16\n",
        m.stages.len(),
        m.target,
        t0.elapsed().as_secs_f64(),
        compiled.units,
        compiled.from_cache,
        out.display()
    );
    text
}

/// The model, plan, storages, draft and caches the flags name, checked.
pub(crate) fn inputs(args: &CompileArgs) -> Result<Inputs> {
    let plan_model = match &args.plan {
        Some(p) => plan::plan_model(p)?,
        None => None,
    };
    let model = match (&args.model, plan_model) {
        (Some(m), _) => m.clone(),
        (None, Some(m)) => m,
        (None, None) => bail!("--model is required (a checkpoint folder or config.json), unless the plan names its model"),
    };
    let src = ModelSource::open(&model)?;
    let cfg = &src.config;
    let want_target = match (args.target.as_deref(), args.arch.as_deref()) {
        (Some(t), arch) => Some(Target::named(t, arch).map_err(|e| anyhow::anyhow!("--target {t} --arch: {e}"))?),
        (None, Some(_)) => bail!("--arch needs --target cuda or --target rocm"),
        (None, None) => None,
    };
    let p = match &args.plan {
        Some(file) => {
            let mut p = plan::load_plan(file, Some(cfg))?;
            if let Some(pp) = args.pp {
                p.check_pp(file, pp)?;
            }
            if args.arch.is_some() {
                bail!("--arch: {} names its own (`arch:`); change it there", file.display());
            }
            match &want_target {
                // The plan's split, compiled for this machine.
                Some(Target::Host) if p.target != Target::Host => {
                    eprintln!(
                        "m3c compile: --target host: compiling {}'s {} stages for this machine, in place of its `target: {}`",
                        file.display(),
                        p.stages.len(),
                        p.target
                    );
                    p.target = Target::Host;
                }
                Some(t) if std::mem::discriminant(t) != std::mem::discriminant(&p.target) => bail!(
                    "--target {}: {} says `target: {}` (`m3c plan --gpu` writes the GPU's target); change the plan, or give --target host to compile its split for this machine",
                    args.target.as_deref().unwrap_or(""),
                    file.display(),
                    p.target
                ),
                _ => {}
            }
            p
        }
        None => {
            let target = want_target.unwrap_or(Target::Host);
            // Without a plan, the planner sizes stages for the target's
            // flagship memory.
            let mut gpu = GpuProfile::named(GpuProfile::default_name(target.name())).context("built-in GPU profile")?;
            if target == Target::Host {
                // Host stages live in host memory: balance time, do not cap by HBM.
                gpu.memory = f64::INFINITY;
                gpu.name = "host".into();
            }
            plan::make_plan(cfg, args.pp.unwrap_or(1), &gpu, Workload { batch: 1, context: 8192, kv_cache: args.kv_cache.into() }, target)?
        }
    };
    let mut emit = Vec::new();
    for e in &args.emit {
        emit.push(match e.as_str() {
            "mlir" => m3c_compiler::compile::Emit::Mlir,
            "llvm" => m3c_compiler::compile::Emit::Llvm,
            _ => m3c_compiler::compile::Emit::Ptx,
        });
    }
    let cpu = m3c_compiler::backend::resolve_cpu(&args.cpu)?;
    m3c_compiler::backend::check_cpu(&cpu)?;
    if emit.contains(&m3c_compiler::compile::Emit::Ptx) && !m3c_compiler::backend::backend(&p.target, &cpu).has_device_code() {
        bail!("--emit ptx needs a GPU target (--target cuda, or `target: cuda` in the plan); {} has no device code", p.target);
    }
    let runtime_lib = m3c_compiler::compile::find_runtime_lib()?;
    // GPUs default to bf16 activations (what inference runs in); the host
    // defaults to f32, the mode that matches the reference exactly.
    let activations = match (args.activations, &p.target) {
        (Some(a), _) => a.into(),
        (None, Target::Host) => m3c_compiler::lower::Storage::F32,
        (None, Target::Cuda { .. } | Target::Rocm { .. }) => m3c_compiler::lower::Storage::Bf16,
    };
    let storages = m3c_compiler::lower::Storages { kv_cache: args.kv_cache.into(), activations };
    let cache = match (&args.cache_dir, args.no_cache) {
        (_, true) => None,
        // A folder the user named must work (compile errors otherwise).
        (Some(dir), false) => Some(dir.clone()),
        // The default one is worth a warning, not a failed compile.
        (None, false) => m3c_compiler::compile::cache::default_dir().filter(|dir| match std::fs::create_dir_all(dir) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("m3c: warning: no object cache ({}: {e}); every unit is compiled", dir.display());
                false
            }
        }),
    };
    let draft = match &args.speculative_config {
        // A plan may name the head (`draft:`); the flag names it otherwise.
        None => match &p.draft {
            Some(dir) => Some(plan::DraftHead::load(dir)?.for_target(cfg).map_err(anyhow::Error::msg)?),
            None => None,
        },
        Some(m3c_contract::speculative::SpeculativeConfig::Ngram(_)) => {
            bail!("--speculative-config: n-gram drafts have nothing to compile; give them to `m3c run` or `m3c serve`")
        }
        Some(m3c_contract::speculative::SpeculativeConfig::Eagle3 { .. }) if p.draft.is_some() => {
            bail!("--speculative-config: the plan names its draft (`draft:`); give one of them")
        }
        Some(m3c_contract::speculative::SpeculativeConfig::Eagle3 { model, .. }) => {
            Some(plan::DraftHead::load(model)?.for_target(cfg).map_err(anyhow::Error::msg)?)
        }
    };
    Ok(Inputs { model, src, plan: p, emit, cpu, storages, runtime_lib, cache, draft })
}
