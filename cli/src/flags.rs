//! The command line's flags (clap), and the parsers of their values.

use std::path::PathBuf;

#[derive(clap::Args)]
pub(crate) struct PlanArgs {
    /// The model (folder or config.json). May be omitted with --check when the plan names it.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Validate this plan and print its per-stage table.
    #[arg(long, value_name = "PLAN.yaml", conflicts_with = "out")]
    pub(crate) check: Option<PathBuf>,
    /// Number of pipeline stages.
    #[arg(long)]
    pub(crate) pp: Option<usize>,
    /// Sequences decoded together (the cost model's batch).
    #[arg(long, default_value_t = 1)]
    pub(crate) batch: usize,
    /// Context length the KV caches must hold per sequence.
    #[arg(long, default_value_t = 8192)]
    pub(crate) context: usize,
    /// How the compiled stages will store K and V (as `m3c compile --kv-cache`).
    #[arg(long = "kv-cache", value_enum, default_value_t = CacheStorage::F32)]
    pub(crate) kv_cache: CacheStorage,
    /// GPU profile (H200, H100, H20, B200, A100, L40S, MI300X, MI325X, MI355X); default H200, MI300X for --target rocm.
    #[arg(long)]
    pub(crate) gpu: Option<String>,
    /// GPU memory in GB (overrides the profile's).
    #[arg(long, value_name = "GB")]
    pub(crate) gpu_mem: Option<f64>,
    /// Target the plan compiles for (written into it): default the maker of --gpu's GPU (cuda for NVIDIA's, rocm for AMD's), else host.
    #[arg(long, value_parser = ["host", "cuda", "rocm"])]
    pub(crate) target: Option<String>,
    /// GPU architecture: a CUDA one for --target cuda (default sm_90a), an AMD chip for --target rocm (gfx942, the default, or gfx950).
    #[arg(long)]
    pub(crate) arch: Option<String>,
    /// Write the plan here instead of standard output.
    #[arg(short = 'o', long = "out", value_name = "PLAN.yaml")]
    pub(crate) out: Option<PathBuf>,
    /// Also draw the plan (made or checked): per stage its layers, weight and KV memory against the GPU's, and its predicted step time.
    #[arg(long, value_name = "FILE.svg")]
    pub(crate) svg: Option<PathBuf>,
    /// Count a speculative draft too, in vLLM's JSON: for `{"method": "eagle3", "model": DIR, "num_speculative_tokens": K}` the draft's weights and cache on the last stage and the aux hidden states each boundary carries to it.
    #[arg(long, value_name = "JSON", value_parser = m3c_contract::speculative::SpeculativeConfig::from_json)]
    pub(crate) speculative_config: Option<m3c_contract::speculative::SpeculativeConfig>,
}

impl PlanArgs {
    /// The GPU profile's name: `--gpu`, else the target's flagship.
    pub(crate) fn gpu_name(&self) -> &str {
        self.gpu.as_deref().unwrap_or_else(|| m3c_compiler::plan::GpuProfile::default_name(self.target()))
    }

    /// `--target`, else the target of `--gpu`'s maker (a plan sized for a
    /// GPU compiles for it), else host.
    pub(crate) fn target(&self) -> &str {
        match (&self.target, &self.gpu) {
            (Some(t), _) => t,
            (None, Some(g)) if g.to_ascii_uppercase().starts_with("MI") => "rocm",
            (None, Some(_)) => "cuda",
            (None, None) => "host",
        }
    }
}

/// The LLVM CPU host code is compiled for unless told otherwise.
pub(crate) const DEFAULT_CPU: &str = "x86-64-v3";

