//! Element types of checkpoint tensors: the contract's one table
//! (`m3c_contract::DType`), plus the conversion to the safetensors crate's
//! type that `init-tiny` writes with.

pub use m3c_contract::DType;

/// The safetensors crate's name for a type (used when writing files).
pub fn to_safetensors(d: DType) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match d {
        DType::BF16 => S::BF16,
        DType::F16 => S::F16,
        DType::F32 => S::F32,
        DType::F8E4M3 => S::F8_E4M3,
        DType::U8 => S::U8,
        DType::I64 => S::I64,
        DType::I32 => S::I32,
        DType::F64 => S::F64,
        DType::Bool => S::BOOL,
    }
}
