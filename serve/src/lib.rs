//! `m3c serve`: an OpenAI-compatible HTTP server over a compiled pipeline.
//!
//! One process, the front, holds the HTTP server (axum on tokio), the
//! tokenizer and chat template, sampling defaults, admission and metrics;
//! it starts the stage executables under mpirun with `--serve`, as `m3c run`
//! does (the plan's hosts included), and talks to the first stage over its
//! standard input and output, which mpirun carries to whichever host runs
//! it. The stages stay compute-only: the first one schedules the steps
//! (runtime/src/serve.rs), the last one samples.
//!
//! Start-up ([`run`]): the KV pools sized ([`KvSize`]: `--kv-budget`,
//! `--kv-blocks` or `--kv-fraction`), the context capped at what a pool
//! holds, one mpirun job per replica (`--data-parallel-size`), then the
//! HTTP server. A replica's `Supervisor` ends a lost job on every host,
//! names the stage, host and signal from mpirun's log, and starts it again
//! within `--max-restarts`, on a spare host in place of a lost one where the
//! hostfile lists one; without restarts left the replica is out of routing
//! and the server stops when none is left. (The CLI compiles a model folder
//! into the build cache before this: `m3c`'s `serve_cmd`.)

mod engine;
mod http;
mod kv_events;
pub use kv_events::KvEventsConfig;
mod media;
mod metrics;
pub mod openai;
pub mod output;
mod replicas;
mod route;
pub mod tool_grammar;

use anyhow::{Context, Result};
use m3c_contract::sampling::SamplingParams;
use m3c_contract::stage_args::{GpuModes, KvPool, PoolSize, StageArgs};
pub use media::MediaPolicy;
use std::future::IntoFuture;
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::watch;

/// What `m3c serve` was asked for.
pub struct Options {
    /// Seeds of unseeded requests come from this and their order (vLLM's
    /// `--seed`); `None`: random.
    pub seed: Option<u64>,
    /// A stats line on standard error every few seconds (vLLM's; off with
    /// `--disable-log-stats`).
    pub log_stats: bool,
    pub out: PathBuf,
    pub model: PathBuf,
    pub host: String,
    pub port: u16,
    /// How the API names the model, whom it answers, and what it accepts.
    pub api: ApiOptions,
    /// Sequences running at once.
    pub max_batch: usize,
    /// How large each stage's KV pool is.
    pub kv_size: KvSize,
    /// Automatic prefix caching (on unless `--no-enable-prefix-caching`).
    pub prefix_caching: bool,
    /// How the first stage encodes images and videos.
    pub encoder: m3c_contract::stage_args::EncoderOptions,
    pub max_queue: usize,
    pub prefill_chunk: usize,
    pub timeout_s: f64,
    /// Seconds in-flight requests get to finish after SIGTERM.
    pub grace_s: f64,
    pub gpu: GpuModes,
    /// Hostfile and extra mpirun options.
    pub launch: m3c_front::launch::Launch,
    /// Where `POST /debug/trace` writes its timelines (`None`: no tracing).
    pub trace_dir: Option<PathBuf>,
    /// Speculative decoding (`--speculative-config`).
    pub speculative: Option<m3c_contract::speculative::SpeculativeConfig>,
    /// vLLM's KV-cache events (`--kv-events-config`), when enabled.
    pub kv_events: Option<KvEventsConfig>,
    /// The longest sequence a request may make (`--max-model-len`; at most the model's context).
    pub max_model_len: Option<usize>,
    /// vLLM's `--block-size`, which must be the compiled cache block.
    pub block_size: Option<usize>,
    /// Pipelines of the build behind this one front (vLLM's
    /// `--data-parallel-size`), on the hostfile's slots in turn or all here.
    pub data_parallel_size: usize,
    /// How often a lost pipeline is started again (`--max-restarts`,
    /// `--restart-window-s`).
    pub healing: Healing,
}

pub use engine::Healing;

/// What the OpenAI API itself is asked for, beside the pipeline behind it.
pub struct ApiOptions {
    /// The model's names in requests (`--served-model-name A B ...`; the
    /// first is the one answers carry). None given: the checkpoint
    /// folder's name, and the model path as the command line gave it
    /// (vLLM's default).
    pub served_model_name: Vec<String>,
    /// Requests must carry `Authorization: Bearer KEY` (`None`: open).
    pub api_key: Option<String>,
    /// `max_tokens` of a chat request that gives none (capped by the context and the KV pool).
    pub default_max_tokens: usize,
    /// Where chat images may come from, and how much of them
    /// (`allowed_local` as given: checked and made canonical at start).
    pub media: MediaPolicy,
    /// Chat template keyword arguments every chat request starts from
    /// (`--default-chat-template-kwargs`; a request's own win).
    pub default_chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// vLLM's `--structured-outputs-config`.
    pub structured: StructuredOutputs,
}

