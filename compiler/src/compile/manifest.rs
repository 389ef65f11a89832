//! OUT/manifest.json: what was compiled from what, with content hashes.

use crate::config::ModelConfig;
use crate::lower::{Boundary, CacheSlot, StageProgram};
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct Manifest {
    pub format: &'static str,
    pub compiler: String,
    pub target: String,
    pub cpu: String,
    /// How the KV and index-key caches store elements (`f32` or `bf16`).
    pub kv_cache: &'static str,
    /// How activations between kernels and stages are stored (`f32` or `bf16`).
    pub activations: &'static str,
    /// Hash of every compile input; every stage embeds it and checks its peers.
    pub compile_id: String,
    /// The config's file name (not its path, so OUT does not depend on where it was built).
    pub config_file: String,
    pub config_sha256: String,
    pub plan_sha256: String,
    pub runtime_sha256: String,
    pub launcher: &'static str,
    pub stages: Vec<StageEntry>,
}

#[derive(Debug, Serialize)]
pub struct StageEntry {
    pub stage: usize,
    pub executable: String,
    pub sha256: String,
    pub holds: String,
    /// The MPI host the plan puts this stage on (`mpirun --host`), if any.
    pub host: Option<String>,
    /// First and last layer, if the stage has layers.
    pub layers: Option<[usize; 2]>,
    pub input: Boundary,
    pub output: Boundary,
    pub tensors: Vec<String>,
    pub caches: Vec<CacheSlot>,
    /// Whether the stage encodes images (holds the vision tower).
    pub vision: bool,
    pub kernels: Vec<String>,
    /// CUDA stages: what the executable embeds, `cubin ARCH` (assembled by
    /// ptxas at compile time) or `ptx ARCH` (no ptxas: JIT at start-up).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_code: Option<String>,
}

impl Manifest {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &ModelConfig,
        config_sha: &str,
        plan_json: &str,
        runtime_sha: &str,
        compile_id: &str,
        cpu: &str,
        target: &str,
        kv_cache: &'static str,
        activations: &'static str,
    ) -> Manifest {
        Manifest {
            format: "m3c-out/1",
            compiler: format!("m3c {}", env!("CARGO_PKG_VERSION")),
            target: target.into(),
            cpu: cpu.into(),
            kv_cache,
            activations,
            compile_id: compile_id.into(),
            config_file: cfg.source.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            config_sha256: config_sha.into(),
            plan_sha256: super::sha256_hex(plan_json.as_bytes()),
            runtime_sha256: runtime_sha.into(),
            launcher: "run.sh",
            stages: Vec::new(),
        }
    }
}

impl StageEntry {
    pub fn new(p: &StageProgram, exe: &str, bytes: &[u8], host: Option<String>) -> StageEntry {
        use crate::model::Part;
        let layers: Vec<usize> = p.parts.iter().filter_map(|x| if let Part::Layer(l) = x { Some(*l) } else { None }).collect();
        StageEntry {
            stage: p.index,
            executable: exe.into(),
            sha256: super::sha256_hex(bytes),
            holds: super::holds(p),
            host,
            layers: layers.first().map(|&a| [a, *layers.last().unwrap_or(&a)]),
            input: p.input,
            output: p.output,
            tensors: p.tensors.iter().map(|t| t.name.clone()).collect(),
            caches: p.caches.clone(),
            vision: p.vision.is_some(),
            kernels: p.kernels.iter().map(|k| k.symbol()).collect(),
            device_code: None,
        }
    }
}
