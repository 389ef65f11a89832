//! The command line of a stage executable (every rank gets the same): one
//! type, [`StageArgs`], with its one encoder ([`StageArgs::to_args`], what
//! the front passes to mpirun) and its one parser ([`StageArgs::parse`],
//! what each stage reads). Options that exclude each other are one type
//! each, so only one can be said: where the prompts come from
//! ([`Prompts`]), the weights ([`Weights`]), the KV pool ([`KvPool`] and its
//! [`PoolSize`]); [`GpuModes`] holds the GPU stages' modes.

use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq)]
pub struct StageArgs {
    /// Where the weights come from.
    pub weights: Weights,
    /// A golden file (the fixtures' tensor names) the last stage compares its results with.
    pub expect: Option<PathBuf>,
    /// The run's prompts, or `Served` (requests arrive while serving).
    pub prompts: Prompts,
    pub max_new_tokens: usize,
    pub dump: Option<PathBuf>,
    /// Seconds a rank waits for a message before it gives up.
    pub timeout_s: f64,
    /// Sequences per micro-batch (default: the prompts shared over the stages).
    pub micro_batch: Option<usize>,
    /// Every stage's KV pool.
    pub kv: KvPool,
    /// Prefill prompts in chunks of this many tokens.
    pub prefill_chunk: Option<usize>,
    /// How GPU stages run their steps.
    pub gpu: GpuModes,
    /// Print each generated id as it arrives (`m3c-id SEQ ID`) instead of
    /// every prompt's ids at the end: what `m3c run` reads to stream text.
    pub stream_ids: bool,
    /// How the last stage picks each token (greedy by default).
    pub sampling: SamplingParams,
    /// Ids that end a sequence (after being emitted); empty: none.
    pub eos_ids: Vec<i64>,
    /// Byte strings that end a sequence once its generated text holds one
    /// (given in hex, so any bytes survive the command line).
    pub stops: Vec<Vec<u8>>,
    /// Per-sequence sampling that differs from `sampling` (a `--prompts`
    /// JSONL line's own settings).
    pub seq_sampling: Vec<(usize, SamplingParams)>,
    /// The images of the prompts (`m3c_contract::images`), read by the stage
    /// that encodes them.
    pub images: Option<PathBuf>,
    /// Report each generated token's logprob and this many alternatives.
    pub logprobs: Option<u8>,
    /// The grammar every prompt's output must match from its first token
    /// (`m3c_constrain`'s text form), unless a prompt that arrives on
    /// standard input brings its own.
    pub grammar: Option<String>,
    /// Record every stage's timeline; the first stage prints it at the end
    /// (`m3c-trace` lines).
    pub trace: bool,
    /// Speculative decoding by prompt lookup (`--speculative ngram:K:MIN:MAX`).
    pub speculative: Option<crate::speculative::Ngram>,
    /// Speculative decoding by the EAGLE3 draft head compiled into the last
    /// stage (`--eagle3 K --draft-model DIR`).
    pub eagle3: Option<crate::speculative::Eagle3Run>,
    /// How the stage that holds the vision tower encodes images and videos.
    pub encoder: EncoderOptions,
    /// This rank's place among the ranks of every pipeline on its machine
    /// (`m3c serve --data-parallel-size`); `None`: its own job's ranks only.
    pub node_share: Option<NodeShare>,
}

/// A rank's place among all the ranks on its machine when several
/// pipelines share it: its GPU is the `offset`-th the machine's ranks
/// take, and it gets `1/total` of the cores and free memory. (Within one
/// job, Open MPI's local rank and size say the same.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeShare {
    pub offset: usize,
    pub total: usize,
}

impl std::fmt::Display for NodeShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.offset, self.total)
    }
}

impl NodeShare {
    /// `OFFSET/TOTAL`, with the offset below the total.
    pub fn parse(v: &str) -> Result<NodeShare, String> {
        let bad = || format!("--node-share `{v}`: expected OFFSET/TOTAL, the offset below the total (0/2)");
        let (o, t) = v.split_once('/').ok_or_else(bad)?;
        let (offset, total) = (o.parse::<usize>().map_err(|_| bad())?, t.parse::<usize>().map_err(|_| bad())?);
        if offset >= total || total > 1 << 16 {
            return Err(bad());
        }
        Ok(NodeShare { offset, total })
    }
}

