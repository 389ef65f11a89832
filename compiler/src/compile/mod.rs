//! `m3c compile`: config + plan → OUT/ with one executable per stage, a
//! manifest and a launcher.
//!
//! Per stage: lower (graph slice → fused kernel calls → MLIR), back end
//! (MLIR → LLVM → x86-64 object), link with the runtime (`mpicc`). OUT is
//! built in a temporary folder and renamed into place, so a failed compile
//! leaves nothing behind; nothing in it depends on time, paths or thread
//! timing, so the same inputs give byte-identical folders.

pub mod cache;
pub mod link;
mod manifest;

pub use link::{find_runtime_lib, sh_quote, RUNTIME_LIB_ENV};
pub use m3c_contract::manifest::{sha256_hex, Manifest, StageEntry};

use crate::backend::{Backend, Unit, UnitCode};
use crate::config::ModelConfig;
use crate::graph::{build_graph, ModelGraph};
use crate::lower::{fuse_stage, Boundary, DraftPart, LowerError, StageProgram, Storages};
use crate::plan::draft::DraftHead;
use crate::plan::{Plan, StagePlan};
use anyhow::{Context, Result};
use cache::unit_hash;
use m3c_contract::target::Target;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// What `--emit` adds to OUT besides the executables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Emit {
    /// `stage-K.steps.txt` (fused program) and `stage-K.mlir` (before lowering).
    Mlir,
    /// `stage-K.llvm.mlir` (LLVM dialect) and `stage-K.ll` (LLVM IR).
    Llvm,
    /// `stage-K.ptx` (CUDA target).
    Ptx,
}

pub struct CompileRequest<'a> {
    pub config: &'a ModelConfig,
    pub plan: &'a Plan,
    pub out: &'a Path,
    pub emit: Vec<Emit>,
    /// LLVM CPU name for host code.
    pub cpu: String,
    /// How the stages store their KV and index-key caches and their activations.
    pub storages: Storages,
    pub runtime_lib: PathBuf,
    /// The object cache's folder (see [`cache`]); `None` compiles every unit.
    pub cache: Option<PathBuf>,
    /// An EAGLE3 draft head compiled into the last stage (the target's
    /// stages then carry its aux states).
    pub draft: Option<&'a DraftHead>,
}

/// A finished compile: the manifest written, and how many distinct units
/// the stages were compiled in and how many of those the cache held.
pub struct Compiled {
    pub manifest: Manifest,
    pub units: usize,
    pub from_cache: usize,
}

/// The names m3c writes into OUT: anything else there means the folder is
/// not (only) an m3c output, and it is never replaced.
fn is_output_name(name: &str) -> bool {
    if matches!(name, "manifest.json" | "run.sh" | "compile-report.txt") {
        return true;
    }
    let emitted = |rest: &str| matches!(rest, "" | ".steps.txt" | ".mlir" | ".llvm.mlir" | ".ll" | ".ptx" | ".cubin");
    // The encoder ranks' executable (and what --emit writes of it).
    if let Some(rest) = name.strip_prefix("encoder") {
        return emitted(rest);
    }
    let Some(rest) = name.strip_prefix("stage-") else { return false };
    let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    digits > 0 && emitted(&rest[digits..])
}

