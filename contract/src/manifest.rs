//! `OUT/manifest.json`: what `m3c compile` made, from what, with content
//! hashes. The compiler writes it; `m3c run` and `m3c serve` read it back
//! with the same type before they start a stage.

use crate::stage::{Boundary, CacheSlot};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The `format` of the manifests this version writes and reads.
pub const FORMAT: &str = "m3c-out/4";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub compiler: String,
    pub target: crate::target::Target,
    pub cpu: String,
    /// How the KV and index-key caches store elements (`f32` or `bf16`).
    pub kv_cache: String,
    /// How activations between kernels and stages are stored (`f32` or `bf16`).
    pub activations: String,
    /// Hash of every compile input; every stage embeds it and checks its peers.
    pub compile_id: String,
    /// The config's file name (not its path, so OUT does not depend on where it was built).
    pub config_file: String,
    pub config_sha256: String,
    pub plan_sha256: String,
    pub runtime_sha256: String,
    pub launcher: String,
    /// The model's context: its config's `max_position_embeddings`.
    pub max_positions: usize,
    /// Positions per KV cache block (the model's MSA block): what a
    /// sequence's cache grows by, and the unit of prefix caching.
    /// (Defaulted so that an older manifest is refused for its format, not
    /// for a missing key.)
    #[serde(default)]
    pub kv_block: usize,
    /// The image placeholder id, when the model has a vision tower.
    pub image_token: Option<usize>,
    /// The video placeholder id, likewise.
    #[serde(default)]
    pub video_token: Option<usize>,
    pub stages: Vec<StageEntry>,
    /// sha256 of the EAGLE3 draft's `config.json` when its head was
    /// compiled into the last stage: the front checks a run's draft against
    /// it before mpirun starts, in the last stage's words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_config_sha256: Option<String>,
    /// The encoder ranks' executable (a plan's `vision: {ranks: N}`), run by
    /// every encoder rank after the stages.
    #[serde(default)]
    pub encoder: Option<EncoderEntry>,
}

/// The encoder ranks: their one executable and where each runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncoderEntry {
    pub executable: String,
    pub sha256: String,
    /// One per rank: the host it runs on, if the plan names one.
    pub hosts: Vec<Option<String>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_code: Option<String>,
}

/// Why a manifest cannot be used; the caller names the file.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestError {
    #[error("not an m3c manifest ({0})")]
    Unreadable(String),
    #[error("format {found:?} is not the one this m3c reads ({FORMAT}); recompile with this m3c")]
    Format { found: String },
    #[error("it lists no stages")]
    NoStages,
    #[error("its kv_block is 0: a cache block holds at least one position")]
    KvBlock,
    #[error("entry {position} is stage {found}: the stages must be listed in order")]
    Order { position: usize, found: usize },
    #[error("stage {stage} names host {host:?}, which is not a host name")]
    Host { stage: usize, host: String },
    #[error("stage {stage}'s sha256 {sha:?} is not 64 hex digits")]
    Sha { stage: usize, sha: String },
}

impl Manifest {
    /// Parses and checks a manifest: this version's format, stages listed
    /// in order, valid host names and hashes.
    pub fn parse(text: &str) -> Result<Manifest, ManifestError> {
        let m: Manifest = serde_json::from_str(text).map_err(|e| ManifestError::Unreadable(e.to_string()))?;
        if m.format != FORMAT {
            return Err(ManifestError::Format { found: m.format });
        }
        if m.stages.is_empty() {
            return Err(ManifestError::NoStages);
        }
        if m.kv_block == 0 {
            return Err(ManifestError::KvBlock);
        }
        for (position, s) in m.stages.iter().enumerate() {
            if s.stage != position {
                return Err(ManifestError::Order { position, found: s.stage });
            }
            if let Some(host) = s.host.as_ref().filter(|h| !valid_host(h)) {
                return Err(ManifestError::Host { stage: s.stage, host: host.clone() });
            }
            if s.sha256.len() != 64 || !s.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(ManifestError::Sha { stage: s.stage, sha: s.sha256.clone() });
            }
        }
        // The encoder ranks come after the stages: checked as they are, and
        // their executable is a plain name in the folder.
        if let Some(e) = &m.encoder {
            let after = m.stages.len();
            if let Some(host) = e.hosts.iter().flatten().find(|h| !valid_host(h)) {
                return Err(ManifestError::Host { stage: after, host: host.clone() });
            }
            if e.sha256.len() != 64 || !e.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(ManifestError::Sha { stage: after, sha: e.sha256.clone() });
            }
            if e.executable != "encoder" || e.hosts.is_empty() {
                return Err(ManifestError::Unreadable(format!(
                    "`encoder`: expected the executable `encoder` and one or more ranks, found `{}` and {} rank(s)",
                    e.executable,
                    e.hosts.len()
                )));
            }
        }
        Ok(m)
    }

    /// Whether the pipeline encodes images: a stage holds the vision tower
    /// (the first, or another that sends the features to it), or encoder
    /// ranks of their own do.
    pub fn encodes_images(&self) -> bool {
        self.stages.iter().any(|s| s.vision) || self.encoder.is_some()
    }

    /// Cache bytes per position of each stage (every cache row of a sequence).
    pub fn cache_bytes_per_position(&self) -> Vec<u64> {
        self.stages.iter().map(|s| s.caches.iter().map(|c| (c.width * c.bytes) as u64).sum()).collect()
    }
}

