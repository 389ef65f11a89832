//! The `m3c` command line. Library code returns typed errors; this is the
//! edge where they get context and become a message and an exit code.
//! `src/main.rs` only calls [`main`], so that tests can build the same CLI.

use crate::plan::{self, GpuProfile, Target, Workload};
use crate::source::ModelSource;
use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use m3c_contract::stage_args::StageArgs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "m3c", bin_name = "m3c", version, about = "Compile MiniMax-M3 into pipeline-parallel executables")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show what a model holds: layers by kind, parameters, bytes by dtype, per-layer weights.
    Inspect {
        /// A checkpoint folder (config.json + safetensors) or a config.json.
        model: PathBuf,
        /// Print the model graph in its stable text form instead.
        #[arg(long)]
        graph: bool,
        /// Also read every weight and report each tensor holding NaN or Inf (exit 1 if any).
        #[arg(long, conflicts_with = "graph")]
        check_values: bool,
    },
    /// Write a balanced partition plan, or check one (`--check PLAN.yaml`).
    Plan(PlanArgs),
    /// Compile the model into one executable per pipeline stage (OUT/stage-K), a manifest and a launcher.
    Compile(CompileArgs),
    /// Run a compiled OUT folder under mpirun: one rank per stage, greedy decoding.
    Run(Box<RunArgs>),
    /// Serve a compiled OUT folder over HTTP with OpenAI's API (completions, chat), batching requests continuously.
    Serve(Box<ServeArgs>),
    /// Write a random tiny MiniMax-M3 checkpoint (hub layout) into a new folder.
    InitTiny {
        /// The folder to create.
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 8)]
        layers: usize,
        /// Hidden size (a multiple of 128); heads are 32 wide.
        #[arg(long, default_value_t = 128)]
        hidden: usize,
        /// Store every text-layer linear in MXFP8 like MiniMax-M3-MXFP8.
        #[arg(long)]
        mxfp8: bool,
        /// The vision tower's hidden size (MiniMax-M3: 1280).
        #[arg(long, default_value_t = 64)]
        vision_hidden: usize,
        /// Its attention heads (MiniMax-M3: 16).
        #[arg(long, default_value_t = 4)]
        vision_heads: usize,
        /// Its MLP width (MiniMax-M3: 5120).
        #[arg(long, default_value_t = 128)]
        vision_mlp: usize,
        /// Its layers (MiniMax-M3: 32).
        #[arg(long, default_value_t = 2)]
        vision_layers: usize,
        /// The projector and patch merger's hidden width (MiniMax-M3: 6144).
        #[arg(long, default_value_t = 96)]
        projector_hidden: usize,
    },
}

#[derive(clap::Args)]
struct PlanArgs {
    /// The model (folder or config.json). May be omitted with --check when the plan names it.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Validate this plan and print its per-stage table.
    #[arg(long, value_name = "PLAN.yaml", conflicts_with = "out")]
    check: Option<PathBuf>,
    /// Number of pipeline stages.
    #[arg(long)]
    pp: Option<usize>,
    /// Sequences decoded together (the cost model's batch).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Context length the KV caches must hold per sequence.
    #[arg(long, default_value_t = 8192)]
    context: usize,
    /// How the compiled stages will store K and V (as `m3c compile --kv-cache`).
    #[arg(long = "kv-cache", value_parser = ["f32", "bf16"], default_value = "f32")]
    kv_cache: String,
    /// GPU profile (H200, H100, H20, B200, A100, L40S).
    #[arg(long, default_value = "H200")]
    gpu: String,
    /// GPU memory in GB (overrides the profile's).
    #[arg(long, value_name = "GB")]
    gpu_mem: Option<f64>,
    /// Target the plan compiles for.
    #[arg(long, default_value = "host", value_parser = ["host", "cuda"])]
    target: String,
    /// CUDA architecture for --target cuda.
    #[arg(long, default_value = "sm_90a")]
    arch: String,
    /// Write the plan here instead of standard output.
    #[arg(short = 'o', long = "out", value_name = "PLAN.yaml")]
    out: Option<PathBuf>,
}