/// How images and videos are encoded on the stage that holds the tower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncoderOptions {
    /// Bytes of encoded features kept by content hash, so a repeated image
    /// or video chunk is not encoded again (0: no cache).
    pub cache_bytes: u64,
    /// Encode inside the step loop, every running sequence waiting (the
    /// behaviour before encodes ran beside it; kept to measure against).
    pub inline: bool,
}

impl Default for EncoderOptions {
    fn default() -> EncoderOptions {
        EncoderOptions { cache_bytes: 512 << 20, inline: false }
    }
}

/// Where a stage's weights come from: a checkpoint or a seed, never both.
#[derive(Debug, Clone, PartialEq)]
pub enum Weights {
    /// The checkpoint folder (`--model`).
    Checkpoint(PathBuf),
    /// Random weights of the compiled shapes from this seed
    /// (`--synthetic-weights`): real-size layers timed without their files.
    Synthetic(u64),
}

impl Weights {
    /// The checkpoint folder, unless the weights are synthetic.
    pub fn checkpoint(&self) -> Option<&PathBuf> {
        match self {
            Weights::Checkpoint(dir) => Some(dir),
            Weights::Synthetic(_) => None,
        }
    }
}

/// Where a run's prompts come from: each way of giving them excludes the
/// others, so only one can be said.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompts {
    /// Token ids on the command line, one `--prompt-ids` a prompt.
    Ids(Vec<Vec<i64>>),
    /// A prompts file of ids, one prompt a line (`--prompts`), with the
    /// prompts it held when the arguments were parsed.
    File { path: PathBuf, ids: Vec<Vec<i64>> },
    /// This many prompts arrive on the first stage's standard input as
    /// framed `add` commands (`crate::protocol::read_command`), each with
    /// its images (`--stdin-prompts`): how `m3c run` sends them, so that
    /// no stage reads a file of the front's (it may run on another host)
    /// and no prompt is bound by the length of a command line. Every
    /// stage knows the count.
    Stdin(usize),
    /// None: requests arrive on the first stage's standard input for as
    /// long as it serves (`--serve`, what `m3c serve` starts).
    Served,
}

impl Prompts {
    /// The prompts given on the command line or in a file (none when they
    /// come on standard input, or while serving).
    pub fn inline(&self) -> &[Vec<i64>] {
        match self {
            Prompts::Ids(ids) | Prompts::File { ids, .. } => ids,
            Prompts::Stdin(_) | Prompts::Served => &[],
        }
    }

    /// How many prompts the run has, wherever they come from (0 while serving).
    pub fn count(&self) -> usize {
        match self {
            Prompts::Stdin(n) => *n,
            other => other.inline().len(),
        }
    }
}

/// How large every stage's KV pool is, and whether it keeps prefixes:
/// what `m3c run` and `m3c serve` decide and every stage is told.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvPool {
    pub size: PoolSize,
    /// Automatic prefix caching: full cache blocks are kept after their
    /// sequence ends and reused by later sequences with the same prefix.
    pub prefix_caching: bool,
    /// The first stage reports blocks stored in and evicted from the prefix
    /// cache (`m3c-kvs`, `m3c-kvr` lines), for `m3c serve`'s KV-cache
    /// events.
    pub events: bool,
}

impl Default for KvPool {
    fn default() -> KvPool {
        KvPool { size: PoolSize::WholeContext, prefix_caching: true, events: false }
    }
}

/// How many blocks a stage's KV pool has: one way of three.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum PoolSize {
    /// One sequence of the model's whole context.
    #[default]
    WholeContext,
    /// This many blocks (`--kv-blocks`).
    Blocks(usize),
    /// This share of each stage's free memory (a GPU's after its weights;
    /// the least any stage offers: `--kv-fraction`).
    Fraction(f64),
}

/// How GPU stages run their steps (host stages ignore both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuModes {
    /// Replay each decode micro-batch's step as a captured graph.
    pub graphs: bool,
    /// Prefill linears with bf16 or MXFP8 weights on the vendor's GEMM
    /// library (cuBLAS: tensor cores).
    pub prefill_gemm_vendor: bool,
}