#[derive(clap::Args)]
pub(crate) struct CompileArgs {
    /// A partition plan; without one, the planner's balanced plan for --pp stages.
    pub(crate) plan: Option<PathBuf>,
    /// The model: a checkpoint folder or its config.json (weights are not read). May be omitted when the plan names it.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Number of pipeline stages: the plan's when a plan is given (a different count is an error), else 1.
    #[arg(long, value_parser = positive_count)]
    pub(crate) pp: Option<usize>,
    /// Target to compile for (default: the plan's, else host).
    #[arg(long, value_parser = ["host", "cuda", "rocm"])]
    pub(crate) target: Option<String>,
    /// GPU architecture without a plan: a CUDA one for --target cuda (default sm_90a), an AMD chip for --target rocm (gfx942, the default, or gfx950). A plan names its own.
    #[arg(long)]
    pub(crate) arch: Option<String>,
    /// Output folder; an earlier m3c output there is replaced, anything else is refused.
    #[arg(short = 'o', long = "out", default_value = "out")]
    pub(crate) out: PathBuf,
    /// Also write intermediate code per stage: `mlir` (fused steps + MLIR), `llvm` (LLVM dialect + LLVM IR), `ptx` (the GPU's device code: PTX and cubin for cuda, the code object for rocm).
    #[arg(long, value_parser = ["mlir", "llvm", "ptx"], action = clap::ArgAction::Append)]
    pub(crate) emit: Vec<String>,
    /// LLVM CPU for host code (`x86-64` runs anywhere; `x86-64-v3` needs AVX2; `native`: this machine's CPU, recorded by its name, e.g. `znver4`). A stage started on a CPU without the features its build uses stops with an error naming them.
    #[arg(long, default_value = DEFAULT_CPU)]
    pub(crate) cpu: String,
    /// How KV and MSA index-key caches store elements: `f32` (exact), `bf16` (half the memory and attention reads; values rounded to nearest even), or `fp8` (e4m3 with a scale of 1, as vLLM's without calibrated scales: a quarter of f32's; rounded to nearest even, saturated at ±448).
    #[arg(long = "kv-cache", value_enum, default_value_t = CacheStorage::F32)]
    pub(crate) kv_cache: CacheStorage,
    /// How activations between kernels and stages are stored: `f32` (exact; the host default) or `bf16` (the cuda default: half the activation memory and bytes sent between stages; every kernel still computes and accumulates in f32).
    #[arg(long, value_enum)]
    pub(crate) activations: Option<ActivationStorage>,
    /// The object cache: compiled kernels and entries by the hash of everything they depend on, so a kernel shared by stages, splits and compiles is compiled once (default: $M3C_CACHE_DIR, else $XDG_CACHE_HOME/m3c, else ~/.cache/m3c).
    #[arg(long, value_name = "DIR", conflicts_with = "no_cache")]
    pub(crate) cache_dir: Option<PathBuf>,
    /// Compile an EAGLE3 draft head into the last stage, in vLLM's JSON: `{"method": "eagle3", "model": DIR, "num_speculative_tokens": K}` (DIR: the draft's config.json; its weights are read when the stages start). Every stage then carries the target's aux hidden states to it; `run` and `serve` speculate with it when given the same config.
    #[arg(long, value_name = "JSON", value_parser = m3c_contract::speculative::SpeculativeConfig::from_json)]
    pub(crate) speculative_config: Option<m3c_contract::speculative::SpeculativeConfig>,
    /// Compile every unit, reading and writing no object cache.
    #[arg(long)]
    pub(crate) no_cache: bool,
}

