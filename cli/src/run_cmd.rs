//! `m3c run`: a compiled OUT folder under mpirun, prompts in, tokens or
//! text out.

use crate::flags::RunArgs;
use anyhow::{bail, Context, Result};
use m3c_contract::images::SeqImages;
use m3c_contract::protocol::SeqRequest;
use m3c_contract::stage_args::StageArgs;
use m3c_contract::thinking::{ThinkBudget, ThinkStart};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Images (`--image`, or a `--prompts` JSONL chat's image parts):
/// processed, each one's placeholder run put into the prompt it goes with
/// (a chat's are expanded here; a --prompt-ids prompt must hold them
/// already), each prompt checked against the context; each prompt's images
/// by its place among the run's prompts (the `--prompt-ids` first).
fn image_prompt(
    args: &RunArgs,
    videos: Vec<m3c_front::vision::video::Video>,
    mut text_in: Option<&mut m3c_front::text::front::Encoded>,
    manifest: &m3c_contract::manifest::Manifest,
) -> Result<BTreeMap<usize, SeqImages>> {
    use m3c_front::vision::prompt::{self, ImageTokens, PromptImageError};
    let from_lines = text_in.as_ref().is_some_and(|t| t.images.iter().any(|i| !i.is_empty()) || t.videos.iter().any(|v| !v.is_empty()));
    if args.image.is_empty() && videos.is_empty() && !from_lines {
        return Ok(BTreeMap::new());
    }
    if !manifest.encodes_images() {
        bail!(
            "{} was compiled without the vision tower (its plan says `vision: false`); compile with it to run image prompts",
            args.out.display()
        );
    }
    let image_token = manifest.image_token.ok_or(PromptImageError::NoVision)?;
    // Which prompt gets which image files (by its place among the text
    // prompts; the `--prompt-ids` go before them).
    let offset = if args.image.is_empty() && videos.is_empty() { args.prompt_ids.len() } else { 0 };
    type Media = (usize, Vec<PathBuf>, Vec<m3c_front::vision::video::Video>);
    let per_seq: Vec<Media> = if args.image.is_empty() && videos.is_empty() {
        text_in.as_mut().map_or(Vec::new(), |t| {
            let lines = t.images.iter().cloned().zip(std::mem::take(&mut t.videos));
            lines.enumerate().filter(|(_, (f, v))| !f.is_empty() || !v.is_empty()).map(|(s, (f, v))| (s, f, v)).collect()
        })
    } else if args.image.is_empty() {
        // Videos alone: the one --prompt or --chat (checked by the caller).
        vec![(0, Vec::new(), videos)]
    } else {
        let prompts = args.prompt_ids.len() + args.prompt.len() + args.chat.len() + usize::from(args.prompts.is_some());
        if prompts != 1 || !args.prompt.is_empty() || args.prompts.is_some() {
            bail!(
                "--image goes with exactly one --chat or one --prompt-ids (this run has {prompts} prompt source(s)); a --prompts JSONL chat takes image parts per line"
            );
        }
        vec![(0, args.image.clone(), videos)]
    };
    let ctx = manifest.max_positions;
    let video_token = manifest.video_token.unwrap_or(usize::MAX) as u32;
    let mut seqs = BTreeMap::new();
    for (seq, files, seq_videos) in per_seq {
        let processed = prompt::load(&files)?;
        let tokens: Vec<usize> = processed.iter().map(|p| p.tokens()).collect();
        let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        let video_tokens: usize = seq_videos.iter().map(|v| v.tokens()).sum();
        let (len, media) = match text_in.as_deref_mut() {
            Some(enc) => {
                let t = ImageTokens::new(|t| enc.tokenizer.token_id(t), image_token, &chat_format(&args.model)?.media)?;
                enc.ids[seq] = t.expand(&enc.ids[seq], &tokens).with_context(|| format!("prompt {seq}"))?;
                let media = prompt::seq_media_in_order(&enc.ids[seq], image_token as u32, video_token, processed, seq_videos)
                    .with_context(|| format!("prompt {seq}"))?;
                (enc.ids[seq].len(), media)
            }
            None => {
                let ids = m3c_contract::prompts::parse_ids(&args.prompt_ids[seq], "--prompt-ids").map_err(|e| anyhow::anyhow!(e))?;
                let t = ImageTokens { start: 0, image: image_token as u32, end: 0 };
                t.check_runs(&ids, &tokens, &names)?;
                (ids.len(), prompt::seq_images(&processed))
            }
        };
        if len + args.max_new_tokens > ctx {
            bail!(
                "prompt {seq} is {len} tokens ({} of them for the image(s) and video(s): {}) and --max-new-tokens {}: more than the model's context of {ctx} positions",
                tokens.iter().sum::<usize>() + video_tokens,
                names.iter().zip(&tokens).map(|(n, t)| format!("{n} takes {t}")).collect::<Vec<_>>().join(", "),
                args.max_new_tokens
            );
        }
        seqs.insert(offset + seq, media);
    }
    Ok(seqs)
}

/// A prompt's grammar (its text) and reasoning budget.
type OutputRules = (Option<String>, Option<ThinkBudget>);

/// What each prompt's output is held to: the run's grammar
/// (`--json-schema`, `--regex`, `--choice`, `--grammar`) behind the
/// reasoning the prompt leaves room for (`m3c_constrain::thinking::wrap`),
/// checked against the model's tokens; and the reasoning budget
/// (`--thinking-token-budget`, else half of `--max-new-tokens` under a
/// constraint, as `m3c serve` does).
fn run_outputs(args: &RunArgs, eos: &[i64], think: &[ThinkStart]) -> Result<Vec<OutputRules>> {
    let thinks = think.iter().any(|&t| t != ThinkStart::Closed);
    let tags = &chat_format(&args.model)?.think;
    let (grammar, vocabulary) = match run_grammar(args, eos)? {
        Some((text, flag, v)) => (Some((text, flag)), Some(v)),
        None if thinks && args.thinking_token_budget.is_some() => {
            (None, Some(m3c_constrain::Vocabulary::load(&args.model, None, &ends(eos))?))
        }
        None => (None, None),
    };
    // A budget needs the closing tag as one token: asked for without one,
    // an error; the default one is then left out.
    let closes = vocabulary.as_ref().is_some_and(|v| v.token_of(tags.close.as_bytes()).is_some());
    if args.thinking_token_budget.is_some() && thinks && !closes {
        anyhow::bail!(
            "--thinking-token-budget needs `{}` as one token of {}/tokenizer.json, and it has none",
            tags.close,
            args.model.display()
        );
    }
    let mut wrapped: BTreeMap<&'static str, String> = BTreeMap::new();
    think
        .iter()
        .map(|&start| {
            let g = match (&grammar, &vocabulary) {
                (Some((text, flag)), Some(v)) => {
                    if !wrapped.contains_key(start.name()) {
                        let w = m3c_constrain::thinking::wrap(text, start, tags).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
                        v.compile(&w).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
                        wrapped.insert(start.name(), w);
                    }
                    wrapped.get(start.name()).cloned()
                }
                _ => None,
            };
            let default = g.is_some().then(|| u32::try_from(args.max_new_tokens / 2).unwrap_or(u32::MAX));
            let budget = args.thinking_token_budget.or(default).filter(|_| start != ThinkStart::Closed && closes);
            Ok((g, budget.map(|budget| ThinkBudget { start, budget })))
        })
        .collect()
}

/// The EOS ids as the grammar compiler takes them.
fn ends(eos: &[i64]) -> Vec<u32> {
    eos.iter().filter_map(|&e| u32::try_from(e).ok()).collect()
}

/// The run's grammar as llguidance's text, checked against the model's
/// tokens (which come back too), and the flag that gave it.
fn run_grammar(args: &RunArgs, eos: &[i64]) -> Result<Option<(String, &'static str, m3c_constrain::Vocabulary)>> {
    use m3c_constrain::Grammar;
    let read = |f: &std::path::Path, what: &str| {
        m3c_contract::read_user_file(f, what, m3c_contract::input::limits::TOKENIZER).map_err(|e| anyhow::anyhow!("{e}"))
    };
    let (grammar, flag) = if let Some(given) = &args.json_schema {
        // The schema itself, or a file holding it.
        let (text, what) = if given.trim_start().starts_with('{') {
            (given.clone(), "the schema given".to_string())
        } else {
            (read(std::path::Path::new(given), "--json-schema")?, given.clone())
        };
        let schema = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("--json-schema {what}: not JSON: {e}"))?;
        (Grammar::JsonSchema(schema), "--json-schema")
    } else if let Some(r) = &args.regex {
        (Grammar::Regex(r.clone()), "--regex")
    } else if !args.choice.is_empty() {
        (Grammar::Choice(args.choice.clone()), "--choice")
    } else if let Some(f) = &args.grammar {
        (Grammar::Lark(read(f, "--grammar")?), "--grammar")
    } else {
        return Ok(None);
    };
    if !args.stop.is_empty() {
        anyhow::bail!("--stop does not combine with {flag}: the grammar decides where the output ends (a stop string could cut it short)");
    }
    if eos.is_empty() {
        anyhow::bail!("{flag} needs the model's EOS to end the output (not --ignore-eos, and an eos_token_id in the checkpoint)");
    }
    let text = grammar.to_text();
    let vocabulary = m3c_constrain::Vocabulary::load(&args.model, None, &ends(eos))?;
    vocabulary.compile(&text).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    Ok(Some((text, flag, vocabulary)))
}

