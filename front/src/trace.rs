//! Pipeline timelines: the trace the stages print (`m3c-trace` lines, see
//! the runtime's `trace.rs`) collected into a Chrome trace file, and read
//! back for `m3c report`: each stage's busy share and waits, the bubble,
//! and a Gantt chart as SVG.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, Read};
use std::sync::mpsc;

/// What the stages' output carries besides their own lines: the trace.
#[derive(Debug, Default)]
pub struct Collected {
    pub events: Vec<String>,
    pub meta: Option<String>,
}

/// Splits a job's standard output: `m3c-trace` lines are kept, the rest
/// goes on through the returned reader (for the text streamer) unchanged.
pub fn tap(pipe: impl Read + Send + 'static) -> (impl BufRead, std::thread::JoinHandle<Collected>) {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    let reader = std::thread::spawn(move || {
        let mut got = Collected::default();
        let mut input = std::io::BufReader::new(pipe);
        let mut line = Vec::new();
        while input.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
            if let Some(e) = line.strip_prefix(b"m3c-trace ") {
                got.events.push(String::from_utf8_lossy(e).trim_end().to_string());
            } else if let Some(m) = line.strip_prefix(b"m3c-trace-meta ") {
                got.meta = Some(String::from_utf8_lossy(m).trim_end().to_string());
            } else {
                // Nobody may read the rest (the streamer gave up): the
                // trace is still collected.
                let _ = tx.send(std::mem::take(&mut line));
            }
            line.clear();
        }
        got
    });
    (std::io::BufReader::new(ChannelReader { rx, buf: Vec::new(), at: 0 }), reader)
}

