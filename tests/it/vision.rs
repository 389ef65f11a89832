//! The image processor against the reference's outputs
//! (`tests/fixtures/vision/processor_golden.*`, transformers 5.24): the RGB
//! conversion, torchvision's resize and the `pixel_values` of each PNG,
//! exactly; the `smart_resize` table; and bad images refused with a reason.

use m3c::vision::processor::{self, ImageError};
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
    type D = *const u64;
    let name = format!("_mlir_ciface_{symbol}");
    let p: Vec<D> = args.iter().map(|a| a.as_ptr()).collect();
    // SAFETY: `_mlir_ciface_` symbols take one descriptor pointer per
    // argument; each descriptor covers a live buffer of the sizes it states.
    unsafe {
        match p.len() {
            2 => lib.get::<unsafe extern "C" fn(D, D)>(name.as_bytes()).unwrap()(p[0], p[1]),
            3 => lib.get::<unsafe extern "C" fn(D, D, D)>(name.as_bytes()).unwrap()(p[0], p[1], p[2]),
            4 => lib.get::<unsafe extern "C" fn(D, D, D, D)>(name.as_bytes()).unwrap()(p[0], p[1], p[2], p[3]),
            5 => lib.get::<unsafe extern "C" fn(D, D, D, D, D)>(name.as_bytes()).unwrap()(p[0], p[1], p[2], p[3], p[4]),
            n => panic!("{symbol}: {n} arguments"),
        }
    }
}

/// The tiny fixture's vision program, as m3c fuses it for the host, run
/// call by call on the compiled kernels: each intermediate the reference
/// recorded (patch embeddings, the pre-LayerNorm output, each layer's
/// output, the projector's output, the merged image features) within 1e-5.
#[test]
fn the_compiled_vision_tower_matches_every_reference_intermediate() {
    use m3c::lower::Step;
    use m3c::source::ModelSource;
    use m3c_kernels::MemTy;
    let dir = fixture("tiny-m3");
    let cfg = &ModelSource::open(&dir).unwrap().config;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("plan.yaml"), "version: 1\nstages:\n  - layers: \"0-7\"\n").unwrap();
    let plan = m3c::plan::load_plan(&tmp.path().join("plan.yaml"), Some(cfg)).unwrap();
    let prog = m3c::compile::lower_all(cfg, &plan, m3c::lower::Storages::default()).unwrap().remove(0);
    let vision = prog.vision.clone().expect("the embedding's stage holds the vision tower");
    let used: Vec<m3c_kernels::Kernel> = prog
        .kernels
        .iter()
        .filter(|k| vision.steps.iter().any(|s| matches!(s, Step::Call { kernel, .. } if kernel == *k)))
        .cloned()
        .collect();
    let lib = crate::host_kernels::build(&used, tmp.path());
    let ck = m3c::weights::Checkpoint::open(&dir).unwrap();
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
                use m3c::lower::fuse::Arg;
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
            Step::ImageRows { .. } => panic!("image rows in the vision entry"),
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
        assert!(d <= 1e-5, "{name}: off by {d}");
    }
}