/// The run's prompts as the stages take them: ids (the flags', then a
/// file's), then the texts and chats encoded; each repeated for `-n`
/// choices, with its images.
struct Inputs {
    prompts: Vec<Vec<i64>>,
    /// Where each prompt leaves the model's reasoning (ids: all content).
    think: Vec<ThinkStart>,
    images: BTreeMap<usize, SeqImages>,
    /// The text front, when any prompt is text (its output is streamed as text).
    text: Option<m3c_front::text::front::Encoded>,
    choices: usize,
}

/// Reads every prompt source of the run, checks each prompt against the
/// model's context, and processes the images.
fn inputs(args: &RunArgs, compiled: &m3c_front::launch::Compiled) -> Result<Inputs> {
    // A --prompts file: chats and texts (JSONL), or ids, one prompt a line.
    let (jsonl, ids_file) = match &args.prompts {
        Some(f) => {
            let text = m3c_contract::read_user_file(f, "--prompts", m3c_contract::input::limits::PROMPTS)?;
            if m3c_front::text::front::is_jsonl(&text) {
                (Some((f.clone(), text)), Vec::new())
            } else {
                let ids = m3c_contract::prompts::parse_prompts_file(&text, &f.display().to_string()).map_err(|e| anyhow::anyhow!(e))?;
                (None, ids)
            }
        }
        None => (None, Vec::new()),
    };
    if !ids_file.is_empty() && !args.prompt_ids.is_empty() {
        bail!("give --prompt-ids or a --prompts file of ids, not both");
    }
    // Text prompts become ids here; the stages only see ids.
    // Videos: decoded and processed first, since their text (timestamps)
    // is tokenized with the prompt's.
    if !args.video.is_empty() && (args.prompt.len() + args.chat.len() != 1 || !args.prompt_ids.is_empty() || args.prompts.is_some()) {
        let token = chat_format(&args.model).map_or("video placeholder", |f| f.media.video);
        bail!("--video goes with exactly one --prompt (holding one `{token}` per video) or one --chat");
    }
    let videos = m3c_front::vision::prompt::load_videos(&args.video)?;
    let mut text = text_prompts(args, jsonl.as_ref(), &videos)?;
    // Images: processed here, expanded into (or checked against) the one
    // prompt they belong to, and handed to the stage that encodes them.
    let images = image_prompt(args, videos, text.as_mut(), &compiled.manifest)?;
    let choices = usize::from(args.choices);
    // Choice C of prompt P is sequence P·n + C, with P's images.
    let images = images.into_iter().flat_map(|(seq, im)| (0..choices).map(move |c| (seq * choices + c, im.clone()))).collect();
    if let Some(t) = text.as_mut() {
        t.repeat_each(choices);
    }
    let mut prompts: Vec<Vec<i64>> = args
        .prompt_ids
        .iter()
        .map(|p| m3c_contract::prompts::parse_ids(p, "--prompt-ids").map_err(|e| anyhow::anyhow!(e)))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .chain(ids_file)
        .flat_map(|p| std::iter::repeat_n(p, choices))
        .collect();
    let mut think = vec![ThinkStart::Closed; prompts.len()];
    think.extend(text.iter().flat_map(|t| t.think.iter().copied()));
    prompts.extend(text.iter().flat_map(|t| &t.ids).map(|p| p.iter().map(|&i| i64::from(i)).collect::<Vec<_>>()));
    if prompts.is_empty() {
        bail!("no prompt: give --prompt-ids, --prompt, --chat or --prompts");
    }
    // One more position than the tokens: the cache holds the last id too.
    let ctx = compiled.manifest.max_positions;
    if let Some((i, p)) = prompts.iter().enumerate().find(|(_, p)| p.len().checked_add(args.max_new_tokens).is_none_or(|n| n >= ctx)) {
        bail!(
            "prompt {i}: {} tokens + --max-new-tokens {} exceed the model's {ctx} positions (max_position_embeddings)",
            p.len(),
            args.max_new_tokens
        );
    }
    Ok(Inputs { prompts, think, images, text, choices })
}

