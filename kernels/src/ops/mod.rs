//! The kernel types, one module (file) each; `kernels!` in `lib.rs` lists
//! them once more to make the `Kernel` enum.

pub mod add;
pub mod attention;
pub mod axial_rope;
pub mod bias_act;
pub mod copy_cols;
pub mod dequant_mxfp8;
pub mod embedding;
pub mod gelu;
pub mod head_norm_rope;
pub mod layer_norm;
pub mod linear;
pub mod rms_norm;
pub mod routed_experts;
pub mod router;
pub mod sample;
pub mod scatter_rows;
pub mod swiglu_oai;
pub mod to_bf16;

pub use add::Add;
pub use attention::Attention;
pub use axial_rope::AxialRope;
pub use bias_act::BiasAct;
pub use copy_cols::CopyCols;
pub use dequant_mxfp8::DequantMxfp8;
pub use embedding::Embedding;
pub use gelu::Gelu;
pub use head_norm_rope::HeadNormRope;
pub use layer_norm::LayerNorm;
pub use linear::Linear;
pub use rms_norm::RmsNorm;
pub use routed_experts::RoutedExperts;
pub use router::Router;
pub use sample::Sample;
pub use scatter_rows::ScatterRows;
pub use swiglu_oai::SwiGluOai;
pub use to_bf16::ToBf16;
