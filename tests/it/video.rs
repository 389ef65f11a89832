//! Videos against the reference (`tests/fixtures/video`, made by its
//! `make_golden.py` with transformers 5.24 and PyAV): FFmpeg's frames equal
//! PyAV's, `pixel_values_videos`, `video_grid_thw` and the expanded prompt
//! equal the processor's, the tiny model's logits with the video are within
//! 1e-3 of the reference's at pp 1 and 3 (the same bytes at both), and bad
//! videos are refused with a reason.

use m3c_front::vision::video::{self, VideoError, VideoLimits};
use m3c_tests::{fixture, read_tensor_f32, read_tensor_i64};

fn golden() -> std::path::PathBuf {
    fixture("video/golden.safetensors")
}

fn golden_json() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture("video/golden.json")).unwrap()).unwrap()
}

fn clip() -> std::path::PathBuf {
    fixture("video/clip.mp4")
}

#[test]
fn the_clip_gives_the_references_frames_pixel_values_and_prompt() {
    let limits = VideoLimits::default();
    let (rgb, frames, fps) = video::sampled_frames(&clip(), &limits, "clip.mp4").unwrap();
    let info = golden_json();
    let want_frames: Vec<usize> = info["frames_indices"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    assert_eq!(frames, want_frames, "sampled frames (1 fps of a 4 fps stream)");
    assert_eq!(fps, 4.0);
    // PyAV's rgb24 frames, all 36: each sampled one must be equal, byte for byte.
    let st_bytes = std::fs::read(golden()).unwrap();
    let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
    let all = st.tensor("frames").unwrap();
    let (h, w) = (all.shape()[1], all.shape()[2]);
    for (f, &i) in rgb.iter().zip(&frames) {
        assert_eq!((f.h, f.w), (h, w));
        assert!(f.data == all.data()[i * h * w * 3..(i + 1) * h * w * 3], "frame {i}: RGB differs from PyAV's");
    }
    let v = video::process_file(&clip(), &limits, "clip.mp4").unwrap();
    let grids: Vec<i64> = v.grids.iter().flatten().map(|&g| g as i64).collect();
    assert_eq!(grids, read_tensor_i64(&golden(), "video_grid_thw"), "video_grid_thw: 5 temporal patches in chunks of 4 and 1");
    let (shape, want) = read_tensor_f32(&golden(), "pixel_values_videos");
    assert_eq!(v.pixel_values.len(), shape[0] * shape[1]);
    let diff = v.pixel_values.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(diff <= 1e-6, "pixel_values_videos off by {diff}");
    // The prompt: the video's text put in before tokenizing, so the first
    // timestamp is tokenized with the `:` before it, as the reference does.
    let tok = m3c_front::text::TextTokenizer::from_dir(&fixture("tiny-m3")).unwrap();
    let text = video::expand_text(
        info["prompt"].as_str().unwrap(),
        std::slice::from_ref(&v),
        &m3c_contract::chat_format::ChatFormat::of_family("minimax_m3").unwrap().media,
    )
    .unwrap();
    assert_eq!(text, info["text"].as_str().unwrap());
    let ids: Vec<i64> = tok.encode(&text).unwrap().into_iter().map(i64::from).collect();
    assert_eq!(ids, read_tensor_i64(&golden(), "input_ids"), "the expanded prompt's ids");
}

#[test]
fn bad_videos_are_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let limits = VideoLimits::default();
    let e = video::process_bytes(b"not a video at all", &limits, "junk.mp4").unwrap_err();
    assert!(matches!(e, VideoError::Decode { .. }) && e.to_string().starts_with("junk.mp4: not a video"), "{e}");
    // A still image is a video of one frame (as FFmpeg, and so vLLM, reads it).
    let png = std::fs::read(fixture("vision/A_rgb_56x84_noresize.png")).unwrap();
    assert_eq!(video::process_bytes(&png, &limits, "a.png").unwrap().grids, vec![[1, 4, 6]]);
    // The clip cut in half: its index is at the end, so nothing can be read.
    let bytes = std::fs::read(clip()).unwrap();
    let e = video::process_bytes(&bytes[..bytes.len() / 2], &limits, "half.mp4").unwrap_err();
    assert!(e.to_string().contains("half.mp4"), "{e}");
    // Bounds: length, frame size, pixels of all frames.
    let e = video::process_file(&clip(), &VideoLimits { max_seconds: 5.0, ..limits.clone() }, "clip.mp4").unwrap_err();
    assert_eq!(e.to_string(), "clip.mp4: 9.0 s of video; the most m3c takes is 5 s");
    let e = video::process_file(&clip(), &VideoLimits { max_frame_pixels: 1000, ..limits.clone() }, "clip.mp4").unwrap_err();
    assert!(matches!(e, VideoError::FrameTooLarge { w: 64, h: 48, .. }), "{e}");
    let e = video::process_file(&clip(), &VideoLimits { total_pixels: 20000, ..limits.clone() }, "clip.mp4").unwrap_err();
    assert!(e.to_string().contains("9 sampled frames of 56×56 are 31360 pixels"), "{e}");
    // Fewer placeholders than videos.
    let v = video::process_file(&clip(), &limits, "clip.mp4").unwrap();
    let e = video::expand_text("no video token here", &[v], &m3c_contract::chat_format::ChatFormat::of_family("minimax_m3").unwrap().media)
        .unwrap_err();
    assert_eq!(e.to_string(), "the prompt has 0 video placeholder(s) (`]<]video[>[`) but 1 video(s) were given");
    // The CLI: a file that is not a video names it and exits non-zero.
    let junk = dir.path().join("junk.mp4");
    std::fs::write(&junk, b"\x00\x00\x00\x18ftypmp42 garbage").unwrap();
    let (out, model) = crate::shared::tiny(1);
    let o = m3c_tests::m3c_run(&out, &model, &["--prompt", "A ]<]video[>[", "--max-new-tokens", "2", "--video", junk.to_str().unwrap()]);
    m3c_tests::fails_with(&o, &["junk.mp4", "not a video"]);
    let o = m3c_tests::m3c_run(&out, &model, &["--prompt-ids", "1,2", "--max-new-tokens", "2", "--video", clip().to_str().unwrap()]);
    m3c_tests::fails_with(&o, &["--video goes with exactly one --prompt"]);
}