#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// A folder written by `m3c compile`.
    pub(crate) out: PathBuf,
    /// The checkpoint folder (config.json + safetensors) the stages were compiled for.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// A prompt as token ids, `1,2,3`; repeat for several prompts (they run as concurrent micro-batches).
    #[arg(
        long = "prompt-ids",
        value_name = "IDS",
        required_unless_present_any = ["prompts", "prompt", "chat"],
        conflicts_with_all = ["prompts", "prompt", "chat"]
    )]
    pub(crate) prompt_ids: Vec<String>,
    /// A file with one prompt per line: token ids separated by commas, or JSON lines ({"prompt": TEXT} or {"messages": [...]}, with optional sampling fields).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "chat"])]
    pub(crate) prompts: Option<PathBuf>,
    /// A prompt as text, completed as it is (the checkpoint's tokenizer.json); repeat for several. The continuation streams to stdout.
    #[arg(long, value_name = "TEXT")]
    pub(crate) prompt: Vec<String>,
    /// One user turn through the checkpoint's chat template, with the generation prompt; repeat for several conversations.
    #[arg(long, value_name = "TEXT")]
    pub(crate) chat: Vec<String>,
    /// An image for the prompt (PNG, JPEG, WebP or GIF; repeatable, in order). With --chat, the user turn holds the images first, then the text; with --prompt-ids, the ids already hold one placeholder run per image.
    #[arg(long, value_name = "FILE")]
    pub(crate) image: Vec<PathBuf>,
    /// A video for the prompt (MP4, WebM, MKV, ...: what FFmpeg decodes; repeatable, in order), sampled at 1 frame per second as the reference processor samples. With --chat, the user turn holds the images, then the videos, then the text; with --prompt, the text holds one `]<]video[>[` per video.
    #[arg(long, value_name = "FILE")]
    pub(crate) video: Vec<PathBuf>,
    /// A system message before each --chat turn.
    #[arg(long, value_name = "TEXT", requires = "chat")]
    pub(crate) system: Option<String>,
    /// The template's thinking mode for --chat (default: the template's own, adaptive for MiniMax-M3).
    #[arg(long, value_parser = ["enabled", "disabled", "adaptive"], requires = "chat")]
    pub(crate) thinking: Option<String>,
    /// Close the model's reasoning after this many tokens of it (vLLM's
    /// `thinking_token_budget`; under --json-schema, --regex, --choice or
    /// --grammar the default is half of --max-new-tokens).
    #[arg(long, value_name = "TOKENS")]
    pub(crate) thinking_token_budget: Option<u32>,
    /// Tokens to generate per prompt, at most (a sequence also ends on an EOS id).
    #[arg(long, default_value_t = 256, value_parser = count)]
    pub(crate) max_new_tokens: usize,
    /// The sampling fields, one flag each (`m3c_contract::sampling::FIELDS`).
    #[command(flatten)]
    pub(crate) sampling: SamplingFlags,
    /// End a sequence once its text holds STR (repeatable; it may span tokens). The stop string is not printed.
    #[arg(long, value_name = "STR", value_parser = stop_string)]
    pub(crate) stop: Vec<String>,
    /// Do not end a sequence on an EOS id (generation_config.json's eos_token_id, else config.json's).
    #[arg(long)]
    pub(crate) ignore_eos: bool,
    /// Write prompt_ids, prefill_logits, generated_ids and decode_logits here (several prompts: FILE.p0.safetensors, ...).
    #[arg(long, value_name = "FILE.safetensors")]
    pub(crate) dump: Option<PathBuf>,
    /// Record every stage's timeline (steps, sends, receives, waits) into this Chrome trace file (Perfetto, chrome://tracing; `m3c report` reads it).
    #[arg(long, value_name = "FILE.json")]
    pub(crate) trace: Option<PathBuf>,
    /// Sequences per micro-batch (default: the prompts shared evenly over the stages).
    #[arg(long, value_name = "SEQS", value_parser = positive_count)]
    pub(crate) micro_batch: Option<usize>,
    /// Compute every prompt in full: no prompt reuses the cache blocks of another with the same prefix.
    #[arg(long)]
    pub(crate) no_enable_prefix_caching: bool,
    #[command(flatten)]
    pub(crate) encoder: EncoderFlags,
    /// Cache blocks in each stage's KV pool (default: exactly what every prompt reaches); with fewer, prompts take turns (preemption).
    #[arg(long, value_name = "N", value_parser = positive_count)]
    pub(crate) kv_blocks: Option<usize>,
    /// Prefill long prompts in chunks of this many tokens, so they pipeline through the stages.
    #[arg(long, value_name = "TOKENS", value_parser = positive_count)]
    pub(crate) prefill_chunk: Option<usize>,
    /// Compare the first prompt's logits and ids with a golden file (the fixtures' tensor names); fail if they differ.
    #[arg(long, value_name = "GOLDEN.safetensors")]
    pub(crate) expect: Option<PathBuf>,
    /// Seconds without a sign of life (a heartbeat) from a neighbour before a stage gives up on it; a stage that computes counts as alive.
    #[arg(long, default_value_t = 30.0, value_parser = timeout_s)]
    pub(crate) timeout_s: f64,
    /// How many times a lost pipeline (a stage killed, a lost link or host) is started again: unfinished prompts go on where they were, token for token as without the fault; finished ones are not run again. 0: a fault ends the run. A run with --dump, --expect or --trace records one job and is not resumed.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = count)]
    pub(crate) max_restarts: usize,
    /// Report each generated token's log-probability (raw logits, as vLLM's
    /// default) and this many most likely alternatives (0 to 20): a line
    /// `logprobs N: [{"id", "logprob", "top": [[id, logprob], ...]}, ...]`
    /// per prompt after its ids or text.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(0..=20))]
    pub(crate) logprobs: Option<u8>,
    /// Speculative decoding, in vLLM's JSON: `{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": A, "prompt_lookup_max": B}` (prompt lookup), or `{"method": "eagle3", "model": DIR, "num_speculative_tokens": K}` (the draft head OUT was compiled with; DIR holds its weights). The output is bit-identical with and without it; it prints the mean acceptance length.
    #[arg(long, value_name = "JSON", value_parser = speculative_config)]
    pub(crate) speculative_config: Option<m3c_contract::speculative::SpeculativeConfig>,
    /// Choices per prompt (1 to 16), as OpenAI's `n`: choice i draws from seed + i, so it is what a run with
    /// that seed gives; prompt P's choice C is sequence P × N + C ("### prompt P choice C" with text).
    #[arg(short = 'n', long = "n", value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=16))]
    pub(crate) choices: u8,
    /// Constrain every output to JSON valid under this JSON schema: the schema itself (`'{"type": "object", ...}'`) or a file holding it.
    #[arg(long, value_name = "JSON|FILE", conflicts_with_all = ["regex", "choice", "grammar"])]
    pub(crate) json_schema: Option<String>,
    /// Constrain every output to match this regular expression whole.
    #[arg(long, value_name = "REGEX", conflicts_with_all = ["choice", "grammar"])]
    pub(crate) regex: Option<String>,
    /// Constrain every output to one of these strings (repeat the flag).
    #[arg(long, value_name = "TEXT", conflicts_with = "grammar")]
    pub(crate) choice: Vec<String>,
    /// Constrain every output to this Lark grammar (a file, llguidance's dialect).
    #[arg(long, value_name = "FILE")]
    pub(crate) grammar: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) gpu: GpuFlags,
    #[command(flatten)]
    pub(crate) launch: LaunchFlags,
}

