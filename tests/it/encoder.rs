//! Encodes beside the step loop: while a request's image encodes on the
//! first stage's encoder thread, running sequences keep taking steps (the
//! timeline shows them inside the encode); `--encodes inline` keeps the old
//! behaviour, where every step waits. Where an encode runs changes no bit.

use m3c_tests::{m3c_run, stderr};
use serde_json::Value;

/// A 672×672 PNG (576 image tokens): an encode long enough to see steps in.
fn big_png(path: &std::path::Path) {
    let n = 672usize;
    let rgb: Vec<u8> = (0..n).flat_map(|y| (0..n).flat_map(move |x| [(x * 7 + y * 3) as u8, (x * y) as u8, (x ^ y) as u8])).collect();
    image::save_buffer(path, &rgb, n as u32, n as u32, image::ExtendedColorType::Rgb8).unwrap();
}

/// A span's (start, end) in µs; a step's name with its span and the
/// sequences it carried.
type Span = (f64, f64);
type Named = (String, f64, f64, Vec<u64>);

/// Stage 0's encode spans (`cat: encode`, beside the loop) and its vision
/// and text steps, from a Chrome trace.
fn spans(trace: &std::path::Path) -> (Vec<Span>, Vec<Named>) {
    let doc: Value = serde_json::from_slice(&std::fs::read(trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let span = |e: &Value| (e["ts"].as_f64().unwrap(), e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap());
    let encodes = events.iter().filter(|e| e["cat"] == "encode" && e["ph"] == "X").map(span).collect();
    let steps = events
        .iter()
        .filter(|e| e["tid"] == 0 && e["cat"] == "step" && e["ph"] == "X")
        .map(|e| {
            let (a, b) = span(e);
            let seqs = e["args"]["seqs"].as_array().map(|s| s.iter().filter_map(Value::as_u64).collect()).unwrap_or_default();
            (e["name"].as_str().unwrap().to_string(), a, b, seqs)
        })
        .collect();
    (encodes, steps)
}

/// The sequences an encode carried (on any track), from a Chrome trace.
fn image_seqs(trace: &std::path::Path) -> Vec<u64> {
    let doc: Value = serde_json::from_slice(&std::fs::read(trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    events
        .iter()
        .filter(|e| e["cat"] == "encode" && e["ph"] == "X")
        .flat_map(|e| e["args"]["seqs"].as_array().cloned().unwrap_or_default())
        .filter_map(|q| q.as_u64())
        .collect()
}

#[test]
fn steps_go_on_while_an_image_encodes_and_no_bit_changes() {
    let dir = tempfile::tempdir().unwrap();
    big_png(&dir.path().join("big.png"));
    let prompts = dir.path().join("prompts.jsonl");
    let image_chat = r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "big.png"}}, {"type": "text", "text": "What is it?"}]}], "thinking": "disabled"}"#;
    std::fs::write(&prompts, format!("{{\"prompt\": \"Count with me: 1, 2, 3,\"}}\n{image_chat}\n")).unwrap();
    let (out, model) = crate::shared::tiny(2);
    let mut dumps = Vec::new();
    for mode in ["beside", "inline"] {
        let d = dir.path().join(mode);
        std::fs::create_dir(&d).unwrap();
        let (dump, trace) = (d.join("d.safetensors"), d.join("t.json"));
        let args = [
            "--prompts",
            prompts.to_str().unwrap(),
            "--max-new-tokens",
            "48",
            "--ignore-eos",
            "--encodes",
            mode,
            "--dump",
            dump.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
        ];
        let o = m3c_run(&out, &model, &args);
        assert!(o.status.success(), "{mode}: {}", stderr(&o));
        let (encodes, steps) = spans(&trace);
        let text_steps = |from: f64, to: f64| steps.iter().filter(|(n, a, ..)| n != "vision" && *a >= from && *a < to).count();
        if mode == "beside" {
            assert_eq!(encodes.len(), 1, "one encode beside the loop: {encodes:?}");
            assert!(!steps.iter().any(|(n, ..)| n == "vision"), "no encode in the loop");
            let (from, to) = encodes[0];
            let inside = text_steps(from, to);
            eprintln!("beside: {inside} of stage 0's steps ran during the {:.1} ms encode", (to - from) / 1e3);
            assert!(inside > 0, "no step of the text prompt ran while the image encoded");
        } else {
            assert!(encodes.is_empty(), "inline: no encode beside the loop");
            let (_, from, to, _) = steps.iter().find(|(n, ..)| n == "vision").cloned().expect("the encode, in the loop");
            assert_eq!(text_steps(from, to), 0, "inline: steps ran during the encode");
        }
        let files = ["d.p0.safetensors", "d.p1.safetensors"].map(|f| std::fs::read(d.join(f)).unwrap());
        dumps.push(files);
    }
    assert!(dumps[0] == dumps[1], "the dumps differ between encodes beside the loop and inline");
}