#[derive(clap::Args)]
struct CompileArgs {
    /// A partition plan; without one, the planner's balanced plan for --pp stages.
    plan: Option<PathBuf>,
    /// The model: a checkpoint folder or its config.json (weights are not read). May be omitted when the plan names it.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Number of pipeline stages (must equal the plan's).
    #[arg(long)]
    pp: usize,
    /// Target to compile for (default: the plan's, else host).
    #[arg(long, value_parser = ["host", "cuda"])]
    target: Option<String>,
    /// Output folder; an earlier m3c output there is replaced, anything else is refused.
    #[arg(short = 'o', long = "out", default_value = "out")]
    out: PathBuf,
    /// Also write intermediate code per stage: `mlir` (fused steps + MLIR), `llvm` (LLVM dialect + LLVM IR), `ptx` (CUDA).
    #[arg(long, value_parser = ["mlir", "llvm", "ptx"], action = clap::ArgAction::Append)]
    emit: Vec<String>,
    /// LLVM CPU for host code (`x86-64` runs anywhere; `x86-64-v3` needs AVX2).
    #[arg(long, default_value = "x86-64-v3")]
    cpu: String,
    /// How KV and MSA index-key caches store elements: `f32` (exact), or `bf16` (half the memory and attention reads; values rounded to nearest even).
    #[arg(long = "kv-cache", value_parser = ["f32", "bf16"], default_value = "f32")]
    kv_cache: String,
    /// How activations between kernels and stages are stored: `f32` (exact; the host default) or `bf16` (the cuda default: half the activation memory and bytes sent between stages; every kernel still computes and accumulates in f32).
    #[arg(long, value_parser = ["f32", "bf16"])]
    activations: Option<String>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// A folder written by `m3c compile`.
    out: PathBuf,
    /// The checkpoint folder (config.json + safetensors) the stages were compiled for.
    #[arg(long)]
    model: PathBuf,
    /// A prompt as token ids, `1,2,3`; repeat for several prompts (they run as concurrent micro-batches).
    #[arg(
        long = "prompt-ids",
        value_name = "IDS",
        required_unless_present_any = ["prompts", "prompt", "chat"],
        conflicts_with_all = ["prompts", "prompt", "chat"]
    )]
    prompt_ids: Vec<String>,
    /// A file with one prompt per line: token ids separated by commas, or JSON lines ({"prompt": TEXT} or {"messages": [...]}, with optional sampling fields).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "chat"])]
    prompts: Option<PathBuf>,
    /// A prompt as text, completed as it is (the checkpoint's tokenizer.json); repeat for several. The continuation streams to stdout.
    #[arg(long, value_name = "TEXT")]
    prompt: Vec<String>,
    /// One user turn through the checkpoint's chat template, with the generation prompt; repeat for several conversations.
    #[arg(long, value_name = "TEXT")]
    chat: Vec<String>,
    /// An image for the prompt (PNG, JPEG, WebP or GIF; repeatable, in order). With --chat, the user turn holds the images first, then the text; with --prompt-ids, the ids already hold one placeholder run per image.
    #[arg(long, value_name = "FILE")]
    image: Vec<PathBuf>,
    /// A system message before each --chat turn.
    #[arg(long, value_name = "TEXT", requires = "chat")]
    system: Option<String>,
    /// The template's thinking mode for --chat (default: the template's own, adaptive for MiniMax-M3).
    #[arg(long, value_parser = ["enabled", "disabled", "adaptive"], requires = "chat")]
    thinking: Option<String>,
    /// Tokens to generate per prompt, at most (a sequence also ends on an EOS id).
    #[arg(long, value_parser = count)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 = greedy. Default: the checkpoint's generation_config.json, else 0.
    #[arg(long, value_parser = number)]
    temperature: Option<f32>,
    /// Sample among the K most likely tokens only (0 = all). Default: generation_config.json's, else 0.
    #[arg(long, value_name = "K", value_parser = count)]
    top_k: Option<usize>,
    /// Sample among the most likely tokens that together reach probability P (1 = all). Default: generation_config.json's, else 1.
    #[arg(long, value_name = "P", value_parser = number)]
    top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one (0 = none). Default: generation_config.json's, else 0.
    #[arg(long, value_name = "P", value_parser = number)]
    min_p: Option<f32>,
    /// Above 1, tokens already in the sequence become less likely (Hugging Face's rule). Default: generation_config.json's, else 1.
    #[arg(long, value_name = "R", value_parser = number)]
    repetition_penalty: Option<f32>,
    /// Seed of the draws: with it, a prompt's tokens are the same at any pp, batch or thread count.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// End a sequence once its text holds STR (repeatable; it may span tokens). The stop string is not printed.
    #[arg(long, value_name = "STR", value_parser = stop_string)]
    stop: Vec<String>,
    /// Do not end a sequence on an EOS id (generation_config.json's eos_token_id, else config.json's).
    #[arg(long)]
    ignore_eos: bool,
    /// Write prompt_ids, prefill_logits, generated_ids and decode_logits here (several prompts: FILE.p0.safetensors, ...).
    #[arg(long, value_name = "FILE.safetensors")]
    dump: Option<PathBuf>,
    /// Sequences per micro-batch (default: the prompts shared evenly over the stages).
    #[arg(long, value_name = "SEQS", value_parser = positive_count)]
    micro_batch: Option<usize>,
    /// Prefill long prompts in chunks of this many tokens, so they pipeline through the stages.
    #[arg(long, value_name = "TOKENS", value_parser = positive_count)]
    prefill_chunk: Option<usize>,
    /// Compare the first prompt's logits and ids with a golden file (the fixtures' tensor names); fail if they differ.
    #[arg(long, value_name = "GOLDEN.safetensors")]
    expect: Option<PathBuf>,
    /// Seconds without a sign of life (a heartbeat) from a neighbour before a stage gives up on it; a stage that computes counts as alive.
    #[arg(long, default_value_t = 30.0, value_parser = timeout_s)]
    timeout_s: f64,
    /// CUDA stages: capture each decode micro-batch's step once as a CUDA graph and replay it (`off`: launch every kernel each step).
    #[arg(long, value_parser = ["on", "off"], default_value = "on")]
    cuda_graphs: String,
    /// CUDA stages: run prefill linears with bf16 weights as cuBLAS tensor-core GEMMs (activations rounded to bf16 for them; `M3C_GEMM_MIN_ROWS`, default 32, sets the smallest step), or `off`: m3c's GEMV kernel, exact f32.
    #[arg(long, value_parser = ["cublas", "off"], default_value = "off")]
    prefill_gemm: String,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// A folder written by `m3c compile`.
    out: PathBuf,
    /// The checkpoint folder (config.json, safetensors, tokenizer.json) the stages were compiled for.
    #[arg(long)]
    model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients use (default: the checkpoint folder's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on the /v1 routes (default: $M3C_API_KEY, else none).
    #[arg(long)]
    api_key: Option<String>,
    /// Sequences running at once (more wait).
    #[arg(long, default_value_t = 64, value_parser = positive_count)]
    max_batch: usize,
    /// Cache memory per stage for the running sequences, in GB; a request reserves its prompt plus max_tokens.
    #[arg(long, value_name = "GB", default_value_t = 8.0, value_parser = number)]
    kv_budget: f32,
    /// Requests that may wait for a slot; past that a request gets 503.
    #[arg(long, default_value_t = 256, value_parser = count)]
    max_queue: usize,
    /// Prefill long prompts in chunks of this many tokens, alongside the running decodes.
    #[arg(long, value_name = "TOKENS", default_value_t = 256, value_parser = positive_count)]
    prefill_chunk: usize,
    /// `max_tokens` of a chat request that sets none (capped by the context); a request reserves cache for all of it.
    #[arg(long, value_name = "TOKENS", default_value_t = 4096, value_parser = positive_count)]
    default_max_tokens: usize,
    /// Seconds without a heartbeat before a stage is declared lost.
    #[arg(long, default_value_t = 30.0, value_parser = timeout_s)]
    timeout_s: f64,
    /// Seconds in-flight requests get to finish after SIGTERM or SIGINT.
    #[arg(long, default_value_t = 30.0, value_parser = timeout_s)]
    grace_s: f64,
    /// CUDA stages: replay decode steps as CUDA graphs.
    #[arg(long, value_parser = ["on", "off"], default_value = "on")]
    cuda_graphs: String,
    /// CUDA stages: prefill linears on cuBLAS tensor cores (`cublas`) or m3c's GEMV (`off`).
    #[arg(long, value_parser = ["cublas", "off"], default_value = "off")]
    prefill_gemm: String,
    /// Chat images given as file:// URLs are read only from inside this folder (without it, file:// URLs are refused).
    #[arg(long, value_name = "DIR")]
    allowed_local_media_path: Option<PathBuf>,
    /// Seconds an http(s) image fetch may take in all.
    #[arg(long, default_value_t = 10.0, value_parser = timeout_s)]
    media_timeout_s: f64,
    /// The largest image a request may bring, in MB (data:, http(s) or file).
    #[arg(long, default_value_t = 20, value_parser = positive_count)]
    max_image_mb: usize,
    /// The most images one request may carry.
    #[arg(long, default_value_t = 8, value_parser = positive_count)]
    max_images_per_request: usize,
}

