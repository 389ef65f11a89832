//! The image processor against the reference's outputs
//! (`tests/fixtures/vision/processor_golden.*`, transformers 5.24): the RGB
//! conversion, torchvision's resize and the `pixel_values` of each PNG,
//! exactly; the `smart_resize` table; and bad images refused with a reason.

use m3c_front::vision::processor::{self, ImageError};
use m3c_tests::fixture;

fn tensor(name: &str) -> (Vec<usize>, Vec<u8>) {
    let bytes = std::fs::read(fixture("vision/processor_golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap_or_else(|_| panic!("no {name}"));
    (t.shape().to_vec(), t.data().to_vec())
}

#[test]
fn every_golden_png_gives_the_references_pixel_values_exactly() {
    for case in ["A_rgb_56x84_noresize", "B_rgb_70x126_roundhalfeven", "C_gray_30x20_minpixels", "D_rgba_28x56_alpha"] {
        let png = std::fs::read(fixture(&format!("vision/{case}.png"))).unwrap();
        let rgb = processor::decode(&png, case).unwrap();
        let (shape, want_rgb) = tensor(&format!("{case}.rgb_hwc_uint8"));
        assert_eq!((rgb.h, rgb.w), (shape[0], shape[1]), "{case}: size");
        assert_eq!(rgb.data, want_rgb, "{case}: RGB (alpha over white, grey replicated)");
        let (rs, want_resized) = tensor(&format!("{case}.resized_chw_uint8"));
        let (oh, ow) = processor::smart_resize(rgb.h, rgb.w, case).unwrap();
        assert_eq!((oh, ow), (rs[1], rs[2]), "{case}: smart_resize");
        let chw = processor::to_chw(&rgb);
        let resized = if (oh, ow) == (rgb.h, rgb.w) { chw } else { processor::resize_chw(&chw, rgb.h, rgb.w, oh, ow) };
        let worst = resized.iter().zip(&want_resized).map(|(a, b)| (*a as i32 - *b as i32).abs()).max().unwrap();
        assert_eq!(worst, 0, "{case}: the resized pixels (torchvision's fixed-point bicubic)");
        let got = processor::process(&png, case).unwrap();
        let (ps, pv) = tensor(&format!("{case}.pixel_values"));
        let want: Vec<f32> = pv.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got.patches(), ps[0], "{case}: rows");
        let diff = got.pixel_values.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert_eq!(diff, 0.0, "{case}: pixel_values");
        let (_, grid) = tensor(&format!("{case}.image_grid_thw"));
        let grid: Vec<usize> = grid.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as usize).collect();
        assert_eq!(got.grid.to_vec(), grid, "{case}: grid");
    }
}

#[test]
fn smart_resize_matches_the_references_table() {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture("vision/processor_golden.json")).unwrap()).unwrap();
    let table = json["smart_resize_table"].as_array().unwrap();
    assert!(table.len() > 10);
    for row in table {
        let hw = |k: &str| (row[k][0].as_u64().unwrap() as usize, row[k][1].as_u64().unwrap() as usize);
        let (h, w) = hw("in_hw");
        match row.get("resized_hw").filter(|v| v.is_array()) {
            Some(_) => assert_eq!(processor::smart_resize(h, w, "t").unwrap(), hw("resized_hw"), "{h}×{w}"),
            None => assert!(processor::smart_resize(h, w, "t").is_err(), "{h}×{w} should be refused: {row}"),
        }
    }
}

#[test]
fn bad_images_are_refused_with_a_reason() {
    let e = processor::process(b"not an image", "cat.png").unwrap_err();
    assert!(matches!(e, ImageError::Decode { .. }) && e.to_string().contains("cat.png"), "{e}");
    let png = std::fs::read(fixture("vision/A_rgb_56x84_noresize.png")).unwrap();
    let e = processor::process(&png[..png.len() / 2], "half.png").unwrap_err();
    assert!(e.to_string().contains("half.png"), "{e}");
    let e = processor::process_rgb(&processor::Rgb { h: 1, w: 300, data: vec![0; 900] }, "strip.png").unwrap_err();
    assert!(matches!(e, ImageError::Aspect { .. }) && e.to_string().contains("200"), "{e}");
}