/// vLLM's `--structured-outputs-config`, as far as m3c has its settings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StructuredOutputs {
    /// A request's grammar binds the whole output, reasoning included
    /// (vLLM's `enable_in_reasoning`); by default it binds what follows the
    /// reasoning. A forced tool call's grammar always follows it.
    pub in_reasoning: bool,
}

impl StructuredOutputs {
    /// From vLLM's JSON; a key m3c cannot honour is an error naming it.
    pub fn from_json(m: &serde_json::Map<String, serde_json::Value>) -> Result<StructuredOutputs, String> {
        use serde_json::Value;
        let mut s = StructuredOutputs::default();
        for (k, v) in m {
            match (k.as_str(), v) {
                ("enable_in_reasoning", Value::Bool(b)) => s.in_reasoning = *b,
                ("backend", Value::String(b)) if b == "auto" || b == "guidance" => {}
                ("backend", v) => return Err(format!("`backend`: m3c's structured outputs are llguidance's (`auto` or `guidance`), not {v}")),
                // m3c's JSON is compact already, and its schemas are held as written.
                ("disable_any_whitespace", Value::Bool(true)) | ("disable_fallback", Value::Bool(_)) => {}
                ("reasoning_parser", Value::String(p))
                    if p.is_empty() || m3c_contract::chat_format::ChatFormat::all_parsers().contains(&p.as_str()) => {}
                ("enable_in_reasoning" | "disable_any_whitespace" | "disable_fallback" | "reasoning_parser", v) => {
                    return Err(format!("`{k}`: {v} is not a value m3c can honour"))
                }
                _ => {
                    return Err(format!(
                        "`{k}` is not a setting m3c takes (enable_in_reasoning, backend, disable_any_whitespace, disable_fallback, reasoning_parser)"
                    ))
                }
            }
        }
        Ok(s)
    }
}

/// How `m3c serve` sizes each stage's KV pool: one of three ways.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvSize {
    /// As many whole blocks as this many bytes hold on the stage with the
    /// most cache per position (`--kv-budget`, the default).
    Budget(u64),
    /// This many blocks (`--kv-blocks`).
    Blocks(usize),
    /// This share of each stage's free memory at start-up, the least any
    /// stage offers (`--kv-fraction`); the first stage reports the count.
    Fraction(f64),
}

/// How long a server whose pipeline was lost still answers (with 503s).
const LINGER: Duration = Duration::from_secs(2);

/// Why the server stops.
#[derive(Debug, Clone)]
enum Stop {
    Signal(i32),
    Down(String),
}

pub fn run(o: Options) -> Result<()> {
    let prepared = prepare(&o)?;
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("cannot start the async runtime")?;
    rt.block_on(serve(o, prepared))
}

/// What `prepare` read and checked; the engine (which needs the async
/// runtime) completes the server's shared state.
struct Prepared {
    /// Each replica's mpirun, and how to make it again (a restart).
    cmds: Vec<std::process::Command>,
    launchers: Vec<Launcher>,
    /// Each replica's host per rank, where known.
    hosts: Vec<Vec<Option<String>>>,
    eos_ids: Vec<i64>,
    stages: usize,
    limits: engine::Limits,
    /// The KV pool, in words for the start-up line.
    pool: String,
    shared: Box<dyn FnOnce(std::sync::Arc<replicas::Replicas>) -> http::Shared + Send>,
}

