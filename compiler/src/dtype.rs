//! Element types of checkpoint tensors.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum DType {
    BF16,
    F16,
    F32,
    /// `float8_e4m3fn`: MXFP8 weight elements.
    F8E4M3,
    /// `uint8`: MXFP8 E8M0 block scales (`weight_scale_inv`).
    U8,
    I64,
    I32,
    F64,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F8E4M3 | DType::U8 => 1,
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
        }
    }

    pub fn from_safetensors(d: safetensors::Dtype) -> Option<DType> {
        use safetensors::Dtype as S;
        Some(match d {
            S::BF16 => DType::BF16,
            S::F16 => DType::F16,
            S::F32 => DType::F32,
            S::F8_E4M3 => DType::F8E4M3,
            S::U8 => DType::U8,
            S::I64 => DType::I64,
            S::I32 => DType::I32,
            S::F64 => DType::F64,
            _ => return None,
        })
    }

    pub fn to_safetensors(self) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match self {
            DType::BF16 => S::BF16,
            DType::F16 => S::F16,
            DType::F32 => S::F32,
            DType::F8E4M3 => S::F8_E4M3,
            DType::U8 => S::U8,
            DType::I64 => S::I64,
            DType::I32 => S::I32,
            DType::F64 => S::F64,
        }
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
        })
    }
}