fn count(v: &str) -> Result<usize, String> {
    m3c_contract::prompts::parse_count(v, "count", false).map_err(|_| format!("`{v}` is not a count (0 to {})", usize::MAX))
}

fn positive_count(v: &str) -> Result<usize, String> {
    m3c_contract::prompts::parse_count(v, "count", true).map_err(|_| format!("`{v}` is not a positive count"))
}

fn stop_string(v: &str) -> Result<String, String> {
    match v.len() {
        0 => Err("a stop string cannot be empty".into()),
        1..=1024 => Ok(v.to_string()),
        n => Err(format!("a stop string of {n} bytes; at most 1024")),
    }
}

fn number(v: &str) -> Result<f32, String> {
    m3c_contract::prompts::parse_number(v, "value").map_err(|_| format!("`{v}` is not a number"))
}

fn timeout_s(v: &str) -> Result<f64, String> {
    m3c_contract::prompts::parse_timeout_s(v)
}

/// Writes to standard output. A closed pipe ends the process quietly by
/// SIGPIPE, as `cat` does (see [`main`]); any other failure, such as a full
/// disk, is an error.
pub fn say(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).context("cannot write to standard output")
}

/// Parses the process arguments, runs the command, and turns errors into a message and exit code 1.
pub fn main() -> ExitCode {
    // Rust ignores SIGPIPE; restore the default so that `m3c ... | head`
    // ends like other command-line tools instead of failing a write.
    // SAFETY: setting a signal disposition before any thread is started.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    crate::signals::install();
    crate::signals::install_llvm_fatal_handler();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Inspect { model, graph, check_values } => inspect(&model, graph, check_values),
        Command::Plan(args) => plan_cmd(args),
        Command::Compile(args) => compile_cmd(args),
        Command::Run(args) => run_cmd(*args),
        Command::Serve(a) => {
            if !(a.kv_budget > 0.0 && a.kv_budget <= 1e6) {
                bail!("--kv-budget {}: expected a positive number of GB (at most 1e6)", a.kv_budget);
            }
            crate::serve::run(crate::serve::Options {
                out: a.out,
                model: a.model,
                host: a.host,
                port: a.port,
                served_model_name: a.served_model_name,
                api_key: a.api_key.or_else(|| std::env::var("M3C_API_KEY").ok().filter(|k| !k.is_empty())),
                max_batch: a.max_batch,
                kv_budget_bytes: (a.kv_budget as f64 * 1e9) as u64,
                max_queue: a.max_queue,
                prefill_chunk: a.prefill_chunk,
                default_max_tokens: a.default_max_tokens,
                timeout_s: a.timeout_s,
                grace_s: a.grace_s,
                cuda_graphs: a.cuda_graphs,
                prefill_gemm: a.prefill_gemm,
                allowed_local_media_path: a.allowed_local_media_path,
                media_timeout_s: a.media_timeout_s,
                max_image_bytes: a.max_image_mb as u64 * (1 << 20),
                max_images_per_request: a.max_images_per_request,
            })
        }
        Command::InitTiny {
            out,
            seed,
            layers,
            hidden,
            mxfp8,
            vision_hidden,
            vision_heads,
            vision_mlp,
            vision_layers,
            projector_hidden,
        } => {
            let vision = crate::tiny::TinyVision {
                hidden: vision_hidden,
                heads: vision_heads,
                intermediate: vision_mlp,
                layers: vision_layers,
                projector: projector_hidden,
            };
            let spec = crate::tiny::TinySpec { seed, layers, hidden, mxfp8, vision };
            crate::tiny::init_tiny(&out, &spec)?;
            say(&format!(
                "wrote {} ({} layers, hidden {}, {}, seed {seed})\n",
                out.display(),
                layers,
                hidden,
                if mxfp8 { "MXFP8" } else { "bf16" }
            ))?;
            Ok(())
        }
    }
}