/// Everything the server needs before it listens: OUT checked, the
/// tokenizer, template and sampling defaults read, the stage command line,
/// the media policy. Every error here is the user's and names its source.
fn prepare(o: &Options) -> Result<Prepared> {
    let compiled = m3c_front::launch::Compiled::open(&o.out, &o.model)?;
    compiled.check_speculation(o.speculative.as_ref())?;
    compiled.check_gpu_modes(o.gpu)?;
    if let Some(b) = o.block_size.filter(|&b| b != compiled.manifest.kv_block) {
        anyhow::bail!(
            "--block-size {b}: {}'s caches are paged in blocks of its MSA block, {} positions; give --block-size {} or leave it out",
            o.model.display(),
            compiled.manifest.kv_block,
            compiled.manifest.kv_block
        );
    }
    if let Some(n) = o.max_model_len.filter(|&n| n > compiled.manifest.max_positions) {
        anyhow::bail!(
            "--max-model-len {n}: {}'s context is {} positions (max_position_embeddings); give at most that",
            o.model.display(),
            compiled.manifest.max_positions
        );
    }
    let tokenizer = m3c_front::text::TextTokenizer::from_dir(&o.model)?;
    let template = m3c_front::text::ChatTemplate::from_dir(&o.model)?;
    let format = m3c_contract::chat_format::ChatFormat::of_model_dir(&o.model).map_err(anyhow::Error::msg)?;
    let gen = m3c_front::text::generation::GenerationDefaults::from_dir(&o.model)?;
    // vLLM's defaults: the checkpoint's generation_config.json, else
    // OpenAI's (temperature 1, everything kept).
    let sampling = gen.sampling.over(SamplingParams::OPENAI);
    sampling.check().map_err(|e| anyhow::anyhow!("{}/generation_config.json: {e}", o.model.display()))?;
    let names = served_names(&o.api.served_model_name, &o.model);
    let seeds = http::Seeds::new(o.seed);
    let name = names[0].clone();
    let per_position = compiled.cache_bytes_per_position().into_iter().max().unwrap_or(0).max(1);
    let stages = compiled.stages;
    // Sequences per micro-batch: the running ones shared over the stages,
    // so every stage has a micro-batch to work on.
    let micro = o.max_batch.div_ceil(stages).max(1);
    let mut stage = StageArgs::new(o.model.clone());
    stage.prompts = m3c_contract::stage_args::Prompts::Served;
    stage.micro_batch = Some(micro);
    stage.prefill_chunk = Some(o.prefill_chunk);
    stage.timeout_s = o.timeout_s;
    stage.gpu = o.gpu;
    stage.eos_ids = gen.eos_ids.clone();
    stage.set_speculation(o.speculative.clone());
    // The stages' KV pools; admission then counts against exactly what the
    // pools hold (0 blocks: the stages size them, by --kv-fraction).
    let kv_block = compiled.manifest.kv_block as u64;
    let block_bytes = per_position * kv_block;
    let max_blocks = m3c_contract::blocks::MAX_BLOCKS as u64;
    let size = match o.kv_size {
        KvSize::Budget(bytes) => match (bytes / block_bytes).min(max_blocks) {
            0 => anyhow::bail!(
                "--kv-budget {:.3} GB holds no cache block: one block of {kv_block} positions takes {:.3} MB on the largest stage",
                bytes as f64 / 1e9,
                block_bytes as f64 / 1e6
            ),
            n => PoolSize::Blocks(n as usize),
        },
        KvSize::Blocks(n) => PoolSize::Blocks(n.min(max_blocks as usize)),
        KvSize::Fraction(f) => PoolSize::Fraction(f),
    };
    let blocks = if let PoolSize::Blocks(n) = size { n as u64 } else { 0 };
    if o.kv_events.is_some() && !o.prefix_caching {
        anyhow::bail!(
            "--kv-events-config: KV-cache events report the blocks the prefix cache stores and evicts, and --no-enable-prefix-caching turns the cache off"
        );
    }
    compiled.check_memory(&o.model, (blocks > 0).then_some(blocks * kv_block), &o.launch)?;
    let replicas = o.data_parallel_size.max(1);
    let placements = compiled.replica_placements(replicas, &o.launch)?;
    // Several replicas are routed by what each one's prefix cache holds,
    // which its first stage's block events say.
    let events = o.kv_events.is_some() || (replicas > 1 && o.prefix_caching);
    stage.kv = KvPool { size, prefix_caching: o.prefix_caching, events };
    stage.encoder = o.encoder;
    if let Some(d) = &o.trace_dir {
        if !d.is_dir() {
            anyhow::bail!("--trace-dir {}: not a folder", d.display());
        }
        stage.trace = true;
    }
    let trace_dir = o.trace_dir.clone();
    let compiled = std::sync::Arc::new(compiled);
    let launchers = launchers(&compiled, &stage, &o.launch, placements);
    // The first start's commands, the same way a restart makes them: a
    // multi-host job's hosts are checked now, before the server listens.
    let (cmds, hosts): (Vec<_>, Vec<_>) = launchers.iter().map(|l| l(&[])).collect::<Result<Vec<_>>>()?.into_iter().unzip();
    let stage_eos = gen.eos_ids.clone();
    let media = o.api.media.clone().checked()?;
    let limits = engine::Limits { per_position, kv_block, blocks, max_batch: o.max_batch.max(1), max_queue: o.max_queue };
    let (api_key, default_max_tokens) = (o.api.api_key.clone(), o.api.default_max_tokens);
    let default_kwargs = o.api.default_chat_template_kwargs.clone();
    let structured = o.api.structured;
    if let Some(k) = default_kwargs.keys().find(|k| ["add_generation_prompt", "tools", "messages"].contains(&k.as_str())) {
        anyhow::bail!("--default-chat-template-kwargs may not set `{k}` (each request sets it)");
    }
    // The longest sequence: the model's context, or what the KV pool holds
    // (a sequence must fit it alone; its last row scores nothing).
    let pool_positions = if blocks == 0 { usize::MAX } else { (blocks as usize * kv_block as usize).saturating_sub(1) };
    let context = compiled.manifest.max_positions.min(pool_positions).min(o.max_model_len.unwrap_or(usize::MAX));
    // Images: only where the first stage encodes them (the manifest's
    // stages were compiled with the vision tower unless the plan said not).
    let image_token = compiled.manifest.image_token.filter(|_| compiled.encodes_images());
    let video_token = compiled.manifest.video_token.filter(|_| compiled.encodes_images());
    // Structured output compiles grammars against the model's own tokens.
    let eos_ids: Vec<u32> = gen.eos_ids.iter().filter_map(|&e| u32::try_from(e).ok()).collect();
    let grammars = m3c_constrain::Vocabulary::load(&o.model, Some(tokenizer.vocab_size()), &eos_ids).map_err(|e| e.to_string());
    let shared = move |engine| http::Shared {
        engine,
        tokenizer,
        template,
        format,
        defaults: openai::Defaults { sampling },
        name,
        names,
        seeds,
        api_key,
        context,
        default_max_tokens,
        created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        image_token,
        video_token,
        media,
        grammars,
        eos_ids,
        trace_dir,
        default_kwargs,
        structured,
    };
    let pool = match size {
        PoolSize::Fraction(f) => format!("KV pool: {f} of each stage's free memory"),
        _ => format!(
            "KV pool: {blocks} blocks of {kv_block} positions, {:.2} GB per stage, {} caches",
            (blocks * block_bytes) as f64 / 1e9,
            compiled.manifest.kv_cache
        ),
    };
    Ok(Prepared { cmds, launchers, hosts, eos_ids: stage_eos, stages, limits, pool, shared: Box::new(shared) })
}