/// Where mpirun puts the stages, for `m3c run` and `m3c serve` alike.
#[derive(clap::Args)]
pub(crate) struct LaunchFlags {
    /// Open MPI hostfile (`HOST slots=N` lines): ranks go to its hosts in order, where the plan names none.
    #[arg(long, value_name = "FILE")]
    pub(crate) hostfile: Option<PathBuf>,
    /// An extra mpirun option (repeatable; after those of $M3C_MPIRUN_ARGS), e.g. `--mpirun-arg=--mca --mpirun-arg=btl_tcp_if_include --mpirun-arg=eth0`.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    pub(crate) mpirun_arg: Vec<String>,
    /// The network interface (eth0, ib0) or subnet (10.0.0.0/24) the stages talk over: Open MPI's TCP and NCCL's sockets.
    #[arg(long, value_name = "NAME")]
    pub(crate) iface: Option<String>,
}

impl LaunchFlags {
    pub(crate) fn launch(&self) -> anyhow::Result<m3c_front::launch::Launch> {
        m3c_front::launch::Launch::new(self.hostfile.clone(), &self.mpirun_arg, self.iface.clone())
    }
}

/// How GPU stages run, for `m3c run` and `m3c serve` alike.
#[derive(clap::Args)]
pub(crate) struct GpuFlags {
    /// GPU stages: capture each decode micro-batch's step once as a device graph (CUDA or HIP) and replay it (`off`: launch every kernel each step). `--cuda-graphs` is the older name.
    #[arg(long, alias = "cuda-graphs", value_parser = ["on", "off"], default_value = "on")]
    pub(crate) graphs: String,
    /// GPU stages: run prefill linears as the vendor library's tensor-core GEMMs (`vendor`, or its older name `cublas`: cuBLAS on CUDA; activations rounded to bf16 for them; `M3C_GEMM_MIN_ROWS`, default 32, sets the smallest step), or `off`: m3c's GEMV kernel, exact f32.
    #[arg(long, value_parser = ["vendor", "cublas", "off"], default_value = "off")]
    pub(crate) prefill_gemm: String,
}

impl GpuFlags {
    /// What the flags ask of GPU stages.
    pub(crate) fn modes(&self) -> m3c_contract::stage_args::GpuModes {
        m3c_contract::stage_args::GpuModes { graphs: self.graphs == "on", prefill_gemm_vendor: self.prefill_gemm != "off" }
    }
}

