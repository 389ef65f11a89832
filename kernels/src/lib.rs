//! m3c's kernel generators. Each [`Kernel`] is one fused operation at one
//! shape; [`Kernel::mlir`] writes it as an MLIR `func.func` over memrefs in
//! target-neutral dialects (`scf`, `arith`, `math`, `memref`), which the
//! compiler's back ends lower for the host (LLVM) or for GPUs.
//!
//! This crate knows shapes and arithmetic, never files or weights: weights
//! arrive as memref arguments at run time.

mod attention;
mod elementwise;
mod emit;
pub mod gpu;
mod linear;
mod moe;
mod norm;
mod rope;
mod view;

use std::fmt;

pub use attention::SparseSel;
/// The value of a `float8_e4m3fn` byte: the table MXFP8 kernels decode with.
pub use emit::fp8_e4m3_value;
pub use moe::{expert_table_stride, expert_tensor_types};
pub use view::MemTy;

/// Indents every line of `body` by `n` spaces.
pub fn indent(body: &str, n: usize) -> String {
    emit::indent(body, n)
}

/// How f32 values are kept in memory: KV and MSA index-key caches
/// (`--kv-cache`) and the activations that pass between kernels and stages
/// (`--activations`). Kernels compute in f32 either way; `Bf16` halves the
/// memory and the bytes moved, rounding each written value to nearest-even
/// bf16 (as `torch.Tensor.to(torch.bfloat16)` does). Stored as `i16` bit
/// patterns and converted with integer ops, so no back end needs bf16
/// arithmetic and host and GPU round identically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Storage {
    #[default]
    F32,
    Bf16,
}

impl Storage {
    /// The memref element type of a cache of this type.
    pub fn mlir_elem(self) -> &'static str {
        match self {
            Storage::F32 => "f32",
            Storage::Bf16 => "i16",
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            Storage::F32 => 4,
            Storage::Bf16 => 2,
        }
    }

    /// The name users write (`--kv-cache`) and manifests record.
    pub fn name(self) -> &'static str {
        match self {
            Storage::F32 => "f32",
            Storage::Bf16 => "bf16",
        }
    }

    /// Suffix of kernel symbols that touch a cache of this type (none for f32).
    fn suffix(self) -> &'static str {
        match self {
            Storage::F32 => "",
            Storage::Bf16 => "_kvbf16",
        }
    }

    /// Suffix of kernel symbols whose activations are of this type (none for f32).
    fn act_suffix(self) -> &'static str {
        match self {
            Storage::F32 => "",
            Storage::Bf16 => "_abf16",
        }
    }
}

/// How a weight operand is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightType {
    F32,
    BF16,
    F16,
    /// `float8_e4m3fn` elements with one E8M0 (`uint8`) scale per 1×`block` input block.
    Mxfp8 {
        block: usize,
    },
}

impl WeightType {
    /// The MLIR element type of the weight memref.
    pub fn mlir_elem(self) -> &'static str {
        match self {
            WeightType::F32 => "f32",
            WeightType::BF16 => "bf16",
            WeightType::F16 => "f16",
            WeightType::Mxfp8 { .. } => "i8",
        }
    }
    fn tag(self) -> String {
        match self {
            WeightType::F32 => "f32".into(),
            WeightType::BF16 => "bf16".into(),
            WeightType::F16 => "f16".into(),
            WeightType::Mxfp8 { block } => format!("mxfp8b{block}"),
        }
    }
}

