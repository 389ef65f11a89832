use super::names;
use crate::config::{ModelConfig, Quantization};
use crate::dtype::DType;

/// Where a tensor lives in the model; stages are made of parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Part {
    Embedding,
    Layer(usize),
    FinalNorm,
    LmHead,
    /// The vision tower, projector and patch merger.
    Vision,
    /// An EAGLE3 draft head (its own program on the stage that runs it).
    Draft,
}

/// What a tensor does; the cost model reads this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Role {
    Embedding,
    Norm,
    /// A linear weight `[out, in]`.
    Linear,
    /// The MXFP8 E8M0 scales `[out, in/32]` of the linear before it.
    Scale,
    /// A routed expert's tensor (linear or scale) of expert `e`.
    Expert(usize),
    /// MoE router weight or its selection bias.
    Router,
    Vision,
}

/// Which element types the checkpoint may store a tensor in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum TypeRule {
    /// Any floating type (bf16, f16, f32).
    Float,
    /// `float8_e4m3fn` (MXFP8 weight).
    Fp8,
    /// `uint8` E8M0 scales.
    E8M0,
}

impl TypeRule {
    pub fn accepts(self, d: DType) -> bool {
        match self {
            TypeRule::Float => d.is_float(),
            TypeRule::Fp8 => d == DType::F8E4M3,
            TypeRule::E8M0 => d == DType::U8,
        }
    }
    pub fn describe(self) -> &'static str {
        match self {
            TypeRule::Float => "bf16, f16 or f32",
            TypeRule::Fp8 => "f8_e4m3 (MXFP8 weight)",
            TypeRule::E8M0 => "u8 (MXFP8 E8M0 scales)",
        }
    }
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub rule: TypeRule,
    /// The type the published checkpoint uses (for sizes without weights).
    pub nominal: DType,
    pub part: Part,
    pub role: Role,
}

impl TensorSpec {
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
    pub fn nominal_bytes(&self) -> u64 {
        self.numel() * self.nominal.size_bytes() as u64
    }
    /// Scales are storage, not parameters.
    pub fn is_parameter(&self) -> bool {
        self.rule != TypeRule::E8M0
    }
}

/// Builds a layout: the helpers every family's tensor list uses.
pub(crate) struct LayoutBuilder<'a> {
    pub cfg: &'a ModelConfig,
    /// The float type of unquantised tensors (the config's `torch_dtype`).
    pub float: DType,
    pub out: Vec<TensorSpec>,
}

impl<'a> LayoutBuilder<'a> {
    pub fn new(cfg: &'a ModelConfig) -> Self {
        let float = cfg.torch_dtype.as_deref().and_then(DType::from_torch).unwrap_or(DType::BF16);
        LayoutBuilder { cfg, float, out: Vec::new() }
    }

    pub fn push(&mut self, name: String, shape: Vec<usize>, rule: TypeRule, nominal: DType, part: Part, role: Role) {
        self.out.push(TensorSpec { name, shape, rule, nominal, part, role });
    }

    pub fn float(&mut self, name: String, shape: Vec<usize>, part: Part, role: Role) {
        let nominal = self.float;
        self.push(name, shape, TypeRule::Float, nominal, part, role);
    }

    /// A text-layer linear: fp8 + scales under MXFP8, else float.
    pub fn linear(&mut self, stem: &str, out: usize, inp: usize, part: Part, role: Role) {
        match &self.cfg.quantization {
            Quantization::Mxfp8 { block, .. } => {
                let scale_role = if let Role::Expert(e) = role { Role::Expert(e) } else { Role::Scale };
                self.push(names::weight(stem), vec![out, inp], TypeRule::Fp8, DType::F8E4M3, part, role);
                self.push(names::scales(stem), vec![out, inp / block], TypeRule::E8M0, DType::U8, part, scale_role);
            }
            Quantization::None => self.float(names::weight(stem), vec![out, inp], part, role),
        }
    }
}

/// Every tensor the checkpoint of `cfg` must contain, in a stable order (its
/// family's layout).
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    cfg.family.model().tensors(cfg)
}
