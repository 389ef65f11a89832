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