/// Whether `h` can name a host for mpirun: a DNS name or IPv4 address
/// (letters, digits, `-`, `_` and `.`-separated labels of at most 63
/// characters, none starting with `-`). Anything else, such as a space, a
/// quote, `$(...)` or mpirun's `:slots` suffix, is refused when the plan is
/// read, before it can reach a launcher.
pub fn valid_host(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
}

/// Checks that `DIR/config.json` is the config stages were compiled from
/// (`compiled`: its sha256): the one check, in one wording, that the front
/// makes before mpirun starts and each stage makes at start.
pub fn check_config(dir: &std::path::Path, compiled: &str) -> Result<(), String> {
    let config = dir.join("config.json");
    let bytes =
        crate::input::read_bytes(&config, "config", crate::input::limits::CONFIG).map_err(|e| format!("--model {}: {e}", dir.display()))?;
    let hash = sha256_hex(&bytes);
    if hash == compiled {
        return Ok(());
    }
    Err(format!(
        "--model {}: {} is not the config these stages were compiled from (sha256 {}…, compiled for {}…); \
         recompile with `m3c compile --model {}` or pass the model folder it was compiled for",
        dir.display(),
        config.display(),
        &hash[..12],
        compiled.get(..12).unwrap_or(compiled),
        dir.display()
    ))
}

/// Checks that `dir` is the EAGLE3 draft whose head these stages hold
/// (`compiled`: its config's sha256; `None`: they hold none), in the words
/// both the front's pre-flight and the last stage use.
pub fn check_draft_config(dir: &std::path::Path, compiled: Option<&str>) -> Result<(), String> {
    let Some(compiled) = compiled else {
        return Err(format!(
            "EAGLE3 draft {}: these stages were compiled without a draft head; EAGLE3 speculation needs one \
             (`m3c compile --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{}\", ...}}'`)",
            dir.display(),
            dir.display()
        ));
    };
    let config = dir.join("config.json");
    let bytes = crate::input::read_bytes(&config, "draft config", crate::input::limits::CONFIG)
        .map_err(|e| format!("EAGLE3 draft {}: {e}", dir.display()))?;
    let hash = sha256_hex(&bytes);
    if hash == compiled {
        return Ok(());
    }
    Err(format!(
        "EAGLE3 draft {}: {} is not the draft these stages were compiled with (sha256 {}…, compiled for {}…); \
         recompile with `m3c compile --speculative-config` naming this draft",
        dir.display(),
        config.display(),
        &hash[..12],
        compiled.get(..12).unwrap_or(compiled)
    ))
}

/// Lower-case hex sha256 of `bytes`: the manifest's content hashes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        let stage = |k: usize| StageEntry {
            stage: k,
            executable: format!("stage-{k}"),
            sha256: sha256_hex(&[k as u8]),
            holds: "layer 0".into(),
            host: Some("node-1".into()),
            layers: Some([0, 0]),
            input: Boundary::TokenIds,
            output: Boundary::Logits { vocab: 8 },
            tensors: vec!["w".into()],
            caches: vec![CacheSlot { layer: 0, kind: "key".into(), width: 4, bytes: 2 }],
            vision: k == 0,
            kernels: vec![],
            device_code: None,
        };
        Manifest {
            format: FORMAT.into(),
            compiler: "m3c 0.1.0".into(),
            target: crate::target::Target::Host,
            cpu: "x86-64".into(),
            kv_cache: "bf16".into(),
            activations: "f32".into(),
            compile_id: "id".into(),
            config_file: "config.json".into(),
            config_sha256: "c".into(),
            plan_sha256: "p".into(),
            runtime_sha256: "r".into(),
            launcher: "run.sh".into(),
            max_positions: 64,
            kv_block: 4,
            image_token: Some(9),
            video_token: Some(10),
            encoder: None,
            draft_config_sha256: None,
            stages: vec![stage(0), stage(1)],
        }
    }

    #[test]
    fn a_manifest_round_trips_and_answers_from_its_stages() {
        let m = sample();
        let back = Manifest::parse(&serde_json::to_string_pretty(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        assert!(back.encodes_images());
        assert_eq!(back.cache_bytes_per_position(), vec![8, 8]);
    }

    #[test]
    fn a_damaged_manifest_is_an_error_naming_what_is_wrong() {
        let text = |f: &dyn Fn(&mut Manifest)| {
            let mut m = sample();
            f(&mut m);
            serde_json::to_string(&m).unwrap()
        };
        assert_eq!(Manifest::parse(&text(&|m| m.format = "m3c-out/0".into())), Err(ManifestError::Format { found: "m3c-out/0".into() }));
        assert_eq!(Manifest::parse(&text(&|m| m.stages.clear())), Err(ManifestError::NoStages));
        assert_eq!(Manifest::parse(&text(&|m| m.stages.swap(0, 1))), Err(ManifestError::Order { position: 0, found: 1 }));
        assert_eq!(
            Manifest::parse(&text(&|m| m.stages[1].host = Some("a b".into()))),
            Err(ManifestError::Host { stage: 1, host: "a b".into() })
        );
        assert!(matches!(Manifest::parse(&text(&|m| m.stages[0].sha256 = "../x".into())), Err(ManifestError::Sha { stage: 0, .. })));
        assert!(matches!(Manifest::parse("{\"format\": 1}"), Err(ManifestError::Unreadable(_))));
    }
}