/// `--prompt`, `--chat` and a JSONL `--prompts` file through the tokenizer
/// and chat template (`None`: the run has no text prompt).
fn text_prompts(
    args: &RunArgs,
    jsonl: Option<&(PathBuf, String)>,
    videos: &[m3c_front::vision::video::Video],
) -> Result<Option<m3c_front::text::front::Encoded>> {
    if args.prompt.is_empty() && args.chat.is_empty() && jsonl.is_none() {
        return Ok(None);
    }
    let thinking = args.thinking.as_deref().map(|t| match t {
        "enabled" => m3c_front::text::ThinkingMode::Enabled,
        "disabled" => m3c_front::text::ThinkingMode::Disabled,
        _ => m3c_front::text::ThinkingMode::Adaptive,
    });
    let req = m3c_front::text::front::TextRequest {
        prompts: &args.prompt,
        chats: &args.chat,
        system: args.system.as_deref(),
        thinking,
        chat_images: args.image.len(),
        videos,
    };
    let mut enc = m3c_front::text::front::encode(&args.model, &req)?;
    if let Some((file, text)) = jsonl {
        m3c_front::text::front::encode_jsonl(&args.model, file, text, &mut enc)?;
        if enc.ids.is_empty() {
            bail!("--prompts {}: no prompts in it", file.display());
        }
    }
    if let Some(i) = enc.ids.iter().position(|p| p.is_empty()) {
        bail!("prompt {i} is empty: it has no tokens to continue from");
    }
    Ok(Some(enc))
}