/// Bytes from a channel as a reader (the end of the channel is the end).
struct ChannelReader {
    rx: mpsc::Receiver<Vec<u8>>,
    buf: Vec<u8>,
    at: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.at == self.buf.len() {
            match self.rx.recv() {
                Ok(b) => (self.buf, self.at) = (b, 0),
                Err(_) => return Ok(0),
            }
        }
        let n = out.len().min(self.buf.len() - self.at);
        out[..n].copy_from_slice(&self.buf[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// The collected trace as a Chrome trace file's bytes.
pub fn chrome_json(c: &Collected) -> Result<Vec<u8>> {
    let events: Vec<Value> =
        c.events.iter().map(|e| serde_json::from_str(e).with_context(|| format!("a damaged trace event: {e}"))).collect::<Result<_>>()?;
    let meta: Value = match &c.meta {
        Some(m) => serde_json::from_str(m).context("the trace's metadata line")?,
        None => bail!("the stages printed no trace metadata (did the run end early?)"),
    };
    let doc = serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms", "metadata": meta});
    Ok(serde_json::to_vec(&doc)?)
}

/// A span of one stage's track.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub name: String,
    pub start: f64,
    pub dur: f64,
    pub micro_batch: Option<u64>,
    /// `wait`: the stage it waited on.
    pub from: Option<usize>,
}

/// A trace read back: each stage's spans (steps and waits), in time order.
#[derive(Debug, Clone)]
pub struct Timeline {
    pub stages: BTreeMap<usize, Vec<Span>>,
    pub names: BTreeMap<usize, String>,
    /// Sends without a receive and receives without a send (by flow id).
    pub unpaired: usize,
    pub clock_error_us: f64,
}

impl Timeline {
    /// Reads a Chrome trace file written by `m3c run --trace`.
    pub fn parse(text: &str) -> Result<Timeline> {
        let doc: Value = serde_json::from_str(text).context("not JSON")?;
        let events = doc["traceEvents"].as_array().context("no `traceEvents` array: not a Chrome trace")?;
        let mut stages: BTreeMap<usize, Vec<Span>> = BTreeMap::new();
        let mut names = BTreeMap::new();
        let mut flows: BTreeMap<String, i32> = BTreeMap::new();
        for e in events {
            let tid = e["tid"].as_u64().context("an event without a `tid`")? as usize;
            match (e["ph"].as_str(), e["cat"].as_str()) {
                (Some("M"), _) if e["name"] == "thread_name" => {
                    names.insert(tid, e["args"]["name"].as_str().unwrap_or_default().to_string());
                }
                (Some("X"), Some("step" | "wait")) => stages.entry(tid).or_default().push(Span {
                    name: e["name"].as_str().unwrap_or_default().to_string(),
                    start: e["ts"].as_f64().context("a span without `ts`")?,
                    dur: e["dur"].as_f64().context("a span without `dur`")?,
                    micro_batch: e["args"]["micro_batch"].as_u64(),
                    from: e["args"]["from"].as_u64().map(|f| f as usize),
                }),
                (Some(ph @ ("s" | "f")), Some("flow")) => {
                    let id = e["id"].as_str().context("a flow without an id")?.to_string();
                    *flows.entry(id).or_default() += if ph == "s" { 1 } else { -1 };
                }
                _ => {}
            }
        }
        for spans in stages.values_mut() {
            spans.sort_by(|a, b| a.start.total_cmp(&b.start));
        }
        let clock_error_us = doc["metadata"]["clock_error_us"].as_f64().unwrap_or(0.0);
        Ok(Timeline { stages, names, unpaired: flows.values().filter(|&&v| v != 0).count(), clock_error_us })
    }

    /// From the first step's start to the last step's end, over all stages.
    pub fn window(&self) -> (f64, f64) {
        let steps = self.stages.values().flatten().filter(|s| s.name != "wait");
        let start = steps.clone().map(|s| s.start).fold(f64::INFINITY, f64::min);
        let end = steps.map(|s| s.start + s.dur).fold(f64::NEG_INFINITY, f64::max);
        (start, end)
    }

    /// Per stage: (busy µs, µs waited on each stage) within the window.
    pub fn busy(&self) -> BTreeMap<usize, (f64, BTreeMap<usize, f64>)> {
        let (a, b) = self.window();
        let clip = |s: &Span| (s.start + s.dur).min(b) - s.start.max(a);
        self.stages
            .iter()
            .map(|(&k, spans)| {
                let busy = spans.iter().filter(|s| s.name != "wait").map(|s| clip(s).max(0.0)).sum();
                let mut waits: BTreeMap<usize, f64> = BTreeMap::new();
                for s in spans.iter().filter(|s| s.name == "wait") {
                    *waits.entry(s.from.unwrap_or(usize::MAX)).or_default() += clip(s).max(0.0);
                }
                (k, (busy, waits))
            })
            .collect()
    }

    /// The idle share of stage time over the window: 1 − Σ busy / (N × window).
    pub fn bubble(&self) -> f64 {
        let (a, b) = self.window();
        let busy: f64 = self.busy().values().map(|v| v.0).sum();
        let total = (b - a) * self.stages.len() as f64;
        if total > 0.0 {
            1.0 - busy / total
        } else {
            0.0
        }
    }

    /// Mean step time of each stage by kind (`prefill`, `decode`), in µs.
    pub fn mean_steps(&self, kind: &str) -> BTreeMap<usize, f64> {
        self.stages
            .iter()
            .filter_map(|(&k, spans)| {
                let d: Vec<f64> = spans.iter().filter(|s| s.name == kind).map(|s| s.dur).collect();
                (!d.is_empty()).then(|| (k, d.iter().sum::<f64>() / d.len() as f64))
            })
            .collect()
    }

    /// The per-stage table of `m3c report`.
    pub fn table(&self) -> String {
        let (a, b) = self.window();
        let mut o = String::new();
        let _ = writeln!(
            o,
            "{} stage(s), {:.3} ms from the first step to the last; clocks aligned within {:.1} us",
            self.stages.len(),
            (b - a) / 1e3,
            self.clock_error_us
        );
        let _ = writeln!(o, "{:<24} {:>7} {:>8} {:>10} {:>10}  waited on", "stage", "steps", "busy %", "prefill ms", "decode ms");
        let (pre, dec) = (self.mean_steps("prefill"), self.mean_steps("decode"));
        for (k, (busy, waits)) in self.busy() {
            let steps = self.stages[&k].iter().filter(|s| s.name != "wait").count();
            let w: Vec<String> = waits
                .iter()
                .map(|(f, t)| format!("{} {:.3} ms", if *f == usize::MAX { "?".to_string() } else { format!("stage {f}") }, t / 1e3))
                .collect();
            let _ = writeln!(
                o,
                "{:<24} {:>7} {:>8.1} {:>10} {:>10}  {}",
                self.names.get(&k).cloned().unwrap_or_else(|| format!("stage {k}")),
                steps,
                busy / (b - a).max(1e-9) * 100.0,
                pre.get(&k).map_or("-".into(), |t| format!("{:.3}", t / 1e3)),
                dec.get(&k).map_or("-".into(), |t| format!("{:.3}", t / 1e3)),
                if w.is_empty() { "-".into() } else { w.join(", ") }
            );
        }
        let _ = writeln!(o, "pipeline bubble (idle share of stage time): {:.1}%", self.bubble() * 100.0);
        o
    }

    /// The Gantt chart's boxes, laid out once for the SVG and the PNG: one
    /// row per stage, each step a box coloured by its micro-batch's slot
    /// in the pipeline (micro-batch number mod the stage count: the batches
    /// in flight together differ), vision encodes grey, waits a thin line.
    fn boxes(&self) -> Vec<GanttBox> {
        let (a, b) = self.window();
        let span = (b - a).max(1e-9);
        let n = self.stages.len().max(1) as u64;
        let mut out = Vec::new();
        for (row, spans) in self.stages.values().enumerate() {
            for s in spans {
                let x0 = GANTT.left + (s.start - a) / span * GANTT.width;
                let w = (s.dur / span * GANTT.width).max(0.5);
                let y = GANTT.top + GANTT.row * row as f64;
                let (y, h, rgb) = if s.name == "wait" {
                    (y + GANTT.row - 6.0, 2.0, [0xbb, 0xbb, 0xbb])
                } else {
                    let rgb = s.micro_batch.map_or([0x88, 0x88, 0x88], |m| PALETTE[(m % n % PALETTE.len() as u64) as usize]);
                    (y + 4.0, GANTT.row - 12.0, rgb)
                };
                out.push(GanttBox { x: x0, y, w, h, rgb, title: (s.name != "wait").then(|| format!("{} {:.3} ms", s.name, s.dur / 1e3)) });
            }
        }
        out
    }

    fn height(&self) -> f64 {
        GANTT.top + GANTT.row * self.stages.len().max(1) as f64 + 40.0
    }

    /// The timeline as a Gantt chart in SVG, with the stages' names and the
    /// time axis.
    pub fn svg(&self) -> String {
        let (a, b) = self.window();
        let span = (b - a).max(1e-9);
        let (width, height) = (GANTT.left + GANTT.width + 20.0, self.height());
        let mut o = String::new();
        let _ = writeln!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            o,
            r#"<text x="{}" y="20">m3c pipeline timeline: {:.3} ms, bubble {:.1}%</text>"#,
            GANTT.left,
            span / 1e3,
            self.bubble() * 100.0
        );
        for (i, k) in self.stages.keys().enumerate() {
            let y = GANTT.top + GANTT.row * i as f64;
            let name = self.names.get(k).cloned().unwrap_or_else(|| format!("stage {k}"));
            let _ = writeln!(o, r#"<text x="4" y="{}">{}</text>"#, y + GANTT.row / 2.0 + 4.0, xml_escape(&name));
        }
        for g in self.boxes() {
            let fill = format!("#{:02x}{:02x}{:02x}", g.rgb[0], g.rgb[1], g.rgb[2]);
            let title = g.title.map(|t| format!("<title>{t}</title>")).unwrap_or_default();
            let _ =
                writeln!(o, r#"<rect x="{:.2}" y="{:.2}" width="{:.2}" height="{:.2}" fill="{fill}">{title}</rect>"#, g.x, g.y, g.w, g.h);
        }
        let _ = writeln!(o, r#"<text x="{}" y="{}">0 ms</text>"#, GANTT.left, height - 12.0);
        let _ =
            writeln!(o, r#"<text x="{}" y="{}" text-anchor="end">{:.3} ms</text>"#, GANTT.left + GANTT.width, height - 12.0, span / 1e3);
        o.push_str("</svg>\n");
        o
    }

    /// The same chart as a PNG's bytes (the boxes only: no text), for
    /// places that show no SVG.
    pub fn png(&self) -> Result<Vec<u8>> {
        let (w, h) = ((GANTT.left + GANTT.width + 20.0) as u32, self.height() as u32);
        let mut img = image::RgbImage::from_pixel(w, h, image::Rgb([255, 255, 255]));
        for g in self.boxes() {
            let (x0, y0) = (g.x.floor().max(0.0) as u32, g.y.floor().max(0.0) as u32);
            let (x1, y1) = (((g.x + g.w).ceil() as u32).min(w), ((g.y + g.h).ceil() as u32).min(h));
            for y in y0..y1 {
                for x in x0..x1.max(x0 + 1).min(w) {
                    img.put_pixel(x, y, image::Rgb(g.rgb));
                }
            }
        }
        let mut bytes = Vec::new();
        img.write_to(&mut std::io::Cursor::new(&mut bytes), image::ImageFormat::Png).context("encoding the PNG")?;
        Ok(bytes)
    }
}

/// Where the Gantt chart's parts go, in pixels.
struct Layout {
    left: f64,
    width: f64,
    row: f64,
    top: f64,
}

const GANTT: Layout = Layout { left: 150.0, width: 1000.0, row: 36.0, top: 40.0 };

/// Colours of the micro-batch slots (Tableau 10).
const PALETTE: [[u8; 3]; 8] = [
    [0x4e, 0x79, 0xa7],
    [0xf2, 0x8e, 0x2b],
    [0x59, 0xa1, 0x4f],
    [0xe1, 0x57, 0x59],
    [0x76, 0xb7, 0xb2],
    [0xed, 0xc9, 0x48],
    [0xb0, 0x7a, 0xa1],
    [0xff, 0x9d, 0xa7],
];

/// One box of the chart: its place, colour and tooltip.
struct GanttBox {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
    rgb: [u8; 3],
    title: Option<String>,
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

use std::fmt::Write as _;
