//! The `m3c` command line. Library code returns typed errors; this is the
//! edge where they get context and become a message and an exit code.
//! `src/main.rs` only calls [`main`], so that tests can build the same CLI.
//!
//! One module per command: `compile_cmd`, `plan_cmd`, `bench_cmd`,
//! `run_cmd` (a run is a series of jobs, `run_jobs`, and `run_journal`
//! carries each prompt's tokens across them) and `serve_cmd` (vLLM's flags,
//! the build cache); `flags` holds the clap definitions. `inspect`,
//! `init-tiny` and `report` are here, as is `check_weights_before_launch`,
//! which reads the checkpoint as the stages will before mpirun starts.

mod bench_cmd;
mod compile_cmd;
mod flags;
mod plan_cmd;
mod run_cmd;
mod run_jobs;
mod run_journal;
mod serve_cmd;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use flags::{CompileArgs, PlanArgs, RunArgs, ServeArgs};
use m3c_compiler::source::ModelSource;
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
    /// Run a compiled OUT folder under mpirun, one rank per stage: prompts (ids, text, chat, images) in, tokens out, with sampling, constraints, `-n` choices and speculative decoding.
    Run(Box<RunArgs>),
    /// Serve a model folder (compiled on first start) or a compiled OUT over HTTP: OpenAI's API (completions, chat, responses; tools, reasoning, images, structured output), vLLM's flags, continuous batching.
    Serve(Box<ServeArgs>),
    /// Read a trace of `m3c run --trace`: each stage's busy share and waits, the pipeline's bubble, and optionally a timeline picture.
    Report {
        /// The Chrome trace file.
        trace: PathBuf,
        /// Also draw the timeline as a Gantt chart (one row per stage, micro-batches coloured apart).
        #[arg(long, value_name = "FILE.svg")]
        svg: Option<PathBuf>,
        /// The same chart as a PNG (boxes only), for places that show no SVG.
        #[arg(long, value_name = "FILE.png")]
        png: Option<PathBuf>,
        /// Put the plan's predicted step times (its cost model, at --batch and --context) beside the measured ones.
        #[arg(long, value_name = "PLAN.yaml")]
        plan: Option<PathBuf>,
        /// With --plan: the GPU profile of the prediction.
        #[arg(long, default_value = "H200")]
        gpu: String,
        /// With --plan: sequences per decode step.
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// With --plan: context length of the prediction.
        #[arg(long, default_value_t = 4096)]
        context: usize,
    },
    /// Time the host linear kernels at prefill and decode shapes beside this machine's measured FMA peak.
    BenchKernels(bench_cmd::BenchArgs),
    /// Write a random tiny checkpoint of a model family (hub layout, with a tokenizer) into a new folder.
    InitTiny {
        /// The folder to create.
        out: PathBuf,
        /// The model family (minimax_m3).
        #[arg(long, default_value = "minimax_m3", value_parser = family_id)]
        family: m3c_compiler::family::Family,
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

/// `m3c report`: the trace's per-stage table (and the plan's prediction
/// beside it), and the timeline as SVG.
fn report(trace: &Path, [svg, png]: [Option<&Path>; 2], plan: Option<&Path>, gpu: &str, (batch, context): (usize, usize)) -> Result<()> {
    let text = m3c_contract::read_user_file(trace, "trace", 1 << 30)?;
    let t = m3c_front::trace::Timeline::parse(&text).with_context(|| format!("{}: not a trace of `m3c run --trace`", trace.display()))?;
    if t.stages.is_empty() {
        bail!("{}: the trace has no steps", trace.display());
    }
    say(&t.table())?;
    if let Some(p) = plan {
        say(&plan_cmd::predicted_beside(p, &t, gpu, batch, context)?)?;
    }
    if let Some(out) = svg {
        m3c_compiler::fsutil::write_file_atomically(out, t.svg().as_bytes())?;
        say(&format!("wrote {}\n", out.display()))?;
    }
    if let Some(out) = png {
        m3c_compiler::fsutil::write_file_atomically(out, &t.png()?)?;
        say(&format!("wrote {}\n", out.display()))?;
    }
    Ok(())
}

/// Writes to standard output. A closed pipe ends the process quietly by
/// SIGPIPE, as `cat` does (see [`main`]); any other failure, such as a full
/// disk, is an error.
/// `--family ID`: one of the families m3c compiles, named in the error.
fn family_id(id: &str) -> Result<m3c_compiler::family::Family, String> {
    use m3c_compiler::family::Family;
    Family::of_id(id)
        .ok_or_else(|| format!("no model family `{id}`; m3c has: {}", Family::all().map(Family::id).collect::<Vec<_>>().join(", ")))
}

pub fn say(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).context("cannot write to standard output")
}

/// Parses the process arguments, runs the command, and turns errors into a message and exit code 1.
/// The command line's definition (subcommands, flags, values), for tests
/// that check documented command lines against it.
pub fn command() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

pub fn main() -> ExitCode {
    // Rust ignores SIGPIPE; restore the default so that `m3c ... | head`
    // ends like other command-line tools instead of failing a write.
    // SAFETY: setting a signal disposition before any thread is started.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    m3c_signals::install();
    m3c_compiler::backend::install_llvm_fatal_handler();
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
        Command::Plan(args) => plan_cmd::plan_cmd(args),
        Command::Compile(args) => compile_cmd::compile_cmd(args),
        Command::Run(args) => run_cmd::run_cmd(*args),
        Command::BenchKernels(args) => bench_cmd::bench_kernels(args),
        Command::Report { trace, svg, png, plan, gpu, batch, context } => {
            report(&trace, [svg.as_deref(), png.as_deref()], plan.as_deref(), &gpu, (batch, context))
        }
        Command::Serve(a) => serve_cmd::serve_cmd(*a),
        Command::InitTiny {
            out,
            family,
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
            let vision = m3c_compiler::tiny::TinyVision {
                hidden: vision_hidden,
                heads: vision_heads,
                intermediate: vision_mlp,
                layers: vision_layers,
                projector: projector_hidden,
            };
            let spec = m3c_compiler::tiny::TinySpec { family, seed, layers, hidden, mxfp8, vision };
            m3c_compiler::tiny::init_tiny(&out, &spec)?;
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

/// Before mpirun starts: the checkpoint's safetensors as every stage will
/// read them (headers, sizes, each tensor of the layout's name, type and
/// shape: what `m3c inspect` checks, in milliseconds), so a damaged or
/// wrong checkpoint is one clear error, not one line among mpirun's.
pub(crate) fn check_weights_before_launch(model: &Path) -> Result<()> {
    let src = ModelSource::open(model)?;
    if let Some(ck) = src.checkpoint()? {
        m3c_compiler::inspect::report(&src.config, Some(&ck))?;
    }
    Ok(())
}

fn inspect(model: &Path, graph: bool, check_values: bool) -> Result<()> {
    let src = ModelSource::open(model)?;
    if graph {
        return say(&m3c_compiler::graph::build_graph(&src.config).text());
    }
    let ck = src.checkpoint()?;
    let report = m3c_compiler::inspect::report(&src.config, ck.as_ref())?;
    say(&report)?;
    if check_values {
        let Some(ck) = &ck else { bail!("--check-values: {} has no weights to check", model.display()) };
        let bad = m3c_compiler::inspect::check_values(ck);
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