/// The run's sampling: the flags, else the checkpoint's defaults, else
/// greedy; and the EOS ids that stop a sequence. Says which on stderr.
fn sampling(args: &RunArgs) -> Result<(m3c_contract::sampling::SamplingParams, Vec<i64>)> {
    let defaults = m3c_front::text::generation::GenerationDefaults::from_dir(&args.model)?;
    let flags = args.sampling.0;
    let sampling = flags.or(defaults.sampling).over(m3c_contract::sampling::SamplingParams::GREEDY);
    sampling.check().map_err(|e| anyhow::anyhow!("{e} (from the flags or {}/generation_config.json)", args.model.display()))?;
    let eos: Vec<i64> = if args.ignore_eos { Vec::new() } else { defaults.eos_ids.clone() };
    eprintln!(
        "m3c: {}; {}{}",
        {
            // Every field by the contract's table, as its flag names it.
            let fields: Vec<String> = m3c_contract::sampling::FIELDS.iter().map(|f| format!("{} {}", f.long, (f.get)(&sampling))).collect();
            if sampling.temperature == 0.0 {
                format!("greedy ({})", fields[1..].join(", "))
            } else {
                format!("sampling at {}", fields.join(", "))
            }
        },
        if eos.is_empty() { "no EOS stop".to_string() } else { format!("stops on EOS id(s) {eos:?}") },
        if defaults.sources.is_empty() { String::new() } else { format!(" (defaults from {})", defaults.sources.join(", ")) }
    );
    Ok((sampling, eos))
}