fn inspect(model: &Path, graph: bool, check_values: bool) -> Result<()> {
    let src = ModelSource::open(model)?;
    if graph {
        return say(&crate::graph::build_graph(&src.config).text());
    }
    let ck = src.checkpoint()?;
    let report = crate::inspect::report(&src.config, ck.as_ref())?;
    say(&report)?;
    if check_values {
        let Some(ck) = &ck else { bail!("--check-values: {} has no weights to check", model.display()) };
        let bad = crate::inspect::check_values(ck);
        if bad.is_empty() {
            return say(&format!("values      all {} tensors finite\n", ck.tensors.len()));
        }
        let lines: Vec<String> = bad
            .iter()
            .map(|b| format!("  {} in {}: {} NaN, {} Inf (first at element {})", b.tensor, b.file.display(), b.nan, b.inf, b.first))
            .collect();
        bail!("{} tensor(s) hold non-finite values:\n{}", bad.len(), lines.join("\n"));
    }
    Ok(())
}

fn gpu_profile(args: &PlanArgs) -> Result<GpuProfile> {
    let mut gpu = GpuProfile::named(&args.gpu)
        .with_context(|| format!("--gpu {}: unknown GPU; known: {}", args.gpu, GpuProfile::known_names().join(", ")))?;
    if let Some(gb) = args.gpu_mem {
        if !(gb.is_finite() && gb > 0.0) {
            bail!("--gpu-mem {gb}: expected a positive number of GB");
        }
        gpu.memory = gb * 1e9;
        gpu.name = format!("{} with {gb} GB", gpu.name);
    }
    Ok(gpu)
}