/// Refuses to replace `dir` unless it is provably an earlier m3c output:
/// its manifest.json parses as m3c's and it holds only files m3c writes.
pub fn check_replaceable_output(dir: &Path) -> Result<()> {
    let refuse = |why: String| {
        anyhow::anyhow!("{}: {why}; m3c replaces only an earlier m3c output (choose a new folder, or remove it first)", dir.display())
    };
    let manifest = dir.join("manifest.json");
    let text = m3c_contract::read_user_file(&manifest, "manifest", 64 << 20)
        .map_err(|_| refuse("already exists, is not empty and has no m3c manifest.json".into()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|_| refuse("its manifest.json is not m3c's".into()))?;
    let ours =
        v["format"].as_str().is_some_and(|f| f.starts_with("m3c-out/")) && v["compiler"].as_str().is_some_and(|c| c.starts_with("m3c "));
    if !ours {
        return Err(refuse("its manifest.json is not m3c's".into()));
    }
    let entries = std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    for e in entries {
        let e = e.with_context(|| format!("cannot read {}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let is_file = e.file_type().map(|t| t.is_file()).unwrap_or(false);
        if !is_file || !is_output_name(&name) {
            return Err(refuse(format!("it holds `{name}`, which m3c did not write")));
        }
    }
    Ok(())
}

/// Refuses output folders that would swallow their own inputs: OUT equal to
/// or containing the model's folder, or the current folder.
pub fn check_out_path(out: &Path, model: &Path) -> Result<()> {
    let abs = |p: &Path| std::fs::canonicalize(p).or_else(|_| std::path::absolute(p));
    let Ok(out_abs) = abs(out) else { return Ok(()) };
    if let Ok(cwd) = std::env::current_dir().and_then(|c| abs(&c)) {
        if cwd.starts_with(&out_abs) {
            anyhow::bail!(
                "-o {}: the current folder (or a folder above it) cannot be the output folder; name a new folder, such as `-o out`",
                out.display()
            );
        }
    }
    let model_dir = if model.is_dir() { model.to_path_buf() } else { model.parent().map(Path::to_path_buf).unwrap_or_default() };
    if let Ok(m) = abs(if model_dir.as_os_str().is_empty() { Path::new(".") } else { &model_dir }) {
        if m.starts_with(&out_abs) {
            anyhow::bail!("-o {}: it holds the model {} ; the output folder must be somewhere else", out.display(), model.display());
        }
    }
    Ok(())
}

/// What a stage knows of images: the tower's stage knows its program's
/// geometry; the embedding's stage of a plan that puts the tower elsewhere
/// knows the placeholders and where the features come from.
fn vision_meta(p: &StageProgram, plan_stage: &crate::plan::StagePlan, cfg: &ModelConfig) -> Option<m3c_contract::stage::VisionMeta> {
    let vc = cfg.vision.as_ref()?;
    let meta = |patch_row, merge, encoder_stage| m3c_contract::stage::VisionMeta {
        patch_row,
        merge,
        image_token: vc.image_token_id as i64,
        video_token: vc.video_token_id as i64,
        encoder_stage,
    };
    match (&p.vision, plan_stage.vision_from) {
        (Some(v), _) => Some(meta(v.patch_row, v.merge, p.index)),
        (None, Some(k)) => {
            use m3c_contract::images::{MERGE_SIDE, PATCH_ROW};
            Some(meta(PATCH_ROW, MERGE_SIDE * MERGE_SIDE, k))
        }
        (None, None) => None,
    }
}

/// The stage metadata embedded in each executable (the contract's
/// `StageMeta`, which the runtime reads back).
#[allow(clippy::too_many_arguments)]
fn stage_meta(
    p: &StageProgram,
    plan_stage: &crate::plan::StagePlan,
    (stages, encoders): (usize, usize),
    cfg: &ModelConfig,
    compile_id: &str,
    config_sha: &str,
    cpu: &str,
    target: &Target,
    device: Option<usize>,
    act: m3c_kernels::Storage,
    draft_sha: Option<&str>,
) -> String {
    use m3c_contract::stage::StageMeta;
    StageMeta {
        compile_id: compile_id.into(),
        config_sha256: config_sha.into(),
        stage: p.index,
        stages,
        hidden: cfg.text.hidden_size,
        act_bytes: act.bytes(),
        vocab: cfg.text.vocab_size,
        max_positions: cfg.text.max_position_embeddings,
        kv_block: cfg.text.kv_block(),
        holds: holds(p),
        first_stage: p.text.input == Boundary::TokenIds,
        last_stage: matches!(p.text.output, Boundary::Logits { .. }),
        cpu: cpu.into(),
        cpu_features: crate::backend::cpu_features(cpu),
        target: target.clone(),
        device: device.map(|d| d as i32),
        tensors: p.tensors.clone(),
        caches: p.caches.clone(),
        vision: vision_meta(p, plan_stage, cfg),
        aux_in: p.aux_in,
        aux_slots: p.aux_slots,
        draft: p.draft.as_ref().zip(draft_sha).map(|(d, sha)| m3c_contract::stage::DraftMeta {
            vocab: d.vocab,
            order: d.order.clone(),
            config_sha256: sha.into(),
        }),
        encoders,
        encoder: p.index >= stages,
    }
    .to_json()
}

pub fn holds(p: &StageProgram) -> String {
    use crate::model::Part;
    let mut s = Vec::new();
    if p.parts.contains(&Part::Embedding) {
        s.push("embed".to_string());
    }
    let layers: Vec<usize> = p.parts.iter().filter_map(|x| if let Part::Layer(l) = x { Some(*l) } else { None }).collect();
    match layers.as_slice() {
        [] => {}
        [l] => s.push(format!("layer {l}")),
        [a, .., b] => s.push(format!("layers {a}-{b}")),
    }
    if p.parts.contains(&Part::FinalNorm) {
        s.push("norm".into());
    }
    if p.parts.contains(&Part::LmHead) {
        s.push("lm_head".into());
    }
    if p.parts.contains(&Part::Vision) && !p.parts.contains(&Part::Embedding) {
        s.push("vision".into());
    }
    s.join(" + ")
}

/// The embedded metadata as two LLVM-dialect globals the runtime reads.
fn meta_globals(json: &str) -> String {
    let mut esc = String::with_capacity(json.len() * 2);
    for b in json.bytes() {
        if b.is_ascii_alphanumeric() || b" _-.:,{}[]".contains(&b) {
            esc.push(b as char);
        } else {
            esc.push_str(&format!("\\{b:02X}"));
        }
    }
    use m3c_contract::stage::abi::{META, META_LEN};
    format!(
        "  llvm.mlir.global external constant @{META}(\"{esc}\") {{addr_space = 0 : i32}} : !llvm.array<{} x i8>\n\
         \x20 llvm.mlir.global external constant @{META_LEN}({} : i64) {{addr_space = 0 : i32}} : i64\n",
        json.len(),
        json.len()
    )
}

/// Lowers every stage of `plan` for its target (no back end): what
/// `--emit mlir` shows and what the compile id hashes.
pub fn lower_all(cfg: &ModelConfig, plan: &Plan, storages: Storages, draft: Option<&DraftHead>, cpu: &str) -> Result<Vec<StageProgram>> {
    // bf16 rows travel between stages as f32 words (MPI, NCCL), two to a word.
    if storages.activations == m3c_kernels::Storage::Bf16 && !cfg.text.hidden_size.is_multiple_of(2) {
        anyhow::bail!(
            "--activations bf16: hidden_size {} of {} is odd; bf16 activations need an even hidden size",
            cfg.text.hidden_size,
            cfg.source.display()
        );
    }
    let mut graph = build_graph(cfg);
    if let Some(d) = draft {
        crate::graph::draft::tap_aux_states(&mut graph, &d.aux_layers).map_err(|e| anyhow::anyhow!("{}: {e}", cfg.source.display()))?;
    }
    let backend = crate::backend::backend(&plan.target, cpu);
    let last = plan.stages.len().saturating_sub(1);
    // Aux states made on stages 0..=i: the slots stage i passes on.
    let made: Vec<usize> = plan
        .stages
        .iter()
        .scan(0, |n, s| {
            let parts = s.parts();
            *n += draft.map_or(0, |d| d.aux_layers.iter().filter(|&&l| parts.contains(&crate::graph::draft::aux_producer(l))).count());
            Some(*n)
        })
        .collect();
    let mut programs: Vec<StageProgram> = plan
        .stages
        .iter()
        .enumerate()
        .map(|(i, s)| {
            // The head runs on the last stage, where the target's tokens are drawn.
            let aux_in = if i == 0 { 0 } else { made[i - 1] };
            let part = DraftPart { aux_in, aux_slots: made[i], head: draft.filter(|_| i == last) };
            lower_stage(cfg, &graph, i, s, &*backend, storages, part)
        })
        .collect::<Result<_, _>>()?;
    // Encoder ranks of their own: one program, the tower alone, numbered
    // after the stages.
    if plan.encoders.is_some() {
        let tower = crate::plan::StagePlan::tower_only();
        programs.push(lower_stage(cfg, &graph, plan.stages.len(), &tower, &*backend, storages, DraftPart::default())?);
    }
    Ok(programs)
}

/// What a compile hashes, and the lowered stages it hashes.
struct Lowered {
    programs: Vec<StageProgram>,
    compile_id: String,
    config_sha: String,
    plan_json: String,
    runtime_sha: String,
    draft_sha: String,
}

/// The compile id `compile` would give `req`'s output (lowering, no back
/// end): what a build folder kept for reuse is checked against.
pub fn compile_id(req: &CompileRequest) -> Result<String> {
    Ok(lower(req)?.compile_id)
}

fn lower(req: &CompileRequest) -> Result<Lowered> {
    let cfg = req.config;
    let config_bytes = std::fs::read(&cfg.source).with_context(|| format!("cannot read {}", cfg.source.display()))?;
    let config_sha = sha256_hex(&config_bytes);
    let runtime =
        std::fs::read(&req.runtime_lib).with_context(|| format!("cannot read the runtime library {}", req.runtime_lib.display()))?;
    let runtime_sha = sha256_hex(&runtime);
    let mut plan = req.plan.clone();
    plan.model = None;
    let plan_json = serde_json::to_string(&plan).context("plan serialisation")?;
    let programs = lower_all(cfg, req.plan, req.storages, req.draft, &req.cpu)?;
    // The draft's config by content (its folder's path is no input).
    let draft_sha = match req.draft {
        Some(d) => {
            let file = d.source.join("config.json");
            sha256_hex(&std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?)
        }
        None => String::new(),
    };

    // The compile id covers every input: compiler version, target and CPU,
    // the config's bytes, the plan, the runtime library and the generated
    // code of every stage (which is where the kernel generators show).
    let target_name = req.plan.target.to_string();
    let mut h = Sha256::new();
    let (kv_cache, activations) = (req.storages.kv_cache.name(), req.storages.activations.name());
    for part in
        [env!("CARGO_PKG_VERSION"), &target_name, &req.cpu, kv_cache, activations, &config_sha, &plan_json, &runtime_sha, &draft_sha]
    {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    for p in &programs {
        h.update((p.mlir.len() as u64).to_le_bytes());
        h.update(p.mlir.as_bytes());
    }
    let compile_id: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(Lowered { programs, compile_id, config_sha, plan_json, runtime_sha, draft_sha })
}

pub fn compile(req: &CompileRequest) -> Result<Compiled> {
    let backend = crate::backend::backend(&req.plan.target, &req.cpu);
    let cfg = req.config;
    let Lowered { programs, compile_id, config_sha, plan_json, runtime_sha, draft_sha } = lower(req)?;
    let target_name = req.plan.target.to_string();
    let (kv_cache, activations) = (req.storages.kv_cache.name(), req.storages.activations.name());
    // Pipeline stages; an encoder program, if any, comes after them.
    let n = req.plan.stages.len();
    let stage_units = programs
        .iter()
        .map(|p| backend.units(p.index, &p.fused).map_err(|m| anyhow::anyhow!("stage {}: {m}", p.index)))
        .collect::<Result<Vec<_>>>()?;
    let cache = match &req.cache {
        Some(dir) => Some(cache::ObjectCache::open(dir, &target_name, &req.cpu, &backend.toolchain()?)?),
        None => None,
    };
    let mut manifest =
        manifest::new(cfg, &config_sha, &plan_json, &runtime_sha, &compile_id, &req.cpu, &req.plan.target, kv_cache, activations);
    manifest.draft_config_sha256 = Some(draft_sha.clone()).filter(|s| !s.is_empty());
    let mut report = String::new();
    let mut counts = (0, 0);
    crate::fsutil::write_dir_atomically(req.out, check_replaceable_output, |dir| {
        let work = dir.join(".obj");
        std::fs::create_dir(&work)?;
        // `--emit llvm` writes every unit's IR, which the cache does not keep.
        let codes = unit_codes(&*backend, &stage_units, cache.as_ref(), req.emit.contains(&Emit::Llvm), &req.cpu, &work)?;
        counts = (codes.len(), codes.values().filter(|c| c.cached).count());
        for (key, c) in &codes {
            std::fs::write(work.join(format!("{key}.o")), &c.code.object)?;
        }
        // Each stage's metadata, link and files, one thread per core: a
        // stage's executable depends only on its own objects.
        let job = StageJob {
            req,
            stages: n,
            compile_id: &compile_id,
            config_sha: &config_sha,
            draft_sha: &draft_sha,
            codes: &codes,
            work: &work,
            dir,
        };
        let jobs: Vec<(&StageProgram, &Vec<Unit>)> = programs.iter().zip(&stage_units).collect();
        for (entry, lines) in parallel_map(&jobs, |_, (p, units)| job.finish(p, units))? {
            report.push_str(&lines);
            if entry.stage < n {
                manifest.stages.push(entry);
            } else {
                let hosts = req.plan.encoders.as_ref().map_or(Vec::new(), |e| e.place.iter().map(|p| p.host.clone()).collect());
                manifest.encoder = Some(m3c_contract::manifest::EncoderEntry { executable: entry.executable, sha256: entry.sha256, hosts });
            }
        }
        std::fs::remove_dir_all(&work)?;
        let hosts: Vec<Option<String>> = req.plan.stages.iter().map(|s| s.place.host.clone()).collect();
        let encoder_hosts = manifest.encoder.as_ref().map_or(Vec::new(), |e| e.hosts.clone());
        std::fs::write(dir.join("run.sh"), link::launcher(&hosts, &encoder_hosts))?;
        set_executable(&dir.join("run.sh"))?;
        if let Some(header) = backend.report_header().filter(|_| !report.is_empty()) {
            std::fs::write(dir.join("compile-report.txt"), header + &report)?;
        }
        let text = serde_json::to_string_pretty(&manifest)? + "\n";
        std::fs::write(dir.join("manifest.json"), text)?;
        Ok(())
    })?;
    Ok(Compiled { manifest, units: counts.0, from_cache: counts.1 })
}

/// What every stage's last steps share.
struct StageJob<'a> {
    req: &'a CompileRequest<'a>,
    stages: usize,
    compile_id: &'a str,
    config_sha: &'a str,
    draft_sha: &'a str,
    codes: &'a std::collections::BTreeMap<String, UnitResult>,
    work: &'a Path,
    dir: &'a Path,
}

impl StageJob<'_> {
    /// Compiles stage `p`'s metadata, links its executable from its units'
    /// objects, writes what `--emit` asks for, and returns its manifest
    /// entry and compile-report lines.
    fn finish(&self, p: &StageProgram, units: &[Unit]) -> Result<(StageEntry, String)> {
        let (req, work, dir) = (self.req, self.work, self.dir);
        // The encoder ranks' program comes after the stages.
        let encoder = p.index >= self.stages;
        let name = if encoder { "encoder".to_string() } else { format!("stage-{}", p.index) };
        let tower = crate::plan::StagePlan::tower_only();
        let plan_stage = req.plan.stages.get(p.index).unwrap_or(&tower);
        let device = plan_stage.place.device;
        let encoders = req.plan.encoders.as_ref().map_or(0, |e| e.ranks);
        let meta = stage_meta(
            p,
            plan_stage,
            (self.stages, encoders),
            req.config,
            self.compile_id,
            self.config_sha,
            &req.cpu,
            &req.plan.target,
            device,
            req.storages.activations,
            Some(self.draft_sha).filter(|s| !s.is_empty()),
        );
        // The metadata is an object of its own: the units' code does not
        // depend on the compile id, so the cache can hold it.
        let meta = crate::backend::host::compile(&format!("module {{\n{}}}\n", meta_globals(&meta)), &req.cpu)
            .with_context(|| format!("stage {}: metadata", p.index))?;
        let meta_obj = work.join(format!("{name}.meta.o"));
        std::fs::write(&meta_obj, &meta.object)?;
        let codes: Vec<(&Unit, &UnitCode)> = units.iter().map(|u| (u, &self.codes[&unit_hash(u)].code)).collect();
        if req.emit.contains(&Emit::Mlir) {
            std::fs::write(dir.join(format!("{name}.steps.txt")), p.listing())?;
            std::fs::write(dir.join(format!("{name}.mlir")), &p.mlir)?;
        }
        if req.emit.contains(&Emit::Llvm) {
            for (suffix, text) in emitted_texts(&codes, &meta.llvm_dialect, &meta.llvm_ir) {
                std::fs::write(dir.join(format!("{name}{suffix}")), text)?;
            }
        }
        if req.emit.contains(&Emit::Ptx) {
            for (suffix, bytes) in codes.iter().flat_map(|(_, c)| &c.device_files) {
                std::fs::write(dir.join(format!("{name}{suffix}")), bytes)?;
            }
        }
        let mut objects: Vec<PathBuf> = units.iter().map(|u| work.join(format!("{}.o", unit_hash(u)))).collect();
        objects.push(meta_obj);
        let exe = dir.join(&name);
        link::link(&objects, &req.runtime_lib, &exe).with_context(|| format!("stage {}: linking {}", p.index, exe.display()))?;
        let bytes = std::fs::read(&exe)?;
        let mut entry = manifest::stage_entry(p, &name, &bytes, plan_stage.place.host.clone());
        entry.device_code = codes.iter().find_map(|(_, c)| c.device_code.clone());
        Ok((entry, codes.iter().map(|(_, c)| c.report.as_str()).collect()))
    }
}

/// A unit's code, and whether the cache had it.
struct UnitResult {
    code: UnitCode,
    cached: bool,
}

/// The code of every distinct unit of every stage, by [`unit_hash`]: from
/// the cache where it has it (unless `fresh`), else compiled, on up to one
/// thread per core, and stored.
fn unit_codes(
    backend: &dyn Backend,
    stage_units: &[Vec<Unit>],
    cache: Option<&cache::ObjectCache>,
    fresh: bool,
    cpu: &str,
    work: &Path,
) -> Result<std::collections::BTreeMap<String, UnitResult>> {
    let mut distinct = std::collections::BTreeMap::new();
    for u in stage_units.iter().flatten() {
        distinct.entry(unit_hash(u)).or_insert(u);
    }
    let mut codes = std::collections::BTreeMap::new();
    let mut todo = Vec::new();
    for (hash, u) in distinct {
        match cache.filter(|_| !fresh).and_then(|c| c.get(&c.key(u))) {
            Some(code) => {
                codes.insert(hash, UnitResult { code, cached: true });
            }
            None => todo.push((hash, u)),
        }
    }
    let compiled = parallel_map(&todo, |_, (_, u)| backend.compile_unit(u, cpu, work))?;
    let mut warned = false;
    let stored = !todo.is_empty();
    for ((hash, u), code) in todo.into_iter().zip(compiled) {
        if let Some(c) = cache {
            // A cache that cannot be written costs time, not correctness: say so once.
            if let Err(e) = c.put(&c.key(u), &code) {
                if !warned {
                    eprintln!("m3c: warning: the object cache is not written: {e:#}");
                    warned = true;
                }
            }
        }
        codes.insert(hash, UnitResult { code, cached: false });
    }
    if let Some(c) = cache.filter(|_| stored) {
        c.prune_to_cap();
    }
    Ok(codes)
}

/// A stage's `--emit llvm` files: each unit's text in link order under a
/// comment naming it, then the metadata's.
fn emitted_texts(codes: &[(&Unit, &UnitCode)], meta_dialect: &str, meta_ir: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let sections =
        codes.iter().flat_map(|(u, c)| c.emitted.iter().map(move |(suffix, text)| (u.name.as_str(), suffix.as_str(), text.as_str())));
    let meta = [("metadata", ".llvm.mlir", meta_dialect), ("metadata", ".ll", meta_ir)];
    for (name, suffix, text) in sections.chain(meta) {
        let comment = if suffix == ".ll" { ";" } else { "//" };
        let i = match out.iter().position(|(s, _)| s == suffix) {
            Some(i) => i,
            None => {
                out.push((suffix.to_string(), String::new()));
                out.len() - 1
            }
        };
        out[i].1.push_str(&format!("{comment} ---- unit {name} ----\n{text}\n"));
    }
    out
}

/// `f` over `items` on up to `available_parallelism` threads; results in
/// item order, the first error wins.
fn parallel_map<T: Sync, R: Send>(items: &[T], f: impl Fn(usize, &T) -> Result<R> + Sync) -> Result<Vec<R>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len()).max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<R>>>> = items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= items.len() {
                    break;
                }
                let r = f(i, &items[i]);
                *results[i].lock().expect("no panics while holding the lock") = Some(r);
            });
        }
    });
    results.into_iter().map(|m| m.into_inner().expect("lock").expect("every item ran")).collect()
}

fn set_executable(p: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Lowers stage `index` of a plan for `backend`'s target, storing caches and activations as `storages` says.
fn lower_stage(
    cfg: &ModelConfig,
    graph: &ModelGraph,
    index: usize,
    stage: &StagePlan,
    backend: &dyn Backend,
    storages: Storages,
    draft: DraftPart,
) -> Result<StageProgram, LowerError> {
    let parts = stage.parts();
    let fused = fuse_stage(cfg, graph, &parts, storages, draft, stage.vision_from.is_some())
        .map_err(|message| LowerError::Stage { stage: index, message })?;
    let mlir = backend.module(&fused).map_err(|message| LowerError::Stage { stage: index, message })?;
    Ok(StageProgram { index, parts, fused, mlir })
}
