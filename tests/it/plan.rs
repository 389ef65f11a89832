use m3c_compiler::config::ModelConfig;
use m3c_compiler::family::load_config;
use m3c_compiler::plan::{balance, brute_force, make_plan, parse_plan, table, GpuProfile, Item, Target, Workload};
use m3c_tests::{configs, fails_with, fixture, m3c, stderr, stdout};
use std::path::Path;

fn tiny() -> ModelConfig {
    load_config(&fixture("tiny-m3/config.json")).unwrap()
}

/// The error message of an invalid plan (fails if it is valid).
fn plan_error(text: &str) -> String {
    match parse_plan(Path::new("p.yaml"), text, Some(&tiny())) {
        Ok(p) => panic!("plan unexpectedly valid: {p:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn valid_plan_with_defaults() {
    let p = parse_plan(Path::new("dir/p.yaml"), "model: m\nstages:\n  - layers: 0-3\n  - layers: \"4-7\"\n", Some(&tiny())).unwrap();
    assert_eq!(p.target, Target::Host);
    assert_eq!(p.model.as_deref(), Some(Path::new("dir/m")));
    assert!(p.stages[0].embedding && !p.stages[0].lm_head);
    assert!(p.stages[1].final_norm && p.stages[1].lm_head && !p.stages[1].embedding);
    // A stage may hold only the head.
    let p = parse_plan(
        Path::new("p.yaml"),
        "target: cuda\nstages:\n  - layers: 0-7\n    device: 0\n  - lm_head: true\n    device: 1\n",
        Some(&tiny()),
    )
    .unwrap();
    assert_eq!(p.target, Target::Cuda { arch: "sm_90a".into() });
    assert!(p.stages[1].final_norm && p.stages[1].layers.is_none());
}

#[test]
fn plan_errors_point_at_line_and_column() {
    let cases: &[(&str, &str)] = &[
        ("stages:\n  - layers: 0-3\n    layerz: 4\n", "p.yaml:3:5: stages[0]: unknown field `layerz`"),
        ("stages:\n  - layers: 0-3\n  - layers: 5-7\n", "p.yaml:3:13: stage 1 starts at layer 5, so layer 4 is in no stage"),
        ("stages:\n  - layers: 0-4\n  - layers: 3-7\n", "p.yaml:3:13: stage 1: layers 3-7 overlap stage 0 (layers 0-4)"),
        ("stages:\n  - layers: 0-3\n  - layers: 4-9\n", "p.yaml:3:13: layer 9 is out of range: the model has 8 layers (0-7)"),
        ("stages:\n  - layers: 0-7\n  - host: b\n  - lm_head: true\n", "p.yaml:3:5: stage 1 is empty"),
        ("stages:\n  - layers: 0-5\n", "p.yaml:2:13: layers 6-7 are in no stage (the model has 8 layers)"),
        ("target: tpu\nstages:\n  - layers: 0-7\n", "p.yaml:1:9: unknown target \"tpu\""),
        ("target: cuda\narch: hopper\nstages:\n  - layers: 0-7\n", "p.yaml:2:7: `arch`: \"hopper\" is not a CUDA architecture"),
        ("stages:\n  - layers: 0-7\n    device: 1\n", "p.yaml:3:5: stage 0: `device` applies to the GPU targets (cuda, rocm) only"),
        ("stages:\n  - layers: 7-2\n", "p.yaml:2:13: layer range \"7-2\" is backwards"),
        ("stages:\n  - layers: [0, 7]\n", "p.yaml:2:13: `layers` must be a layer number or an inclusive range"),
        ("stages:\n  - layers: 0-3\n  - layers: 4-7\n    embedding: true\n", "p.yaml:4:5: the embedding must be on the first stage"),
        ("stages:\n  - layers: 0-3\n    lm_head: true\n  - layers: 4-7\n", "p.yaml:3:5: the lm_head must be on the last stage (stage 1)"),
        (
            "stages:\n  - layers: 0-3\n    final_norm: true\n  - layers: 4-7\n",
            "p.yaml:3:5: the final norm on stage 0 would run before layer 7 on stage 1",
        ),
        (
            "stages:\n  - layers: 0-3\n    lm_head: true\n  - layers: 4-7\n    lm_head: true\n",
            "p.yaml:5:5: `lm_head` is set on stages 0 and 1",
        ),
        (
            "stages:\n  - layers: 0-3\n    vision: true\n  - layers: 4-7\n    vision: true\n",
            "p.yaml:5:5: `vision` is set on stages 0 and 1: the tower lives on exactly one stage",
        ),
        (
            "stages:\n  - layers: 0-2\n  - layers: 3-5\n    vision: true\n  - layers: 6-7\n    vision: true\n",
            "p.yaml:6:5: `vision` is set on stages 1 and 2",
        ),
        ("stages: []\n", "p.yaml:1:9: `stages` is empty"),
        ("version: 2\nstages:\n  - layers: 0-7\n", "p.yaml:1:10: unsupported plan version 2"),
        ("stages:\n  - layers: 0-3\n   bad indent\n", "p.yaml:3:"),
        ("links:\n  ib: fast\nstages:\n  - layers: 0-7\n", "p.yaml:2:7: link `ib`: `fast`: expected BANDWIDTH, LATENCY"),
        ("links:\n  ib: 400 Gb, 5 us\nstages:\n  - layers: 0-7\n", "p.yaml:2:7: link `ib`: `400 Gb`: expected a bandwidth"),
        ("stages:\n  - layers: 0-3\n    link: ib\n  - layers: 4-7\n", "p.yaml:3:5: stage 0 has no stage before it"),
        ("stages:\n  - layers: 0-3\n  - layers: 4-7\n    link: ib\n", "p.yaml:4:11: stage 1: no link named `ib` (the plan has no `links`)"),
        (
            "links:\n  ib: 400 Gb/s, 5 us\n  eth: 100 Gb/s, 20 us\nstages:\n  - layers: 0-3\n    host: a\n  - layers: 4-7\n    host: b\n",
            "p.yaml:8:11: stages 0 and 1 are on different hosts and the plan has several links (eth, ib): say which",
        ),
    ];
    for (text, expected) in cases {
        let e = plan_error(text);
        assert!(e.starts_with(expected), "plan:\n{text}\nexpected: {expected}\ngot:      {e}");
    }
}

/// `m3c plan` refusals say what is wrong: a plan whose stage count is not
/// `--pp`, and a model that cannot fit the stages asked for (with how many would).
#[test]
fn plan_refusals_say_what_is_wrong() {
    let (pp2, real) = (configs("tiny-m3.pp2.yaml"), configs("minimax-m3.config.json"));
    let cases: [(Vec<&str>, &[&str]); 2] = [
        (vec!["plan", "--check", pp2.to_str().unwrap(), "--pp", "4"], &["tiny-m3.pp2.yaml:", "the plan has 2 stages but --pp 4 was given"]),
        (vec!["plan", "--model", real.to_str().unwrap(), "--pp", "4"], &["no split into 4 stages fits H200", "at least --pp 8"]),
    ];
    for (args, parts) in cases {
        fails_with(&m3c(&args), parts);
    }
}

#[test]
fn shipped_plans_validate() {
    for (plan, stages) in [
        ("tiny-m3.pp2.yaml", 2),
        ("tiny-m3.pp4.yaml", 4),
        ("minimax-m3-mxfp8.pp4.yaml", 4),
        ("minimax-m3-mxfp8.pp8.yaml", 8),
        ("minimax-m3.pp8.yaml", 8),
    ] {
        let out = m3c(&["plan", "--check", configs(plan).to_str().unwrap(), "--pp", &stages.to_string()]);
        assert!(out.status.success(), "{plan}: {}", stderr(&out));
        assert!(stdout(&out).contains(&format!("valid plan, {stages} stages")), "{plan}");
    }
}

/// A small deterministic generator for random cost tables.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[test]
fn planner_equals_brute_force_on_random_tables() {
    let mut rng = Lcg(7);
    let mut feasible = 0;
    for case in 0..400 {
        let n = 1 + (rng.next() * 9.0) as usize;
        let items: Vec<Item> = (0..n).map(|_| Item { time: rng.next() * 10.0, memory: rng.next() * 10.0 }).collect();
        let stages = 1 + (rng.next() * n as f64) as usize;
        let cap = 5.0 + rng.next() * 30.0;
        let dp = balance(&items, stages, cap);
        let bf = brute_force(&items, stages, cap);
        match (&dp, bf) {
            (None, None) => {}
            (Some(s), Some(b)) => {
                feasible += 1;
                assert!((s.bottleneck - b).abs() <= 1e-9 * b.max(1.0), "case {case}: dp {} vs brute force {b}", s.bottleneck);
                // The split it returns really has that bottleneck and fits.
                for w in s.bounds.windows(2) {
                    assert!(w[0] < w[1], "case {case}: empty stage");
                    let t: f64 = items[w[0]..w[1]].iter().map(|i| i.time).sum();
                    let m: f64 = items[w[0]..w[1]].iter().map(|i| i.memory).sum();
                    assert!(t <= s.bottleneck + 1e-9 && m <= cap * (1.0 + 1e-12), "case {case}");
                }
                assert_eq!((s.bounds[0], *s.bounds.last().unwrap(), s.bounds.len()), (0, n, stages + 1));
            }
            _ => panic!("case {case}: dp {dp:?} vs brute force {bf:?}"),
        }
    }
    assert!(feasible > 100, "too few feasible cases ({feasible}) to mean anything");
}

/// The planner's pp=4 plan of the real MXFP8 checkpoint for one
/// 8192-token sequence on H200s, with what it was planned for.
fn real_model_pp4_on_h200() -> (ModelConfig, GpuProfile, Workload, m3c_compiler::plan::Plan) {
    let cfg = load_config(&configs("minimax-m3-mxfp8.config.json")).unwrap();
    let gpu = GpuProfile::named("H200").unwrap();
    let w = Workload { batch: 1, context: 8192, kv_cache: m3c_kernels::Storage::Bf16 };
    let p = make_plan(&cfg, 4, &gpu, w, Target::Host).unwrap();
    (cfg, gpu, w, p)
}

#[test]
fn real_model_pp4_moves_away_from_even_split() {
    let (cfg, gpu, w, p) = real_model_pp4_on_h200();
    let counts: Vec<usize> = p.stages.iter().map(|s| s.layers.unwrap().len()).collect();
    assert_ne!(counts, vec![15, 15, 15, 15]);
    // The dense layers make stage 0 take more layers; the lm_head makes the last take fewer.
    assert!(counts[0] > 15 && counts[3] < 15, "{counts:?}");
    let t = table(&cfg, &p, &gpu, w);
    assert!(t.contains("even split 15/15/15/15 would be: slowest stage 3 (layers 45-59 + norm + lm_head)"), "{t}");
}

/// The table predicts a healing pipeline's recovery for the real model:
/// the largest stage's weights copied again from the page cache, and the
/// sequences in flight prefilled again, growing with the batch.
#[test]
fn real_model_recovery_is_predicted_part_by_part() {
    use m3c_compiler::plan::recovery::{predict, PAGE_CACHE_TO_GPU, TEARDOWN_S};
    let (cfg, gpu, w, p) = real_model_pp4_on_h200();
    let largest = m3c_compiler::plan::stage_costs(&cfg, &p, &gpu, w).iter().map(|c| c.cost.weight_bytes).fold(0.0, f64::max);
    let r = predict(&cfg, &p, &gpu, w, 30.0);
    assert!((r.weights - largest / PAGE_CACHE_TO_GPU).abs() < 1e-9 && r.weights > 5.0, "{r:?}");
    assert_eq!((r.teardown, r.detect_silent), (TEARDOWN_S, 30.0));
    let eight = predict(&cfg, &p, &gpu, Workload { batch: 8, ..w }, 30.0);
    assert!(r.reprefill > 0.0 && eight.reprefill > 4.0 * r.reprefill, "{r:?} {eight:?}");
    let t = table(&cfg, &p, &gpu, w);
    // The prefill line beside the decode table: the same roofline the
    // recovery's re-prefill takes, and sparse layers keep 4x the context
    // from costing 16x.
    let prefill =
        |c: usize| m3c_compiler::plan::recovery::prefill_seconds(&cfg, &p, &gpu, Workload { context: c, ..w }).iter().sum::<f64>();
    assert!((prefill(w.context) - r.reprefill).abs() < 1e-12);
    assert!(t.contains(&format!("prefill of one 8192-token prompt, predicted: {:.3} s", r.reprefill)), "{t}");
    let growth = prefill(4 * w.context) / prefill(w.context);
    assert!(growth > 4.0 && growth < 8.0, "{growth}");
    let line = t.lines().find(|l| l.starts_with("recovery of a lost stage")).unwrap_or_else(|| panic!("{t}"));
    assert!(line.contains(&format!("next token {:.1} s after a stage dies", r.after_a_death())), "{line}");
    for b in [1, 8, 32] {
        eprintln!("batch {b}: {:?}", predict(&cfg, &p, &gpu, Workload { batch: b, ..w }, 30.0));
    }
}

#[test]
fn written_plan_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plans/tiny.yaml");
    let model = fixture("tiny-m3");
    let o = m3c(&["plan", "--model", model.to_str().unwrap(), "--pp", "3", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("# stage") && text.contains("pipeline bubble"), "{text}");
    let p = m3c_compiler::plan::load_plan(&out, Some(&tiny())).unwrap();
    assert_eq!(p.stages.len(), 3);
    // The model path is relative to the plan file and resolves to the fixture.
    assert_eq!(std::fs::canonicalize(p.model.unwrap()).unwrap(), std::fs::canonicalize(model).unwrap());
    let check = m3c(&["plan", "--check", out.to_str().unwrap()]);
    assert!(check.status.success(), "{}", stderr(&check));
}

/// A plan's links: the report counts each boundary across hosts (a
/// decode step's rows and a prefill's, hidden width × storage bytes each),
/// from the only link or the one a stage names, and points out hosts
/// whose link is not described; a written plan keeps its links.
#[test]
fn links_between_hosts_are_counted_per_boundary() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = m3c_tests::configs("minimax-m3-mxfp8.config.json");
    let plan = dir.path().join("p.yaml");
    let stages = "stages:\n  - layers: 0-16\n    host: a\n  - layers: 17-32\n    host: a\n  - layers: 33-48\n    host: b\n  - layers: 49-59\n    host: c\n";
    let write = |links: &str| {
        std::fs::write(&plan, format!("model: {}\ntarget: cuda\n{links}{stages}", cfg.display())).unwrap();
        let o = m3c(&["plan", "--check", plan.to_str().unwrap(), "--batch", "64", "--context", "8192"]);
        assert!(o.status.success(), "{}", stderr(&o));
        m3c_tests::stdout(&o)
    };
    let t = write("links:\n  ib: \"400 Gb/s, 5 us\"\n");
    // 64 rows × 6144 × 2 B = 0.786 MB: 5 us + 15.7 us; 8192 rows: 100.663 MB, 2.018 ms.
    let row = |b: &str| {
        t.lines().find(|l| l.starts_with(b)).unwrap_or_else(|| panic!("no {b} row:\n{t}")).split_whitespace().collect::<Vec<_>>().join(" ")
    };
    assert_eq!(row("1->2"), "1->2 ib (400 Gb/s, 5 us) 64 0.786 0.021 8192 100.663 2.018", "{t}");
    assert_eq!(row("2->3"), "2->3 ib (400 Gb/s, 5 us) 64 0.786 0.021 8192 100.663 2.018", "{t}");
    assert!(!t.contains("0->1"), "stages 0 and 1 share a host:\n{t}");
    assert!(
        t.contains("crossing hosts adds 0.041 ms to each decoded token's trip") && t.contains("4.037 ms to a 8192-token prefill"),
        "{t}"
    );
    let t = write("");
    assert!(t.contains("1->2     stages on a and b: describe the link between them (`links:`)"), "{t}");
    // A stage names its link among several; the written plan keeps them.
    let stages2 = stages.replace("    host: c\n", "    host: c\n    link: eth\n").replace("    host: b\n", "    host: b\n    link: ib\n");
    let text = format!("target: cuda\nlinks:\n  ib: 400 Gb/s, 5 us\n  eth: 100 Gb/s, 20 us\n{stages2}");
    let real = m3c_compiler::source::ModelSource::open(&cfg).unwrap().config;
    let p = m3c_compiler::plan::parse_plan(Path::new("p.yaml"), &text, Some(&real)).unwrap();
    assert_eq!(p.boundary_link(2).map(|(n, l)| (n, l.to_string())), Some(("eth", "100 Gb/s, 20 us".to_string())));
    assert_eq!(p.boundary_link(0), None);
    let yaml = m3c_compiler::plan::plan_yaml(&p, None, None, "", "");
    assert_eq!(m3c_compiler::plan::parse_plan(Path::new("w.yaml"), &yaml, Some(&real)).unwrap(), p, "{yaml}");
}

/// The vision tower's weights count on stage 0 when the planner balances,
/// and a text-only (flat) config plans and checks without one.
#[test]
fn vision_weights_count_on_stage_0_and_text_only_models_plan() {
    let (cfg, gpu, w, p) = real_model_pp4_on_h200();
    assert!(p.stages[0].vision && !p.stages[1].vision);
    let mut off = p.clone();
    off.stages[0].vision = false;
    let (with, without) = (m3c_compiler::plan::stage_costs(&cfg, &p, &gpu, w), m3c_compiler::plan::stage_costs(&cfg, &off, &gpu, w));
    let extra = with[0].memory - without[0].memory;
    // 865,567,232 bf16 parameters (the tower's linears are unquantised; the patch conv is fp32).
    assert!((1.7e9..1.8e9).contains(&extra), "vision adds {extra} bytes to stage 0");
    assert_eq!(with[1].memory, without[1].memory);

    let dir = tempfile::tempdir().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture("tiny-m3").join("config.json")).unwrap()).unwrap();
    let mut text = v["text_config"].clone();
    text["architectures"] = serde_json::json!(["MiniMaxM3SparseForCausalLM"]);
    let flat = dir.path().join("config.json");
    std::fs::write(&flat, text.to_string()).unwrap();
    let out = dir.path().join("flat.yaml");
    let o = m3c(&["plan", "--model", flat.to_str().unwrap(), "--pp", "2", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = m3c(&["plan", "--check", out.to_str().unwrap(), "--model", flat.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `vision: true` on another stage puts the tower there: its weights count
/// there, the embedding's stage takes its features, the table and the
/// picture say where it is and what a 672×672 image costs, and a written
/// plan keeps the placement.
#[test]
fn the_vision_tower_can_sit_on_another_stage() {
    let text = "stages:\n  - layers: 0-2\n  - layers: 3-5\n  - layers: 6-7\n    vision: true\n";
    let p = parse_plan(Path::new("p.yaml"), text, Some(&tiny())).unwrap();
    assert!(!p.stages[0].vision && p.stages[2].vision && p.stages[0].vision_from == Some(2));
    assert_eq!(p.stages[2].describe(), "layers 6-7 + norm + lm_head + vision");
    let (cfg, gpu) = (tiny(), GpuProfile::named("H200").unwrap());
    let w = Workload { batch: 1, context: 8192, kv_cache: Default::default() };
    let t = table(&cfg, &p, &gpu, w);
    assert!(t.contains("vision tower on stage 2 (beside its own steps; features go to stage 0): a 672x672 image (2304 patches) is"), "{t}");
    let mut first = p.clone();
    (first.stages[0].vision, first.stages[0].vision_from, first.stages[2].vision) = (true, None, false);
    let (there, here) = (m3c_compiler::plan::stage_costs(&cfg, &p, &gpu, w), m3c_compiler::plan::stage_costs(&cfg, &first, &gpu, w));
    let tower = here[0].cost.weight_bytes - there[0].cost.weight_bytes;
    assert!(
        tower > 0.0 && (there[2].cost.weight_bytes - here[2].cost.weight_bytes - tower).abs() < 1.0,
        "the tower's weights move with it"
    );
    let yaml = m3c_compiler::plan::plan_yaml(&p, None, None, "test", "");
    assert!(yaml.contains("  - layers: \"6-7\"   # stage 2\n    final_norm: true\n    lm_head: true\n    vision: true\n"), "{yaml}");
    assert!(!yaml.contains("vision: false"), "{yaml}");
    let back = parse_plan(Path::new("p.yaml"), &yaml, Some(&tiny())).unwrap();
    assert_eq!(
        back.stages.iter().map(|s| (s.vision, s.vision_from)).collect::<Vec<_>>(),
        vec![(false, Some(2)), (false, None), (true, None)]
    );
    let svg = m3c_compiler::plan::plan_svg(&cfg, &p, &gpu, w);
    assert!(svg.contains(">layers 6-7 + vision</text>") && !svg.contains(">layers 0-2 + vision</text>"), "{svg}");
}

/// `vision: {ranks: N}` puts the tower on encoder ranks of their own: no
/// stage holds it, the embedding's stage takes the features from rank
/// `stages`; bad counts and hosts, and a stage's own `vision` beside it,
/// are errors naming the key.
#[test]
fn encoder_ranks_of_their_own_are_planned_and_checked() {
    let text = "vision:\n  ranks: 2\n  hosts: [a, b]\nstages:\n  - layers: 0-3\n  - layers: 4-7\n";
    let p = parse_plan(Path::new("p.yaml"), text, Some(&tiny())).unwrap();
    assert!(p.stages.iter().all(|s| !s.vision) && p.stages[0].vision_from == Some(2));
    let e = p.encoders.as_ref().unwrap();
    assert_eq!((e.ranks, e.place.iter().map(|p| p.host.clone().unwrap()).collect::<Vec<_>>()), (2, vec!["a".to_string(), "b".into()]));
    let (gpu, w) = (GpuProfile::named("H200").unwrap(), Workload { batch: 1, context: 8192, kv_cache: Default::default() });
    let t = table(&tiny(), &p, &gpu, w);
    assert!(t.contains("vision tower on 2 encoder rank(s) of their own (ranks 2..3, "), "{t}");
    let svg = m3c_compiler::plan::plan_svg(&tiny(), &p, &gpu, w);
    assert!(svg.contains("; vision tower on 2 encoder rank(s) of their own</text>") && !svg.contains("+ vision"), "{svg}");
    for (text, want) in [
        ("vision:\n  ranks: 0\nstages:\n  - layers: 0-7\n", "p.yaml:2:10: `ranks` must be 1 to 64, not 0"),
        ("vision:\n  ranks: 2\n  hosts: [a]\nstages:\n  - layers: 0-7\n", "p.yaml:3:10: `hosts` lists 1 but `ranks` is 2: one per rank"),
        ("vision:\n  ranks: 1\n  hosts: [\"a b\"]\nstages:\n  - layers: 0-7\n", "`a b` is not a host name"),
        (
            "vision:\n  ranks: 1\nstages:\n  - layers: 0-7\n    vision: false\n",
            "stage 0 says `vision`, but the plan puts the tower on encoder ranks of its own (`vision: {ranks: 1}`)",
        ),
        ("vision:\n  rank: 1\nstages:\n  - layers: 0-7\n", "unknown field `rank`"),
    ] {
        let e = plan_error(text);
        assert!(e.contains(want), "plan:\n{text}\nexpected: {want}\ngot:      {e}");
    }
}

/// `m3c plan --svg`: per stage a weights bar and a KV bar under the GPU's
/// usable memory, its layers and its predicted step time; a stage over
/// the memory is drawn red.
#[test]
fn the_plan_picture_has_a_bar_per_stage() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("p.svg");
    let o = m3c(&["plan", "--check", configs("minimax-m3-mxfp8.pp4.yaml").to_str().unwrap(), "--svg", svg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let p = std::fs::read_to_string(&svg).unwrap();
    assert!(p.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\"") && p.trim_end().ends_with("</svg>"), "{p}");
    for k in 0..4 {
        assert!(p.contains(&format!("<title>stage {k} weights ")) && p.contains(&format!("<title>stage {k} KV ")), "stage {k}:\n{p}");
        assert!(p.contains(&format!(">stage {k}</text>")), "stage {k} label");
    }
    assert_eq!(p.matches("(slowest)").count(), 1, "{p}");
    assert!(!p.contains("#d62728\"><title>"), "the shipped pp 4 plan fits: no red bar\n{p}");
    // On a smaller GPU the same plan does not fit: its bars turn red.
    let o = m3c(&[
        "plan",
        "--check",
        configs("minimax-m3-mxfp8.pp4.yaml").to_str().unwrap(),
        "--gpu-mem",
        "80",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read_to_string(&svg).unwrap().contains("#d62728\"><title>stage"), "over-memory stages are red");
}

/// `m3c plan --speculative-config` with an EAGLE3 draft: its weights and
/// cache on the last stage, and the target's aux states each boundary
/// carries to it (tiny-m3 at pp 4, layers 0-1 | 2 | 3 | 4-7); a draft
/// that does not fit its target is an error naming the key.
#[test]
fn plan_counts_an_eagle3_drafts_weights_and_aux_states() {
    let draft = fixture("eagle3-tiny");
    let spec = |dir: &Path| format!(r#"{{"method": "eagle3", "model": "{}", "num_speculative_tokens": 3}}"#, dir.display());
    let model = fixture("tiny-m3");
    let args = |s: &str| {
        vec![
            "plan".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--pp".into(),
            "4".into(),
            "--speculative-config".into(),
            s.to_string(),
        ]
    };
    let r = m3c(&args(&spec(&draft)).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(r.status.success(), "{}", stderr(&r));
    let err = stderr(&r);
    assert!(err.contains("EAGLE3 draft") && err.contains("on stage 3 (the last)"), "{err}");
    // f32 activations on the host: 128 × 4 = 512 B per aux state and row.
    // The fixture reads the inputs of layers 2, 4 and 5 (vLLM's default):
    // made on stage 0 (layer 1's output), stage 2 (layer 3's) and stage 3.
    for line in [
        "0->1               1          512        1          512",
        "1->2               1          512        0            0",
        "2->3               2         1024        1          512",
    ] {
        assert!(err.contains(line), "missing `{line}` in {err}");
    }
    assert!(err.contains("2048 B per row forwarded") && err.contains("1024 B per row sent straight"), "{err}");
    // A draft whose aux layers, width or architecture do not fit the target.
    let dir = tempfile::tempdir().unwrap();
    let fixture_config = std::fs::read_to_string(draft.join("config.json")).unwrap();
    for (key, value, says) in [
        (
            "eagle_aux_hidden_state_layer_ids",
            serde_json::json!([2, 4, 9]),
            "`eagle_aux_hidden_state_layer_ids` holds 9, but the target has 8 layers",
        ),
        (
            "target_hidden_size",
            serde_json::json!(256),
            "`target_hidden_size` (or `hidden_size`) is 256, but the target's hidden size is 128",
        ),
        ("architectures", serde_json::json!(["LlamaForCausalLM"]), "an EAGLE3 draft head"),
    ] {
        let mut config: serde_json::Value = serde_json::from_str(&fixture_config).unwrap();
        match key {
            "eagle_aux_hidden_state_layer_ids" => config["eagle_config"][key] = value,
            _ => config[key] = value,
        }
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        let r = m3c(&args(&spec(dir.path())).iter().map(String::as_str).collect::<Vec<_>>());
        assert!(!r.status.success() && stderr(&r).contains(says), "{key}: {}", stderr(&r));
    }
}

#[test]
fn a_plan_sized_for_a_gpu_names_its_target() {
    let model = fixture("tiny-m3");
    let target_of = |extra: &[&str]| {
        let mut a = vec!["plan", "--model", model.to_str().unwrap(), "--pp", "2"];
        a.extend_from_slice(extra);
        let r = m3c(&a);
        assert!(r.status.success(), "{extra:?}: {}", stderr(&r));
        stdout(&r).lines().find_map(|l| l.strip_prefix("target: ").map(str::to_string)).unwrap_or_default()
    };
    assert_eq!(target_of(&["--gpu", "H200"]), "cuda");
    assert_eq!(target_of(&["--gpu", "MI300X"]), "rocm");
    assert_eq!(target_of(&[]), "host");
    // Said outright, the target wins over the GPU's maker.
    assert_eq!(target_of(&["--gpu", "H200", "--target", "host"]), "host");
}

/// The README's workflow on a machine without a GPU: `m3c plan --gpu H200`
/// writes `target: cuda`; `m3c compile PLAN` takes the plan's stage count
/// (no --pp), and `--target host` compiles the plan's split for this
/// machine, saying so; another target that disagrees names the plan.
#[test]
fn a_gpu_plan_compiles_for_this_machine_with_target_host_and_its_stage_count() {
    let model = fixture("tiny-m3");
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.yaml");
    let r = m3c(&["plan", "--model", model.to_str().unwrap(), "--pp", "2", "--gpu", "H200", "-o", plan.to_str().unwrap()]);
    assert!(r.status.success(), "{}", stderr(&r));
    let out = dir.path().join("out");
    let r = m3c(&["compile", plan.to_str().unwrap(), "--target", "host", "-o", out.to_str().unwrap()]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(stderr(&r).contains("--target host: compiling") && stderr(&r).contains("`target: cuda"), "{}", stderr(&r));
    assert!(out.join("stage-0").is_file() && out.join("stage-1").is_file() && !out.join("stage-2").exists());
    let r = m3c(&["compile", plan.to_str().unwrap(), "--target", "rocm", "-o", dir.path().join("o2").to_str().unwrap()]);
    assert!(
        !r.status.success() && stderr(&r).contains("plan.yaml says `target: cuda") && stderr(&r).contains("--target host"),
        "{}",
        stderr(&r)
    );
    let r = m3c(&["compile", plan.to_str().unwrap(), "--pp", "3", "--target", "host", "-o", dir.path().join("o3").to_str().unwrap()]);
    assert!(!r.status.success() && stderr(&r).contains("the plan has 2 stages but --pp 3 was given"), "{}", stderr(&r));
}