impl Default for GpuModes {
    fn default() -> GpuModes {
        GpuModes { graphs: true, prefill_gemm_vendor: false }
    }
}

impl StageArgs {
    /// Arguments with every default: greedy, no prompts, no flags.
    pub fn new(model: PathBuf) -> StageArgs {
        StageArgs {
            weights: Weights::Checkpoint(model),
            expect: None,
            prompts: Prompts::Ids(Vec::new()),
            max_new_tokens: 0,
            dump: None,
            timeout_s: DEFAULT_TIMEOUT_S,
            micro_batch: None,
            kv: KvPool::default(),
            prefill_chunk: None,
            gpu: GpuModes::default(),
            stream_ids: false,
            sampling: SamplingParams::GREEDY,
            eos_ids: Vec::new(),
            stops: Vec::new(),
            seq_sampling: Vec::new(),
            images: None,
            logprobs: None,
            grammar: None,
            trace: false,
            speculative: None,
            eagle3: None,
            encoder: EncoderOptions::default(),
            node_share: None,
        }
    }

    /// Speculative decoding as `--speculative-config` says: prompt lookup,
    /// or the EAGLE3 head compiled into the last stage.
    pub fn set_speculation(&mut self, c: Option<crate::speculative::SpeculativeConfig>) {
        use crate::speculative::{Eagle3Run, SpeculativeConfig};
        (self.speculative, self.eagle3) = match c {
            None => (None, None),
            Some(SpeculativeConfig::Ngram(n)) => (Some(n), None),
            Some(SpeculativeConfig::Eagle3 { model, tokens, disable_by_batch_size }) => {
                (None, Some(Eagle3Run { tokens, model, disable_by_batch_size }))
            }
        };
    }

    /// The command line that [`StageArgs::parse`] reads back as `self`.
    pub fn to_args(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let mut flag = |name: &str, value: String| out.extend([name.to_string(), value]);
        let path = |p: &PathBuf| p.display().to_string();
        let ids = |p: &[i64]| p.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        match &self.weights {
            Weights::Checkpoint(dir) => flag("--model", path(dir)),
            Weights::Synthetic(seed) => flag("--synthetic-weights", seed.to_string()),
        }
        match &self.prompts {
            Prompts::Ids(prompts) => prompts.iter().for_each(|p| flag("--prompt-ids", ids(p))),
            Prompts::File { path: f, .. } => flag("--prompts", path(f)),
            Prompts::Stdin(n) => flag("--stdin-prompts", n.to_string()),
            Prompts::Served => {}
        }
        // What shapes each request, for prompts given as flags only: a
        // request on standard input (`m3c run`, `m3c serve`) brings its own.
        let inline = matches!(self.prompts, Prompts::Ids(_) | Prompts::File { .. });
        if inline {
            flag("--max-new-tokens", self.max_new_tokens.to_string());
        }
        for (name, value) in [
            ("--dump", self.dump.as_ref().map(path)),
            ("--expect", self.expect.as_ref().map(path)),
            ("--images", self.images.as_ref().map(path)),
            ("--prefill-chunk", self.prefill_chunk.map(|n| n.to_string())),
            ("--micro-batch", self.micro_batch.map(|n| n.to_string())),
            ("--kv-blocks", if let PoolSize::Blocks(n) = self.kv.size { Some(n.to_string()) } else { None }),
            ("--kv-fraction", if let PoolSize::Fraction(f) = self.kv.size { Some(f.to_string()) } else { None }),
            ("--timeout-s", Some(self.timeout_s.to_string())),
            ("--graphs", Some(if self.gpu.graphs { "on" } else { "off" }.to_string())),
            ("--prefix-caching", Some(if self.kv.prefix_caching { "on" } else { "off" }.to_string())),
            ("--kv-events", self.kv.events.then(|| "on".to_string())),
            ("--prefill-gemm", Some(if self.gpu.prefill_gemm_vendor { "vendor" } else { "off" }.to_string())),
            ("--eos-ids", (!self.eos_ids.is_empty()).then(|| ids(&self.eos_ids))),
            ("--speculative", self.speculative.map(|n| n.encode())),
            ("--eagle3", self.eagle3.as_ref().map(crate::speculative::Eagle3Run::encode_tokens)),
            ("--draft-model", self.eagle3.as_ref().map(|e| path(&e.model))),
            ("--encoder-cache-bytes", Some(self.encoder.cache_bytes.to_string())),
            ("--encodes", Some(if self.encoder.inline { "inline" } else { "beside" }.to_string())),
            ("--node-share", self.node_share.map(|s| s.to_string())),
        ] {
            if let Some(v) = value {
                flag(name, v);
            }
        }
        if inline {
            // Each sampling field as a flag of its own name (`--top-k`).
            for (k, v) in self.sampling.fields() {
                flag(&format!("--{}", k.replace('_', "-")), v);
            }
            for (seq, p) in &self.seq_sampling {
                flag("--seq-sampling", format!("{seq}:{}", p.encode()));
            }
            for stop in &self.stops {
                flag("--stop", crate::protocol::hex(stop));
            }
            if let Some(k) = self.logprobs {
                flag("--logprobs", k.to_string());
            }
            if let Some(g) = &self.grammar {
                flag("--grammar", crate::protocol::hex(g.as_bytes()));
            }
        }
        for (switch, on) in [("--trace", self.trace), ("--stream-ids", self.stream_ids), ("--serve", self.serving())] {
            if on {
                out.push(switch.into());
            }
        }
        out
    }

