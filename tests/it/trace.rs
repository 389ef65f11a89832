//! Pipeline timelines (`m3c run --trace`, `m3c report`): the trace is a
//! Chrome trace with one track per stage, one span per step a stage ran,
//! no two steps of a stage overlapping, every send paired with its
//! receive; tracing changes no token; the report and its SVG say what the
//! trace holds.

use m3c_tests::{fixture, m3c, m3c_run, stderr, stdout};
use serde_json::Value;

/// Steps a stage reported in its closing line (`prefill N step(s)` and
/// `decode M step(s)`).
fn reported_steps(log: &str, stage: usize, stages: usize) -> usize {
    let line = log
        .lines()
        .find(|l| l.starts_with(&format!("m3c stage {stage}/{stages}: done;")))
        .unwrap_or_else(|| panic!("no closing line:\n{log}"));
    let count = |kind: &str| -> usize {
        line.split(&format!("{kind} "))
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{line}"))
    };
    count("prefill") + count("decode")
}

#[test]
fn a_pp4_trace_has_every_step_and_message_and_changes_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let (out, model) = (crate::shared::out("tiny-m3", 4), fixture("tiny-m3"));
    let run = ["--prompt-ids", "1,2,3,4,5", "--prompt-ids", "6,7", "--prompt-ids", "8,9,10", "--prompt-ids", "11", "--max-new-tokens", "6"];
    let plain = m3c_run(&out, &model, &run);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let trace = dir.path().join("t.json");
    let traced = m3c_run(&out, &model, &[&run[..], &["--trace", trace.to_str().unwrap()]].concat());
    assert!(traced.status.success(), "{}", stderr(&traced));
    assert_eq!(stdout(&traced), stdout(&plain), "tracing changed the output (or leaked trace lines into it)");
    let doc: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).expect("the trace is JSON");
    let events = doc["traceEvents"].as_array().expect("a Chrome trace: traceEvents");
    let tracks: Vec<u64> =
        events.iter().filter(|e| e["ph"] == "M" && e["name"] == "thread_name").filter_map(|e| e["tid"].as_u64()).collect();
    assert_eq!(tracks, vec![0, 1, 2, 3], "one track per stage");
    assert!(doc["metadata"]["clock_error_us"].as_f64().is_some_and(|e| (0.0..1e5).contains(&e)), "{}", doc["metadata"]);
    let log = stderr(&traced);
    for k in 0..4u64 {
        let mut steps: Vec<(f64, f64)> = events
            .iter()
            .filter(|e| e["tid"] == k && e["cat"] == "step" && e["ph"] == "X")
            .map(|e| (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap()))
            .collect();
        assert_eq!(steps.len(), reported_steps(&log, k as usize, 4), "stage {k}: one span per step it ran");
        steps.sort_by(|a, b| a.0.total_cmp(&b.0));
        for w in steps.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0 + 1e-3, "stage {k}: steps overlap: {w:?}");
        }
        // A wait ends where the receive it waited for starts (Perfetto
        // draws overlapping spans on one track mis-nested).
        // In whole nanoseconds, as Perfetto reads the microseconds.
        let ns = |v: &Value| (v.as_f64().unwrap() * 1000.0).round() as i64;
        let span = |e: &Value| (ns(&e["ts"]), ns(&e["ts"]) + ns(&e["dur"]));
        let recv_starts: Vec<i64> = events.iter().filter(|e| e["tid"] == k && e["name"] == "recv").map(|e| span(e).0).collect();
        for w in events.iter().filter(|e| e["tid"] == k && e["name"] == "wait").map(span) {
            let next = recv_starts.iter().filter(|&&r| r >= w.0).fold(i64::MAX, |a, &b| a.min(b));
            assert!(w.1 <= next, "stage {k}: the wait {w:?} runs past the receive at {next}");
        }
    }
    // Every send has its receive: flow starts and ends pair by id, and
    // each send's bytes are what its receive got.
    let ids = |ph: &str| -> std::collections::BTreeMap<String, u64> {
        events
            .iter()
            .filter(|e| e["cat"] == "msg" && e["name"] == ph)
            .map(|e| (e["args"]["id"].as_str().unwrap().to_string(), e["args"]["bytes"].as_u64().unwrap()))
            .collect()
    };
    let (sends, recvs) = (ids("send"), ids("recv"));
    assert!(!sends.is_empty(), "no messages traced");
    assert_eq!(sends, recvs, "every send pairs with a receive of the same bytes");
    let t = m3c_front::trace::Timeline::parse(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert_eq!(t.unpaired, 0);

    // The report: a row per stage, the bubble, and an SVG row per stage.
    let svg = dir.path().join("t.svg");
    let o = m3c(&["report", trace.to_str().unwrap(), "--svg", svg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r = stdout(&o);
    for k in 0..4 {
        assert!(r.lines().any(|l| l.starts_with(&format!("stage {k} ("))), "no row for stage {k}:\n{r}");
    }
    let bubble: f64 =
        r.split("bubble (idle share of stage time): ").nth(1).and_then(|s| s.split('%').next()).and_then(|b| b.parse().ok()).unwrap();
    assert!((0.0..100.0).contains(&bubble) && (bubble / 100.0 - t.bubble()).abs() < 1e-3, "{r}");
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\"") && picture.trim_end().ends_with("</svg>"), "{picture}");
    for k in 0..4 {
        assert!(picture.contains(&format!(">stage {k} (")), "no row for stage {k} in the SVG");
    }
    let boxes = picture.matches("<title>").count();
    let steps: usize = (0..4).map(|k| reported_steps(&log, k, 4)).sum();
    assert_eq!(boxes, steps, "one box per step");

    // The PNG: a coloured band per stage, white between them; and the
    // cost model's prediction beside the measured steps.
    let png = dir.path().join("t.png");
    let o = m3c(&[
        "report",
        trace.to_str().unwrap(),
        "--png",
        png.to_str().unwrap(),
        "--plan",
        m3c_tests::configs("tiny-m3.pp4.yaml").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let img = image::open(&png).expect("a PNG").to_rgb8();
    let coloured = |y: u32| {
        (0..img.width()).any(|x| {
            let p = img.get_pixel(x, y).0;
            let (lo, hi) = (*p.iter().min().unwrap(), *p.iter().max().unwrap());
            hi - lo > 40 // not white or grey
        })
    };
    let bands = (0..img.height())
        .fold((0, false), |(n, was), y| {
            let is = coloured(y);
            (n + usize::from(is && !was), is)
        })
        .0;
    assert_eq!(bands, 4, "one coloured row per stage");
    let r = stdout(&o);
    let predicted: Vec<&str> =
        r.lines().skip_while(|l| !l.starts_with("predicted")).skip(2).take_while(|l| l.starts_with(|c: char| c.is_ascii_digit())).collect();
    assert_eq!(predicted.len(), 4, "a predicted row per stage:\n{r}");
    for l in predicted {
        let ratio: f64 = l.split_whitespace().last().unwrap().parse().unwrap_or_else(|_| panic!("{l}"));
        assert!(ratio > 0.0, "{l}");
    }
}

/// A trace file that is not one is an error naming it; `--trace` into a
/// missing folder is refused before the job starts.
#[test]
fn bad_traces_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"traceEvents\": 3}").unwrap();
    let o = m3c(&["report", bad.to_str().unwrap()]);
    assert!(!o.status.success() && stderr(&o).contains("bad.json: not a trace of `m3c run --trace`"), "{}", stderr(&o));
    let (out, model) = (crate::shared::out("tiny-m3", 2), fixture("tiny-m3"));
    let o = m3c_run(&out, &model, &["--prompt-ids", "1,2", "--max-new-tokens", "1", "--trace", "/nonexistent/dir/t.json"]);
    assert!(
        !o.status.success() && stderr(&o).contains("--trace /nonexistent/dir/t.json: the folder /nonexistent/dir does not exist"),
        "{}",
        stderr(&o)
    );
    assert!(!stderr(&o).contains("m3c stage"), "the job started: {}", stderr(&o));
}
