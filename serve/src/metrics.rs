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

    /// The histogram's series (its family's header written before);
    /// `labels` (`a="x",b="y"`, or empty) go on every one.
    fn write_series(&self, out: &mut String, name: &str, labels: &str) {
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
    /// Pipeline restarts by cause, requests that went on after one, and
    /// how long each took from the loss to the stages being up again.
    pub restarts: std::collections::BTreeMap<&'static str, u64>,
    pub requests_resumed: u64,
    pub restart_seconds: Histogram,
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
#[derive(Debug, Clone, Copy, Default, PartialEq)]
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

impl std::ops::Add for Gauges {
    type Output = Gauges;
    /// Several replicas' figures as one server's.
    fn add(self, o: Gauges) -> Gauges {
        Gauges {
            running: self.running + o.running,
            waiting: self.waiting + o.waiting,
            cache_used: self.cache_used + o.cache_used,
            cache_budget: self.cache_budget + o.cache_budget,
            blocks_used: self.blocks_used + o.blocks_used,
            blocks_cached: self.blocks_cached + o.blocks_cached,
            blocks_total: self.blocks_total + o.blocks_total,
            sequences: (self.sequences.0 + o.sequences.0, self.sequences.1 + o.sequences.1),
        }
    }
}

/// One replica's figures at a scrape (`--data-parallel-size`; one for a lone pipeline).
pub struct Scrape<'a> {
    pub metrics: &'a Metrics,
    pub gauges: Gauges,
    /// Whether it takes requests now.
    pub up: bool,
}

/// One replica's row of every family: its counters, gauges and labels.
struct Row<'a> {
    c: &'a Counters,
    g: &'a Gauges,
    /// `replica="R"` with several replicas, else empty.
    labels: String,
}

/// `{a,b}` of the non-empty label lists (nothing when all are empty).
fn braces(parts: &[&str]) -> String {
    let parts: Vec<&str> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

/// Prometheus text, one metric family at a time, every name under `m3c:`,
/// each family with one series per replica.
struct Exposition<'a> {
    out: String,
    rows: &'a [Row<'a>],
}

impl Exposition<'_> {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP m3c:{name} {help}\n# TYPE m3c:{name} {kind}");
    }
    fn series<T: fmt::Display>(&mut self, name: &str, kind: &str, help: &str, v: impl Fn(&Counters, &Gauges) -> T) {
        self.family(name, kind, help);
        for r in self.rows {
            let _ = writeln!(self.out, "m3c:{name}{} {}", braces(&[&r.labels]), v(r.c, r.g));
        }
    }
    fn gauge<T: fmt::Display>(&mut self, name: &str, help: &str, v: impl Fn(&Counters, &Gauges) -> T) {
        self.series(name, "gauge", help, v);
    }
    fn counter(&mut self, name: &str, help: &str, v: impl Fn(&Counters) -> u64) {
        self.series(name, "counter", help, |c, _| v(c));
    }
    /// Values labelled `KEY="i"` by their index, per replica.
    fn indexed<T: fmt::Display>(&mut self, name: &str, kind: &str, help: &str, key: &str, values: impl Fn(&Counters) -> Vec<T>) {
        self.family(name, kind, help);
        for r in self.rows {
            for (i, v) in values(r.c).iter().enumerate() {
                let _ = writeln!(self.out, "m3c:{name}{} {v}", braces(&[&format!("{key}=\"{i}\""), &r.labels]));
            }
        }
    }
    fn histogram(&mut self, name: &str, help: &str, h: impl Fn(&Counters) -> &Histogram) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for r in self.rows {
            h(r.c).write_series(&mut self.out, name, &r.labels);
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
}

/// The exposition: m3c's families, then vLLM's names for the series that
/// routers and autoscalers read (`model`: the served name). Each family
/// has a series per replica, labelled `replica="R"` (vLLM's `engine="R"`)
/// when there are several.
pub fn render(replicas: &[Scrape], model: &str) -> String {
    let guards: Vec<_> = replicas.iter().map(|r| r.metrics.c.lock().unwrap_or_else(|e| e.into_inner())).collect();
    let several = replicas.len() > 1;
    let rows: Vec<Row> = guards
        .iter()
        .zip(replicas)
        .enumerate()
        .map(|(i, (c, r))| Row { c, g: &r.gauges, labels: if several { format!("replica=\"{i}\"") } else { String::new() } })
        .collect();
    let mut w = Exposition { out: String::new(), rows: &rows };
    render_m3c(&mut w);
    if several {
        w.family("replica_up", "gauge", "Whether a replica takes requests (1) or is out of routing (0).");
        for (r, s) in rows.iter().zip(replicas) {
            let _ = writeln!(w.out, "m3c:replica_up{{{}}} {}", r.labels, u8::from(s.up));
        }
    }
    render_vllm(&rows, model, &mut w.out);
    w.out
}