/// A memref descriptor of any rank, as MLIR's C interface passes it:
/// allocated and aligned pointers, offset, sizes, strides.
fn descriptor(ptr: *const u8, sizes: &[usize]) -> Vec<u64> {
    let mut d = vec![ptr as u64, ptr as u64, 0];
    d.extend(sizes.iter().map(|&s| s as u64));
    let mut stride = 1usize;
    let mut strides = vec![0u64; sizes.len()];
    for i in (0..sizes.len()).rev() {
        strides[i] = stride as u64;
        stride *= sizes[i];
    }
    d.extend(strides);
    d
}

/// Calls a kernel's C interface with one descriptor per argument.
fn call(lib: &libloading::Library, symbol: &str, args: &[Vec<u64>]) {
    let p: Vec<*const std::ffi::c_void> = args.iter().map(|a| a.as_ptr().cast()).collect();
    // SAFETY: `_mlir_ciface_` symbols take one descriptor pointer per
    // argument; each descriptor covers a live buffer of the sizes it states.
    unsafe { crate::host_kernels::call_symbol(lib, symbol, &p) }
}

/// The tiny fixture's vision program, as m3c fuses it for the host, run
/// call by call on the compiled kernels: each intermediate the reference
/// recorded (patch embeddings, the pre-LayerNorm output, each layer's
/// output, the projector's output, the merged image features) within 1e-5.
#[test]
fn the_compiled_vision_tower_matches_every_reference_intermediate() {
    use m3c_compiler::lower::Step;
    use m3c_compiler::source::ModelSource;
    use m3c_kernels::MemTy;
    let dir = fixture("tiny-m3");
    let cfg = &ModelSource::open(&dir).unwrap().config;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("plan.yaml"), "version: 1\nstages:\n  - layers: \"0-7\"\n").unwrap();
    let plan = m3c_compiler::plan::load_plan(&tmp.path().join("plan.yaml"), Some(cfg)).unwrap();
    let prog = m3c_compiler::compile::lower_all(cfg, &plan, m3c_compiler::lower::Storages::default(), None, "x86-64-v3").unwrap().remove(0);
    let vision = prog.vision.clone().expect("the embedding's stage holds the vision tower");
    let used: Vec<m3c_kernels::Kernel> = prog
        .kernels
        .iter()
        .filter(|k| vision.steps.iter().any(|s| matches!(s, Step::Call { kernel, .. } if kernel == *k)))
        .cloned()
        .collect();
    let lib = crate::host_kernels::build(&used, tmp.path());
    let ck = m3c_compiler::weights::Checkpoint::open(&dir).unwrap();
    let golden = dir.join("golden.safetensors");
    let (_, pixels) = m3c_tests::read_tensor_f32(&golden, "mm_pixel_values");
    let grid = m3c_tests::read_tensor_i64(&golden, "mm_image_grid_thw");
    let im = m3c_contract::images::SeqImages { grids: vec![[grid[0] as usize, grid[1] as usize, grid[2] as usize]], pixels };
    let (ppos, segs) = (im.positions(), im.segment_ends());
    let p = im.patches();
    let mut rows = p;
    let mut bufs: std::collections::HashMap<usize, Vec<f32>> = Default::default();
    let mut out = Vec::new();
    let mut seen: Vec<(String, Vec<f32>)> = Vec::new();
    for step in &vision.steps {
        match step {
            Step::Alloc { id, width, elem } => {
                assert_eq!(*elem, "f32");
                bufs.insert(*id, vec![0f32; rows * width]);
            }
            Step::Free { id, .. } => {
                bufs.remove(id);
            }
            Step::Regroup { from, to, factor, .. } => {
                let b = bufs.remove(from).unwrap();
                bufs.insert(*to, b);
                rows /= factor;
            }
            Step::CopyToX { id, .. } => out = bufs[id].clone(),
            Step::Call { kernel, args, what, .. } => {
                use m3c_compiler::lower::fuse::Arg;
                let descs: Vec<Vec<u64>> = args
                    .iter()
                    .map(|a| match a {
                        Arg::Buf { id, width, .. } => descriptor(bufs[id].as_ptr() as *const u8, &[rows, *width]),
                        Arg::Pixels { row } => descriptor(im.pixels.as_ptr() as *const u8, &[p, *row]),
                        Arg::PatchPos => descriptor(ppos.as_ptr() as *const u8, &[p, 3]),
                        Arg::Segments => descriptor(segs.as_ptr() as *const u8, &[p]),
                        Arg::Weight { slot, ty } => {
                            let MemTy { dims, .. } = ty;
                            let dims: Vec<usize> = dims.iter().map(|d| d.unwrap()).collect();
                            descriptor(ck.bytes(&ck.tensors[&prog.tensors[*slot].name]).as_ptr(), &dims)
                        }
                        other => panic!("{what}: unexpected argument {other}"),
                    })
                    .collect();
                call(&lib, &kernel.symbol(), &descs);
                if let Some(Arg::Buf { id, .. }) = args.last() {
                    seen.push((what.clone(), bufs[id].clone()));
                }
            }
            Step::ImageRows { .. } | Step::CopyAux { .. } => panic!("{step} in the vision entry"),
        }
    }
    let inter = fixture("vision/tiny_m3_vision_intermediates.safetensors");
    let after = |pred: &dyn Fn(&str) -> bool, nth: usize| -> &Vec<f32> {
        &seen.iter().filter(|(w, _)| pred(w)).nth(nth).unwrap_or_else(|| panic!("no call #{nth} of that kind")).1
    };
    let adds = |n| after(&|w: &str| w.starts_with("vision add"), n);
    let checks: Vec<(&str, &Vec<f32>)> = vec![
        ("patch_embeds", after(&|w: &str| w.contains("patch_embedding"), 0)),
        ("hidden_0", after(&|w: &str| w.contains("pre_layrnorm"), 0)),
        ("hidden_1", adds(1)),
        ("hidden_2", adds(3)),
        ("projector_out", after(&|w: &str| w.contains("bias") && w.contains("multi_modal_projector.linear_2"), 0)),
        ("image_embeds", &out),
    ];
    for (name, got) in checks {
        let (_, want) = m3c_tests::read_tensor_f32(&inter, name);
        assert_eq!(got.len(), want.len(), "{name}: size");
        let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("vision intermediate {name}: max |Δ| {d:.2e}");
        assert!(d <= 1e-5, "{name}: off by {d}");
    }
}

