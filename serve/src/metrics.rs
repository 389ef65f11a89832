//! `GET /metrics`: Prometheus text, with vLLM-like names under `m3c:`, and
//! the series routers and autoscalers read under vLLM's own names
//! (`vllm:num_requests_running`, ...), with its `model_name` and `engine`
//! labels: the same values, so a dashboard or router built for vLLM reads
//! m3c unchanged.

use std::fmt::{self, Write};
use std::sync::Mutex;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

#[derive(Default, Clone)]
pub struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    pub fn observe(&mut self, seconds: f64) {
        for (c, &b) in self.counts.iter_mut().zip(&BUCKETS) {
            if seconds <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    /// The histogram's family; `labels` (`a="x",b="y"`, or empty) go on every series.
    fn write(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let sep = if labels.is_empty() { "" } else { "," };
        for (c, b) in self.counts.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let plain = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}\n{name}_sum{plain} {}\n{name}_count{plain} {}",
            self.count, self.sum, self.count
        );
    }
}

/// One stage's figures over the last report interval.
#[derive(Default, Clone, Copy)]
pub struct StageStat {
    pub steps: u64,
    pub busy_s: f64,
    /// Mean compute time of a step over the last interval (seconds).
    pub step_s: f64,
    /// Busy share of the last interval's wall time.
    pub busy_fraction: f64,
}

#[derive(Default)]
pub struct Counters {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub requests_ok: u64,
    pub requests_failed: u64,
    pub requests_cancelled: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub stages: Vec<StageStat>,
    /// Prompt tokens looked up in the prefix cache, and found there.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    /// Speculative decoding: verify steps, draft tokens, accepted drafts,
    /// and accepted drafts by position in their draft.
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted: u64,
    pub spec_accepted_per_pos: Vec<u64>,
    /// The first stage's vision encoder, as it last reported.
    pub encoder: EncoderStats,
}

/// The vision encoder's figures (`Event::Encoder`): cumulative counts and
/// the cache's and queue's present size.
#[derive(Default, Clone, Copy)]
pub struct EncoderStats {
    pub hits: u64,
    pub misses: u64,
    pub entries: u64,
    pub bytes: u64,
    pub in_flight: u64,
    pub encoded: u64,
    pub encode_us: u64,
}

#[derive(Default)]
pub struct Metrics {
    pub c: Mutex<Counters>,
}

/// What the engine knows at the moment of a scrape.
pub struct Gauges {
    pub running: usize,
    pub waiting: usize,
    pub cache_used: u64,
    pub cache_budget: u64,
    /// KV pool blocks held by sequences, held by the prefix cache only, and in all.
    pub blocks_used: u64,
    pub blocks_cached: u64,
    pub blocks_total: u64,
    /// Sequences holding KV blocks, and sequences waiting for them.
    pub sequences: (usize, usize),
}

/// Prometheus text, one metric family at a time, every name under `m3c:`.
struct Exposition(String);

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP m3c:{name} {help}\n# TYPE m3c:{name} {kind}");
    }
    fn gauge(&mut self, name: &str, help: &str, v: impl fmt::Display) {
        self.family(name, "gauge", help);
        let _ = writeln!(self.0, "m3c:{name} {v}");
    }
    fn counter(&mut self, name: &str, help: &str, v: u64) {
        self.family(name, "counter", help);
        let _ = writeln!(self.0, "m3c:{name} {v}");
    }
    /// One value per stage, labelled `stage="K"`.
    fn per_stage<T: fmt::Display>(&mut self, name: &str, kind: &str, help: &str, values: impl Iterator<Item = T>) {
        self.family(name, kind, help);
        for (k, v) in values.enumerate() {
            let _ = writeln!(self.0, "m3c:{name}{{stage=\"{k}\"}} {v}");
        }
    }
}

/// The cumulative counts the last stats line was written at.
#[derive(Default, Clone, Copy)]
pub struct StatsMark {
    prompt: u64,
    generation: u64,
    prefix_queries: u64,
    prefix_hits: u64,
    draft_tokens: u64,
    accepted: u64,
    drafts: u64,
}

