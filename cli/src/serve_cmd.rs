//! `m3c serve`: a compiled folder, or a model folder compiled on first start
//! (vLLM's `vllm serve MODEL --pipeline-parallel-size N ...`), then the
//! server. A model folder's build lives in the build cache, keyed by what
//! was asked of it, and is reused while its compile id is the one a compile
//! would give now.

use crate::flags::{CompileArgs, ServeArgs};
use anyhow::{bail, Context, Result};
use m3c_contract::speculative::SpeculativeConfig;
use std::path::{Path, PathBuf};

pub(crate) fn serve_cmd(mut a: ServeArgs) -> Result<()> {
    check_vllm_flags(&a)?;
    a.activations = activations_of_dtype(&a)?;
    check_before_compiling(&a)?;
    let (out, model) = pipeline(&a)?;
    crate::check_weights_before_launch(&model)?;
    let kv_size = match (a.kv_blocks, a.kv_fraction.or(a.gpu_memory_utilization)) {
        (Some(n), _) => m3c_serve::KvSize::Blocks(n),
        (None, Some(f)) => m3c_serve::KvSize::Fraction(f),
        (None, None) => m3c_serve::KvSize::Budget((a.kv_budget as f64 * 1e9) as u64),
    };
    m3c_serve::run(m3c_serve::Options {
        out,
        model,
        host: a.host,
        port: a.port,
        api: m3c_serve::ApiOptions {
            served_model_name: a.served_model_name,
            api_key: a.api_key.or_else(|| std::env::var("M3C_API_KEY").ok().filter(|k| !k.is_empty())),
            default_max_tokens: a.default_max_tokens,
            media: m3c_serve::MediaPolicy {
                allowed_local: a.allowed_local_media_path,
                max_bytes: a.max_image_mb as u64 * (1 << 20),
                timeout: std::time::Duration::from_secs_f64(a.media_timeout_s),
                max_images: a.max_images_per_request,
                max_video_bytes: a.max_video_mb as u64 * (1 << 20),
                max_videos: a.max_videos_per_request,
                allowed_domains: a.allowed_media_domains,
                allow_private: a.allow_private_media_urls,
            },
            default_chat_template_kwargs: a.default_chat_template_kwargs.unwrap_or_default(),
            structured: m3c_serve::StructuredOutputs::from_json(&a.structured_outputs_config.unwrap_or_default())
                .map_err(|e| anyhow::anyhow!("--structured-outputs-config: {e}"))?,
        },
        max_batch: a.max_batch,
        kv_size,
        prefix_caching: !a.no_enable_prefix_caching,
        seed: a.vllm.seed,
        log_stats: !a.vllm.disable_log_stats,
        encoder: a.encoder.options(),
        max_queue: a.max_queue,
        prefill_chunk: a.prefill_chunk,
        timeout_s: a.timeout_s,
        grace_s: a.grace_s,
        gpu: a.gpu.modes(),
        launch: a.launch.launch()?,
        trace_dir: a.trace_dir,
        speculative: a.speculative_config,
        kv_events: match &a.kv_events_config {
            Some(text) => m3c_serve::KvEventsConfig::from_json(text).map_err(anyhow::Error::msg)?,
            None => None,
        },
        max_model_len: a.max_model_len,
        block_size: a.block_size,
        data_parallel_size: a.data_parallel_size,
        healing: m3c_serve::Healing { max_restarts: a.max_restarts, window: std::time::Duration::from_secs_f64(a.restart_window_s) },
    })
}

/// vLLM's flags that m3c takes with their meaning, checked; those it
/// accepts without effect are said once, here.
fn check_vllm_flags(a: &ServeArgs) -> Result<()> {
    if !(a.kv_budget > 0.0 && a.kv_budget <= 1e6) {
        bail!("--kv-budget {}: expected a positive number of GB (at most 1e6)", a.kv_budget);
    }
    for (flag, name) in [("--tool-call-parser", &a.tool_call_parser), ("--reasoning-parser", &a.reasoning_parser)] {
        let parsers = m3c_contract::chat_format::ChatFormat::all_parsers();
        if let Some(n) = name.as_deref().filter(|n| !parsers.contains(n)) {
            bail!("{flag} {n}: m3c's parsers are {parsers:?} (each family's chat template's tool calls and reasoning)");
        }
    }
    if let Some(n) = a.vllm.tensor_parallel_size.filter(|&n| n > 1) {
        bail!(
            "--tensor-parallel-size {n}: m3c splits a model into pipeline stages, not tensor shards; give --pipeline-parallel-size {n} (one stage per GPU)"
        );
    }
    if let Some(n) = a.vllm.max_num_batched_tokens {
        bail!(
            "--max-num-batched-tokens {n}: m3c has no per-step token budget; it bounds each prompt's chunk (--prefill-chunk TOKENS) and the sequences in a step (--max-batch N)"
        );
    }
    if a.trust_remote_code {
        eprintln!("m3c serve: --trust-remote-code has no effect: m3c runs no code from the model folder");
    }
    if let Some(mode) = &a.mm_encoder_tp_mode {
        eprintln!(
            "m3c serve: --mm-encoder-tp-mode {mode}: m3c does not shard the vision tower; it runs whole where the plan puts it (stage 0)"
        );
    }
    if a.enable_auto_tool_choice {
        eprintln!(
            "m3c serve: --enable-auto-tool-choice: tool calls are parsed from every chat answer (`tool_choice: auto` is the default)"
        );
    }
    Ok(())
}