/// The stage command line (every stage gets the same arguments: pipeline
/// settings only) and the run's requests, one per prompt and choice, each
/// complete: the run's sampling (over a JSONL line's own fields; choice C
/// of a prompt draws from its seed + C, as OpenAI's `n` in `m3c serve`),
/// stop strings, logprobs, grammar and reasoning budget. The requests go to
/// the first stage on its standard input (`--stdin-prompts`), so that no
/// stage reads a file of this machine's.
fn stage_args(args: &RunArgs, inputs: &Inputs) -> Result<(StageArgs, Vec<SeqRequest>)> {
    let (sampling, eos) = sampling(args)?;
    let mut stage = StageArgs::new(args.model.clone());
    stage.prompts = m3c_contract::stage_args::Prompts::Stdin(inputs.prompts.len());
    stage.dump = args.dump.clone();
    stage.expect = args.expect.clone();
    stage.prefill_chunk = args.prefill_chunk;
    stage.micro_batch = args.micro_batch;
    stage.kv.prefix_caching = !args.no_enable_prefix_caching;
    stage.encoder = args.encoder.options();
    stage.timeout_s = args.timeout_s;
    stage.gpu = args.gpu.modes();
    // The run's front reads every token as it comes (a lost pipeline's
    // prompts then go on from there) and prints ids or text itself.
    stage.stream_ids = true;
    stage.trace = args.trace.is_some();
    if let Some(c) = &args.speculative_config {
        eprintln!(
            "m3c run: speculative decoding ({}): up to {} draft tokens a step, as many as the measured cost of their rows repays (none where none does)",
            c.method(),
            c.tokens()
        );
    }
    stage.set_speculation(args.speculative_config.clone());
    let outputs = run_outputs(args, &eos, &inputs.think)?;
    stage.eos_ids = eos;
    let lines = inputs.text.as_ref().map_or(&[][..], |t| &t.overrides[..]);
    let stops: Vec<Vec<u8>> = args.stop.iter().map(|s| s.as_bytes().to_vec()).collect();
    let mut requests = Vec::with_capacity(inputs.prompts.len());
    for (seq, prompt) in inputs.prompts.iter().enumerate() {
        let mut p = lines.get(seq).copied().unwrap_or_default().over(sampling);
        p.check().map_err(|e| anyhow::anyhow!("--prompts: prompt {}: {e}", seq / inputs.choices))?;
        p.seed = p.seed.wrapping_add((seq % inputs.choices) as u64);
        let (grammar, think) = outputs.get(seq).cloned().unwrap_or_default();
        requests.push(SeqRequest {
            stops: stops.clone(),
            logprobs: args.logprobs,
            grammar,
            think,
            ..SeqRequest::new(seq, prompt.clone(), args.max_new_tokens, p)
        });
    }
    Ok((stage, requests))
}