#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// A model folder (config.json, safetensors, tokenizer.json), compiled on first start into the build cache and reused after; or a folder written by `m3c compile`, served with --model.
    #[arg(value_name = "MODEL_DIR | OUT")]
    pub(crate) out: PathBuf,
    /// With a compiled OUT: the checkpoint folder it was compiled for.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Pipeline stages to compile a model folder into (as vLLM's; `--pp` for short).
    #[arg(long, visible_alias = "pp", value_name = "N", value_parser = positive_count, help_heading = "Parallel")]
    pub(crate) pipeline_parallel_size: Option<usize>,
    /// A partition plan for a model folder (hosts, devices, the split), in place of the planner's.
    #[arg(long, value_name = "PLAN.yaml", help_heading = "Parallel")]
    pub(crate) plan: Option<PathBuf>,
    /// Target a model folder compiles for (default: the plan's, else host).
    #[arg(long, value_parser = ["host", "cuda", "rocm"], help_heading = "Parallel")]
    pub(crate) target: Option<String>,
    /// Positions per KV cache block: MiniMax-M3's caches are paged by its MSA block (128), so only that value is accepted (vLLM's recipe gives 128).
    #[arg(long, value_name = "N", value_parser = positive_count, help_heading = "Cache")]
    pub(crate) block_size: Option<usize>,
    /// KV cache element type: `auto` (f32 on the host, exact), `bf16`, or `fp8` (e4m3, scale 1, as vLLM's without calibrated scales: a quarter of f32's memory).
    #[arg(long, value_name = "DTYPE", value_enum, help_heading = "Cache")]
    pub(crate) kv_cache_dtype: Option<KvCacheDtype>,
    /// vLLM's name for --kv-fraction: each stage's KV pool takes this share (0-1] of its free memory at start-up.
    #[arg(long, value_name = "F", value_parser = fraction, conflicts_with_all = ["kv_fraction", "kv_blocks"], help_heading = "Cache")]
    pub(crate) gpu_memory_utilization: Option<f64>,
    /// How activations are stored when a model folder is compiled (`f32`, the host default; `bf16`, the GPU default).
    #[arg(long, value_enum, help_heading = "Cache")]
    pub(crate) activations: Option<ActivationStorage>,
    /// The longest sequence (prompt + completion) a request may make, at most the model's context.
    #[arg(long, value_name = "TOKENS", value_parser = positive_count, help_heading = "Model")]
    pub(crate) max_model_len: Option<usize>,
    /// Compile and load no vision tower: a text-only deployment (image parts are refused).
    #[arg(long, help_heading = "Model")]
    pub(crate) language_model_only: bool,
    /// Accepted for vLLM's command lines; m3c runs no code from the model folder.
    #[arg(long, help_heading = "Model")]
    pub(crate) trust_remote_code: bool,
    /// The model names clients may use, the first in answers (default: the checkpoint folder's name, and the path as given here, as vLLM's). A request without `model` goes to this model.
    #[arg(long, value_name = "NAME", num_args = 1.., help_heading = "Frontend")]
    pub(crate) served_model_name: Vec<String>,
    /// Tool-call parser: `minimax_m3` (MiniMax-M3's, what m3c parses; another name is an error).
    #[arg(long, value_name = "NAME", help_heading = "Frontend")]
    pub(crate) tool_call_parser: Option<String>,
    /// Reasoning parser: `minimax_m3` (the `<mm:think>` block becomes the answer's `reasoning`, and `reasoning_content`; another name is an error).
    #[arg(long, value_name = "NAME", help_heading = "Frontend")]
    pub(crate) reasoning_parser: Option<String>,
    /// vLLM's structured-output settings, as JSON: `{"enable_in_reasoning": true}` makes a request's grammar bind the whole output, reasoning included (by default it binds what follows the reasoning); `backend` may be `auto` or `guidance` (llguidance, m3c's).
    #[arg(long, value_name = "JSON", value_parser = json_object, help_heading = "Frontend")]
    pub(crate) structured_outputs_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// Accepted for vLLM's command lines: m3c parses tool calls out of every chat answer.
    #[arg(long, help_heading = "Frontend")]
    pub(crate) enable_auto_tool_choice: bool,
    /// Chat template keyword arguments every chat request starts from (a request's `chat_template_kwargs` win), as JSON: e.g. `{"thinking_mode": "enabled"}`.
    #[arg(long, value_name = "JSON", value_parser = json_object, help_heading = "Frontend")]
    pub(crate) default_chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// vLLM's encoder placement (`data` or `weights`): accepted; m3c runs the whole vision tower where the plan puts it (stage 0), unsharded.
    #[arg(long, value_name = "MODE", value_parser = ["data", "weights"], help_heading = "Multimodal")]
    pub(crate) mm_encoder_tp_mode: Option<String>,
    #[command(flatten)]
    pub(crate) vllm: VllmFlags,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", help_heading = "Frontend")]
    pub(crate) host: String,
    #[arg(long, default_value_t = 8000, help_heading = "Frontend")]
    pub(crate) port: u16,
    /// Require `Authorization: Bearer KEY` on the /v1 routes (default: $M3C_API_KEY, else none).
    #[arg(long, help_heading = "Frontend")]
    pub(crate) api_key: Option<String>,
    /// Pipelines of the build behind this one server (vLLM's flag): N mpirun jobs of the plan's stages, on a --hostfile's slots in turn (replica R's rank K on slot R×ranks+K) or all on this machine. Requests go to the replica whose prefix cache holds the longest start of the prompt when that is at least half of it and the replica is less than a batch busier than the least busy one, else to the least busy; /health is 200 while any replica serves, and /metrics gives each replica's series (`replica="R"`, vLLM's `engine="R"`).
    #[arg(long, visible_alias = "dp", value_name = "N", default_value_t = 1, value_parser = positive_count, help_heading = "Parallel")]
    pub(crate) data_parallel_size: usize,
    /// Sequences running at once (more wait); vLLM's --max-num-seqs.
    #[arg(long, visible_alias = "max-num-seqs", default_value_t = 64, value_parser = positive_count, help_heading = "Scheduler")]
    pub(crate) max_batch: usize,
    /// KV cache memory per stage, in GB: the stages' pools of cache blocks, shared by the running sequences and the prefix cache.
    #[arg(long, value_name = "GB", default_value_t = 8.0, value_parser = number, help_heading = "Cache")]
    pub(crate) kv_budget: f32,
    /// Compute every prompt in full: keep no finished sequence's cache blocks for later requests with the same prefix.
    #[arg(long, overrides_with = "enable_prefix_caching", help_heading = "Cache")]
    pub(crate) no_enable_prefix_caching: bool,
    /// Keep finished sequences' cache blocks for later requests with the same prefix: on by default (as in vLLM).
    #[arg(long, overrides_with = "no_enable_prefix_caching", help_heading = "Cache")]
    pub(crate) enable_prefix_caching: bool,
    #[command(flatten)]
    pub(crate) encoder: EncoderFlags,
    /// Cache blocks in each stage's KV pool, in place of what --kv-budget holds (vLLM's --num-gpu-blocks-override).
    #[arg(long, visible_alias = "num-gpu-blocks-override", value_name = "N", value_parser = positive_count, help_heading = "Cache")]
    pub(crate) kv_blocks: Option<usize>,
    /// Size each stage's KV pool to this share (0-1] of its free memory at start-up (a GPU's after its weights; leave room for step scratch), in place of --kv-budget.
    #[arg(long, value_name = "F", value_parser = fraction, conflicts_with = "kv_blocks", help_heading = "Cache")]
    pub(crate) kv_fraction: Option<f64>,
    /// Requests that may wait for a slot; past that a request gets 503.
    #[arg(long, default_value_t = 256, value_parser = count, help_heading = "Scheduler")]
    pub(crate) max_queue: usize,
    /// Prefill long prompts in chunks of this many tokens, alongside the running decodes.
    #[arg(long, value_name = "TOKENS", default_value_t = 256, value_parser = positive_count, help_heading = "Scheduler")]
    pub(crate) prefill_chunk: usize,
    /// `max_tokens` of a chat request that sets none (capped by the context and the KV pool).
    #[arg(long, value_name = "TOKENS", default_value_t = 4096, value_parser = positive_count, help_heading = "Frontend")]
    pub(crate) default_max_tokens: usize,
    /// Seconds without a heartbeat before a stage is declared lost.
    #[arg(long, default_value_t = 30.0, value_parser = timeout_s, help_heading = "Server")]
    pub(crate) timeout_s: f64,
    /// How many times a lost pipeline (a stage that died, a lost link or host) is started again within --restart-window-s: its open requests wait and go on where their streams were, token for token as without the fault. Past it, or with 0, they fail and a lone pipeline ends the server.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = count, help_heading = "Server")]
    pub(crate) max_restarts: usize,
    /// The window --max-restarts counts restarts in, in seconds.
    #[arg(long, value_name = "S", default_value_t = 600.0, value_parser = window_s, help_heading = "Server")]
    pub(crate) restart_window_s: f64,
    /// Seconds in-flight requests get to finish after SIGTERM or SIGINT.
    #[arg(long, default_value_t = 30.0, value_parser = timeout_s, help_heading = "Server")]
    pub(crate) grace_s: f64,
    /// Speculative decoding, in vLLM's JSON: `{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": A, "prompt_lookup_max": B}` (prompt lookup), or `{"method": "eagle3", "model": DIR, "num_speculative_tokens": K}` (the draft head OUT was compiled with). Answers are bit-identical with and without it; /metrics counts drafts and accepted tokens.
    #[arg(long, value_name = "JSON", value_parser = speculative_config, help_heading = "Speculative decoding")]
    pub(crate) speculative_config: Option<m3c_contract::speculative::SpeculativeConfig>,
    /// vLLM's KV-cache events for KV-aware routers, in vLLM's JSON: `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "", "replay_endpoint": "tcp://*:5558"}`: every block the prefix cache stores or evicts, published over ZeroMQ as msgpack `BlockStored`/`BlockRemoved` (and `AllBlocksCleared` at start).
    #[arg(long, value_name = "JSON")]
    pub(crate) kv_events_config: Option<String>,
    #[command(flatten)]
    pub(crate) gpu: GpuFlags,
    #[command(flatten)]
    pub(crate) launch: LaunchFlags,
    /// Chat images given as file:// URLs are read only from inside this folder (without it, file:// URLs are refused).
    #[arg(long, value_name = "DIR", help_heading = "Multimodal")]
    pub(crate) allowed_local_media_path: Option<PathBuf>,
    /// Fetch http(s) media only from these hosts (vLLM's flag; every hop of a redirect too).
    #[arg(long, value_name = "HOST", num_args = 1.., help_heading = "Multimodal")]
    pub(crate) allowed_media_domains: Option<Vec<String>>,
    /// Let http(s) media come from loopback, private and link-local addresses (refused by default: a client could
    /// otherwise make the server fetch from this machine's or its network's own services).
    #[arg(long, help_heading = "Multimodal")]
    pub(crate) allow_private_media_urls: bool,
    /// Seconds an http(s) image fetch may take in all.
    #[arg(long, default_value_t = 10.0, value_parser = timeout_s, help_heading = "Multimodal")]
    pub(crate) media_timeout_s: f64,
    /// Allow `POST /debug/trace {"seconds": N}`: a timeline of every stage over the next N seconds, written here as a Chrome trace.
    #[arg(long, value_name = "DIR", help_heading = "Server")]
    pub(crate) trace_dir: Option<PathBuf>,
    /// The largest image a request may bring, in MB (data:, http(s) or file).
    #[arg(long, default_value_t = 20, value_parser = positive_count, help_heading = "Multimodal")]
    pub(crate) max_image_mb: usize,
    /// The most images one request may carry.
    #[arg(long, default_value_t = 8, value_parser = positive_count, help_heading = "Multimodal")]
    pub(crate) max_images_per_request: usize,
    /// The largest video a request may bring, in MB (data:, http(s) or file).
    #[arg(long, default_value_t = 256, value_parser = positive_count, help_heading = "Multimodal")]
    pub(crate) max_video_mb: usize,
    /// The most videos one request may carry.
    #[arg(long, default_value_t = 2, value_parser = positive_count, help_heading = "Multimodal")]
    pub(crate) max_videos_per_request: usize,
}