impl Metrics {
    /// vLLM's periodic line over the `seconds` since `last`: prompt and
    /// generation throughput, running and waiting requests, KV cache usage,
    /// the prefix cache's hit rate and, where drafts were verified,
    /// speculation's mean acceptance length. `None` when nothing ran,
    /// waited or moved since (an idle server stays quiet).
    pub fn stats_line(&self, g: &Gauges, last: &mut StatsMark, seconds: f64) -> Option<String> {
        let c = self.c.lock().unwrap_or_else(|e| e.into_inner());
        let now = StatsMark {
            prompt: c.prompt_tokens,
            generation: c.generation_tokens,
            prefix_queries: c.prefix_queries,
            prefix_hits: c.prefix_hits,
            draft_tokens: c.spec_draft_tokens,
            accepted: c.spec_accepted,
            drafts: c.spec_drafts,
        };
        drop(c);
        let d = |a: u64, b: u64| a.saturating_sub(b);
        let (prompt, generation) = (d(now.prompt, last.prompt), d(now.generation, last.generation));
        if prompt == 0 && generation == 0 && g.running == 0 && g.waiting == 0 {
            *last = now;
            return None;
        }
        let rate = |n: u64| if seconds > 0.0 { n as f64 / seconds } else { 0.0 };
        let share = |a: u64, b: u64| if b == 0 { 0.0 } else { 100.0 * a as f64 / b as f64 };
        let mut line = format!(
            "m3c serve: prompt throughput {:.1} tokens/s, generation throughput {:.1} tokens/s, running {} reqs, waiting {} reqs, KV cache usage {:.1}%, prefix cache hit rate {:.1}%",
            rate(prompt),
            rate(generation),
            g.running,
            g.waiting,
            share(g.blocks_used, g.blocks_total),
            share(d(now.prefix_hits, last.prefix_hits), d(now.prefix_queries, last.prefix_queries)),
        );
        let (drafts, drafted, accepted) =
            (d(now.drafts, last.drafts), d(now.draft_tokens, last.draft_tokens), d(now.accepted, last.accepted));
        if drafts > 0 {
            let _ = write!(
                line,
                ", speculation: mean acceptance length {:.2} ({accepted} of {drafted} draft tokens accepted)",
                1.0 + accepted as f64 / drafts as f64
            );
        }
        *last = now;
        Some(line)
    }

    /// The exposition: m3c's families, then vLLM's names for the series
    /// that routers and autoscalers read (`model`: the served name).
    pub fn render(&self, g: &Gauges, model: &str) -> String {
        let mut text = self.render_m3c(g);
        self.render_vllm(g, model, &mut text);
        text
    }