/// vLLM's families, same values and meanings as the `m3c:` ones: requests
/// running and waiting, KV cache usage (0 to 1), prefix cache queries and
/// hits (tokens), prompt and generation tokens, preemptions, time to first
/// token and inter-token latency, and speculation's counts; each replica
/// is vLLM's `engine` (its data-parallel rank).
fn render_vllm(rows: &[Row], model: &str, out: &mut String) {
    let model: String = model.chars().map(|ch| if ch == '"' || ch == '\\' || ch == '\n' { '_' } else { ch }).collect();
    let labels: Vec<String> = (0..rows.len()).map(|i| format!("model_name=\"{model}\",engine=\"{i}\"")).collect();
    let mut one = |name: &str, kind: &str, help: &str, v: &dyn Fn(&Counters, &Gauges) -> String| {
        let _ = writeln!(out, "# HELP vllm:{name} {help}\n# TYPE vllm:{name} {kind}");
        for (r, l) in rows.iter().zip(&labels) {
            let _ = writeln!(out, "vllm:{name}{{{l}}} {}", v(r.c, r.g));
        }
    };
    one("num_requests_running", "gauge", "Number of requests in model execution batches.", &|_, g| g.running.to_string());
    one("num_requests_waiting", "gauge", "Number of requests waiting to be processed.", &|_, g| g.waiting.to_string());
    one("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", &|_, g| usage(g).to_string());
    one("prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", &|c, _| {
        c.prefix_queries.to_string()
    });
    one("prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", &|c, _| c.prefix_hits.to_string());
    one("prompt_tokens_total", "counter", "Number of prefill tokens processed.", &|c, _| c.prompt_tokens.to_string());
    one("generation_tokens_total", "counter", "Number of generation tokens processed.", &|c, _| c.generation_tokens.to_string());
    one("num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", &|c, _| c.preemptions.to_string());
    one("spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", &|c, _| c.spec_drafts.to_string());
    one("spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", &|c, _| c.spec_draft_tokens.to_string());
    one("spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.", &|c, _| c.spec_accepted.to_string());
    let histograms: [(&str, &str, Pick); 2] = [
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", |c| &c.ttft),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", |c| &c.itl),
    ];
    for (name, help, h) in histograms {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (r, l) in rows.iter().zip(&labels) {
            h(r.c).write_series(out, name, l);
        }
    }
}

/// Which of a replica's histograms a family shows.
type Pick = fn(&Counters) -> &Histogram;

/// The share of the KV pool's blocks that sequences hold (0 to 1).
fn usage(g: &Gauges) -> f64 {
    if g.blocks_total == 0 {
        0.0
    } else {
        g.blocks_used as f64 / g.blocks_total as f64
    }
}