/// One kernel at one shape. Activations are rows `[S, width]` (S dynamic:
/// prompt length at prefill, 1 at decode) of f32 values stored as `act`.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub enum Kernel {
    /// Gemma RMSNorm of each row: `x · rsqrt(mean(x²) + eps) · (1 + w)`.
    RmsNorm { width: usize, eps: f64, weight: WeightType, act: Storage },
    /// `y = x Wᵀ` with `W: [out, inp]`; `x` stored as `act`, `y` as
    /// `out_act` (f32 for the logits whatever the activations are).
    Linear { inp: usize, out: usize, weight: WeightType, act: Storage, out_act: Storage },
    /// Per-head Gemma RMSNorm fused with partial NeoX RoPE (QK-norm + RoPE,
    /// also the MSA indexer's).
    HeadNormRope { heads: usize, head_dim: usize, rotary_dim: usize, theta: f64, eps: f64, weight: WeightType, act: Storage },
    /// SwiGLU-OAI of a gate and an up projection.
    SwiGluOai { width: usize, alpha: f64, limit: f64, beta: f64, act: Storage },
    /// Greedy sampling: the first index of each row's maximum.
    Argmax { width: usize },
    /// Row gather from an embedding table `[vocab, width]`.
    Embedding { vocab: usize, width: usize, weight: WeightType, act: Storage },
    /// Elementwise `a + b` (the residual adds, routed + shared expert).
    Add { width: usize, act: Storage },
    /// Row `r` of `x` into row `pos[r]` of `y`: a sequence's new keys and
    /// values into its cache, at positions read from memory (not baked into
    /// the call), so a decode step's launches are the same at every position.
    ScatterRows { width: usize, cache: Storage, act: Storage },
    /// `y = bf16(x)` row by row (nearest even), as bf16 bits: the input of a
    /// tensor-core GEMM (cuBLAS) on the GPU.
    ToBf16 { width: usize },
    /// An MXFP8 weight `[out, inp]` (fp8 + E8M0 scale per 1×`block`)
    /// decoded to bf16 bits `[out, inp]`: one linear's weight, transiently,
    /// for a tensor-core GEMM at prefill (Hopper's cuBLAS has no MXFP8).
    /// fp8 · 2^k is exact in bf16 (3 mantissa bits into 7) unless the scale
    /// pushes it out of range, so the GEMM sees the weights the GEMV does.
    DequantMxfp8 { out: usize, inp: usize, block: usize },
    /// Causal GQA attention over the cache; MSA block selection fused in when `sparse` is set.
    Attention { heads: usize, kv_heads: usize, head_dim: usize, scale: f64, sparse: Option<SparseSel>, cache: Storage, act: Storage },
    /// fp32 sigmoid router with selection bias, top-k, renormalisation and routed scaling.
    Router { width: usize, experts: usize, top_k: usize, scale: f64, weight: WeightType, bias: Option<WeightType>, act: Storage },
    /// The routed experts' SwiGLU-OAI MLPs, weighted and summed per token.
    RoutedExperts {
        experts: usize,
        hidden: usize,
        inter: usize,
        top_k: usize,
        weight: WeightType,
        alpha: f64,
        limit: f64,
        beta: f64,
        act: Storage,
    },
}

