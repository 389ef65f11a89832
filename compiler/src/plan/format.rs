//! The YAML partition plan: parsing and validation against a model config.
//! See docs/plan.md for the format.

use super::links::Link;
use super::locate::{locate, Locations, Pos};
use crate::config::ModelConfig;
use crate::model::Part;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

/// An inclusive range of decoder layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LayerRange {
    pub first: usize,
    pub last: usize,
}

impl LayerRange {
    /// Layers in the range (at least one: `first <= last` by construction).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.last - self.first + 1
    }
    /// "layer 4 is" / "layers 4-7 are", for messages.
    fn phrase(&self) -> String {
        if self.len() == 1 {
            format!("layer {self} is")
        } else {
            format!("layers {self} are")
        }
    }
    pub fn iter(&self) -> impl Iterator<Item = usize> {
        self.first..=self.last
    }
}

impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

pub use m3c_contract::target::{valid_arch, Target};

/// One pipeline stage: a contiguous range of layers and the non-layer parts it holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StagePlan {
    pub layers: Option<LayerRange>,
    pub embedding: bool,
    pub final_norm: bool,
    pub lm_head: bool,
    /// Holds the vision tower, projector and patch merge (the embedding's
    /// stage unless the plan says `vision: false` there: a text-only
    /// deployment; or another stage with `vision: true`, which encodes
    /// beside its own steps and sends the features to the embedding's).
    pub vision: bool,
    /// The stage whose tower's features this stage's embedding takes, when
    /// it is another stage (the embedding's stage of such a plan).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vision_from: Option<usize>,
    /// Where it runs (the plan's keys of the same names).
    #[serde(flatten)]
    pub place: Placement,
}

/// Where a stage runs: what the plan says beyond the split itself (none
/// of it changes what a stage computes).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Placement {
    /// GPU device ordinal on its host (GPU targets).
    pub device: Option<usize>,
    /// The host (MPI node) the stage should run on.
    pub host: Option<String>,
    /// The link (a name in the plan's `links`) the previous stage's
    /// activations cross to reach this one.
    pub link: Option<String>,
}

impl StagePlan {
    /// The encoder ranks' program (a plan's `vision: {ranks: N}`): the
    /// vision tower alone.
    pub fn tower_only() -> StagePlan {
        StagePlan {
            layers: None,
            embedding: false,
            final_norm: false,
            lm_head: false,
            vision: true,
            vision_from: None,
            place: Placement::default(),
        }
    }

    pub fn parts(&self) -> BTreeSet<Part> {
        let mut p = BTreeSet::new();
        if self.embedding {
            p.insert(Part::Embedding);
        }
        if let Some(r) = self.layers {
            p.extend(r.iter().map(Part::Layer));
        }
        if self.final_norm {
            p.insert(Part::FinalNorm);
        }
        if self.lm_head {
            p.insert(Part::LmHead);
        }
        if self.vision {
            p.insert(Part::Vision);
        }
        p
    }

    pub fn describe(&self) -> String {
        let mut s = Vec::new();
        if self.embedding {
            s.push("embed".to_string());
        }
        if let Some(r) = self.layers {
            s.push(if r.len() == 1 { format!("layer {r}") } else { format!("layers {r}") });
        }
        if self.final_norm {
            s.push("norm".to_string());
        }
        if self.lm_head {
            s.push("lm_head".to_string());
        }
        if self.vision && !self.embedding {
            s.push("vision".to_string());
        }
        s.join(" + ")
    }
}

/// A validated partition plan.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Plan {
    /// The model the plan names, resolved against the plan file's folder.
    pub model: Option<PathBuf>,
    pub target: Target,
    pub stages: Vec<StagePlan>,
    /// The links between hosts, by name (`links:`).
    pub links: BTreeMap<String, Link>,
    /// An EAGLE3 draft head's folder (`draft:`, resolved like `model:`),
    /// compiled into the last stage. Not hashed as a path: the compile id
    /// covers its config's bytes.
    #[serde(skip)]
    pub draft: Option<PathBuf>,
    /// Encoder ranks of their own (`vision: {ranks: N}`): the vision tower
    /// runs there, off every stage, and the first stage sends them images.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encoders: Option<Encoders>,
}