/// `m3c run --prompt TEXT --video clip.mp4`: the prompt is the reference
/// processor's, the prefill logits are within 1e-3 of the reference's, and
/// pp 3 dumps exactly what pp 1 does (prefill and greedy decode after it).
#[test]
fn a_video_prompt_matches_the_golden_at_pp_1_and_3() {
    let dir = tempfile::tempdir().unwrap();
    let info = golden_json();
    let (_, want) = read_tensor_f32(&golden(), "video_logits");
    let mut first: Option<(String, Vec<u8>)> = None;
    for pp in [1, 3] {
        let (out, model) = crate::shared::tiny(pp);
        let dump = dir.path().join(format!("pp{pp}.safetensors"));
        let o = m3c_tests::m3c_run(
            &out,
            &model,
            &[
                "--prompt",
                info["prompt"].as_str().unwrap(),
                "--video",
                clip().to_str().unwrap(),
                "--max-new-tokens",
                "6",
                "--dump",
                dump.to_str().unwrap(),
            ],
        );
        assert!(o.status.success(), "pp={pp}: {}", m3c_tests::stderr(&o));
        assert_eq!(read_tensor_i64(&dump, "prompt_ids"), read_tensor_i64(&golden(), "input_ids"), "pp={pp}: prompt ids");
        let got = read_tensor_f32(&dump, "prefill_logits").1;
        assert_eq!(got.len(), want.len());
        let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("pp={pp}: video_logits max |Δ| {diff:.2e}");
        assert!(diff <= 1e-3, "pp={pp}: video logits off by {diff}");
        let now = (m3c_tests::stdout(&o), std::fs::read(&dump).unwrap());
        match &first {
            None => first = Some(now),
            Some(f) => assert!(*f == now, "pp={pp}: output or dump differs from pp=1"),
        }
    }
}
