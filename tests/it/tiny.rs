use m3c_compiler::family::load_config;
use m3c_compiler::weights::{bind, Checkpoint};
use m3c_tests::{m3c, stderr};

fn init(dir: &std::path::Path, name: &str, extra: &[&str]) -> std::path::PathBuf {
    let out = dir.join(name);
    let mut args = vec!["init-tiny", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    let o = m3c(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    out
}

#[test]
fn init_tiny_binds_and_is_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    for flags in [&["--seed", "3"][..], &["--seed", "3", "--mxfp8"], &["--seed", "3", "--layers", "2", "--hidden", "256"]] {
        let a = init(dir.path(), "a", flags);
        let b = init(dir.path(), "b", flags);
        for f in ["config.json", "model.safetensors"] {
            assert_eq!(std::fs::read(a.join(f)).unwrap(), std::fs::read(b.join(f)).unwrap(), "{f} differs for {flags:?}");
        }
        let cfg = load_config(&a.join("config.json")).unwrap();
        let ck = Checkpoint::open(&a).unwrap();
        bind(&cfg, &ck, None).unwrap_or_else(|e| panic!("{flags:?}: {e}"));
        assert_eq!(cfg.is_mxfp8(), flags.contains(&"--mxfp8"));
        std::fs::remove_dir_all(&a).unwrap();
        std::fs::remove_dir_all(&b).unwrap();
    }
    let a = init(dir.path(), "s1", &["--seed", "1"]);
    let b = init(dir.path(), "s2", &["--seed", "2"]);
    assert_ne!(std::fs::read(a.join("model.safetensors")).unwrap(), std::fs::read(b.join("model.safetensors")).unwrap());
}

#[test]
fn init_tiny_refuses_to_overwrite_and_bad_sizes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keep.txt"), "x").unwrap();
    let o = m3c(&["init-tiny", dir.path().to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("already exists and is not empty"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(dir.path().join("keep.txt")).unwrap(), "x");
    let o = m3c(&["init-tiny", dir.path().join("x").to_str().unwrap(), "--hidden", "100"]);
    assert!(!o.status.success() && stderr(&o).contains("--hidden must be a positive multiple of 128"));
    assert!(!dir.path().join("x").exists(), "nothing half written");
}

#[test]
fn init_tiny_writes_the_fixture_tokenizer_so_text_prompts_work() {
    use m3c_front::text::TextTokenizer;
    let dir = tempfile::tempdir().unwrap();
    let a = init(dir.path(), "t", &["--seed", "1", "--layers", "2"]);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let fixture = m3c_tests::fixture("tiny-m3").join(f);
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(fixture).unwrap(),
            "{f}: not the fixture's (compiler/data/tiny-tokenizer is stale)"
        );
    }
    let tk = TextTokenizer::from_dir(&a).unwrap();
    let cfg = load_config(&a.join("config.json")).unwrap();
    assert_eq!(tk.vocab_size(), cfg.text.vocab_size, "the tokenizer covers the tiny model's vocabulary");
    assert!(m3c_front::text::ChatTemplate::from_dir(&a).unwrap().is_some(), "a chat template comes with it");
}