/// The encoder ranks of a plan: how many, and where each runs.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Encoders {
    pub ranks: usize,
    /// One per rank (or none): its host and GPU, as a stage's.
    pub place: Vec<Placement>,
}

/// The most encoder ranks a plan may ask for.
pub const MAX_ENCODER_RANKS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The file is missing, not a regular file, too large or not UTF-8.
    #[error(transparent)]
    Input(#[from] m3c_contract::InputError),
    #[error("{file}:{line}:{col}: {message}")]
    At { file: PathBuf, line: usize, col: usize, message: String },
    #[error("{file}: {message}")]
    File { file: PathBuf, message: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlan {
    version: Option<u32>,
    model: Option<String>,
    /// An EAGLE3 draft head's folder, compiled into the last stage.
    draft: Option<String>,
    target: Option<String>,
    arch: Option<String>,
    links: Option<BTreeMap<String, String>>,
    /// Encoder ranks of their own for the vision tower.
    vision: Option<RawVision>,
    stages: Vec<RawStage>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVision {
    ranks: usize,
    hosts: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStage {
    layers: Option<serde_yaml::Value>,
    embedding: Option<bool>,
    final_norm: Option<bool>,
    lm_head: Option<bool>,
    vision: Option<bool>,
    device: Option<usize>,
    host: Option<String>,
    link: Option<String>,
}

struct Ctx<'a> {
    file: &'a Path,
    loc: Locations,
}

impl Ctx<'_> {
    fn at(&self, pos: Option<Pos>, message: String) -> PlanError {
        match pos {
            Some(p) => PlanError::At { file: self.file.to_path_buf(), line: p.line, col: p.col, message },
            None => PlanError::File { file: self.file.to_path_buf(), message },
        }
    }
    fn value(&self, path: &str, message: String) -> PlanError {
        self.at(self.loc.value(path), message)
    }
    fn key(&self, path: &str, message: String) -> PlanError {
        self.at(self.loc.key(path), message)
    }
}

/// Reads a plan file; see [`parse_plan`].
pub fn load_plan(path: &Path, cfg: Option<&ModelConfig>) -> Result<Plan, PlanError> {
    parse_plan(path, &read_plan_text(path)?, cfg)
}

/// A plan file's text: a regular file of at most 1 MB (a plan of 1,000
/// stages is 60 KB), without a byte-order mark.
fn read_plan_text(path: &Path) -> Result<String, PlanError> {
    Ok(m3c_contract::read_user_file(path, "plan", m3c_contract::input::limits::PLAN)?)
}

/// The deepest nesting of YAML flow collections (`[`, `{`) a plan may use.
/// A plan needs 1; the YAML parser and the locator are quadratic in depth.
const MAX_FLOW_DEPTH: usize = 16;

/// The line of the first flow collection nested deeper than
/// [`MAX_FLOW_DEPTH`] (quotes and comments are skipped), if any.
fn too_deep(text: &str) -> Option<usize> {
    let (mut depth, mut line) = (0usize, 1usize);
    let mut quote: Option<char> = None;
    let mut comment = false;
    let mut prev = '\n';
    for c in text.chars() {
        if c == '\n' {
            line += 1;
            comment = false;
        } else if comment {
        } else if let Some(q) = quote {
            if c == q {
                quote = None;
            }
        } else {
            match c {
                '"' | '\'' => quote = Some(c),
                '#' if prev.is_whitespace() => comment = true,
                '[' | '{' => {
                    depth += 1;
                    if depth > MAX_FLOW_DEPTH {
                        return Some(line);
                    }
                }
                ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        prev = c;
    }
    None
}

pub use m3c_contract::manifest::valid_host;

/// Reads only the `model:` entry of a plan (to find the model before validating).
pub fn plan_model(path: &Path) -> Result<Option<PathBuf>, PlanError> {
    let text = read_plan_text(path)?;
    if let Some(line) = too_deep(&text) {
        return Err(PlanError::At {
            file: path.to_path_buf(),
            line,
            col: 1,
            message: format!("flow collections nested deeper than {MAX_FLOW_DEPTH} levels"),
        });
    }
    let raw: RawPlan = from_yaml(path, &text)?;
    Ok(raw.model.map(|m| resolve(path, &m)))
}

fn resolve(plan: &Path, model: &str) -> PathBuf {
    let m = Path::new(model);
    if m.is_absolute() {
        m.to_path_buf()
    } else {
        plan.parent().unwrap_or(Path::new(".")).join(m)
    }
}

fn from_yaml(path: &Path, text: &str) -> Result<RawPlan, PlanError> {
    serde_yaml::from_str(text).map_err(|e| {
        let message = e.to_string();
        // serde_yaml appends " at line L column C"; put the place first instead.
        let message = message.split(" at line ").next().unwrap_or(&message).to_string();
        match e.location() {
            Some(l) => PlanError::At { file: path.to_path_buf(), line: l.line(), col: l.column(), message },
            None => PlanError::File { file: path.to_path_buf(), message },
        }
    })
}

fn parse_layers(ctx: &Ctx, path: &str, v: &serde_yaml::Value, num_layers: Option<usize>) -> Result<LayerRange, PlanError> {
    let bad = || ctx.value(path, format!("`layers` must be a layer number or an inclusive range like \"0-14\", found {}", show(v)));
    let range = match v {
        serde_yaml::Value::Number(n) => {
            let l = n.as_u64().ok_or_else(bad)? as usize;
            LayerRange { first: l, last: l }
        }
        serde_yaml::Value::String(s) => {
            let (a, b) = s.split_once('-').unwrap_or((s, s));
            let a: usize = a.trim().parse().map_err(|_| bad())?;
            let b: usize = b.trim().parse().map_err(|_| bad())?;
            if a > b {
                return Err(ctx.value(path, format!("layer range \"{s}\" is backwards: the first layer must not exceed the last")));
            }
            LayerRange { first: a, last: b }
        }
        _ => return Err(bad()),
    };
    if let Some(n) = num_layers {
        if range.last >= n {
            return Err(ctx.value(path, format!("layer {} is out of range: the model has {n} layers (0-{})", range.last, n - 1)));
        }
    }
    Ok(range)
}

fn show(v: &serde_yaml::Value) -> String {
    serde_yaml::to_string(v).map(|s| s.trim().to_string()).unwrap_or_else(|_| "?".into())
}

/// Parses and validates plan text. With a config, layer numbers are checked
/// against the model and every layer must be in exactly one stage.
pub fn parse_plan(path: &Path, text: &str, cfg: Option<&ModelConfig>) -> Result<Plan, PlanError> {
    let text = m3c_contract::input::strip_bom(text);
    if let Some(line) = too_deep(text) {
        return Err(PlanError::At {
            file: path.to_path_buf(),
            line,
            col: 1,
            message: format!("flow collections nested deeper than {MAX_FLOW_DEPTH} levels"),
        });
    }
    let raw = from_yaml(path, text)?;
    let ctx = Ctx { file: path, loc: locate(text) };
    if let Some(v) = raw.version {
        if v != 1 {
            return Err(ctx.value("version", format!("unsupported plan version {v}: this m3c reads version 1")));
        }
    }
    let target = parse_target(&ctx, &raw)?;
    if raw.stages.is_empty() {
        return Err(ctx.value("stages", "`stages` is empty: a plan needs at least one stage".into()));
    }
    let num_layers = cfg.map(|c| c.text.num_layers);
    let mut stages = parse_stages(&ctx, &raw, &target, num_layers)?;
    let norm = place_parts(&ctx, &raw, &mut stages)?;
    check_layers(&ctx, &stages, num_layers, norm)?;
    let links = parse_links(&ctx, &raw, &stages)?;
    let draft = raw.draft.as_deref().map(|d| resolve(path, d));
    let encoders = parse_encoders(&ctx, &raw, &mut stages)?;
    Ok(Plan { model: raw.model.as_deref().map(|m| resolve(path, m)), target, stages, links, draft, encoders })
}

/// `vision: {ranks: N, hosts: [...]}`: the tower on ranks
/// of its own, after the stages; no stage then holds it, and the
/// embedding's takes its features from them.
fn parse_encoders(ctx: &Ctx, raw: &RawPlan, stages: &mut [StagePlan]) -> Result<Option<Encoders>, PlanError> {
    let Some(v) = &raw.vision else { return Ok(None) };
    if v.ranks == 0 || v.ranks > MAX_ENCODER_RANKS {
        return Err(ctx.value("vision.ranks", format!("`ranks` must be 1 to {MAX_ENCODER_RANKS}, not {}", v.ranks)));
    }
    if let Some(i) = raw.stages.iter().position(|s| s.vision.is_some()) {
        return Err(ctx.key(
            &format!("stages[{i}].vision"),
            format!("stage {i} says `vision`, but the plan puts the tower on encoder ranks of its own (`vision: {{ranks: {}}}`); say one of them", v.ranks),
        ));
    }
    if let Some(n) = v.hosts.as_ref().map(Vec::len).filter(|&n| n != v.ranks) {
        return Err(ctx.value("vision.hosts", format!("`hosts` lists {n} but `ranks` is {}: one per rank", v.ranks)));
    }
    if let Some(h) = v.hosts.iter().flatten().find(|h| !valid_host(h)) {
        return Err(ctx.value("vision.hosts", format!("`{h}` is not a host name")));
    }
    // On GPUs an encoder rank takes the device of its local rank number, as
    // a stage without `device` does.
    let place = (0..v.ranks).map(|j| Placement { device: None, host: v.hosts.as_ref().map(|h| h[j].clone()), link: None }).collect();
    // The first encoder rank's number: after the stages.
    let first = stages.len();
    if let Some(s) = stages.iter_mut().find(|s| s.embedding) {
        (s.vision, s.vision_from) = (false, Some(first));
    }
    Ok(Some(Encoders { ranks: v.ranks, place }))
}

/// The plan's `links`, each parsed, and each stage's `link` checked: it
/// names one of them, and not on stage 0. Stages on different named hosts
/// with no `link` take the plan's only link; with several, they must say.
fn parse_links(ctx: &Ctx, raw: &RawPlan, stages: &[StagePlan]) -> Result<BTreeMap<String, Link>, PlanError> {
    let mut links = BTreeMap::new();
    for (name, text) in raw.links.iter().flatten() {
        if !valid_host(name) {
            return Err(ctx.key(&format!("links.{name}"), format!("link name {name:?}: letters, digits, `-`, `_` and `.` only")));
        }
        let link = Link::parse(text).map_err(|e| ctx.value(&format!("links.{name}"), format!("link `{name}`: {e}")))?;
        links.insert(name.clone(), link);
    }
    let known = || links.keys().map(String::as_str).collect::<Vec<_>>().join(", ");
    for (i, s) in stages.iter().enumerate() {
        let path = format!("stages[{i}].link");
        match &s.place.link {
            Some(_) if i == 0 => {
                return Err(ctx.key(&path, "stage 0 has no stage before it: `link` names the link from the previous stage".into()))
            }
            Some(l) if !links.contains_key(l) => {
                let have = if links.is_empty() { "the plan has no `links`".to_string() } else { format!("known: {}", known()) };
                return Err(ctx.value(&path, format!("stage {i}: no link named `{l}` ({have})")));
            }
            None if i > 0 && links.len() > 1 && crosses_hosts(&stages[i - 1], s) => {
                return Err(ctx.value(
                    &format!("stages[{i}].host"),
                    format!("stages {} and {i} are on different hosts and the plan has several links ({}): say which joins them (`link:` on stage {i})", i - 1, known()),
                ))
            }
            _ => {}
        }
    }
    Ok(links)
}

/// Two stages on named, different hosts.
fn crosses_hosts(a: &StagePlan, b: &StagePlan) -> bool {
    matches!((&a.place.host, &b.place.host), (Some(x), Some(y)) if x != y)
}

/// The plan's `target` and `arch`.
fn parse_target(ctx: &Ctx, raw: &RawPlan) -> Result<Target, PlanError> {
    let name = raw.target.as_deref().unwrap_or("host");
    match (name, raw.arch.as_deref()) {
        ("host", Some(_)) => Err(ctx.key("arch", "`arch` applies to targets cuda and rocm only; this plan's target is host".into())),
        ("host" | "cuda" | "rocm", arch) => Target::named(name, arch).map_err(|e| ctx.value("arch", format!("`arch`: {e}"))),
        (other, _) => Err(ctx.value("target", format!("unknown target \"{other}\": expected \"host\", \"cuda\" or \"rocm\""))),
    }
}

/// Each stage as written: its layer range, host and device checked, the
/// non-layer parts only where the plan sets them.
fn parse_stages(ctx: &Ctx, raw: &RawPlan, target: &Target, num_layers: Option<usize>) -> Result<Vec<StagePlan>, PlanError> {
    let n = raw.stages.len();
    let mut stages = Vec::with_capacity(n);
    for (i, s) in raw.stages.iter().enumerate() {
        let p = format!("stages[{i}]");
        let layers = match &s.layers {
            Some(v) => Some(parse_layers(ctx, &format!("{p}.layers"), v, num_layers)?),
            None => None,
        };
        if let Some(h) = &s.host {
            if !valid_host(h) {
                return Err(ctx.value(
                    &format!("{p}.host"),
                    format!("stage {i}: `host` must be a host name or IPv4 address (letters, digits, `-`, `_`, `.`), found {h:?}"),
                ));
            }
        }
        if s.device.is_some() && *target == Target::Host {
            return Err(ctx.key(
                &format!("{p}.device"),
                format!("stage {i}: `device` applies to the GPU targets (cuda, rocm) only; this plan's target is host"),
            ));
        }
        stages.push(StagePlan {
            layers,
            embedding: s.embedding.unwrap_or(false),
            final_norm: s.final_norm.unwrap_or(false),
            lm_head: s.lm_head.unwrap_or(false),
            vision: false,
            vision_from: None,
            place: Placement { device: s.device, host: s.host.clone(), link: s.link.clone() },
        });
    }
    Ok(stages)
}

/// Places the non-layer parts: each on the stage the plan names, else the
/// first (embedding, vision) or last (lm_head, final norm) stage, exactly
/// once. Returns the final norm's stage.
fn place_parts(ctx: &Ctx, raw: &RawPlan, stages: &mut [StagePlan]) -> Result<usize, PlanError> {
    let n = stages.len();
    let place = |key: &str, default: usize, stages: &mut [StagePlan], get: fn(&mut StagePlan) -> &mut bool| -> Result<usize, PlanError> {
        let set: Vec<usize> = (0..n).filter(|&i| raw.stages[i].field(key) == Some(true)).collect();
        match set.as_slice() {
            [] => {
                *get(&mut stages[default]) = true;
                Ok(default)
            }
            [one] => Ok(*one),
            [_, second, ..] => Err(ctx.key(
                &format!("stages[{second}].{key}"),
                format!("`{key}` is set on stages {} and {second}: it lives on exactly one stage", set[0]),
            )),
        }
    };
    let emb = place("embedding", 0, stages, |s| &mut s.embedding)?;
    if emb != 0 {
        return Err(ctx.key(
            &format!("stages[{emb}].embedding"),
            format!("the embedding must be on the first stage (stage 0), where token ids enter the pipeline; found on stage {emb}"),
        ));
    }
    // The vision tower's features replace embedding rows before layer 0:
    // it lives with the embedding unless another stage says `vision: true`
    // (it then encodes there, off the first stage's step loop, and sends
    // the features to it); `vision: false` there leaves it out.
    let elsewhere: Vec<usize> = (0..n).filter(|&i| i != emb && raw.stages[i].vision == Some(true)).collect();
    match elsewhere.as_slice() {
        [] => stages[emb].vision = raw.stages[emb].vision != Some(false),
        [k] => {
            if raw.stages[emb].vision == Some(true) {
                return Err(ctx.key(
                    &format!("stages[{k}].vision"),
                    format!("`vision` is set on stages {emb} and {k}: the tower lives on exactly one stage"),
                ));
            }
            stages[*k].vision = true;
            stages[emb].vision_from = Some(*k);
        }
        [first, second, ..] => {
            return Err(ctx.key(
                &format!("stages[{second}].vision"),
                format!("`vision` is set on stages {first} and {second}: the tower lives on exactly one stage"),
            ))
        }
    }
    let head = place("lm_head", n - 1, stages, |s| &mut s.lm_head)?;
    if head != n - 1 {
        return Err(ctx.key(
            &format!("stages[{head}].lm_head"),
            format!("the lm_head must be on the last stage (stage {}), which samples the next token; found on stage {head}", n - 1),
        ));
    }
    place("final_norm", head, stages, |s| &mut s.final_norm)
}

/// Layers in order, contiguous, each in exactly one stage; the final norm
/// after the last layer; no empty stage.
fn check_layers(ctx: &Ctx, stages: &[StagePlan], num_layers: Option<usize>, norm: usize) -> Result<(), PlanError> {
    let mut next = 0usize;
    let mut last_layer_stage = 0usize;
    for (i, s) in stages.iter().enumerate() {
        let Some(r) = s.layers else { continue };
        let path = format!("stages[{i}].layers");
        if r.first < next {
            let owner = stages[..i].iter().rposition(|p| p.layers.is_some_and(|q| q.last >= r.first)).unwrap_or(0);
            return Err(ctx.value(
                &path,
                format!(
                    "stage {i}: layers {r} overlap stage {owner} (layers {}); each layer belongs to exactly one stage",
                    stages[owner].layers.map(|x| x.to_string()).unwrap_or_default()
                ),
            ));
        }
        if r.first > next {
            let gap = LayerRange { first: next, last: r.first - 1 };
            return Err(ctx.value(&path, format!("stage {i} starts at layer {}, so {} in no stage", r.first, gap.phrase())));
        }
        next = r.last + 1;
        last_layer_stage = i;
    }
    if let Some(total) = num_layers {
        if next < total {
            let gap = LayerRange { first: next, last: total - 1 };
            let path = if next == 0 { "stages".to_string() } else { format!("stages[{last_layer_stage}].layers") };
            return Err(ctx.value(&path, format!("{} in no stage (the model has {total} layers)", gap.phrase())));
        }
    }
    if norm < last_layer_stage {
        return Err(ctx.key(
            &format!("stages[{norm}].final_norm"),
            format!("the final norm on stage {norm} would run before layer {} on stage {last_layer_stage}", next.saturating_sub(1)),
        ));
    }
    for (i, s) in stages.iter().enumerate() {
        if s.parts().is_empty() {
            return Err(
                ctx.value(&format!("stages[{i}]"), format!("stage {i} is empty: it holds no layers, embedding, final norm or lm_head"))
            );
        }
    }
    Ok(())
}

impl RawStage {
    fn field(&self, key: &str) -> Option<bool> {
        match key {
            "embedding" => self.embedding,
            "final_norm" => self.final_norm,
            "lm_head" => self.lm_head,
            _ => None,
        }
    }
}

impl Plan {
    /// The link stage `k`'s activations cross to stage `k + 1`: the one
    /// stage `k + 1` names, else the plan's only link when the two are on
    /// different named hosts; `None`: the same host (or not known).
    pub fn boundary_link(&self, k: usize) -> Option<(&str, &Link)> {
        let next = self.stages.get(k + 1)?;
        let name = match &next.place.link {
            Some(l) => l.as_str(),
            None if self.links.len() == 1 && crosses_hosts(&self.stages[k], next) => self.links.keys().next()?.as_str(),
            None => return None,
        };
        self.links.get_key_value(name).map(|(n, l)| (n.as_str(), l))
    }

    /// Checks the stage count against `--pp N`.
    pub fn check_pp(&self, file: &Path, pp: usize) -> Result<(), PlanError> {
        if self.stages.len() != pp {
            let loc = locate(&read_plan_text(file).unwrap_or_default());
            let ctx = Ctx { file, loc };
            return Err(ctx.value("stages", format!("the plan has {} stages but --pp {pp} was given", self.stages.len())));
        }
        Ok(())
    }
}