impl Kernel {
    /// The kernel's function name: a pure function of its parameters, so the
    /// same kernel generated twice has one name (and is emitted once).
    pub fn symbol(&self) -> String {
        let base = match self {
            Kernel::RmsNorm { width, eps, weight, .. } => format!("m3c_rms_norm_w{width}_eps{}_{}", num_tag(*eps), weight.tag()),
            Kernel::Linear { inp, out, weight, act, out_act } => {
                // The output type is named only when it differs (the logits).
                let y = if out_act != act { format!("_y{}", out_act.name()) } else { String::new() };
                format!("m3c_linear_i{inp}_o{out}_{}{y}", weight.tag())
            }
            Kernel::HeadNormRope { heads, head_dim, rotary_dim, theta, eps, weight, .. } => {
                format!("m3c_head_norm_rope_h{heads}_d{head_dim}_r{rotary_dim}_t{}_eps{}_{}", num_tag(*theta), num_tag(*eps), weight.tag())
            }
            Kernel::SwiGluOai { width, alpha, limit, beta, .. } => {
                format!("m3c_swiglu_oai_w{width}_a{}_l{}_b{}", num_tag(*alpha), num_tag(*limit), num_tag(*beta))
            }
            Kernel::Argmax { width } => format!("m3c_argmax_w{width}"),
            Kernel::ToBf16 { width } => format!("m3c_to_bf16_w{width}"),
            Kernel::DequantMxfp8 { out, inp, block } => format!("m3c_dequant_mxfp8b{block}_o{out}_i{inp}"),
            Kernel::Embedding { vocab, width, weight, .. } => format!("m3c_embedding_v{vocab}_w{width}_{}", weight.tag()),
            Kernel::Add { width, .. } => format!("m3c_add_w{width}"),
            Kernel::ScatterRows { width, cache, .. } => format!("m3c_scatter_rows_w{width}{}", cache.suffix()),
            Kernel::Attention { heads, kv_heads, head_dim, scale, sparse, cache, .. } => {
                let mut s = format!("m3c_attention_h{heads}_kv{kv_heads}_d{head_dim}_s{}", num_tag(*scale));
                if let Some(m) = sparse {
                    s.push_str(&format!("_msa_ih{}_id{}_b{}_k{}_l{}_i{}", m.index_heads, m.index_dim, m.block, m.topk, m.local, m.init));
                }
                s.push_str(cache.suffix());
                s
            }
            Kernel::Router { width, experts, top_k, scale, weight, bias, .. } => format!(
                "m3c_router_w{width}_e{experts}_k{top_k}_s{}_{}{}",
                num_tag(*scale),
                weight.tag(),
                bias.map_or(String::new(), |b| format!("_bias{}", b.tag()))
            ),
            Kernel::RoutedExperts { experts, hidden, inter, top_k, weight, alpha, limit, beta, .. } => format!(
                "m3c_routed_experts_e{experts}_h{hidden}_i{inter}_k{top_k}_{}_a{}_l{}_b{}",
                weight.tag(),
                num_tag(*alpha),
                num_tag(*limit),
                num_tag(*beta)
            ),
        };
        format!("{base}{}", self.act().map_or("", |a| a.act_suffix()))
    }

    /// How the kernel's activations are stored (`None`: it has none, or
    /// only f32 logits).
    pub fn act(&self) -> Option<Storage> {
        match self {
            Kernel::RmsNorm { act, .. }
            | Kernel::Linear { act, .. }
            | Kernel::HeadNormRope { act, .. }
            | Kernel::SwiGluOai { act, .. }
            | Kernel::Embedding { act, .. }
            | Kernel::Add { act, .. }
            | Kernel::ScatterRows { act, .. }
            | Kernel::Attention { act, .. }
            | Kernel::Router { act, .. }
            | Kernel::RoutedExperts { act, .. } => Some(*act),
            Kernel::Argmax { .. } | Kernel::ToBf16 { .. } | Kernel::DequantMxfp8 { .. } => None,
        }
    }

    /// Kernels this one calls (emitted with it).
    pub fn deps(&self) -> Vec<Kernel> {
        match self {
            Kernel::RoutedExperts { hidden, inter, weight, alpha, limit, beta, .. } => {
                moe::expert_deps(*hidden, *inter, *weight, *alpha, *limit, *beta)
            }
            _ => Vec::new(),
        }
    }