    /// vLLM's families, same values and meanings as the `m3c:` ones:
    /// requests running and waiting, KV cache usage (0 to 1), prefix cache
    /// queries and hits (tokens), prompt and generation tokens,
    /// preemptions, time to first token and inter-token latency, and
    /// speculation's counts.
    fn render_vllm(&self, g: &Gauges, model: &str, out: &mut String) {
        let c = self.c.lock().unwrap_or_else(|e| e.into_inner());
        let model: String = model.chars().map(|ch| if ch == '"' || ch == '\\' || ch == '\n' { '_' } else { ch }).collect();
        let labels = format!("model_name=\"{model}\",engine=\"0\"");
        let mut one = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(out, "# HELP vllm:{name} {help}\n# TYPE vllm:{name} {kind}\nvllm:{name}{{{labels}}} {v}");
        };
        one("num_requests_running", "gauge", "Number of requests in model execution batches.", g.running.to_string());
        one("num_requests_waiting", "gauge", "Number of requests waiting to be processed.", g.waiting.to_string());
        let usage = if g.blocks_total == 0 { 0.0 } else { g.blocks_used as f64 / g.blocks_total as f64 };
        one("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage.to_string());
        one(
            "prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            c.prefix_queries.to_string(),
        );
        one("prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", c.prefix_hits.to_string());
        one("prompt_tokens_total", "counter", "Number of prefill tokens processed.", c.prompt_tokens.to_string());
        one("generation_tokens_total", "counter", "Number of generation tokens processed.", c.generation_tokens.to_string());
        one("num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", c.preemptions.to_string());
        one("spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", c.spec_drafts.to_string());
        one("spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", c.spec_draft_tokens.to_string());
        one("spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.", c.spec_accepted.to_string());
        c.ttft.write(out, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", &labels);
        c.itl.write(out, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", &labels);
    }

    fn render_m3c(&self, g: &Gauges) -> String {
        let c = self.c.lock().unwrap_or_else(|e| e.into_inner());
        let mut w = Exposition(String::new());
        w.gauge("num_requests_running", "Requests whose sequences are in the pipeline.", g.running);
        w.gauge("num_requests_waiting", "Requests waiting for cache budget or a batch slot.", g.waiting);
        w.gauge("cache_bytes_used", "Cache bytes of the KV blocks sequences hold (per stage, the largest stage).", g.cache_used);
        w.gauge("cache_bytes_budget", "The KV pool's bytes (the whole blocks --kv-budget holds), per stage.", g.cache_budget);
        let usage = if g.blocks_total == 0 { 0.0 } else { g.blocks_used as f64 / g.blocks_total as f64 };
        w.gauge("kv_cache_usage_perc", "Share of the KV pool's blocks that sequences hold (1 = full).", usage);
        w.gauge("kv_cache_blocks_total", "Blocks in every stage's KV pool.", g.blocks_total);
        let e = c.encoder;
        w.counter("encoder_cache_hits_total", "Image grids and video chunks whose features the encoder cache held.", e.hits);
        w.counter("encoder_cache_misses_total", "Image grids and video chunks the encoder cache did not hold (encoded).", e.misses);
        w.gauge("encoder_cache_entries", "Image grids and video chunks the encoder cache holds.", e.entries);
        w.gauge("encoder_cache_bytes", "Bytes of features the encoder cache holds (--encoder-cache-mb bounds it).", e.bytes);
        w.gauge("encoder_requests_in_flight", "Requests whose images or videos are encoding (they join when done).", e.in_flight);
        w.counter("encoder_grids_total", "Image grids and video chunks encoded.", e.encoded);
        w.gauge(
            "encoder_seconds_total",
            "Seconds from asking for a request's encodes to having its features, summed over requests.",
            e.encode_us as f64 / 1e6,
        );
        w.gauge("kv_cache_blocks_cached", "Blocks that only cached prefixes hold (evicted least recently used).", g.blocks_cached);
        w.gauge("num_sequences_running", "Sequences that hold KV blocks and take steps.", g.sequences.0);
        w.gauge("num_sequences_waiting", "Sequences in the pipeline waiting for KV blocks (new, or preempted).", g.sequences.1);
        w.counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", c.prefix_queries);
        w.counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", c.prefix_hits);
        w.counter("num_preemptions_total", "Sequences that gave their KV blocks back to let older ones go on.", c.preemptions);
        // vLLM's names (under m3c:): mean acceptance length = 1 + accepted / drafts.
        w.counter("spec_decode_num_drafts_total", "Verify steps of speculative decoding (a sequence's draft checked).", c.spec_drafts);
        w.counter("spec_decode_num_draft_tokens_total", "Draft tokens proposed.", c.spec_draft_tokens);
        w.counter("spec_decode_num_accepted_tokens_total", "Draft tokens accepted (each equal to the target's own draw).", c.spec_accepted);
        w.family("spec_decode_num_accepted_tokens_per_pos", "counter", "Draft tokens accepted, by position in their draft.");
        for (pos, n) in c.spec_accepted_per_pos.iter().enumerate() {
            let _ = writeln!(w.0, "m3c:spec_decode_num_accepted_tokens_per_pos{{position=\"{pos}\"}} {n}");
        }
        w.counter("prompt_tokens_total", "Prompt tokens of admitted requests.", c.prompt_tokens);
        w.counter("generation_tokens_total", "Tokens generated.", c.generation_tokens);
        w.counter("requests_success_total", "Requests that finished.", c.requests_ok);
        w.counter("requests_failed_total", "Requests that ended with an error.", c.requests_failed);
        w.counter(
            "requests_cancelled_total",
            "Requests cancelled: the client went away or a stop string ended them.",
            c.requests_cancelled,
        );
        c.ttft.write(&mut w.0, "m3c:time_to_first_token_seconds", "Time from a request's arrival to its first token.", "");
        c.itl.write(&mut w.0, "m3c:inter_token_latency_seconds", "Time between a request's consecutive tokens.", "");
        let stages = &c.stages;
        w.per_stage(
            "stage_step_seconds",
            "gauge",
            "Mean compute time of a stage's step over the last second.",
            stages.iter().map(|s| s.step_s),
        );
        w.per_stage(
            "stage_busy_fraction",
            "gauge",
            "Share of the last second a stage spent computing.",
            stages.iter().map(|s| s.busy_fraction),
        );
        w.per_stage("stage_busy_seconds_total", "counter", "Seconds a stage has spent computing.", stages.iter().map(|s| s.busy_s));
        w.per_stage("stage_steps_total", "counter", "Steps a stage has run.", stages.iter().map(|s| s.steps));
        w.0
    }
}