/// What can be told wrong before a model folder's first-start compile
/// (seconds for the real config): the port, and `--block-size` and
/// `--max-model-len` against the config (the same checks, and words, as
/// after it).
fn check_before_compiling(a: &ServeArgs) -> Result<()> {
    if a.port != 0 {
        std::net::TcpListener::bind((a.host.as_str(), a.port))
            .with_context(|| format!("cannot listen on {}:{} (is another server there? give --port)", a.host, a.port))?;
    }
    let config = a.out.join("config.json");
    if a.out.join("manifest.json").is_file() || !config.is_file() {
        return Ok(());
    }
    let cfg = m3c_compiler::family::load_config(&config)?;
    let (block, context) = (cfg.text.kv_block(), cfg.text.max_position_embeddings);
    if let Some(b) = a.block_size.filter(|&b| b != block) {
        bail!(
            "--block-size {b}: {}'s caches are paged in blocks of its MSA block, {block} positions; give --block-size {block} or leave it out",
            a.out.display()
        );
    }
    if let Some(n) = a.max_model_len.filter(|&n| n > context) {
        bail!("--max-model-len {n}: {}'s context is {context} positions (max_position_embeddings); give at most that", a.out.display());
    }
    Ok(())
}

/// `--activations`, with vLLM's `--dtype` read into it: `auto` leaves the
/// default, `bfloat16` and `float32` name a storage (one that disagrees
/// with `--activations` is an error), `float16` is refused.
fn activations_of_dtype(a: &ServeArgs) -> Result<Option<crate::flags::ActivationStorage>> {
    use crate::flags::ActivationStorage;
    let wanted = match a.vllm.dtype.as_deref() {
        None | Some("auto") => return Ok(a.activations),
        Some("bfloat16" | "bf16") => ActivationStorage::Bf16,
        Some("float32" | "float") => ActivationStorage::F32,
        Some(d) => bail!("--dtype {d}: m3c stores activations in float32 or bfloat16 (--dtype bfloat16, or --activations bf16)"),
    };
    match a.activations {
        Some(given) if given != wanted => {
            bail!("--dtype {} and --activations {given:?} disagree: give one of them", a.vllm.dtype.as_deref().unwrap_or_default())
        }
        _ => Ok(Some(wanted)),
    }
}

/// The compiled folder and model folder to serve: as given (`OUT --model
/// MODEL`), or a model folder's build, compiled now unless the build cache
/// holds it.
fn pipeline(a: &ServeArgs) -> Result<(PathBuf, PathBuf)> {
    let compiled = a.out.join("manifest.json").is_file();
    let compile_flags = a.pipeline_parallel_size.is_some()
        || a.plan.is_some()
        || a.target.is_some()
        || a.kv_cache_dtype.is_some()
        || a.language_model_only
        || a.activations.is_some();
    match (compiled, &a.model) {
        (true, Some(model)) => {
            if compile_flags {
                bail!(
                    "{}: a compiled folder is served as it was compiled; --pipeline-parallel-size, --plan, --target, --kv-cache-dtype, --activations and --language-model-only apply to a model folder",
                    a.out.display()
                );
            }
            Ok((a.out.clone(), model.clone()))
        }
        (true, None) => bail!("{}: a compiled folder needs --model DIR, the checkpoint it was compiled for", a.out.display()),
        (false, Some(_)) => bail!(
            "{}: not a compiled folder (no manifest.json); serve a model folder as `m3c serve MODEL_DIR` (without --model)",
            a.out.display()
        ),
        (false, None) if a.out.join("config.json").is_file() => Ok((build(a)?, a.out.clone())),
        (false, None) => bail!("{}: neither a compiled folder (manifest.json) nor a model folder (config.json)", a.out.display()),
    }
}