    /// The MLIR text of this kernel (a `func.func` plus any private globals it uses).
    pub fn mlir(&self) -> String {
        match self {
            Kernel::RmsNorm { width, eps, weight, act } => norm::rms_norm(&self.symbol(), *width, *eps, *weight, *act),
            Kernel::Linear { inp, out, weight, act, out_act } => linear::linear(&self.symbol(), *inp, *out, *weight, *act, *out_act),
            Kernel::HeadNormRope { heads, head_dim, rotary_dim, theta, eps, weight, act } => {
                rope::head_norm_rope(&self.symbol(), *heads, *head_dim, *rotary_dim, *theta, *eps, *weight, *act)
            }
            Kernel::SwiGluOai { width, alpha, limit, beta, act } => {
                elementwise::swiglu_oai(&self.symbol(), *width, *alpha, *limit, *beta, *act)
            }
            Kernel::Argmax { width } => elementwise::argmax(&self.symbol(), *width),
            Kernel::ToBf16 { width } => elementwise::to_bf16(&self.symbol(), *width),
            Kernel::DequantMxfp8 { out, inp, block } => linear::dequant_mxfp8(&self.symbol(), *out, *inp, *block),
            Kernel::Embedding { vocab, width, weight, act } => elementwise::embedding(&self.symbol(), *vocab, *width, *weight, *act),
            Kernel::Add { width, act } => elementwise::add(&self.symbol(), *width, *act),
            Kernel::ScatterRows { width, cache, act } => elementwise::scatter_rows(&self.symbol(), *width, *cache, *act),
            Kernel::Attention { heads, kv_heads, head_dim, scale, sparse, cache, act } => {
                attention::attention(&self.symbol(), *heads, *kv_heads, *head_dim, *scale, *sparse, *cache, *act)
            }
            Kernel::Router { width, experts, top_k, scale, weight, bias, act } => {
                moe::router(&self.symbol(), *width, *experts, *top_k, *scale, *weight, *bias, *act)
            }
            Kernel::RoutedExperts { experts, hidden, inter, top_k, weight, alpha, limit, beta, act } => {
                moe::routed_experts(&self.symbol(), *experts, *hidden, *inter, *top_k, *weight, *alpha, *limit, *beta, *act)
            }
        }
    }

    /// Globals (lookup tables) the kernel refers to, by name and MLIR text.
    pub fn globals(&self) -> Vec<(String, String)> {
        match self {
            Kernel::Linear { inp, weight: w @ WeightType::Mxfp8 { .. }, .. } if !linear::vectorizes(*inp, *w) => {
                vec![("m3c_fp8_e4m3_lut".into(), emit::fp8_lut_global())]
            }
            Kernel::DequantMxfp8 { .. } => vec![("m3c_fp8_e4m3_lut".into(), emit::fp8_lut_global())],
            Kernel::HeadNormRope { rotary_dim, theta, .. } => {
                vec![(rope::rope_table_name(*rotary_dim, *theta), rope::rope_table(*rotary_dim, *theta))]
            }
            Kernel::RoutedExperts { hidden, inter, weight, .. } => {
                moe::expert_tensor_types(*hidden, *inter, *weight).into_iter().map(|t| (t.view_fn(), t.view_fn_text())).collect()
            }
            _ => Vec::new(),
        }
    }
}

/// A number as part of a symbol name: `1e-6` → `1em6`, `1.702` → `1p702e0`.
pub(crate) fn num_tag(x: f64) -> String {
    format!("{x:e}").replace('-', "m").replace('.', "p")
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.symbol())
    }
}

/// A module holding `kernels` and what they call (each once, in the order
/// first needed) and the globals they need.
pub fn module(kernels: &[Kernel]) -> String {
    module_with(kernels, &[], "")
}

/// [`module`] plus view helpers for `views` and extra functions (`tail`, a
/// stage entry) that call them.
pub fn module_with(kernels: &[Kernel], views: &[MemTy], tail: &str) -> String {
    let mut seen = std::collections::BTreeSet::new();
    let mut globals = std::collections::BTreeMap::new();
    let mut body = String::new();
    fn visit(
        k: &Kernel,
        seen: &mut std::collections::BTreeSet<String>,
        globals: &mut std::collections::BTreeMap<String, String>,
        body: &mut String,
    ) {
        if !seen.insert(k.symbol()) {
            return;
        }
        for d in k.deps() {
            visit(&d, seen, globals, body);
        }
        for (name, text) in k.globals() {
            globals.insert(name, text);
        }
        body.push_str(&k.mlir());
    }
    for k in kernels {
        visit(k, &mut seen, &mut globals, &mut body);
    }
    for v in views {
        globals.insert(v.view_fn(), v.view_fn_text());
    }
    let mut out = String::from("module {\n");
    for text in globals.values() {
        out.push_str(text);
    }
    out.push_str(&body);
    out.push_str(tail);
    out.push_str("}\n");
    out
}