/// The tiny golden's image input (`mm_pixel_values`, `mm_image_grid_thw`:
/// random values, not a picture) as the images file a stage reads, for
/// sequence 0.
fn golden_images_file(dir: &std::path::Path) -> std::path::PathBuf {
    let golden = fixture("tiny-m3").join("golden.safetensors");
    let (_, pixels) = m3c_tests::read_tensor_f32(&golden, "mm_pixel_values");
    let g = m3c_tests::read_tensor_i64(&golden, "mm_image_grid_thw");
    let im = m3c_contract::images::SeqImages { grids: vec![[g[0] as usize, g[1] as usize, g[2] as usize]], pixels };
    let path = dir.join("golden-images.safetensors");
    m3c_front::vision::prompt::write_images_file(&path, &std::collections::BTreeMap::from([(0usize, im)])).unwrap();
    path
}

/// The stage executables run by hand (OUT/run.sh) with `args`.
fn run_stages(out: &std::path::Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(out.join("run.sh")).args(args).output().unwrap()
}

/// The reference's image + text prefill through the compiled stages: the
/// prefill logits within 1e-3 of `mm_logits` at pp = 1, 2 and 4, the same
/// bytes at every pp (greedy decode after the image included), and the same
/// bytes when a text-only prompt shares its micro-batches, whole or in
/// prefill chunks that split the image's placeholder run.
#[test]
fn image_prompts_match_the_golden_at_every_pp_and_beside_text_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tiny-m3");
    let golden = model.join("golden.safetensors");
    let images = golden_images_file(dir.path());
    let ids = m3c_tests::ids_arg(&m3c_tests::read_tensor_i64(&golden, "mm_input_ids"));
    let text = m3c_tests::ids_arg(&m3c_tests::read_tensor_i64(&golden, "prompt_ids"));
    let (_, want) = m3c_tests::read_tensor_f32(&golden, "mm_logits");
    let m = model.to_str().unwrap();
    let mut first: Option<Vec<u8>> = None;
    for pp in [1, 2, 4] {
        let d = dir.path().join(format!("pp{pp}"));
        std::fs::create_dir(&d).unwrap();
        let out = crate::shared::out("tiny-m3", pp);
        let dump = d.join("mm.safetensors");
        let base = ["--model", m, "--max-new-tokens", "6", "--images", images.to_str().unwrap()];
        let o = run_stages(&out, &[&base[..], &["--prompt-ids", &ids, "--dump", dump.to_str().unwrap()]].concat());
        assert!(o.status.success(), "pp={pp}: {}", String::from_utf8_lossy(&o.stderr));
        let got = m3c_tests::read_tensor_f32(&dump, "prefill_logits").1;
        let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("pp={pp}: mm_logits max |Δ| {diff:.2e}");
        assert!(diff <= 1e-3, "pp={pp}: mm_logits off by {diff}");
        let bytes = std::fs::read(&dump).unwrap();
        match &first {
            None => first = Some(bytes),
            Some(b) => assert!(*b == bytes, "pp={pp}: the image prompt's dump (prefill and greedy decode) differs from pp=1"),
        }
        if pp != 2 {
            continue;
        }
        let solo_text = d.join("text.safetensors");
        let o = run_stages(&out, &["--model", m, "--max-new-tokens", "6", "--prompt-ids", &text, "--dump", solo_text.to_str().unwrap()]);
        assert!(o.status.success());
        for extra in [&["--micro-batch", "2"][..], &["--micro-batch", "2", "--prefill-chunk", "7"][..]] {
            let both = d.join("both.safetensors");
            let args = [&base[..], &["--prompt-ids", &ids, "--prompt-ids", &text, "--dump", both.to_str().unwrap()], extra].concat();
            let o = run_stages(&out, &args);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let (p0, p1) = (d.join("both.p0.safetensors"), d.join("both.p1.safetensors"));
            assert!(std::fs::read(&p0).unwrap() == std::fs::read(&dump).unwrap(), "{extra:?}: the image prompt beside a text prompt");
            assert!(std::fs::read(&p1).unwrap() == std::fs::read(&solo_text).unwrap(), "{extra:?}: the text prompt beside an image prompt");
        }
    }
}