/// `--kv-cache` or `--activations` (clap has checked it is `f32` or `bf16`).
fn storage(name: &str) -> m3c_kernels::Storage {
    if name == "bf16" {
        m3c_kernels::Storage::Bf16
    } else {
        m3c_kernels::Storage::F32
    }
}

fn plan_cmd(args: PlanArgs) -> Result<()> {
    let gpu = gpu_profile(&args)?;
    if args.batch == 0 || args.context == 0 {
        bail!("--batch and --context must be at least 1");
    }
    let w = Workload { batch: args.batch, context: args.context, kv_cache: storage(&args.kv_cache) };
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
        return say(&plan::table(&src.config, &p, &gpu, w));
    }
    let model = args.model.as_ref().context("--model is required (a checkpoint folder or config.json)")?;
    let pp = args.pp.context("--pp N is required to make a plan (or --check PLAN.yaml to check one)")?;
    let src = ModelSource::open(model)?;
    if args.target == "cuda" && !plan::valid_arch(&args.arch) {
        bail!("--arch {:?}: expected a CUDA architecture like sm_90a", args.arch);
    }
    let target = if args.target == "cuda" { Target::Cuda { arch: args.arch.clone() } } else { Target::Host };
    let p = plan::make_plan(&src.config, pp, &gpu, w, target)?;
    let table = plan::table(&src.config, &p, &gpu, w);
    let header = format!(
        "m3c partition plan for {}, made by `m3c plan --pp {pp} --batch {} --context {} --kv-cache {} --gpu {}`",
        model.display(),
        args.batch,
        args.context,
        args.kv_cache,
        args.gpu
    );
    match &args.out {
        Some(out) => {
            let model_ref = relative_to(model, out.parent().unwrap_or(Path::new(".")));
            let yaml = plan::plan_yaml(&p, Some(&model_ref), &header, &table);
            // Round-trip: what we write must validate.
            plan::parse_plan(out, &yaml, Some(&src.config)).context("internal: the written plan does not validate")?;
            crate::fsutil::write_file_atomically(out, yaml.as_bytes())?;
            say(&format!("{table}wrote {}\n", out.display()))?;
        }
        None => {
            let yaml = plan::plan_yaml(&p, Some(&model.display().to_string()), &header, &table);
            plan::parse_plan(Path::new("<stdout>"), &yaml, Some(&src.config)).context("internal: the printed plan does not validate")?;
            say(&yaml)?;
        }
    }
    Ok(())
}

/// `target` written relative to `base` (both made absolute first), so a plan
/// names its model relative to the plan file's folder.
fn relative_to(target: &Path, base: &Path) -> String {
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let (t, b) = (abs(target), abs(if base.as_os_str().is_empty() { Path::new(".") } else { base }));
    let tc: Vec<_> = t.components().collect();
    let bc: Vec<_> = b.components().collect();
    let common = tc.iter().zip(&bc).take_while(|(a, b)| a == b).count();
    let mut r = PathBuf::new();
    for _ in common..bc.len() {
        r.push("..");
    }
    for c in &tc[common..] {
        r.push(c);
    }
    r.display().to_string()
}