fn render_m3c(w: &mut Exposition) {
    w.gauge("num_requests_running", "Requests whose sequences are in the pipeline.", |_, g| g.running);
    w.gauge("num_requests_waiting", "Requests waiting for cache budget or a batch slot.", |_, g| g.waiting);
    w.gauge("cache_bytes_used", "Cache bytes of the KV blocks sequences hold (per stage, the largest stage).", |_, g| g.cache_used);
    w.gauge("cache_bytes_budget", "The KV pool's bytes (the whole blocks --kv-budget holds), per stage.", |_, g| g.cache_budget);
    w.gauge("kv_cache_usage_perc", "Share of the KV pool's blocks that sequences hold (1 = full).", |_, g| usage(g));
    w.gauge("kv_cache_blocks_total", "Blocks in every stage's KV pool.", |_, g| g.blocks_total);
    w.counter("encoder_cache_hits_total", "Image grids and video chunks whose features the encoder cache held.", |c| c.encoder.hits);
    w.counter("encoder_cache_misses_total", "Image grids and video chunks the encoder cache did not hold (encoded).", |c| c.encoder.misses);
    w.gauge("encoder_cache_entries", "Image grids and video chunks the encoder cache holds.", |c, _| c.encoder.entries);
    w.gauge("encoder_cache_bytes", "Bytes of features the encoder cache holds (--encoder-cache-mb bounds it).", |c, _| c.encoder.bytes);
    w.gauge("encoder_requests_in_flight", "Requests whose images or videos are encoding (they join when done).", |c, _| {
        c.encoder.in_flight
    });
    w.counter("encoder_grids_total", "Image grids and video chunks encoded.", |c| c.encoder.encoded);
    w.gauge(
        "encoder_seconds_total",
        "Seconds from asking for a request's encodes to having its features, summed over requests.",
        |c, _| c.encoder.encode_us as f64 / 1e6,
    );
    w.gauge("kv_cache_blocks_cached", "Blocks that only cached prefixes hold (evicted least recently used).", |_, g| g.blocks_cached);
    w.gauge("num_sequences_running", "Sequences that hold KV blocks and take steps.", |_, g| g.sequences.0);
    w.gauge("num_sequences_waiting", "Sequences in the pipeline waiting for KV blocks (new, or preempted).", |_, g| g.sequences.1);
    w.counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", |c| c.prefix_queries);
    w.counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", |c| c.prefix_hits);
    w.counter("num_preemptions_total", "Sequences that gave their KV blocks back to let older ones go on.", |c| c.preemptions);
    // vLLM's names (under m3c:): mean acceptance length = 1 + accepted / drafts.
    w.counter("spec_decode_num_drafts_total", "Verify steps of speculative decoding (a sequence's draft checked).", |c| c.spec_drafts);
    w.counter("spec_decode_num_draft_tokens_total", "Draft tokens proposed.", |c| c.spec_draft_tokens);
    w.counter("spec_decode_num_accepted_tokens_total", "Draft tokens accepted (each equal to the target's own draw).", |c| c.spec_accepted);
    w.indexed(
        "spec_decode_num_accepted_tokens_per_pos",
        "counter",
        "Draft tokens accepted, by position in their draft.",
        "position",
        |c| c.spec_accepted_per_pos.clone(),
    );
    w.counter("prompt_tokens_total", "Prompt tokens of admitted requests.", |c| c.prompt_tokens);
    w.counter("generation_tokens_total", "Tokens generated.", |c| c.generation_tokens);
    w.counter("requests_success_total", "Requests that finished.", |c| c.requests_ok);
    w.counter("requests_failed_total", "Requests that ended with an error.", |c| c.requests_failed);
    w.counter("requests_cancelled_total", "Requests cancelled: the client went away or a stop string ended them.", |c| {
        c.requests_cancelled
    });
    w.family("pipeline_restarts_total", "counter", "Pipelines started again after a loss, by cause.");
    for r in w.rows {
        for (cause, n) in &r.c.restarts {
            let _ = writeln!(w.out, "m3c:pipeline_restarts_total{} {n}", braces(&[&format!("cause=\"{cause}\""), &r.labels]));
        }
    }
    w.counter("requests_resumed_total", "Requests that went on from their sent tokens on a restarted pipeline.", |c| c.requests_resumed);
    w.histogram("m3c:pipeline_restart_seconds", "Time from a pipeline's loss to its restart's stages being up.", |c| &c.restart_seconds);
    w.histogram("m3c:time_to_first_token_seconds", "Time from a request's arrival to its first token.", |c| &c.ttft);
    w.histogram("m3c:inter_token_latency_seconds", "Time between a request's consecutive tokens.", |c| &c.itl);
    let stage_values = |f: fn(&StageStat) -> f64| move |c: &Counters| c.stages.iter().map(f).collect::<Vec<f64>>();
    w.indexed(
        "stage_step_seconds",
        "gauge",
        "Mean compute time of a stage's step over the last second.",
        "stage",
        stage_values(|s| s.step_s),
    );
    w.indexed(
        "stage_busy_fraction",
        "gauge",
        "Share of the last second a stage spent computing.",
        "stage",
        stage_values(|s| s.busy_fraction),
    );
    w.indexed("stage_busy_seconds_total", "counter", "Seconds a stage has spent computing.", "stage", stage_values(|s| s.busy_s));
    w.indexed("stage_steps_total", "counter", "Steps a stage has run.", "stage", |c| {
        c.stages.iter().map(|s| s.steps).collect::<Vec<u64>>()
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_family_has_one_header_and_a_series_per_replica() {
        let (a, b) = (Metrics::default(), Metrics::default());
        a.c.lock().unwrap().prefix_hits = 7;
        b.c.lock().unwrap().ttft.observe(0.2);
        let g = Gauges { running: 2, blocks_total: 10, blocks_used: 5, ..Gauges::default() };
        let two = render(&[Scrape { metrics: &a, gauges: g, up: true }, Scrape { metrics: &b, gauges: Gauges::default(), up: false }], "m");
        assert_eq!(two.matches("# HELP vllm:num_requests_running ").count(), 1);
        for series in [
            "vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 2",
            "vllm:num_requests_running{model_name=\"m\",engine=\"1\"} 0",
            "vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.5",
            "vllm:time_to_first_token_seconds_count{model_name=\"m\",engine=\"1\"} 1",
            "m3c:prefix_cache_hits_total{replica=\"0\"} 7",
            "m3c:replica_up{replica=\"1\"} 0",
        ] {
            assert!(two.contains(series), "{series}:\n{two}");
        }
        // A lone pipeline's series carry no replica label.
        let one = render(&[Scrape { metrics: &a, gauges: g, up: true }], "m");
        assert!(one.contains("m3c:prefix_cache_hits_total 7") && !one.contains("replica"), "{one}");
        assert_eq!((g + g).running, 4);
    }
}
