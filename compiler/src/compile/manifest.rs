//! OUT/manifest.json: what was compiled from what, with content hashes (the
//! contract's [`Manifest`], filled in here from the stage programs).

use crate::config::ModelConfig;
use crate::lower::StageProgram;
use m3c_contract::manifest::{sha256_hex, Manifest, StageEntry, FORMAT};

#[allow(clippy::too_many_arguments)]
pub fn new(
    cfg: &ModelConfig,
    config_sha: &str,
    plan_json: &str,
    runtime_sha: &str,
    compile_id: &str,
    cpu: &str,
    target: &m3c_contract::target::Target,
    kv_cache: &str,
    activations: &str,
) -> Manifest {
    Manifest {
        format: FORMAT.into(),
        compiler: format!("m3c {}", env!("CARGO_PKG_VERSION")),
        target: target.clone(),
        cpu: cpu.into(),
        kv_cache: kv_cache.into(),
        activations: activations.into(),
        compile_id: compile_id.into(),
        config_file: cfg.source.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        config_sha256: config_sha.into(),
        plan_sha256: sha256_hex(plan_json.as_bytes()),
        runtime_sha256: runtime_sha.into(),
        launcher: "run.sh".into(),
        max_positions: cfg.text.max_position_embeddings,
        kv_block: cfg.text.kv_block(),
        image_token: cfg.vision.as_ref().map(|v| v.image_token_id),
        video_token: cfg.vision.as_ref().map(|v| v.video_token_id),
        stages: Vec::new(),
        draft_config_sha256: None,
        encoder: None,
    }
}

pub fn stage_entry(p: &StageProgram, exe: &str, bytes: &[u8], host: Option<String>) -> StageEntry {
    use crate::model::Part;
    let layers: Vec<usize> = p.parts.iter().filter_map(|x| if let Part::Layer(l) = x { Some(*l) } else { None }).collect();
    StageEntry {
        stage: p.index,
        executable: exe.into(),
        sha256: sha256_hex(bytes),
        holds: super::holds(p),
        host,
        layers: layers.first().map(|&a| [a, *layers.last().unwrap_or(&a)]),
        input: p.text.input,
        output: p.text.output,
        tensors: p.tensors.iter().map(|t| t.name.clone()).collect(),
        caches: p.caches.clone(),
        vision: p.vision.is_some(),
        kernels: p.kernels.iter().map(|k| k.symbol()).collect(),
        device_code: None,
    }
}