fn compile_cmd(args: CompileArgs) -> Result<()> {
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
    let want_target = args.target.as_deref().map(|t| if t == "cuda" { Target::Cuda { arch: "sm_90a".into() } } else { Target::Host });
    let p = match &args.plan {
        Some(file) => {
            let p = plan::load_plan(file, Some(cfg))?;
            p.check_pp(file, args.pp)?;
            if let Some(t) = &want_target {
                if std::mem::discriminant(t) != std::mem::discriminant(&p.target) {
                    bail!(
                        "--target {}: {} says `target: {}`; change one of them",
                        args.target.as_deref().unwrap_or(""),
                        file.display(),
                        p.target
                    );
                }
            }
            p
        }
        None => {
            let target = want_target.unwrap_or(Target::Host);
            let mut gpu = GpuProfile::named("H200").context("built-in H200 profile")?;
            if target == Target::Host {
                // Host stages live in host memory: balance time, do not cap by HBM.
                gpu.memory = f64::INFINITY;
                gpu.name = "host".into();
            }
            plan::make_plan(cfg, args.pp, &gpu, Workload { batch: 1, context: 8192, kv_cache: storage(&args.kv_cache) }, target)?
        }
    };
    let mut emit = Vec::new();
    for e in &args.emit {
        emit.push(match e.as_str() {
            "mlir" => crate::compile::Emit::Mlir,
            "llvm" => crate::compile::Emit::Llvm,
            _ => crate::compile::Emit::Ptx,
        });
    }
    if emit.contains(&crate::compile::Emit::Ptx) && p.target == Target::Host {
        bail!("--emit ptx needs the cuda target (--target cuda, or `target: cuda` in the plan)");
    }
    crate::compile::check_out_path(&args.out, &model)?;
    crate::backend::check_cpu(&args.cpu)?;
    let runtime_lib = crate::compile::find_runtime_lib()?;
    let t0 = std::time::Instant::now();
    // GPUs default to bf16 activations (what inference runs in); the host
    // defaults to f32, the mode that matches the reference exactly.
    let activations = match (args.activations.as_deref(), &p.target) {
        (Some(a), _) => storage(a),
        (None, Target::Host) => m3c_kernels::Storage::F32,
        (None, Target::Cuda { .. }) => m3c_kernels::Storage::Bf16,
    };
    let storages = crate::lower::Storages { kv_cache: storage(&args.kv_cache), activations };
    let req = crate::compile::CompileRequest { config: cfg, plan: &p, out: &args.out, emit, cpu: args.cpu.clone(), storages, runtime_lib };
    let m = crate::compile::compile(&req)?;
    let mut text = String::new();
    for s in &m.stages {
        text +=
            &format!("{}/{}: {} ({} kernels, {} tensors)\n", args.out.display(), s.executable, s.holds, s.kernels.len(), s.tensors.len());
    }
    // The hint shows text prompts where the checkpoint can read them.
    let prompt = if model.is_dir() && model.join("tokenizer.json").is_file() { "--prompt \"Hello\"" } else { "--prompt-ids 1,2,3" };
    text += &format!(
        "compiled {} stage(s) for {} in {:.1} s; run: m3c run {} --model DIR {prompt} --max-new-tokens 16\n",
        m.stages.len(),
        m.target,
        t0.elapsed().as_secs_f64(),
        args.out.display()
    );
    say(&text)
}

/// The images file's name in its private folder.
const IMAGES_FILE: &str = "images.safetensors";

/// Images (`--image`, or a `--prompts` JSONL chat's image parts):
/// processed, each one's placeholder run put into the prompt it goes with
/// (a chat's are expanded here; a --prompt-ids prompt must hold them
/// already), each prompt checked against the context, and the images file
/// written into a private folder that lives as long as the returned handle.
fn image_prompt(args: &RunArgs, text_in: Option<&mut crate::text::front::Encoded>, encodes: bool) -> Result<Option<tempfile::TempDir>> {
    use crate::vision::prompt::{self, ImageTokens, PromptImageError};
    let from_lines = text_in.as_ref().is_some_and(|t| t.images.iter().any(|i| !i.is_empty()));
    if args.image.is_empty() && !from_lines {
        return Ok(None);
    }
    if !encodes {
        bail!(
            "{} was compiled without the vision tower (its plan says `vision: false`); compile with it to run image prompts",
            args.out.display()
        );
    }
    let cfg = crate::source::ModelSource::open(&args.model)?.config;
    let vision = cfg.vision.as_ref().ok_or(PromptImageError::NoVision)?;
    // Which prompt gets which image files.
    let per_seq: Vec<(usize, Vec<PathBuf>)> = if args.image.is_empty() {
        text_in.as_ref().map_or(Vec::new(), |t| t.images.iter().cloned().enumerate().filter(|(_, f)| !f.is_empty()).collect())
    } else {
        let prompts = args.prompt_ids.len() + args.prompt.len() + args.chat.len() + usize::from(args.prompts.is_some());
        if prompts != 1 || !args.prompt.is_empty() || args.prompts.is_some() {
            bail!(
                "--image goes with exactly one --chat or one --prompt-ids (this run has {prompts} prompt source(s)); a --prompts JSONL chat takes image parts per line"
            );
        }
        vec![(0, args.image.clone())]
    };
    let ctx = cfg.text.max_position_embeddings;
    let mut text_in = text_in;
    let mut seqs = std::collections::BTreeMap::new();
    for (seq, files) in per_seq {
        let processed = prompt::load(&files)?;
        let tokens: Vec<usize> = processed.iter().map(|p| p.tokens()).collect();
        let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        let len = match text_in.as_deref_mut() {
            Some(enc) => {
                let t = ImageTokens::new(&enc.tokenizer, vision.image_token_id)?;
                enc.ids[seq] = t.expand(&enc.ids[seq], &tokens).with_context(|| format!("prompt {seq}"))?;
                enc.ids[seq].len()
            }
            None => {
                let ids = m3c_contract::prompts::parse_ids(&args.prompt_ids[seq], "--prompt-ids").map_err(|e| anyhow::anyhow!(e))?;
                let t = ImageTokens { start: 0, image: vision.image_token_id as u32, end: 0 };
                t.check_runs(&ids, &tokens, &names)?;
                ids.len()
            }
        };
        if len + args.max_new_tokens > ctx {
            bail!(
                "prompt {seq} is {len} tokens ({} of them for the image(s): {}) and --max-new-tokens {}: more than the model's context of {ctx} positions",
                tokens.iter().sum::<usize>(),
                names.iter().zip(&tokens).map(|(n, t)| format!("{n} takes {t}")).collect::<Vec<_>>().join(", "),
                args.max_new_tokens
            );
        }
        seqs.insert(seq, prompt::seq_images(&processed));
    }
    let dir = tempfile::Builder::new().prefix("m3c-images-").tempdir().context("a folder for the images file")?;
    prompt::write_images_file(&dir.path().join(IMAGES_FILE), &seqs).context("writing the images file")?;
    Ok(Some(dir))
}