/// vLLM's `serve` flags that m3c takes with their meaning, or refuses
/// with the flag that does what the user wants (`serve_cmd::check_vllm_flags`).
#[derive(clap::Args)]
pub(crate) struct VllmFlags {
    /// vLLM's weight and activation type: `auto` (m3c's default), `bfloat16` or `float32` (the activations' storage, as --activations).
    #[arg(long, value_name = "DTYPE", value_parser = ["auto", "bfloat16", "bf16", "float32", "float", "float16", "half"], help_heading = "Model")]
    pub(crate) dtype: Option<String>,
    /// vLLM's tensor parallelism: 1 only; m3c splits a model into pipeline stages (--pipeline-parallel-size).
    #[arg(long, visible_alias = "tp", value_name = "N", value_parser = positive_count, help_heading = "Parallel")]
    pub(crate) tensor_parallel_size: Option<usize>,
    /// vLLM's per-step token budget: refused (m3c bounds each prompt's chunk, --prefill-chunk, and the sequences per step, --max-batch).
    #[arg(long, value_name = "TOKENS", value_parser = positive_count, hide = true)]
    pub(crate) max_num_batched_tokens: Option<usize>,
    /// Seeds of requests that give none come from this seed and their order of arrival, so a restarted server draws the same (vLLM's --seed); without it they are random.
    #[arg(long, value_name = "SEED", help_heading = "Frontend")]
    pub(crate) seed: Option<u64>,
    /// Accepted for vLLM's command lines: m3c writes no per-request log.
    #[arg(long, visible_alias = "disable-log-requests", help_heading = "Server")]
    pub(crate) no_enable_log_requests: bool,
    /// No periodic stats line on standard error (vLLM's).
    #[arg(long, help_heading = "Server")]
    pub(crate) disable_log_stats: bool,
    /// Accepted for vLLM's command lines (m3c's HTTP server logs only errors and the stats line).
    #[arg(long, value_name = "LEVEL", value_parser = ["critical", "error", "warning", "info", "debug", "trace"], help_heading = "Server")]
    pub(crate) uvicorn_log_level: Option<String>,
}

