use m3c_tests::{configs, fixture, m3c, stderr, stdout};

#[test]
fn inspect_real_config_reports_exact_counts() {
    let o = m3c(&["inspect", configs("minimax-m3.config.json").to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    let total = s.lines().find(|l| l.trim_start().starts_with("total ")).expect("a total line");
    assert!(total.trim_end().ends_with(" 427,040,140,160"), "{total}");
    assert!(s.contains("0-2      full attention + dense MLP   (3 layers)"), "{s}");
    assert!(s.contains("3-59     MSA + MoE                    (57 layers)"), "{s}");
    let moe = s.lines().find(|l| l.trim_start().starts_with("layers 3-59 ")).expect("one row for the MoE layers");
    assert!(moe.contains("MSA + MoE") && moe.contains("7,416,066,688") && moe.ends_with("14.83 GB"), "{moe}");
}

#[test]
fn inspect_checkpoint_reads_bytes_from_files() {
    let o = m3c(&["inspect", fixture("tiny-m3-mxfp8").to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("read from 1 shard(s), all 526 tensors bound"), "{s}");
    assert!(s.contains("f8e4m3"), "{s}");
}

#[test]
fn bad_input_exits_non_zero_with_a_message() {
    let o = m3c(&["inspect", "/nonexistent/model"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("/nonexistent/model: no such file or folder"), "{}", stderr(&o));
    let o = m3c(&["plan", "--model", fixture("tiny-m3").to_str().unwrap(), "--pp", "2", "--gpu", "TPUv9"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--gpu TPUv9: unknown GPU; known: H200"), "{}", stderr(&o));
    let o = m3c(&["inspect", "--frobnicate"]);
    assert_eq!(o.status.code(), Some(2), "clap usage errors exit 2");
}

/// `m3c bench-kernels` builds the host linears it times (both weight
/// formats, prefill and decode rows), prints one row per case beside a
/// positive measured peak, and names a bad shape or weight type.
#[test]
fn bench_kernels_times_the_linears_and_names_bad_flags() {
    let o = m3c(&["bench-kernels", "--shapes", "40x64,8x96", "--weights", "bf16,mxfp8", "--rows", "7", "--seconds", "0.01"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    let peak: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix("FMA peak: "))
        .and_then(|l| l.split(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("a peak line");
    assert!(peak > 0.0, "{s}");
    for (shape, w, rows) in [("40x64", "bf16", "7"), ("40x64", "mxfp8", "1"), ("8x96", "mxfp8", "7"), ("8x96", "bf16", "1")] {
        let row = s.lines().find(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() == 7 && f[0] == shape && f[1] == w && f[2] == rows
        });
        let f: Vec<f64> = row
            .unwrap_or_else(|| panic!("no row for {shape} {w} {rows}:\n{s}"))
            .split_whitespace()
            .skip(4)
            .map(|v| v.trim_end_matches('%').parse().unwrap())
            .collect();
        assert!(f.iter().all(|v| *v > 0.0), "{s}");
    }
    let o = m3c(&["bench-kernels", "--shapes", "64x60"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--shapes: `64x60` needs OUT ≥ 1, IN a multiple of 32"), "{}", stderr(&o));
    let o = m3c(&["bench-kernels", "--weights", "int4"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--weights: `int4` is not bf16, mxfp8 or f32"), "{}", stderr(&o));
}
