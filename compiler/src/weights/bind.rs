use super::checkpoint::{Checkpoint, TensorEntry};
use crate::config::ModelConfig;
use crate::model::{expected_tensors, Part, TensorSpec};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;

/// One thing wrong between the config and the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum BindProblem {
    Missing { name: String, shape: Vec<usize>, expected: &'static str },
    Unexpected { name: String, file: PathBuf },
    Shape { name: String, file: PathBuf, expected: Vec<usize>, found: Vec<usize> },
    Dtype { name: String, file: PathBuf, expected: &'static str, found: String },
}

impl fmt::Display for BindProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BindProblem::Missing { name, shape, expected } => {
                write!(f, "missing tensor `{name}` (expected shape {shape:?}, {expected})")
            }
            BindProblem::Unexpected { name, file } => {
                write!(f, "{}: unexpected tensor `{name}` (not part of this config's model)", file.display())
            }
            BindProblem::Shape { name, file, expected, found } => {
                write!(f, "{}: tensor `{name}` has shape {found:?}, expected {expected:?}", file.display())
            }
            BindProblem::Dtype { name, file, expected, found } => {
                write!(f, "{}: tensor `{name}` is {found}, expected {expected}", file.display())
            }
        }
    }
}

/// Every problem found while binding, reported together.
#[derive(Debug, thiserror::Error)]
pub struct BindReport {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub problems: Vec<BindProblem>,
}

impl fmt::Display for BindReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = |p: fn(&BindProblem) -> bool| self.problems.iter().filter(|x| p(x)).count();
        writeln!(
            f,
            "checkpoint {} does not match {}: {} missing, {} unexpected, {} mismatched",
            self.dir.display(),
            self.config.display(),
            count(|p| matches!(p, BindProblem::Missing { .. })),
            count(|p| matches!(p, BindProblem::Unexpected { .. })),
            count(|p| matches!(p, BindProblem::Shape { .. } | BindProblem::Dtype { .. })),
        )?;
        const SHOWN: usize = 40;
        for p in self.problems.iter().take(SHOWN) {
            writeln!(f, "  {p}")?;
        }
        if self.problems.len() > SHOWN {
            writeln!(f, "  ... and {} more", self.problems.len() - SHOWN)?;
        }
        Ok(())
    }
}

/// The tensors of (part of) a model, each bound to its checkpoint entry.
pub struct BoundWeights<'a> {
    pub checkpoint: &'a Checkpoint,
    /// Expected spec and where it lives, in the order of `expected_tensors`.
    pub tensors: Vec<(TensorSpec, &'a TensorEntry)>,
}

impl<'a> BoundWeights<'a> {
    pub fn get(&self, name: &str) -> Option<&(TensorSpec, &'a TensorEntry)> {
        self.tensors.iter().find(|(s, _)| s.name == name)
    }
}

/// Binds the tensors of `parts` (all parts when `None`) by their hub names and
/// checks shape and element type against the config. Tensors of the
/// checkpoint that belong to no part of the model are reported as unexpected
/// when the whole model is bound.
pub fn bind<'a>(cfg: &ModelConfig, ck: &'a Checkpoint, parts: Option<&BTreeSet<Part>>) -> Result<BoundWeights<'a>, BindReport> {
    let specs = expected_tensors(cfg);
    // A flat text config may sit beside hub shards that name text tensors
    // `language_model.…`: accept that prefix when the bare name is absent.
    let alt_prefix = cfg.family.model().stored_prefix(cfg, &|name| ck.tensors.contains_key(name));
    let mut problems = Vec::new();
    let mut tensors = Vec::new();
    let mut used: BTreeSet<&str> = BTreeSet::new();
    for spec in &specs {
        let entry = ck.tensors.get(&spec.name).or_else(|| ck.tensors.get(&format!("{alt_prefix}{}", spec.name)));
        if let Some(e) = entry {
            used.insert(e.name.as_str());
        }
        if parts.is_some_and(|p| !p.contains(&spec.part)) {
            continue;
        }
        let Some(e) = entry else {
            problems.push(BindProblem::Missing { name: spec.name.clone(), shape: spec.shape.clone(), expected: spec.rule.describe() });
            continue;
        };
        let file = ck.file_of(e).to_path_buf();
        let mut ok = true;
        if e.shape != spec.shape {
            problems.push(BindProblem::Shape {
                name: spec.name.clone(),
                file: file.clone(),
                expected: spec.shape.clone(),
                found: e.shape.clone(),
            });
            ok = false;
        }
        if !spec.rule.accepts(e.dtype) {
            problems.push(BindProblem::Dtype { name: spec.name.clone(), file, expected: spec.rule.describe(), found: e.dtype.to_string() });
            ok = false;
        }
        if ok {
            tensors.push((spec.clone(), e));
        }
    }
    if parts.is_none() {
        let by_name: BTreeMap<&str, &TensorEntry> = ck.tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        for (name, e) in by_name {
            if !used.contains(name) {
                problems.push(BindProblem::Unexpected { name: name.to_string(), file: ck.file_of(e).to_path_buf() });
            }
        }
    }
    if problems.is_empty() {
        Ok(BoundWeights { checkpoint: ck, tensors })
    } else {
        Err(BindReport { dir: ck.dir.clone(), config: cfg.source.clone(), problems })
    }
}