/// Seconds between stats lines (vLLM's 10; `M3C_STATS_INTERVAL_S` for tests).
fn stats_interval() -> Duration {
    let s = std::env::var("M3C_STATS_INTERVAL_S").ok().and_then(|v| v.parse::<f64>().ok()).filter(|s| *s > 0.0 && *s <= 3600.0);
    Duration::from_secs_f64(s.unwrap_or(10.0))
}

/// Writes the stats line (`Metrics::stats_line`) every interval while
/// the server runs, one per replica (named, when there are several); the
/// task ends with the runtime.
async fn log_stats(replicas: std::sync::Arc<replicas::Replicas>) {
    let every = stats_interval();
    let mut marks = vec![metrics::StatsMark::default(); replicas.engines.len()];
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut last = std::time::Instant::now();
    loop {
        tick.tick().await;
        let seconds = last.elapsed().as_secs_f64();
        last = std::time::Instant::now();
        for (e, mark) in replicas.engines.iter().zip(&mut marks) {
            if let Some(line) = e.metrics.stats_line(&e.gauges(), mark, seconds) {
                eprintln!("{}", line.replacen("m3c serve: ", &format!("m3c serve: {}", e.replica.prefix()), 1));
            }
        }
    }
}

/// A replica's mpirun, shared by the task that reaps it when the replica
/// is lost and the server's own stop.
type Job = std::sync::Arc<tokio::sync::Mutex<tokio::process::Child>>;

/// Ends a job that is lost or must stop now: after `grace` for mpirun to
/// end by itself (it does within a moment of a rank's death, and says
/// which), SIGTERM to mpirun, which takes its ranks down with it, then
/// after a few seconds SIGKILL to its process group. Its exit status,
/// once reaped.
async fn end_job(job: &Job, grace: Duration) -> Option<std::process::ExitStatus> {
    let mut child = job.lock().await;
    let pid = child.id();
    let status = end_child(&mut child, grace).await;
    // Ranks in mpirun's group that outlive it (stuck in a driver, say)
    // would hold their memory into the next start.
    if let Some(pid) = pid {
        // SAFETY: kill has no memory-safety preconditions; the group is the
        // job's own (Engine::attach), its leader reaped just now.
        unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
    }
    status
}