fn run_cmd(args: RunArgs) -> Result<()> {
    let compiled = crate::launch::Compiled::open(&args.out, &args.model)?;
    if let Some(d) = &args.dump {
        crate::fsutil::check_replaceable_file(d).context("--dump")?;
    }
    // Text prompts become ids here; the stages only see ids.
    // A --prompts file of JSON lines is text too; one of ids goes to the stages as it is.
    let jsonl = match &args.prompts {
        Some(f) => {
            let text = m3c_contract::read_user_file(f, "--prompts", m3c_contract::input::limits::PROMPTS)?;
            crate::text::front::is_jsonl(&text).then(|| (f.clone(), text))
        }
        None => None,
    };
    let text_in = if args.prompt.is_empty() && args.chat.is_empty() && jsonl.is_none() {
        None
    } else {
        let thinking = args.thinking.as_deref().map(|t| match t {
            "enabled" => crate::text::ThinkingMode::Enabled,
            "disabled" => crate::text::ThinkingMode::Disabled,
            _ => crate::text::ThinkingMode::Adaptive,
        });
        let req = crate::text::front::TextRequest {
            prompts: &args.prompt,
            chats: &args.chat,
            system: args.system.as_deref(),
            thinking,
            chat_images: args.image.len(),
        };
        let mut enc = crate::text::front::encode(&args.model, &req)?;
        if let Some((file, text)) = &jsonl {
            crate::text::front::encode_jsonl(&args.model, file, text, &mut enc)?;
            if enc.ids.is_empty() {
                bail!("--prompts {}: no prompts in it", file.display());
            }
        }
        if let Some(i) = enc.ids.iter().position(|p| p.is_empty()) {
            bail!("prompt {i} is empty: it has no tokens to continue from");
        }
        Some(enc)
    };
    // Images: processed here, expanded into (or checked against) the one
    // prompt they belong to, and handed to the stage that encodes them.
    let mut text_in = text_in;
    let images_dir = image_prompt(&args, text_in.as_mut(), compiled.encodes_images())?;
    // Sampling: the flags, else the checkpoint's defaults, else greedy.
    let defaults = crate::text::generation::GenerationDefaults::from_dir(&args.model)?;
    let sampling = m3c_contract::sampling::SamplingParams {
        temperature: args.temperature.or(defaults.temperature).unwrap_or(0.0),
        top_k: args.top_k.or(defaults.top_k).unwrap_or(0),
        top_p: args.top_p.or(defaults.top_p).unwrap_or(1.0),
        min_p: args.min_p.or(defaults.min_p).unwrap_or(0.0),
        repetition_penalty: args.repetition_penalty.or(defaults.repetition_penalty).unwrap_or(1.0),
        seed: args.seed,
    };
    sampling.check().map_err(|e| anyhow::anyhow!("{e} (from the flags or {}/generation_config.json)", args.model.display()))?;
    let eos: &[i64] = if args.ignore_eos { &[] } else { &defaults.eos_ids };
    eprintln!(
        "m3c: {}; {}{}",
        if sampling.temperature == 0.0 {
            format!("greedy (repetition penalty {})", sampling.repetition_penalty)
        } else {
            format!(
                "sampling at temperature {}, top-k {}, top-p {}, min-p {}, repetition penalty {}, seed {}",
                sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.repetition_penalty, sampling.seed
            )
        },
        if eos.is_empty() { "no EOS stop".to_string() } else { format!("stops on EOS id(s) {eos:?}") },
        if defaults.sources.is_empty() { String::new() } else { format!(" (defaults from {})", defaults.sources.join(", ")) }
    );
    // The stage command line: every stage gets the same arguments.
    let mut stage = StageArgs::new(args.model.clone());
    stage.prompts = args
        .prompt_ids
        .iter()
        .map(|p| m3c_contract::prompts::parse_ids(p, "--prompt-ids").map_err(|e| anyhow::anyhow!(e)))
        .collect::<Result<Vec<_>>>()?;
    stage.prompts.extend(text_in.iter().flat_map(|t| &t.ids).map(|p| p.iter().map(|&i| i64::from(i)).collect::<Vec<_>>()));
    // A prompts file of ids goes to the stages as it is.
    stage.prompts_file = args.prompts.clone().filter(|_| jsonl.is_none());
    stage.images = images_dir.as_ref().map(|d| d.path().join(IMAGES_FILE));
    stage.max_new_tokens = args.max_new_tokens;
    stage.dump = args.dump.clone();
    stage.expect = args.expect.clone();
    stage.prefill_chunk = args.prefill_chunk;
    stage.micro_batch = args.micro_batch;
    stage.timeout_s = args.timeout_s;
    stage.cuda_graphs = args.cuda_graphs == "on";
    stage.prefill_gemm_cublas = args.prefill_gemm == "cublas";
    stage.sampling = sampling;
    stage.eos_ids = eos.to_vec();
    stage.stops = args.stop.iter().map(|s| s.as_bytes().to_vec()).collect();
    stage.stream_ids = text_in.is_some();
    // A JSONL line's own sampling fields, over the run's.
    for (seq, o) in text_in.iter().flat_map(|t| t.overrides.iter().enumerate()) {
        if *o == crate::text::front::LineSampling::default() {
            continue;
        }
        let p = m3c_contract::sampling::SamplingParams {
            temperature: o.temperature.unwrap_or(sampling.temperature),
            top_k: o.top_k.unwrap_or(sampling.top_k),
            top_p: o.top_p.unwrap_or(sampling.top_p),
            min_p: o.min_p.unwrap_or(sampling.min_p),
            repetition_penalty: o.repetition_penalty.unwrap_or(sampling.repetition_penalty),
            seed: o.seed.unwrap_or(sampling.seed),
        };
        p.check().map_err(|e| anyhow::anyhow!("--prompts: prompt {seq}: {e}"))?;
        stage.seq_sampling.push((seq, p));
    }
    let pass = stage.to_args();
    let mut cmd = compiled.mpirun(&pass)?;
    if text_in.is_some() {
        cmd.stdout(std::process::Stdio::piped());
    }
    let mut child = cmd.spawn().map_err(crate::launch::spawn_error)?;
    // SIGINT/SIGTERM to m3c are passed on to mpirun, which ends the job.
    let forwarding = crate::signals::ChildRegistration::new(child.id());
    let streamed = match (&text_in, child.stdout.take()) {
        (Some(enc), Some(pipe)) => {
            let done = crate::text::front::stream(std::io::BufReader::new(pipe), enc, &args.stop, std::io::stdout().lock());
            if done.is_err() {
                // Nobody reads the pipe any more: end the job rather than
                // leave a stage blocked on a write.
                let _ = child.kill();
            }
            Some(done)
        }
        _ => None,
    };
    let status = child.wait().context("waiting for mpirun")?;
    if let Some(sig) = forwarding.received() {
        bail!("interrupted (signal {sig}): the pipeline was stopped");
    }
    drop(forwarding);
    if !status.success() {
        bail!(
            "the pipeline failed (mpirun exit status {}); the failing stage's message is above",
            status.code().map_or("signal".into(), |c| c.to_string())
        );
    }
    if let Some(done) = streamed {
        for (i, f) in done.context("streaming the generated text")?.iter().enumerate() {
            eprintln!("prompt {i}: {} prompt tokens, {} generated, finish: {}", f.prompt_tokens, f.generated.len(), f.reason);
        }
    }
    Ok(())
}