/// The tower on the last stage of three (`vision: true` there): an image
/// chat beside a text prompt gives exactly the bytes of the tower on the
/// first stage (videos: `serve::a_video_chat_...`); the encode shows on the
/// last stage's encoder track, beside its own steps.
#[test]
fn the_tower_on_another_stage_gives_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    big_png(&dir.path().join("big.png"));
    let prompts = dir.path().join("prompts.jsonl");
    let image_chat = r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "big.png"}}, {"type": "text", "text": "What is it?"}]}], "thinking": "disabled"}"#;
    std::fs::write(&prompts, format!("{{\"prompt\": \"Count with me: 1, 2, 3,\"}}\n{image_chat}\n")).unwrap();
    let model = m3c_tests::fixture("tiny-m3");
    let mixed = ["--prompts", prompts.to_str().unwrap(), "--max-new-tokens", "24", "--ignore-eos"];
    let mut runs: Vec<Vec<Vec<u8>>> = Vec::new();
    for (name, out) in [("first", crate::shared::tiny(3).0), ("last", crate::shared::tiny_tower_on_last())] {
        let d = dir.path().join(name);
        std::fs::create_dir(&d).unwrap();
        let (m, trace) = (d.join("m.safetensors"), d.join("t.json"));
        let o = m3c_run(&out, &model, &[&mixed[..], &["--dump", m.to_str().unwrap(), "--trace", trace.to_str().unwrap()]].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let doc: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
        let tracks: Vec<u64> =
            doc["traceEvents"].as_array().unwrap().iter().filter(|e| e["cat"] == "encode").filter_map(|e| e["tid"].as_u64()).collect();
        assert_eq!(tracks, vec![if name == "first" { 1000 } else { 1002 }], "{name}: the encode's track");
        let read = |p: std::path::PathBuf| std::fs::read(p).unwrap();
        runs.push(vec![read(d.join("m.p0.safetensors")), read(d.join("m.p1.safetensors"))]);
    }
    assert!(runs[0] == runs[1], "the tower on the last stage changed the bytes");
}

/// Two encoder ranks of their own after two stages (`vision: {ranks: 2}`):
/// two image chats beside a text prompt give exactly the bytes of the tower
/// on the first stage (videos: `serve::a_video_chat_...`); the two images
/// go to the two ranks (both encoder tracks show in the timeline).
#[test]
fn encoder_ranks_of_their_own_give_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    big_png(&dir.path().join("big.png"));
    let small = m3c_tests::fixture("vision/A_rgb_56x84_noresize.png");
    let prompts = dir.path().join("prompts.jsonl");
    let chat = |url: &str| {
        format!(
            r#"{{"messages": [{{"role": "user", "content": [{{"type": "image_url", "image_url": {{"url": "{url}"}}}}, {{"type": "text", "text": "What is it?"}}]}}], "thinking": "disabled"}}"#
        )
    };
    let lines = [chat("big.png"), "{\"prompt\": \"Count with me: 1, 2, 3,\"}".to_string(), chat(small.to_str().unwrap())];
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();
    let model = m3c_tests::fixture("tiny-m3");
    let mixed = ["--prompts", prompts.to_str().unwrap(), "--max-new-tokens", "16", "--ignore-eos"];
    let mut runs: Vec<Vec<Vec<u8>>> = Vec::new();
    for (name, out) in [("first", crate::shared::tiny(2).0), ("ranks", crate::shared::tiny_encoder_ranks())] {
        let d = dir.path().join(name);
        std::fs::create_dir(&d).unwrap();
        let (m, trace) = (d.join("m.safetensors"), d.join("t.json"));
        let o = m3c_run(&out, &model, &[&mixed[..], &["--dump", m.to_str().unwrap(), "--trace", trace.to_str().unwrap()]].concat());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        if name == "ranks" {
            let log = stderr(&o);
            assert!(log.contains("m3c encoder 0/2: done") && log.contains("m3c encoder 1/2: done"), "{log}");
            let doc: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
            let mut tracks: Vec<u64> =
                doc["traceEvents"].as_array().unwrap().iter().filter(|e| e["cat"] == "encode").filter_map(|e| e["tid"].as_u64()).collect();
            tracks.sort();
            assert_eq!(tracks, vec![1002, 1003], "one image per encoder rank (ranks 2 and 3)");
            // Stage 0 stepped the text prompt while an image encoded on its
            // rank. That shows for an encode long enough to hold a step
            // (200 ms; trace times are in µs) that began before the text
            // prompt's last step: on a loaded machine an image can reach
            // its rank after the text's 16 tokens are done. The text
            // prompt is the sequence no encode carries; its last step is
            // the last one that carries it (an image's own prefill comes
            // after its encode, so "any step" would not do). Had encodes
            // held stage 0 up, the text's steps would come after such an
            // encode, so it would begin before the last one and hold none.
            let (encodes, steps) = spans(&trace);
            let imaged = image_seqs(&trace);
            let text: Vec<f64> = steps.iter().filter(|(n, ..)| n != "vision").map(|(_, a, ..)| *a).collect();
            let last = steps
                .iter()
                .filter(|(n, _, _, seqs)| n != "vision" && seqs.iter().any(|q| !imaged.contains(q)))
                .map(|(_, a, ..)| *a)
                .fold(f64::MIN, f64::max);
            let inside = |(from, to): Span| text.iter().filter(|&&a| a >= from && a < to).count();
            let early: Vec<Span> = encodes.iter().copied().filter(|&(from, to)| from < last && to - from > 200_000.0).collect();
            let most = early.iter().map(|&e| inside(e)).max().unwrap_or(0);
            eprintln!("ranks: {most} of stage 0's steps ran during an encode on an encoder rank ({encodes:?} for {imaged:?}, text's last step at {last})");
            assert!(early.is_empty() || most > 0, "no step of stage 0 ran while an image encoded on its rank");
        }
        let read = |p: std::path::PathBuf| std::fs::read(p).unwrap();
        runs.push(vec![read(d.join("m.p0.safetensors")), read(d.join("m.p1.safetensors")), read(d.join("m.p2.safetensors"))]);
    }
    assert!(runs[0] == runs[1], "encoder ranks of their own changed the bytes");
}
