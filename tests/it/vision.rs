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
