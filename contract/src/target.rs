//! What stages are compiled for: one type from the plan through the
//! compiler to the manifest and each stage's metadata, written `host` or
//! `cuda ARCH` wherever it is text, so no reader tests a string prefix.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Target {
    /// x86-64 host code; stages talk over MPI.
    Host,
    /// NVIDIA GPUs of the given architecture (`sm_90a`); stages talk over NCCL.
    Cuda { arch: String },
}

impl Target {
    /// The GPU architecture, for a GPU target.
    pub fn gpu_arch(&self) -> Option<&str> {
        match self {
            Target::Host => None,
            Target::Cuda { arch } => Some(arch),
        }
    }

    pub fn is_gpu(&self) -> bool {
        self.gpu_arch().is_some()
    }

    /// `host` or `cuda ARCH`.
    pub fn parse(text: &str) -> Result<Target, String> {
        match text.split_once(' ') {
            None if text == "host" => Ok(Target::Host),
            Some(("cuda", arch)) if valid_arch(arch) => Ok(Target::Cuda { arch: arch.into() }),
            _ => Err(format!("target {text:?}: expected `host` or `cuda ARCH` (such as `cuda sm_90a`)")),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Host => f.write_str("host"),
            Target::Cuda { arch } => write!(f, "cuda {arch}"),
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
        for t in [Target::Host, Target::Cuda { arch: "sm_90a".into() }] {
            assert_eq!(Target::parse(&t.to_string()), Ok(t.clone()));
            let json = serde_json::to_string(&t).unwrap();
            assert_eq!(serde_json::from_str::<Target>(&json).unwrap(), t, "{json}");
        }
        assert_eq!(serde_json::to_string(&Target::Cuda { arch: "sm_90a".into() }).unwrap(), "\"cuda sm_90a\"");
        for bad in ["", "cuda", "cuda sm_", "cuda sm_90a extra", "rocm gfx942", "Host"] {
            assert!(Target::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Target::Cuda { arch: "sm_90a".into() }.is_gpu() && !Target::Host.is_gpu());
    }
}