    /// The sampling of sequence `seq`.
    pub fn sampling_for(&self, seq: usize) -> &SamplingParams {
        self.seq_sampling.iter().rev().find(|(s, _)| *s == seq).map_or(&self.sampling, |(_, p)| p)
    }
}

/// Seconds without a heartbeat before a peer counts as lost.
pub const DEFAULT_TIMEOUT_S: f64 = 30.0;

/// A share of memory: a number in (0, 1].
pub fn parse_fraction(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!("--kv-fraction: `{}` is not a share of memory in (0, 1]", v.chars().take(40).collect::<String>())),
    }
}

pub const USAGE: &str = "usage: stage-K (--model DIR | --synthetic-weights SEED) ((--prompt-ids 1,2,3 [--prompt-ids ...] | --prompts FILE | --stdin-prompts N) \
--max-new-tokens N | --serve) [--micro-batch SEQS] [--kv-blocks N | --kv-fraction F] [--prefill-chunk TOKENS] [--dump FILE.safetensors] [--expect GOLDEN.safetensors] [--timeout-s S] [--graphs on|off] [--prefix-caching on|off] [--prefill-gemm vendor|off] [--stream-ids] \
[--temperature T] [--top-k K] [--top-p P] [--min-p P] [--repetition-penalty R] [--seed S] [--eos-ids 1,2] [--stop HEX ...] [--seq-sampling SEQ:temperature=T,... ...] [--images FILE.safetensors] [--speculative ngram:K:MIN:MAX[:BATCH] | --eagle3 K --draft-model DIR] [--node-share OFFSET/TOTAL]";

use crate::prompts::{parse_count, parse_ids, parse_prompts_file, parse_timeout_s};
use crate::sampling::SamplingParams;

/// `SEQ:name=value,...`, one sequence's sampling (over the run's).
fn parse_seq_sampling(v: &str, base: SamplingParams) -> Result<(usize, SamplingParams), String> {
    let (seq, fields) = v.split_once(':').ok_or_else(|| format!("--seq-sampling `{v}`: expected SEQ:name=value,..."))?;
    let p = SamplingParams::decode(fields, base).map_err(|e| format!("--seq-sampling `{v}`: {e}"))?;
    Ok((parse_count(seq, "--seq-sampling sequence", false)?, p))
}

/// A stop string's bytes from hex (`0a0a` for "\n\n").
fn parse_hex(v: &str) -> Result<Vec<u8>, String> {
    crate::protocol::unhex(v)
        .filter(|_| v.len() <= 2048)
        .ok_or_else(|| format!("--stop: `{}` is not a non-empty even-length hex string", v.chars().take(40).collect::<String>()))
}

impl StageArgs {
    /// How many prompts the run has, wherever they come from.
    pub fn prompt_count(&self) -> usize {
        self.prompts.count()
    }

