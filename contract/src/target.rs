//! What stages are compiled for: one type from the plan through the
//! compiler to the manifest and each stage's metadata, written `host` or
//! `cuda ARCH` or `rocm CHIP` wherever it is text, so no reader tests a
//! string prefix.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Target {
    /// x86-64 host code; stages talk over MPI.
    Host,
    /// NVIDIA GPUs of the given architecture (`sm_90a`); stages talk over NCCL.
    Cuda { arch: String },
    /// AMD GPUs of the given chip (`gfx942`: MI300X). The compiler makes
    /// their stages; the stage runtime cannot run them yet (no HIP device).
    Rocm { arch: String },
}

impl Target {
    /// The GPU architecture, for a GPU target.
    pub fn gpu_arch(&self) -> Option<&str> {
        match self {
            Target::Host => None,
            Target::Cuda { arch } | Target::Rocm { arch } => Some(arch),
        }
    }

    pub fn is_gpu(&self) -> bool {
        self.gpu_arch().is_some()
    }

    /// The target's name as plans and `--target` spell it.
    pub fn name(&self) -> &'static str {
        match self {
            Target::Host => "host",
            Target::Cuda { .. } => "cuda",
            Target::Rocm { .. } => "rocm",
        }
    }

    /// The target named `name` (`host`, `cuda`, `rocm`) for `arch`, or its
    /// default architecture; an error says what was expected.
    pub fn named(name: &str, arch: Option<&str>) -> Result<Target, String> {
        match (name, arch) {
            ("host", None) => Ok(Target::Host),
            ("host", Some(_)) => Err("an architecture applies to the GPU targets (cuda, rocm) only".into()),
            ("cuda", arch) => {
                let arch = arch.unwrap_or(DEFAULT_CUDA_ARCH);
                if valid_arch(arch) {
                    Ok(Target::Cuda { arch: arch.into() })
                } else {
                    Err(format!("{arch:?} is not a CUDA architecture: expected one like \"sm_90a\""))
                }
            }
            ("rocm", arch) => {
                let arch = arch.unwrap_or(DEFAULT_ROCM_ARCH);
                if ROCM_ARCHS.contains(&arch) {
                    Ok(Target::Rocm { arch: arch.into() })
                } else {
                    Err(format!("{arch:?} is not an AMD GPU m3c compiles for: expected one of {}", ROCM_ARCHS.join(", ")))
                }
            }
            (other, _) => Err(format!("unknown target {other:?}: expected \"host\", \"cuda\" or \"rocm\"")),
        }
    }

    /// `host`, `cuda ARCH` or `rocm CHIP`.
    pub fn parse(text: &str) -> Result<Target, String> {
        let (name, arch) = match text.split_once(' ') {
            Some((name, arch)) if name != "host" => (name, Some(arch)),
            None if text == "host" => (text, None),
            _ => ("", None),
        };
        match Target::named(name, arch) {
            Ok(t) if t.to_string() == text => Ok(t),
            _ => {
                Err(format!("target {text:?}: expected `host`, `cuda ARCH` (such as `cuda sm_90a`) or `rocm CHIP` (such as `rocm gfx942`)"))
            }
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Host => f.write_str("host"),
            Target::Cuda { arch } => write!(f, "cuda {arch}"),
            Target::Rocm { arch } => write!(f, "rocm {arch}"),
        }
    }
}

impl From<Target> for String {
    fn from(t: Target) -> String {
        t.to_string()
    }
}

impl TryFrom<String> for Target {
    type Error = String;
    fn try_from(text: String) -> Result<Target, String> {
        Target::parse(&text)
    }
}

/// The CUDA architecture a plan without `arch` compiles for (H100, H200).
pub const DEFAULT_CUDA_ARCH: &str = "sm_90a";

/// The AMD chip a plan without `arch` compiles for (MI300X, MI325X).
pub const DEFAULT_ROCM_ARCH: &str = "gfx942";

/// The AMD chips m3c compiles for: CDNA 3 (MI300X, MI325X) and CDNA 4
/// (MI350X, MI355X), the wave-64 data-centre GPUs that hold MiniMax-M3 in
/// four to eight of them.
pub const ROCM_ARCHS: &[&str] = &["gfx942", "gfx950"];

/// Whether `arch` is a CUDA architecture name like `sm_90a`.
pub fn valid_arch(arch: &str) -> bool {
    arch.strip_prefix("sm_").is_some_and(|r| {
        let digits = r.strip_suffix('a').unwrap_or(r);
        !digits.is_empty() && digits.len() <= 4 && digits.chars().all(|c| c.is_ascii_digit())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_round_trip_through_their_one_text_form() {
        for t in [
            Target::Host,
            Target::Cuda { arch: "sm_90a".into() },
            Target::Rocm { arch: "gfx942".into() },
            Target::Rocm { arch: "gfx950".into() },
        ] {
            assert_eq!(Target::parse(&t.to_string()), Ok(t.clone()));
            let json = serde_json::to_string(&t).unwrap();
            assert_eq!(serde_json::from_str::<Target>(&json).unwrap(), t, "{json}");
        }
        assert_eq!(serde_json::to_string(&Target::Cuda { arch: "sm_90a".into() }).unwrap(), "\"cuda sm_90a\"");
        for bad in [
            "",
            "cuda",
            "cuda sm_",
            "cuda sm_90a extra",
            "rocm",
            "rocm gfx90a",
            "rocm gfx942 x",
            "rocm sm_90a",
            "cuda gfx942",
            "host gfx942",
            "Host",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Target::Cuda { arch: "sm_90a".into() }.is_gpu() && !Target::Host.is_gpu());
        assert_eq!(Target::named("rocm", None), Ok(Target::Rocm { arch: "gfx942".into() }));
        assert_eq!(Target::named("cuda", None), Ok(Target::Cuda { arch: "sm_90a".into() }));
        assert!(Target::named("host", Some("gfx942")).is_err() && Target::named("tpu", None).is_err());
    }
}