/// The CPU a model folder's build is compiled for: this machine's own
/// (`native`) when every stage runs here (no --hostfile, and a plan that
/// names no host), since the build then never leaves it; else the portable
/// default. A stage started on a CPU without what its build uses says so
/// (the runtime's `cpu_check`).
fn here_only_cpu(a: &ServeArgs) -> Result<String> {
    let plan_names_a_host = match &a.plan {
        // A plan that does not load fails the compile itself, with its error.
        Some(p) => m3c_compiler::plan::load_plan(p, None).is_ok_and(|plan| plan.stages.iter().any(|s| s.place.host.is_some())),
        None => false,
    };
    let here = a.launch.hostfile.is_none() && !plan_names_a_host;
    Ok(if here { "native" } else { crate::flags::DEFAULT_CPU }.to_string())
}

/// The model folder's build for these flags: reused from the build cache
/// while its compile id is the one a compile would give now, else compiled
/// there (and the old one replaced).
fn build(a: &ServeArgs) -> Result<PathBuf> {
    let eagle3 = match &a.speculative_config {
        Some(SpeculativeConfig::Eagle3 { .. }) => a.speculative_config.clone(),
        _ => None,
    };
    let args = CompileArgs {
        plan: a.plan.clone(),
        model: Some(a.out.clone()),
        pp: a.pipeline_parallel_size,
        target: a.target.clone(),
        arch: None,
        out: PathBuf::new(),
        emit: Vec::new(),
        cpu: here_only_cpu(a)?,
        kv_cache: a.kv_cache_dtype.map_or(crate::flags::CacheStorage::F32, Into::into),
        activations: a.activations,
        cache_dir: None,
        no_cache: false,
        speculative_config: eagle3,
    };
    let t0 = std::time::Instant::now();
    let mut inputs = crate::compile_cmd::inputs(&args)?;
    if a.language_model_only {
        // No vision tower compiled or loaded: a text-only deployment.
        inputs.plan.stages.iter_mut().for_each(|s| s.vision = false);
    }
    let dir = build_dir(a, &inputs)?;
    let out = dir.join("out");
    let req = inputs.request(&out);
    let want = m3c_compiler::compile::compile_id(&req)?;
    let have = std::fs::read_to_string(out.join("manifest.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<m3c_compiler::compile::Manifest>(&t).ok())
        .map(|m| m.compile_id);
    match have {
        Some(id) if id == want => {
            eprintln!("m3c serve: the build of {} in {} is current (compile id {}…)", a.out.display(), out.display(), &want[..12]);
        }
        other => {
            let why = if other.is_some() { "is stale (another compile id)" } else { "is not built yet" };
            eprintln!(
                "m3c serve: the build of {} for {} at pp {} {why}; compiling it into {} (kernels come from the object cache where it has them)",
                a.out.display(),
                inputs.plan.target,
                inputs.plan.stages.len(),
                out.display()
            );
            let compiled = m3c_compiler::compile::compile(&req)?;
            eprint!("{}", crate::compile_cmd::compiled_lines(&compiled, &out, &inputs.model, t0));
        }
    }
    Ok(out)
}

/// The build cache's folder for a model folder and what was asked of it:
/// the config's and the plan's bytes, the split, target, storages (caches
/// and activations), CPU, the vision choice and a draft's config, so builds
/// for other flags live side by side. (The compile id then decides whether
/// what it holds is current: the runtime and the compiler are in it.)
fn build_dir(a: &ServeArgs, inputs: &crate::compile_cmd::Inputs) -> Result<PathBuf> {
    let root = m3c_compiler::compile::cache::default_dir()
        .context("no cache folder for the build: set M3C_CACHE_DIR, XDG_CACHE_HOME or HOME")?
        .join("builds");
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("cannot read {}", p.display()));
    let draft = match inputs.draft_config() {
        Some(f) => read(&f)?,
        None => Vec::new(),
    };
    let mut all = Vec::new();
    for part in [
        read(&inputs.src.config.source)?,
        a.plan.as_deref().map(read).transpose()?.unwrap_or_default(),
        inputs.choices().into_bytes(),
        draft,
    ] {
        all.extend((part.len() as u64).to_le_bytes());
        all.extend(part);
    }
    let key = &m3c_compiler::compile::sha256_hex(&all)[..24];
    let name = a.out.canonicalize().ok().and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned())).unwrap_or_default();
    let safe: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
    let dir = root.join(format!("{safe}-{key}"));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create the build folder {}", dir.display()))?;
    Ok(dir)
}