async fn end_child(child: &mut tokio::process::Child, grace: Duration) -> Option<std::process::ExitStatus> {
    if let Ok(Ok(s)) = tokio::time::timeout(grace, child.wait()).await {
        return Some(s);
    }
    if let Some(pid) = child.id() {
        // SAFETY: kill has no memory-safety preconditions; `pid` is our
        // child, not yet reaped, so it names no other process.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    }
    match tokio::time::timeout(JOB_TERM, child.wait()).await {
        Ok(s) => s.ok(),
        Err(_) => {
            if let Some(pid) = child.id() {
                // SAFETY: as above; the group is the child's own (Engine::start).
                unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
            }
            let _ = child.kill().await;
            child.wait().await.ok()
        }
    }
}

/// How long a lost job's mpirun gets to take its ranks down.
const JOB_TERM: Duration = Duration::from_secs(3);

/// How long a lost job's mpirun gets to end by itself before it is told to.
const JOB_GRACE: Duration = Duration::from_secs(2);

/// Each replica's [`Launcher`]. Where each replica runs now, and the hosts
/// any of them found lost, are shared: a replica that lost a host starts
/// again on a spare that no other replica holds (the hostfile's slots
/// after those in use).
fn launchers(
    compiled: &std::sync::Arc<m3c_front::launch::Compiled>,
    stage: &StageArgs,
    launch: &m3c_front::launch::Launch,
    placements: Vec<m3c_front::launch::Placement>,
) -> Vec<Launcher> {
    let spread = std::sync::Arc::new(std::sync::Mutex::new(Spread { placed: placements.clone(), lost: Vec::new() }));
    (0..placements.len())
        .map(|r| {
            let (c, stage, launch, spread) = (compiled.clone(), stage.clone(), launch.clone(), spread.clone());
            std::sync::Arc::new(move |lost: &[String]| {
                // Chosen and recorded under one lock, so two replicas
                // restarting at once never take the same spare.
                let placed = {
                    let mut s = spread.lock().unwrap_or_else(|e| e.into_inner());
                    for h in lost {
                        if !s.lost.contains(h) {
                            s.lost.push(h.clone());
                        }
                    }
                    let hosts: Vec<Vec<Option<String>>> = s.placed.iter().map(|p| c.rank_hosts(p, &launch)).collect();
                    // Without a spare, the replica waits for its hosts.
                    let spare = if lost.is_empty() { None } else { c.avoiding(&launch, &s.lost, &hosts, r) };
                    if let Some(p) = spare {
                        s.placed[r] = p;
                    }
                    s.placed[r].clone()
                };
                Ok((c.mpirun_placed(&stage, &launch, &placed)?, c.rank_hosts(&placed, &launch)))
            }) as Launcher
        })
        .collect()
}

/// Where every replica runs now, and the hosts any replica found lost.
struct Spread {
    placed: Vec<m3c_front::launch::Placement>,
    lost: Vec<String>,
}

/// Makes a replica's mpirun command again (checking its hosts first, as
/// at start-up), avoiding the hosts given where it can; with the host of
/// each rank.
type Launcher = std::sync::Arc<dyn Fn(&[String]) -> Result<(std::process::Command, Vec<Option<String>>)> + Send + Sync>;

/// One replica's supervisor: a lost pipeline's job is ended on every host
/// and, within `--max-restarts`, started again from the same build; its
/// open requests wait and go on where they were (`Engine::resume`).
/// Past the limit, or without healing, the replica is down for good.
struct Supervisor {
    all: std::sync::Arc<replicas::Replicas>,
    r: usize,
    job: Job,
    launcher: Launcher,
    /// The host of each rank of the current start, where known.
    hosts: Vec<Option<String>>,
    stop: watch::Receiver<Option<Stop>>,
    healing: Healing,
    /// The stages' `--timeout-s`: a restart must be up within it (plus start-up).
    timeout: Duration,
}

impl Supervisor {
    async fn run(mut self, mut losses: tokio::sync::mpsc::UnboundedReceiver<engine::Loss>) {
        let e = self.all.engines[self.r].clone();
        let prefix = e.replica.prefix();
        let mut starts: std::collections::VecDeque<std::time::Instant> = Default::default();
        // Hosts found lost: a start avoids them where spares are listed.
        let mut lost_hosts: Vec<String> = Vec::new();
        // Starts in a row that never came up: a restart cycle longer than
        // the window must still end.
        let mut streak = 0;
        while let Some(loss) = losses.recv().await {
            if self.stop.borrow().is_some() {
                return;
            }
            let epoch = e.epoch();
            let t0 = std::time::Instant::now();
            let status = end_job(&self.job, JOB_GRACE).await;
            // What mpirun said names the stage, its host and the signal, or the lost host.
            let end = e.job_end(epoch, Duration::from_secs(1)).await;
            // A host is lost when mpirun lost its daemon, or when a stage
            // found a peer silent (a cut link, a host gone): that peer's host.
            let silent = m3c_contract::lost_peer::rank_in(&loss.why).and_then(|k| self.hosts.get(k).cloned().flatten());
            if let Some(h) = end.as_ref().and_then(|x| x.lost_node.clone()).or(silent) {
                if !lost_hosts.contains(&h) {
                    eprintln!("m3c serve: {prefix}host {h} is taken as lost: a start places its stages on a spare host where the hostfile lists one");
                    lost_hosts.push(h);
                }
            }
            let (said, cause_seen) = match end {
                Some(m3c_front::launch::JobEnd { killed: Some((rank, node, signal)), .. }) => {
                    (format!("; stage {rank} on host {node} was killed by signal {signal}"), Some("signal"))
                }
                Some(m3c_front::launch::JobEnd { lost_node: Some(node), .. }) => (format!("; host {node} was lost"), Some("lost_host")),
                _ => match status.and_then(|s| s.code()) {
                    Some(c) if c != 0 => (format!("; mpirun exit status {c}"), None),
                    _ => (String::new(), None),
                },
            };
            if e.down_reason().is_some() {
                // No healing: the replica is out for good.
                let up = self.all.engines.iter().filter(|x| x.healthy()).count();
                if self.all.engines.len() > 1 && up > 0 {
                    eprintln!("m3c serve: {prefix}{}; the replica is out of routing, {up} serve on", loss.why);
                }
                return;
            }
            let (mut why, mut cause) = (format!("{}{said}", loss.why), cause_seen.unwrap_or(loss.cause));
            streak = if e.served(epoch) { 0 } else { streak + 1 };
            loop {
                let now = std::time::Instant::now();
                while starts.front().is_some_and(|t| now.duration_since(*t) > self.healing.window) {
                    starts.pop_front();
                }
                if starts.len() >= self.healing.max_restarts || streak >= self.healing.max_restarts {
                    e.fail(&format!(
                        "{why}; the pipeline was started again {} time(s) within {:.0} s, the --max-restarts limit, so it stays down",
                        starts.len(),
                        self.healing.window.as_secs_f64()
                    ));
                    return;
                }
                starts.push_back(now);
                *e.metrics.c.lock().unwrap_or_else(|p| p.into_inner()).restarts.entry(cause).or_default() += 1;
                eprintln!(
                    "m3c serve: {prefix}{why} (cause {cause}); starting it again ({} of at most {} within {:.0} s)",
                    starts.len(),
                    self.healing.max_restarts,
                    self.healing.window.as_secs_f64()
                );
                let (l, t1) = (self.launcher.clone(), std::time::Instant::now());
                let teardown = t1.duration_since(t0).as_secs_f64();
                let avoid = lost_hosts.clone();
                let launched = tokio::task::spawn_blocking(move || l(&avoid)).await;
                // A stop that came meanwhile: no new job (attach refuses too).
                if self.stop.borrow().is_some() || e.closing() {
                    return;
                }
                let started = match launched {
                    Ok(Ok((cmd, hosts))) => e.attach(cmd).map(|child| (child, hosts)),
                    Ok(Err(err)) => Err(err),
                    Err(join) => Err(anyhow::anyhow!("the launch task failed: {join}")),
                };
                match started {
                    Ok((child, hosts)) => {
                        if hosts != self.hosts {
                            let on: Vec<String> = hosts.iter().map(|h| h.clone().unwrap_or_else(|| "here".into())).collect();
                            eprintln!("m3c serve: {prefix}the stages now run on {}", on.join(", "));
                        }
                        self.hosts = hosts;
                        *self.job.lock().await = child;
                        eprintln!(
                            "m3c serve: {prefix}restart: the lost job ended in {teardown:.2} s, mpirun started again in {:.2} s",
                            t1.elapsed().as_secs_f64()
                        );
                        // A start that is not up in time is lost too: it gets
                        // the stages' timeout and a minute, or twice what
                        // the first start took.
                        let first = e.first_up().map_or(Duration::ZERO, |d| 2 * d);
                        let (w, epoch, limit) = (e.clone(), e.epoch(), (self.timeout + RESTART_UP).max(first));
                        tokio::spawn(async move {
                            tokio::time::sleep(limit).await;
                            if !w.healthy() {
                                w.lost(
                                    epoch,
                                    &format!("the restarted pipeline was not up within {:.0} s", limit.as_secs_f64()),
                                    "not_ready",
                                );
                            }
                        });
                        break;
                    }
                    Err(err) => {
                        streak += 1;
                        (why, cause) = (format!("starting it again failed: {err:#}"), "start_failed");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        if self.stop.borrow().is_some() {
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// What a restarted pipeline gets beyond `--timeout-s` to be up (mapping
/// weights, allocating its pool).
const RESTART_UP: Duration = Duration::from_secs(60);

/// Listens, starts the pipelines, serves until a signal or until no
/// pipeline is left, then shuts down (in-flight requests get `--grace`
/// seconds).
async fn serve(o: Options, p: Prepared) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((o.host.as_str(), o.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", o.host, o.port))?;
    let addr = listener.local_addr()?;
    let n = p.cmds.len();
    // Bound before the stages start, so a busy endpoint is said at once:
    // one publisher per replica, on the ports plus its rank (vLLM's).
    let mut publishers = Vec::new();
    if let Some(cfg) = o.kv_events.clone() {
        for r in 0..n {
            let cfg = if n > 1 { cfg.for_rank(r).map_err(anyhow::Error::msg)? } else { cfg.clone() };
            let at = cfg.endpoint.clone();
            publishers.push(kv_events::Publisher::start(cfg, p.limits.kv_block as usize).await?);
            let whose = if n > 1 { format!(" for replica {r}") } else { String::new() };
            eprintln!("m3c serve: KV-cache events{whose} (vLLM's BlockStored/BlockRemoved, msgpack over ZeroMQ) on {at}");
        }
    }
    let mut engines = Vec::with_capacity(n);
    let mut jobs: Vec<Job> = Vec::with_capacity(n);
    let mut losses = Vec::with_capacity(n);
    let mut publishers = publishers.into_iter();
    let timeout = Duration::from_secs_f64(o.timeout_s);
    for (r, cmd) in p.cmds.into_iter().enumerate() {
        let replica = engine::Replica { index: r, of: n };
        let (engine, lost) = engine::Engine::new(p.limits, p.stages, timeout, replica, o.healing, p.eos_ids.clone());
        if let Some(pb) = publishers.next() {
            let _ = engine.kv_events.set(pb);
        }
        let child = engine.attach(cmd)?;
        engines.push(engine);
        jobs.push(std::sync::Arc::new(tokio::sync::Mutex::new(child)));
        losses.push(lost);
    }
    let replicas = std::sync::Arc::new(replicas::Replicas::new(engines, p.limits.kv_block as usize, o.prefix_caching, o.max_batch));
    let shared = (p.shared)(replicas.clone());
    let (name, context, stages) = (shared.name.clone(), shared.context, p.stages);
    let app = http::router(shared);
    let pool = &p.pool;
    let pipelines = if n > 1 { format!("{n} replicas of {stages} stage(s)") } else { format!("{stages} stage(s)") };
    eprintln!(
        "m3c serve: http://{addr}/v1 serves `{name}` ({pipelines}, context {context}, up to {} running, {pool}); /health answers 200 once every stage is up",
        o.max_batch
    );
    if o.log_stats {
        tokio::spawn(log_stats(replicas.clone()));
    }
    // Signals, and the loss of every pipeline, stop the server.
    let (stop_tx, stop_rx) = watch::channel(None::<Stop>);
    stop_on_signals(stop_tx.clone());
    // Each pipeline's supervisor ends a lost job and starts it again.
    let placed = losses.into_iter().zip(p.launchers).zip(p.hosts);
    for ((r, job), ((lost, launcher), hosts)) in jobs.iter().enumerate().zip(placed) {
        let (all, job, stop) = (replicas.clone(), job.clone(), stop_rx.clone());
        let s = Supervisor { all, r, job, launcher, hosts, stop, healing: o.healing, timeout };
        tokio::spawn(s.run(lost));
    }
    let r = replicas.clone();
    tokio::spawn(async move {
        let why = r.wait_all_down().await;
        stop_tx.send_if_modified(|s| {
            if s.is_none() {
                *s = Some(Stop::Down(why));
                true
            } else {
                false
            }
        });
    });
    // The server stops accepting at once on a signal; when the pipelines
    // are lost it keeps answering for a moment (503 on /health and on new
    // requests) so that a supervisor sees why, then stops.
    let mut rx = stop_rx.clone();
    let graceful = async move {
        let down = rx.wait_for(Option::is_some).await.map(|s| matches!(*s, Some(Stop::Down(_)))).unwrap_or(false);
        if down {
            tokio::time::sleep(LINGER).await;
        }
    };
    let mut server = tokio::spawn(axum::serve(listener, app).with_graceful_shutdown(graceful).into_future());
    let mut rx = stop_rx.clone();
    let stop = rx.wait_for(Option::is_some).await.map(|s| s.clone()).ok().flatten();
    match stop {
        Some(Stop::Signal(sig)) => {
            let open = replicas.gauges();
            eprintln!(
                "m3c serve: signal {sig}: draining: no new requests; {} running and {} waiting get {} s to finish (Ctrl-C again stops now)",
                open.running, open.waiting, o.grace_s
            );
            if tokio::time::timeout(Duration::from_secs_f64(o.grace_s), &mut server).await.is_err() {
                replicas.fail_open("the server shut down before this request finished");
                let _ = tokio::time::timeout(Duration::from_secs(10), &mut server).await;
            }
            // Each first stage finishes what is open and stops its pipeline.
            replicas.close_input();
            let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(o.timeout_s + 10.0);
            let mut failed = Vec::new();
            for (r, job) in jobs.iter().enumerate() {
                let whose = if n > 1 { format!("replica {r}'s pipeline") } else { "the pipeline".to_string() };
                let mut child = job.lock().await;
                match tokio::time::timeout_at(deadline, child.wait()).await {
                    Ok(Ok(s)) if s.success() => {}
                    // A replica lost earlier was ended then, and said so.
                    Ok(Ok(_)) if replicas.engines[r].down_reason().is_some() && n > 1 => {}
                    Ok(Ok(s)) => failed.push(format!("{whose} ended with {s} while shutting down")),
                    Ok(Err(e)) => failed.push(format!("waiting for {whose}'s mpirun: {e}")),
                    Err(_) => {
                        drop(child);
                        end_job(job, Duration::ZERO).await;
                        failed.push(format!("{whose} did not stop within {} s; it was killed", o.timeout_s + 10.0));
                    }
                }
            }
            if failed.is_empty() {
                eprintln!("m3c serve: stopped");
                Ok(())
            } else {
                anyhow::bail!("{}", failed.join("; "))
            }
        }
        Some(Stop::Down(why)) => {
            // Every open request has its error; let the responses go out.
            let _ = tokio::time::timeout(LINGER + Duration::from_secs(5), &mut server).await;
            let mut codes = Vec::new();
            for job in &jobs {
                let status = end_job(job, Duration::ZERO).await;
                codes.push(status.and_then(|s| s.code()).map_or("signal".to_string(), |c| c.to_string()));
            }
            let word = if n > 1 { "statuses" } else { "status" };
            anyhow::bail!("{why} (mpirun exit {word} {})", codes.join(", "))
        }
        None => anyhow::bail!("the server's stop channel closed"),
    }
}

/// The first SIGINT/SIGTERM/SIGHUP asks for a graceful stop; a second one
/// ends the process at once.
fn stop_on_signals(stop: watch::Sender<Option<Stop>>) {
    m3c_signals::handle_with(move |sig| {
        let first = stop.send_if_modified(|s| {
            if s.is_none() {
                *s = Some(Stop::Signal(sig));
                true
            } else {
                false
            }
        });
        if !first {
            // A second signal means now: mpirun and the stages die with
            // this process (PR_SET_PDEATHSIG).
            eprintln!("m3c serve: signal {sig} again: stopping now");
            // SAFETY: _exit ends the process at once, without running
            // destructors that could wait on the runtime's threads.
            unsafe { libc::_exit(128 + sig) };
        }
    });
}

/// The names a request may give as its `model`: `given`, else the
/// checkpoint folder's name and the path as the command line gave it.
fn served_names(given: &[String], model: &std::path::Path) -> Vec<String> {
    if !given.is_empty() {
        return given.to_vec();
    }
    let folder = model.canonicalize().ok().and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()));
    let mut names = vec![folder.unwrap_or_else(|| "model".into())];
    let as_given = model.to_string_lossy().trim_end_matches('/').to_string();
    if !as_given.is_empty() && !names.contains(&as_given) {
        names.push(as_given);
    }
    names
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_model_is_served_as_its_folder_and_as_given_unless_named() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("MiniMax-M3");
        std::fs::create_dir(&model).unwrap();
        let given = format!("{}/", model.display());
        assert_eq!(super::served_names(&[], std::path::Path::new(&given)), ["MiniMax-M3".to_string(), model.display().to_string()]);
        assert_eq!(super::served_names(&["a".into(), "b".into()], &model), ["a", "b"]);
    }
}