/// A JSON object (`--default-chat-template-kwargs`).
pub(crate) fn json_object(v: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str::<serde_json::Value>(v) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(other) => Err(format!("expected a JSON object such as {{\"thinking_mode\": \"enabled\"}}, not {other}")),
        Err(e) => Err(format!("not JSON ({e}); expected an object such as {{\"thinking_mode\": \"enabled\"}}")),
    }
}

pub(crate) fn count(v: &str) -> Result<usize, String> {
    m3c_contract::prompts::parse_count(v, "count", false).map_err(|_| format!("`{v}` is not a count (0 to {})", usize::MAX))
}

pub(crate) fn positive_count(v: &str) -> Result<usize, String> {
    m3c_contract::prompts::parse_count(v, "count", true).map_err(|_| format!("`{v}` is not a positive count"))
}

/// `--speculative-config` of `run` and `serve`: vLLM's JSON, checked. An
/// EAGLE3 draft's folder must hold its config (the stages check it is the
/// one their head was compiled from, and read its weights).
pub(crate) fn speculative_config(v: &str) -> Result<m3c_contract::speculative::SpeculativeConfig, String> {
    use m3c_contract::speculative::SpeculativeConfig;
    let c = SpeculativeConfig::from_json(v)?;
    if let SpeculativeConfig::Eagle3 { model, .. } = &c {
        if !model.join("config.json").is_file() {
            return Err(format!("--speculative-config: `model` {} has no config.json (an EAGLE3 draft's folder)", model.display()));
        }
    }
    Ok(c)
}

pub(crate) fn stop_string(v: &str) -> Result<String, String> {
    match v.len() {
        0 => Err("a stop string cannot be empty".into()),
        1..=1024 => Ok(v.to_string()),
        n => Err(format!("a stop string of {n} bytes; at most 1024")),
    }
}

pub(crate) fn number(v: &str) -> Result<f32, String> {
    m3c_contract::prompts::parse_number(v, "value").map_err(|_| format!("`{v}` is not a number"))
}

