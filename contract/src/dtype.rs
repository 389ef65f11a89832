//! Element types of checkpoint tensors: one table for the compiler and the
//! runtime, with no silent default for a name it does not know.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum DType {
    #[serde(rename = "BF16")]
    BF16,
    #[serde(rename = "F16")]
    F16,
    #[serde(rename = "F32")]
    F32,
    /// `float8_e4m3fn`: MXFP8 weight elements.
    #[serde(rename = "F8_E4M3")]
    F8E4M3,
    /// `uint8`: MXFP8 E8M0 block scales (`weight_scale_inv`).
    #[serde(rename = "U8")]
    U8,
    #[serde(rename = "I64")]
    I64,
    #[serde(rename = "I32")]
    I32,
    #[serde(rename = "F64")]
    F64,
    /// `bool`, one byte each: an EAGLE3 draft's `t2d` (read past, never used).
    #[serde(rename = "BOOL")]
    Bool,
}

impl DType {
    pub const ALL: [DType; 9] =
        [DType::BF16, DType::F16, DType::F32, DType::F8E4M3, DType::U8, DType::I64, DType::I32, DType::F64, DType::Bool];

    pub fn size_bytes(self) -> usize {
        match self {
            DType::F8E4M3 | DType::U8 | DType::Bool => 1,
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The name safetensors uses in its header.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
            DType::F8E4M3 => "F8_E4M3",
            DType::U8 => "U8",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::F64 => "F64",
            DType::Bool => "BOOL",
        }
    }

    /// The type a safetensors header names, or `None` for one m3c does not read.
    pub fn from_safetensors_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.safetensors_name() == name)
    }

    /// The `torch_dtype` spelling of config.json.
    pub fn from_torch(name: &str) -> Option<DType> {
        Some(match name {
            "bfloat16" => DType::BF16,
            "float16" => DType::F16,
            "float32" => DType::F32,
            _ => return None,
        })
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::BF16 | DType::F16 | DType::F32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::F8E4M3 => "f8e4m3",
            DType::U8 => "u8",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::F64 => "f64",
            DType::Bool => "bool",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for d in DType::ALL {
            assert_eq!(DType::from_safetensors_name(d.safetensors_name()), Some(d));
        }
        assert_eq!(DType::from_safetensors_name("F8_E5M2"), None);
        assert_eq!(DType::from_safetensors_name("bf16"), None);
    }
}