pub(crate) fn run_cmd(args: RunArgs) -> Result<()> {
    let compiled = m3c_front::launch::Compiled::open(&args.out, &args.model)?;
    crate::check_weights_before_launch(&args.model)?;
    compiled.check_speculation(args.speculative_config.as_ref())?;
    compiled.check_gpu_modes(args.gpu.modes())?;
    if let Some(d) = &args.dump {
        m3c_compiler::fsutil::check_replaceable_file(d).context("--dump")?;
    }
    if let Some(t) = &args.trace {
        // Checked now, not after the whole run.
        if let Some(dir) = t.parent().filter(|d| !d.as_os_str().is_empty() && !d.is_dir()) {
            bail!("--trace {}: the folder {} does not exist", t.display(), dir.display());
        }
        m3c_compiler::fsutil::check_replaceable_file(t).context("--trace")?;
    }
    let inputs = inputs(&args, &compiled)?;
    let (mut stage, requests) = stage_args(&args, &inputs)?;
    // Each stage's KV pool: by default exactly the blocks every prompt can
    // reach (prompt, new tokens and the row that scores the last), so a
    // run never waits for blocks; `--kv-blocks` may give fewer (prompts
    // then take turns), but never fewer than the longest prompt needs.
    let kv_block = compiled.manifest.kv_block;
    let per_prompt: Vec<usize> =
        inputs.prompts.iter().map(|p| m3c_contract::blocks::blocks_for(p.len() + args.max_new_tokens + 1, kv_block)).collect();
    let blocks = args.kv_blocks.unwrap_or_else(|| per_prompt.iter().sum::<usize>().max(1));
    if blocks > m3c_contract::blocks::MAX_BLOCKS {
        bail!("the prompts and --max-new-tokens need {blocks} cache blocks; a pool holds at most {}", m3c_contract::blocks::MAX_BLOCKS);
    }
    if let Some((i, &need)) = per_prompt.iter().enumerate().max_by_key(|(_, &n)| n).filter(|(_, &n)| n > blocks) {
        bail!("--kv-blocks {blocks}: prompt {i} and --max-new-tokens {} need {need} blocks of {kv_block} positions", args.max_new_tokens);
    }
    stage.kv.size = m3c_contract::stage_args::PoolSize::Blocks(blocks);
    let launch = args.launch.launch()?;
    compiled.check_memory(&args.model, Some((blocks * kv_block) as u64), &launch)?;
    let Inputs { images, text: text_in, .. } = inputs;
    let constrained = requests.iter().any(|r| r.grammar.is_some());
    // Text prompts come after any id prompts; their streams are numbered from 0.
    let first_text = inputs.prompts.len() - text_in.as_ref().map_or(0, |t| t.ids.len());
    let grammars: Vec<bool> = requests.iter().skip(first_text).map(|r| r.grammar.is_some()).collect();
    let logprobs: Vec<bool> = requests.iter().map(|r| r.logprobs.is_some()).collect();
    // A lost pipeline is started again and the prompts go on, except in
    // runs that record one job whole (a dump, a golden check, a timeline).
    let resumable = args.dump.is_none() && args.expect.is_none() && args.trace.is_none();
    let jobs = crate::run_jobs::RunJobs {
        compiled: &compiled,
        launch: &launch,
        stage,
        requests,
        images,
        max_restarts: if resumable { args.max_restarts } else { 0 },
        trace: args.trace.is_some(),
    };
    let eos = jobs.stage.eos_ids.clone();
    let (ran, streamed) = match &text_in {
        None => (jobs.run(None::<std::io::Sink>)?, None),
        Some(enc) => {
            // A grammar's output ends on an EOS whose text is not the answer's.
            let silent: Vec<u32> = if constrained { eos.iter().filter_map(|&e| u32::try_from(e).ok()).collect() } else { Vec::new() };
            let reasoning = reasoning_to_stderr(&args.model, enc, &grammars)?;
            // The text streamer reads the jobs' events as one stream.
            let (events, sink) = std::io::pipe().context("a pipe for the stages' output")?;
            std::thread::scope(|s| {
                let ran = s.spawn(|| jobs.run(Some(sink)));
                let done = m3c_front::text::front::stream(
                    std::io::BufReader::new(events),
                    enc,
                    &args.stop,
                    &silent,
                    std::io::stdout().lock(),
                    reasoning,
                );
                // Once the streamer stops reading, the jobs stop too.
                let ran = ran.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the job runner failed")));
                match (ran, done) {
                    // The streamer's own failure (its output closed) is the error.
                    (Ok(r), d) if r.reader_gone => {
                        Err(d.err().unwrap_or_else(|| anyhow::anyhow!("the output closed"))).context("streaming the generated text")
                    }
                    (Ok(r), d) => Ok((r, Some(d))),
                    (Err(e), _) => Err(e),
                }
            })?
        }
    };
    if let (Some(file), Some(c)) = (&args.trace, ran.collected) {
        let bytes = m3c_front::trace::chrome_json(&c).context("--trace")?;
        m3c_compiler::fsutil::write_file_atomically(file, &bytes).context("--trace")?;
        eprintln!(
            "m3c: wrote the timeline to {} ({} events); `m3c report {}` summarises it",
            file.display(),
            c.events.len(),
            file.display()
        );
    }
    match streamed {
        Some(done) => {
            let names = text_in.as_ref().map(|t| (0..t.ids.len()).map(|i| t.name(i)).collect::<Vec<_>>()).unwrap_or_default();
            for (f, name) in done.context("streaming the generated text")?.iter().zip(names) {
                eprintln!("{name}: {} prompt tokens, {} generated, finish: {}", f.prompt_tokens, f.generated.len(), f.reason);
            }
        }
        None => print_ids(&ran.journal, &logprobs)?,
    }
    Ok(())
}

