//! Generation defaults of a checkpoint: the sampling settings of
//! `generation_config.json` (as vLLM uses them: every field present is a
//! default, `do_sample` aside) and the ids that end a sequence
//! (`generation_config.json`'s `eos_token_id`, else `config.json`'s, at the
//! top or in `text_config`).

use super::TextError;
use m3c_contract::input::{limits, read_user_file};
use m3c_contract::sampling::SamplingOverrides;
use std::path::Path;

/// What the checkpoint asks for; `None` where it says nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    /// The sampling fields it sets (never the seed).
    pub sampling: SamplingOverrides,
    pub eos_ids: Vec<i64>,
    /// The files the values came from, for the run's report.
    pub sources: Vec<String>,
}

/// `eos_token_id`: one id or a list of ids.
fn ids(v: &serde_json::Value) -> Option<Vec<i64>> {
    match v {
        serde_json::Value::Number(n) => n.as_i64().map(|i| vec![i]),
        serde_json::Value::Array(a) => a.iter().map(|x| x.as_i64()).collect(),
        _ => None,
    }
}

fn read_json(file: &Path, what: &str) -> Result<Option<serde_json::Value>, TextError> {
    if std::fs::symlink_metadata(file).is_err() {
        return Ok(None);
    }
    let text = read_user_file(file, what, limits::TOKENIZER)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| TextError::Config { file: file.to_path_buf(), message: format!("not JSON: {e}") })?;
    if !v.is_object() {
        return Err(TextError::Config { file: file.to_path_buf(), message: "expected a JSON object".into() });
    }
    Ok(Some(v))
}

impl GenerationDefaults {
    pub fn from_dir(dir: &Path) -> Result<GenerationDefaults, TextError> {
        let mut d = GenerationDefaults::default();
        let gen_file = dir.join("generation_config.json");
        if let Some(g) = read_json(&gen_file, "generation config")? {
            let bad = |key: &str, want: &str| TextError::Config { file: gen_file.clone(), message: format!("`{key}`: expected {want}") };
            // Every sampling field the checkpoint sets, by the contract's table.
            let map = g.as_object().cloned().unwrap_or_default();
            d.sampling = SamplingOverrides::from_json(&map)
                .map_err(|(key, why)| TextError::Config { file: gen_file.clone(), message: format!("`{key}`: {why}") })?;
            if let Some(v) = g.get("eos_token_id").filter(|v| !v.is_null()) {
                d.eos_ids = ids(v).ok_or_else(|| bad("eos_token_id", "an id or a list of ids"))?;
                d.sources.push("generation_config.json".into());
            } else if d != GenerationDefaults::default() {
                d.sources.push("generation_config.json".into());
            }
        }
        if d.eos_ids.is_empty() {
            let cfg_file = dir.join("config.json");
            if let Some(c) = read_json(&cfg_file, "model config")? {
                let v = c.get("eos_token_id").or_else(|| c.get("text_config").and_then(|t| t.get("eos_token_id")));
                if let Some(v) = v.filter(|v| !v.is_null()) {
                    d.eos_ids = ids(v).ok_or_else(|| TextError::Config {
                        file: cfg_file.clone(),
                        message: "`eos_token_id`: expected an id or a list of ids".into(),
                    })?;
                    d.sources.push("config.json".into());
                }
            }
        }
        Ok(d)
    }
}