pub(crate) fn fraction(v: &str) -> Result<f64, String> {
    m3c_contract::stage_args::parse_fraction(v)
}

pub(crate) fn timeout_s(v: &str) -> Result<f64, String> {
    m3c_contract::prompts::parse_timeout_s(v)
}

/// `--restart-window-s`: seconds, as `--timeout-s` takes them.
fn window_s(v: &str) -> Result<f64, String> {
    m3c_contract::prompts::parse_timeout_s(v).map_err(|e| e.replace("--timeout-s", "--restart-window-s"))
}

use m3c_compiler::lower::Storage;

/// `--kv-cache`: how the caches store their elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum CacheStorage {
    F32,
    Bf16,
    Fp8,
}

/// `--activations`: how activations between kernels and stages are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ActivationStorage {
    F32,
    Bf16,
}

/// vLLM's `--kv-cache-dtype` (its spellings): `auto` is exact f32 here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum KvCacheDtype {
    Auto,
    #[value(alias = "bfloat16")]
    Bf16,
    #[value(alias = "fp8_e4m3")]
    Fp8,
}

impl From<CacheStorage> for Storage {
    fn from(c: CacheStorage) -> Storage {
        match c {
            CacheStorage::F32 => Storage::F32,
            CacheStorage::Bf16 => Storage::Bf16,
            CacheStorage::Fp8 => Storage::Fp8,
        }
    }
}

impl From<ActivationStorage> for Storage {
    fn from(a: ActivationStorage) -> Storage {
        match a {
            ActivationStorage::F32 => Storage::F32,
            ActivationStorage::Bf16 => Storage::Bf16,
        }
    }
}

impl From<KvCacheDtype> for CacheStorage {
    fn from(d: KvCacheDtype) -> CacheStorage {
        match d {
            KvCacheDtype::Auto => CacheStorage::F32,
            KvCacheDtype::Bf16 => CacheStorage::Bf16,
            KvCacheDtype::Fp8 => CacheStorage::Fp8,
        }
    }
}

impl std::fmt::Display for CacheStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use clap::ValueEnum;
        match self.to_possible_value() {
            Some(v) => f.write_str(v.get_name()),
            None => Ok(()),
        }
    }
}

/// One flag per sampling field of the contract's table (`--temperature`,
/// `--top-k`, ...): a new field there is a new flag here, with its help and
/// its value checked as the field's kind says. Unset flags leave the
/// checkpoint's `generation_config.json`, else greedy decoding.
#[derive(Debug, Clone, Default)]
pub(crate) struct SamplingFlags(pub(crate) m3c_contract::sampling::SamplingOverrides);

impl clap::FromArgMatches for SamplingFlags {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let mut s = SamplingFlags::default();
        s.update_from_arg_matches(m)?;
        Ok(s)
    }

    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        for f in m3c_contract::sampling::FIELDS {
            if let Some(v) = m.get_one::<m3c_contract::sampling::FieldValue>(f.name) {
                (f.set_override)(&mut self.0, Some(*v));
            }
        }
        Ok(())
    }
}

impl clap::Args for SamplingFlags {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        use m3c_contract::sampling::{Kind, FIELDS};
        FIELDS.iter().fold(cmd, |cmd, f| {
            let default = match f.name {
                "seed" => " Default: 0.".to_string(),
                _ => format!(
                    " Default: the checkpoint's generation_config.json, else {}.",
                    (f.get)(&m3c_contract::sampling::SamplingParams::GREEDY)
                ),
            };
            cmd.arg(
                clap::Arg::new(f.name)
                    .long(f.long)
                    .value_name(f.value_name)
                    .help(format!("{}.{default}", f.help))
                    .allow_negative_numbers(f.kind == Kind::Real || f.kind == Kind::Count)
                    .value_parser(move |v: &str| f.parse(v)),
            )
        })
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

/// How the first stage encodes images and videos (`m3c run` and `m3c serve`).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct EncoderFlags {
    /// Features of image grids and video chunks kept by content, in MB, so a repeated image or video is not encoded again (0: no cache).
    #[arg(long, value_name = "MB", default_value_t = 512, help_heading = "Multimodal")]
    pub(crate) encoder_cache_mb: u64,
    /// Where encodes run: `beside` the step loop (running sequences keep stepping; a request joins when its features are ready) or `inline` in it (every running sequence waits, as before).
    #[arg(long, value_name = "WHERE", default_value = "beside", value_parser = ["beside", "inline"], help_heading = "Multimodal")]
    pub(crate) encodes: String,
}

impl EncoderFlags {
    pub(crate) fn options(&self) -> m3c_contract::stage_args::EncoderOptions {
        m3c_contract::stage_args::EncoderOptions {
            cache_bytes: self.encoder_cache_mb.saturating_mul(1 << 20),
            inline: self.encodes == "inline",
        }
    }
}