/// An id run's output: each prompt's ids, and its logprobs where asked.
fn print_ids(journal: &crate::run_journal::Journal, logprobs: &[bool]) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for (s, (ids, lps)) in journal.outputs().enumerate() {
        let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
        writeln!(out, "prompt {s}: {}", ids.join(","))?;
        if logprobs.get(s).copied().unwrap_or(false) {
            writeln!(out, "logprobs {s}: {}", m3c_contract::protocol::logprobs_json(lps))?;
        }
    }
    out.flush()?;
    Ok(())
}

/// A chat's reasoning goes to stderr and its content to stdout, so that
/// `m3c run --chat … --json-schema S | jq` reads the answer alone (the
/// reasoning still shows in a terminal). The split is the server's:
/// strict under a grammar (content is what the grammar bound), lenient
/// otherwise. Raw completions are all content.
fn reasoning_to_stderr<'a>(
    model: &std::path::Path,
    enc: &m3c_front::text::front::Encoded,
    grammars: &[bool],
) -> Result<Option<m3c_front::text::front::Reasoning<'a>>> {
    if !enc.chat.iter().any(|&c| c) {
        return Ok(None);
    }
    let tags = &chat_format(model)?.think;
    let readers = (0..enc.ids.len())
        .map(|i| {
            enc.chat.get(i).copied().unwrap_or(false).then(|| {
                let lenient = !grammars.get(i).copied().unwrap_or(false);
                let start = enc.think.get(i).copied().unwrap_or(ThinkStart::Closed);
                Box::new(ThinkReader(m3c_constrain::thinking::Splitter::new(tags, start, lenient)))
                    as Box<dyn m3c_front::text::front::ReasoningReader>
            })
        })
        .collect();
    Ok(Some(m3c_front::text::front::Reasoning { readers, out: Box::new(std::io::stderr()) }))
}

/// The chat format's splitter, read text by text.
struct ThinkReader(m3c_constrain::thinking::Splitter);

impl m3c_front::text::front::ReasoningReader for ThinkReader {
    fn push(&mut self, text: &str) -> (Vec<u8>, Vec<u8>) {
        let s = self.0.push(text.as_bytes());
        (s.reasoning, s.content)
    }
    fn finish(&mut self) -> (Vec<u8>, Vec<u8>) {
        let s = self.0.finish();
        (s.reasoning, s.content)
    }
}

/// The model's chat format (its `config.json`'s architecture).
fn chat_format(model: &std::path::Path) -> Result<&'static m3c_contract::chat_format::ChatFormat> {
    m3c_contract::chat_format::ChatFormat::of_model_dir(model).map_err(anyhow::Error::msg)
}