    /// Whether the stages serve requests (`m3c serve`) instead of running
    /// a fixed set of prompts.
    pub fn serving(&self) -> bool {
        self.prompts == Prompts::Served
    }

    /// Parses a stage's command line; the error names the flag. A prompts
    /// file is read here (a bounded user file).
    pub fn parse(args: &[String]) -> Result<StageArgs, String> {
        parse_args(args)
    }
}

/// A two-way switch: `v` must be the word for on or the word for off.
/// A count of bytes (0 allowed).
fn parse_bytes(flag: &str, v: &str) -> Result<u64, String> {
    v.parse().map_err(|_| format!("{flag}: `{v}` is not a number of bytes (0 for none)"))
}

fn parse_switch(flag: &str, v: &str, (on, off): (&str, &str)) -> Result<bool, String> {
    match v {
        _ if v == on => Ok(true),
        _ if v == off => Ok(false),
        _ => Err(format!("{flag}: `{v}` is not `{on}` or `{off}`")),
    }
}

/// The flags (besides the sampling fields) that shape each request of a
/// run whose prompts are flags.
const PER_REQUEST: &[&str] = &["--max-new-tokens", "--stop", "--logprobs", "--grammar", "--seq-sampling"];

fn parse_args(args: &[String]) -> Result<StageArgs, String> {
    // Every flag sets its field of `a`; what needs all the flags (the
    // prompts file, per-sequence sampling, the grammar) is settled after.
    let mut a = StageArgs::new(PathBuf::new());
    let (mut model, mut synthetic) = (None, None);
    let (mut kv_blocks, mut kv_fraction) = (None, None);
    let mut max_new = None;
    // The ways of giving prompts, settled into one `Prompts` at the end.
    let (mut ids, mut file, mut stdin, mut serve) = (Vec::new(), None, None, false);
    let mut seq_sampling_text = Vec::new();
    let (mut eagle3_tokens, mut draft_model) = (None, None);
    // Flags that shape each request, which requests on standard input bring themselves.
    let mut per_request: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        if PER_REQUEST.contains(&arg.as_str())
            || SamplingParams::GREEDY
                .fields()
                .iter()
                .any(|(k, _)| arg.strip_prefix("--").map(|f| f.replace('-', "_")).as_deref() == Some(k))
        {
            per_request.push(arg.clone());
        }
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value; {USAGE}"));
        match arg.as_str() {
            "--model" => model = Some(PathBuf::from(value("--model")?)),
            "--prompt-ids" => ids.push(parse_ids(&value("--prompt-ids")?, "--prompt-ids")?),
            "--prompts" => file = Some(PathBuf::from(value("--prompts")?)),
            "--stdin-prompts" => stdin = Some(parse_count(&value("--stdin-prompts")?, "--stdin-prompts", true)?),
            "--max-new-tokens" => max_new = Some(parse_count(&value("--max-new-tokens")?, "--max-new-tokens", false)?),
            "--dump" => a.dump = Some(PathBuf::from(value("--dump")?)),
            "--expect" => a.expect = Some(PathBuf::from(value("--expect")?)),
            "--prefill-chunk" => a.prefill_chunk = Some(parse_count(&value("--prefill-chunk")?, "--prefill-chunk", true)?),
            "--micro-batch" => a.micro_batch = Some(parse_count(&value("--micro-batch")?, "--micro-batch", true)?),
            "--kv-blocks" => {
                let n = parse_count(&value("--kv-blocks")?, "--kv-blocks", true)?;
                if n > crate::blocks::MAX_BLOCKS {
                    return Err(format!("--kv-blocks {n}: at most {} blocks", crate::blocks::MAX_BLOCKS));
                }
                kv_blocks = Some(n);
            }
            "--kv-fraction" => kv_fraction = Some(parse_fraction(&value("--kv-fraction")?)?),
            "--synthetic-weights" => {
                let v = value("--synthetic-weights")?;
                synthetic = Some(v.parse::<u64>().map_err(|_| format!("--synthetic-weights: `{v}` is not a seed (an integer)"))?);
            }
            "--timeout-s" => a.timeout_s = parse_timeout_s(&value("--timeout-s")?)?,
            // `--cuda-graphs`: the older name, kept for command lines that use it.
            "--graphs" | "--cuda-graphs" => a.gpu.graphs = parse_switch(arg, &value(arg)?, ("on", "off"))?,
            "--prefix-caching" => a.kv.prefix_caching = parse_switch("--prefix-caching", &value("--prefix-caching")?, ("on", "off"))?,
            "--kv-events" => a.kv.events = parse_switch("--kv-events", &value("--kv-events")?, ("on", "off"))?,
            "--encodes" => a.encoder.inline = parse_switch("--encodes", &value("--encodes")?, ("inline", "beside"))?,
            "--encoder-cache-bytes" => a.encoder.cache_bytes = parse_bytes("--encoder-cache-bytes", &value(arg)?)?,
            "--prefill-gemm" => {
                // `cublas`: the older name of the vendor library's GEMMs.
                let v = value("--prefill-gemm")?;
                let v = if v == "cublas" { "vendor".to_string() } else { v };
                a.gpu.prefill_gemm_vendor = parse_switch("--prefill-gemm", &v, ("vendor", "off"))?;
            }
            "--stream-ids" => a.stream_ids = true,
            "--trace" => a.trace = true,
            "--images" => a.images = Some(PathBuf::from(value("--images")?)),
            "--serve" => serve = true,
            "--eos-ids" => a.eos_ids = parse_ids(&value("--eos-ids")?, "--eos-ids")?,
            "--stop" => a.stops.push(parse_hex(&value("--stop")?)?),
            "--logprobs" => {
                let v = value("--logprobs")?;
                let k = v.parse::<u8>().ok().filter(|&k| k <= crate::protocol::MAX_TOP_LOGPROBS);
                a.logprobs = Some(k.ok_or_else(|| format!("--logprobs `{v}`: expected 0 to {}", crate::protocol::MAX_TOP_LOGPROBS))?);
            }
            "--grammar" => {
                let bytes = parse_hex(&value("--grammar")?)?;
                a.grammar = Some(String::from_utf8(bytes).map_err(|_| "--grammar: not UTF-8 text".to_string())?);
            }
            "--seq-sampling" => seq_sampling_text.push(value("--seq-sampling")?),
            "--speculative" => a.speculative = Some(crate::speculative::Ngram::parse(&value("--speculative")?)?),
            "--eagle3" => {
                let v = value("--eagle3")?;
                eagle3_tokens = Some(crate::speculative::parse_draft_tokens(&v).map_err(|e| format!("--eagle3: {e}"))?);
            }
            "--draft-model" => draft_model = Some(PathBuf::from(value("--draft-model")?)),
            "--node-share" => a.node_share = Some(NodeShare::parse(&value("--node-share")?)?),
            other => {
                // A sampling field, by its own name (`--top-k K`).
                let field = other.strip_prefix("--").map(|f| f.replace('-', "_")).unwrap_or_default();
                if !SamplingParams::GREEDY.fields().iter().any(|(k, _)| *k == field) {
                    return Err(format!("unknown argument `{other}`; {USAGE}"));
                }
                a.sampling.set_field(&field, &value(other)?).map_err(|e| format!("{other}: {e}"))?;
            }
        }
    }
    if let Some(f) = &file {
        if !ids.is_empty() {
            return Err("give --prompt-ids or --prompts, not both".into());
        }
        let text = crate::read_user_file(f, "--prompts", crate::input::limits::PROMPTS).map_err(|e| e.to_string())?;
        ids = parse_prompts_file(&text, &f.display().to_string())?;
    }
    a.sampling.check()?;
    // Per-sequence sampling is over the run's, wherever the flags stood.
    a.seq_sampling = seq_sampling_text.iter().map(|v| parse_seq_sampling(v, a.sampling)).collect::<Result<Vec<_>, _>>()?;
    if serve && (!ids.is_empty() || max_new.is_some() || a.dump.is_some() || a.expect.is_some()) {
        return Err("--serve takes its prompts from the first stage's standard input: no --prompt-ids, --prompts, --max-new-tokens, --dump or --expect".into());
    }
    if stdin.is_some() && (!ids.is_empty() || serve || a.images.is_some()) {
        return Err("--stdin-prompts takes the prompts and their images from the first stage's standard input: no --prompt-ids, --prompts, --images or --serve".into());
    }
    if let (true, Some(flag)) = (stdin.is_some() || serve, per_request.first()) {
        let mode = if serve { "--serve" } else { "--stdin-prompts" };
        return Err(format!(
            "{mode}: each request on standard input brings its own sampling, token limit, stop strings, logprobs and grammar: no {flag}"
        ));
    }
    if ids.is_empty() && !serve && stdin.is_none() {
        return Err(format!("no prompt: give --prompt-ids or --prompts; {USAGE}"));
    }
    a.kv.size = match (kv_blocks, kv_fraction) {
        (None, None) => PoolSize::WholeContext,
        (Some(n), None) => PoolSize::Blocks(n),
        (None, Some(f)) => PoolSize::Fraction(f),
        (Some(_), Some(_)) => return Err("give --kv-blocks or --kv-fraction, not both".into()),
    };
    a.eagle3 = match (eagle3_tokens, draft_model) {
        (Some((tokens, disable_by_batch_size)), Some(model)) => {
            Some(crate::speculative::Eagle3Run { tokens, model, disable_by_batch_size })
        }
        (None, None) => None,
        _ => return Err("--eagle3 K and --draft-model DIR go together".into()),
    };
    if a.eagle3.is_some() && a.speculative.is_some() {
        return Err("give --speculative or --eagle3, not both".into());
    }
    a.weights = match (model, synthetic) {
        (Some(dir), None) => Weights::Checkpoint(dir),
        (None, Some(seed)) => Weights::Synthetic(seed),
        (None, None) => return Err(format!("--model DIR is required; {USAGE}")),
        (Some(_), Some(_)) => return Err("give --model or --synthetic-weights, not both".into()),
    };
    if !serve && stdin.is_none() {
        a.max_new_tokens = max_new.ok_or_else(|| format!("--max-new-tokens is required; {USAGE}"))?;
    }
    a.prompts = match (serve, stdin, file) {
        (true, ..) => Prompts::Served,
        (_, Some(n), _) => Prompts::Stdin(n),
        (_, None, Some(path)) => Prompts::File { path, ids },
        (_, None, None) => Prompts::Ids(ids),
    };
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_arguments_round_trip() {
        let mut a = StageArgs::new(PathBuf::from("/models/tiny m3"));
        a.prompts = Prompts::Ids(vec![vec![1, 2, 3], vec![4]]);
        a.max_new_tokens = 16;
        a.micro_batch = Some(2);
        a.kv = KvPool { size: PoolSize::Blocks(40), prefix_caching: false, events: true };
        a.encoder = EncoderOptions { cache_bytes: 12345, inline: true };
        a.prefill_chunk = Some(7);
        a.speculative = Some(crate::speculative::Ngram { tokens: 3, min: 2, max: 4, disable_by_batch_size: Some(8) });
        a.timeout_s = 2.5;
        a.gpu = GpuModes { graphs: false, prefill_gemm_vendor: true };
        a.stream_ids = true;
        a.sampling = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.0,
            repetition_penalty: 1.05,
            seed: 7,
            ..SamplingParams::GREEDY
        };
        a.seq_sampling = vec![(1, SamplingParams { seed: 9, top_k: 3, ..a.sampling })];
        a.eos_ids = vec![200_020];
        a.logprobs = Some(3);
        a.grammar = Some("{\"grammars\": []}".into());
        a.stops = vec![b"\n\n".to_vec(), vec![0xff, 0]];
        a.dump = Some(PathBuf::from("d.safetensors"));
        a.images = Some(PathBuf::from("/tmp/i.safetensors"));
        a.trace = true;
        a.node_share = Some(NodeShare { offset: 1, total: 4 });
        assert_eq!(StageArgs::parse(&a.to_args()), Ok(a.clone()));
        for bad in ["4/4", "1", "a/2"] {
            assert!(NodeShare::parse(bad).unwrap_err().contains("OFFSET/TOTAL"), "{bad}");
        }
        let mut s = StageArgs::new(PathBuf::from("m"));
        s.prompts = Prompts::Served;
        s.micro_batch = Some(32);
        s.eagle3 = Some(crate::speculative::Eagle3Run { tokens: 3, model: PathBuf::from("/drafts/e 3"), disable_by_batch_size: Some(4) });
        assert_eq!(StageArgs::parse(&s.to_args()), Ok(s.clone()));
        // One method at a time, and EAGLE3's two flags together.
        s.speculative = a.speculative;
        assert_eq!(StageArgs::parse(&s.to_args()), Err("give --speculative or --eagle3, not both".into()));
        let served = ["--model", "m", "--serve"].map(String::from);
        for extra in [&["--eagle3", "3"][..], &["--draft-model", "d"], &["--eagle3", "0", "--draft-model", "d"]] {
            let args = [&served[..], &extra.iter().map(|s| s.to_string()).collect::<Vec<_>>()].concat();
            assert!(StageArgs::parse(&args).is_err(), "{extra:?}");
        }
        // The older, vendor-named spellings mean what the neutral ones do.
        let base = ["--model", "m", "--serve"].map(String::from).to_vec();
        let with = |extra: &[&str]| StageArgs::parse(&[base.clone(), extra.iter().map(|s| s.to_string()).collect()].concat());
        assert_eq!(with(&["--cuda-graphs", "off", "--prefill-gemm", "cublas"]), with(&["--graphs", "off", "--prefill-gemm", "vendor"]));
        assert_eq!(with(&["--graphs", "off"]).map(|a| a.gpu.graphs), Ok(false));
        let mut r = StageArgs::new(PathBuf::from("m"));
        r.prompts = Prompts::Stdin(3);
        assert_eq!(StageArgs::parse(&r.to_args()), Ok(r.clone()));
        for flag in [&["--max-new-tokens", "4"][..], &["--top-k", "3"], &["--logprobs", "1"]] {
            let mut args = r.to_args();
            args.extend(flag.iter().map(|f| f.to_string()));
            assert!(StageArgs::parse(&args).is_err_and(|e| e.contains(&format!("no {}", flag[0]))), "{flag:?}");
        }
        assert_eq!(r.prompt_count(), 3);
        let mut w = r.clone();
        w.weights = Weights::Synthetic(7);
        w.kv.size = PoolSize::Fraction(0.25);
        assert_eq!(StageArgs::parse(&w.to_args()), Ok(w));
    }

    #[test]
    fn bad_arguments_name_the_flag() {
        for (args, want) in [
            (&["--model", "m", "--prompt-ids", "1", "--max-new-tokens", "2", "--top-p", "2"][..], "top_p"),
            (&["--model", "m", "--prompt-ids", "1", "--max-new-tokens", "2", "--seed", "-1"], "--seed"),
            (&["--model", "m", "--prompt-ids", "1", "--max-new-tokens", "2", "--seq-sampling", "0:colour=red"], "colour"),
            (&["--model", "m", "--prompt-ids", "1", "--max-new-tokens", "2", "--seq-sampling", "x"], "--seq-sampling"),
            (&["--model", "m", "--prompt-ids", "1"], "--max-new-tokens"),
            (&["--model", "m", "--serve", "--max-new-tokens", "2"], "--serve"),
            (&["--model", "m", "--stdin-prompts", "2", "--prompt-ids", "1", "--max-new-tokens", "2"], "--stdin-prompts"),
            (&["--model", "m", "--stdin-prompts", "0", "--max-new-tokens", "2"], "--stdin-prompts"),
            (&["--model", "m", "--serve", "--kv-blocks", "4", "--kv-fraction", "0.5"], "give --kv-blocks or --kv-fraction, not both"),
            (&["--synthetic-weights", "1", "--model", "m", "--serve"], "give --model or --synthetic-weights, not both"),
            (&["--prompts", "p.txt", "--prompt-ids", "1", "--model", "m", "--max-new-tokens", "2"], "--prompt-ids or --prompts"),
            (&["--model", "m", "--prompt-ids", "1", "--max-new-tokens", "2", "--grammar-after", "3"], "unknown argument `--grammar-after`"),
        ] {
            let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
            let e = StageArgs::parse(&args).unwrap_err();
            assert!(e.contains(want), "{args:?}: {e}");
        }
    }
}