/// `m3c run --chat TEXT --image PNG` as a user runs it: the prompt is the
/// reference processor's ids (the tokenizer golden's image chat, its image
/// drawn by the recorded rule), and pp = 2 prints and dumps what pp = 1 does.
#[test]
fn an_image_chat_runs_as_the_reference_processor_prompts_it() {
    use m3c_tests::{stderr, stdout};
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tiny-m3");
    let golden: serde_json::Value = serde_json::from_slice(&std::fs::read(model.join("tokenizer_golden.json")).unwrap()).unwrap();
    let case = &golden["processor"];
    // "R = 3*x, G = 4*y, B = 128 for column x in 0..83, row y in 0..55"
    let (w, h) = (84usize, 56usize);
    let rgb: Vec<u8> = (0..h).flat_map(|y| (0..w).flat_map(move |x| [(3 * x) as u8, (4 * y) as u8, 128])).collect();
    let png = dir.path().join("rule.png");
    image::save_buffer(&png, &rgb, w as u32, h as u32, image::ExtendedColorType::Rgb8).unwrap();
    let mut dumps = Vec::new();
    for pp in [1, 2] {
        let d = dir.path().join(format!("pp{pp}"));
        std::fs::create_dir(&d).unwrap();
        let out = crate::shared::out("tiny-m3", pp);
        let dump = d.join("d.safetensors");
        let o = m3c_tests::m3c_run(
            &out,
            &model,
            &[
                "--chat",
                "What is in this picture?",
                "--system",
                "You are a helpful assistant.",
                "--thinking",
                "disabled",
                "--image",
                png.to_str().unwrap(),
                "--max-new-tokens",
                "5",
                "--dump",
                dump.to_str().unwrap(),
            ],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        let want: Vec<i64> = case["input_ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
        assert_eq!(m3c_tests::read_tensor_i64(&dump, "prompt_ids"), want, "pp={pp}: the image chat's prompt ids");
        dumps.push((stdout(&o), std::fs::read(&dump).unwrap()));
    }
    assert!(dumps[0] == dumps[1], "pp=2 differs from pp=1");
}

/// Bad image input is a clear error and a non-zero exit: a corrupt file, a
/// placeholder run of the wrong length (the expected count named), an
/// extreme aspect ratio, an image too large for the context, an images
/// file that does not match the prompt, and images for a deployment
/// compiled without the vision tower.
#[test]
fn bad_image_input_is_a_clear_error() {
    use m3c_tests::{ids_arg, m3c, stderr};
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("tiny-m3");
    let png = fixture("vision/A_rgb_56x84_noresize.png");
    let out = crate::shared::out("tiny-m3", 1);
    let fails = |extra: &[&str]| -> String {
        let mut a = vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap()];
        a.extend_from_slice(extra);
        if !extra.contains(&"--max-new-tokens") {
            a.extend_from_slice(&["--max-new-tokens", "2"]);
        }
        let o = m3c(&a);
        assert_eq!(o.status.code(), Some(1), "{extra:?} should fail: {}", stderr(&o));
        stderr(&o)
    };
    let run_of = |n: usize| -> String {
        let mut ids = vec![1i64, 2, 502];
        ids.extend(std::iter::repeat_n(500, n));
        ids.extend([503, 3]);
        ids_arg(&ids)
    };
    // The 56×84 image takes (56/28)·(84/28) = 6 tokens.
    let ok = m3c_tests::m3c_run(&out, &model, &["--max-new-tokens", "2", "--prompt-ids", &run_of(6), "--image", png.to_str().unwrap()]);
    assert!(ok.status.success(), "{}", stderr(&ok));
    let e = fails(&["--prompt-ids", &run_of(7), "--image", png.to_str().unwrap()]);
    assert!(e.contains("takes 6 placeholder tokens") && e.contains("has 7"), "{e}");
    let corrupt = dir.path().join("corrupt.png");
    std::fs::write(&corrupt, b"\x89PNG\r\n\x1a\nnot really").unwrap();
    let e = fails(&["--chat", "hi", "--image", corrupt.to_str().unwrap()]);
    assert!(e.contains("corrupt.png") && e.contains("not an image"), "{e}");
    let thin = dir.path().join("thin.png");
    image::save_buffer(&thin, &vec![9u8; 300 * 3], 300, 1, image::ExtendedColorType::Rgb8).unwrap();
    let e = fails(&["--chat", "hi", "--image", thin.to_str().unwrap()]);
    assert!(e.contains("thin.png") && e.contains("200"), "{e}");
    let big = dir.path().join("big.png");
    image::save_buffer(&big, &vec![90u8; 672 * 672 * 3], 672, 672, image::ExtendedColorType::Rgb8).unwrap();
    let e = fails(&["--chat", "hi", "--image", big.to_str().unwrap(), "--max-new-tokens", "4000"]);
    assert!(e.contains("big.png takes 576") && e.contains("context of 4096"), "{e}");
    let e = fails(&["--chat", "a", "--chat", "b", "--image", png.to_str().unwrap()]);
    assert!(e.contains("exactly one"), "{e}");
    // The stages check an images file against the prompt too.
    let images = golden_images_file(dir.path());
    let o = run_stages(
        &out,
        &["--model", model.to_str().unwrap(), "--max-new-tokens", "2", "--prompt-ids", "1,2,500,3", "--images", images.to_str().unwrap()],
    );
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("1 image and video placeholder(s)") && e.contains("make 4 tokens"), "{e}");
    let o = run_stages(&out, &["--model", model.to_str().unwrap(), "--max-new-tokens", "2", "--prompt-ids", "1,2,500,3"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("but no image"), "{e}");
    // A text-only deployment (`vision: false`) refuses images.
    let plan = dir.path().join("text-only.yaml");
    std::fs::write(&plan, "version: 1\nstages:\n  - layers: \"0-7\"\n    vision: false\n").unwrap();
    let t = dir.path().join("t");
    let o = m3c(&["compile", plan.to_str().unwrap(), "--model", model.to_str().unwrap(), "--pp", "1", "-o", t.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run_stages(
        &t,
        &["--model", model.to_str().unwrap(), "--max-new-tokens", "2", "--prompt-ids", &run_of(4), "--images", images.to_str().unwrap()],
    );
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("without the vision tower"), "{e}");
    let o = m3c_tests::m3c_run(&t, &model, &["--max-new-tokens", "2", "--chat", "hi", "--image", png.to_str().unwrap()]);
    assert!(o.status.code() == Some(1) && stderr(&o).contains("compiled without the vision tower"), "{}", stderr(&o));
}

/// `m3c run --prompts FILE.jsonl` with an image chat beside a text chat, in
/// one micro-batch at pp = 2: each prompt's dump equals its solo run's
/// (`--chat --image` and `--chat`), bytes included.
#[test]
fn a_jsonl_image_chat_beside_a_text_chat_gets_its_solo_result() {
    use m3c_tests::{m3c, stderr};
    let dir = tempfile::tempdir().unwrap();
    let (out, model) = crate::shared::tiny(2);
    std::fs::copy(fixture("vision/B_rgb_70x126_roundhalfeven.png"), dir.path().join("b.png")).unwrap();
    let lines = [
        r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "b.png"}}, {"type": "text", "text": "What is this?"}]}], "thinking": "disabled"}"#,
        r#"{"messages": [{"role": "user", "content": "Hello there"}], "thinking": "disabled"}"#,
    ];
    let jsonl = dir.path().join("prompts.jsonl");
    std::fs::write(&jsonl, lines.join("\n")).unwrap();
    let run = |extra: &[&str], dump: &str| {
        let d = dir.path().join(dump);
        let mut a =
            vec!["run", out.to_str().unwrap(), "--model", model.to_str().unwrap(), "--max-new-tokens", "6", "--dump", d.to_str().unwrap()];
        a.extend_from_slice(extra);
        let o = m3c(&a);
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
    };
    run(&["--prompts", jsonl.to_str().unwrap(), "--micro-batch", "2"], "both.safetensors");
    let png = dir.path().join("b.png");
    run(&["--chat", "What is this?", "--thinking", "disabled", "--image", png.to_str().unwrap()], "image.safetensors");
    run(&["--chat", "Hello there", "--thinking", "disabled"], "text.safetensors");
    let read = |f: &str| std::fs::read(dir.path().join(f)).unwrap();
    assert!(read("both.p0.safetensors") == read("image.safetensors"), "the JSONL image chat differs from its solo run");
    assert!(read("both.p1.safetensors") == read("text.safetensors"), "the JSONL text chat differs from its solo run");
    // The image's run: 70×126 resizes to 56×112, 2·4 = 8 tokens.
    let ids = m3c_tests::read_tensor_i64(&dir.path().join("image.safetensors"), "prompt_ids");
    assert_eq!(ids.iter().filter(|&&i| i == 500).count(), 8);
}
