//! An MXFP8 weight decoded to bf16 for a tensor-core GEMM.

use crate::emit::{e8m0_to_f32, fp8_lut_global, store_f32, E8M0_CONSTANTS};
use crate::gpu::{GpuCall, GpuFunc, GpuTarget, WeightArgs, BLOCK};
use crate::host::{index_consts, BASICS};
use crate::unit::{gpu_func, param, KernelUnit, Launch, Param};
use crate::{indent, Storage, WeightType};

/// An MXFP8 weight `[out, inp]` (fp8 + E8M0 scale per 1×`block`) decoded to
/// bf16 bits `[out, inp]`: one linear's weight, transiently, for a
/// tensor-core GEMM at prefill (Hopper's cuBLAS has no MXFP8). fp8 · 2^k is
/// exact in bf16 (3 mantissa bits into 7) unless the scale pushes it out of
/// range, so the GEMM sees the weights the GEMV does.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct DequantMxfp8 {
    pub out: usize,
    pub inp: usize,
    pub block: usize,
}

impl KernelUnit for DequantMxfp8 {
    fn symbol(&self) -> String {
        let DequantMxfp8 { out, inp, block } = self;
        format!("m3c_dequant_mxfp8b{block}_o{out}_i{inp}")
    }
    fn params(&self) -> Vec<Param> {
        let DequantMxfp8 { out, inp, block } = self;
        vec![
            param("w", format!("memref<{out}x{inp}xi8>")),
            param("s", format!("memref<{out}x{}xi8>", inp / block)),
            // Rows of bf16 bits, as the scratch the entry allocates for it is viewed.
            param("y", format!("memref<?x{inp}xi16>")),
        ]
    }
    fn act(&self) -> Option<Storage> {
        None
    }
    /// `y[o, i] = bf16(fp8(w[o, i]) · 2^(s[o, i / block] − 127))` as bf16 bits:
    /// an MXFP8 weight decoded for a tensor-core GEMM (see `Kernel::DequantMxfp8`).
    fn host_body(&self) -> String {
        let DequantMxfp8 { out, inp, block } = *self;
        let wt = format!("memref<{out}x{inp}xi8>");
        let st = format!("memref<{out}x{}xi8>", inp / block);
        // Rows of bf16 bits, as the scratch the entry allocates for it is viewed.
        let yt = format!("memref<?x{inp}xi16>");
        let idx0 = index_consts(&[("cout", out), ("cin", inp), ("cb", block)]);
        let body = format!(
            "{BASICS}\
             {idx0}\
             {E8M0_CONSTANTS}\
             %lut = memref.get_global @m3c_fp8_e4m3_lut : memref<256xf32>\n\
             scf.for %o = %c0 to %cout step %c1 {{\n\
             \x20 scf.for %i = %c0 to %cin step %c1 {{\n\
             \x20   %q = memref.load %w[%o, %i] : {wt}\n\
             \x20   %qi = arith.extui %q : i8 to i32\n\
             \x20   %qx = arith.index_cast %qi : i32 to index\n\
             \x20   %wv = memref.load %lut[%qx] : memref<256xf32>\n\
             \x20   %b = arith.divui %i, %cb : index\n\
             \x20   %sb = memref.load %s[%o, %b] : {st}\n\
             {dec}\
             \x20   %v = arith.mulf %wv, %scale : f32\n\
             {store}\
             \x20 }}\n\
             }}\n\
             return\n",
            dec = indent(&e8m0_to_f32("%scale", "%sb"), 4),
            store = indent(&store_f32("%v", "%y", &yt, "%o", "%i", Storage::Bf16), 4),
        );
        body
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let DequantMxfp8 { out, inp, block } = self;

        // A block per weight row; threads stride its columns.
        let wa = WeightArgs::new(target, "%w", "%s", *out, *inp, WeightType::Mxfp8 { block: *block });
        let yt = format!("memref<?x{inp}xi16>");
        let body = format!(
            "{idx}{consts}%o = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {inp} : index\n\
                     scf.for %i = %t to %cw step %c256 {{\n{}{}}}\n",
            indent(&wa.load("v", "%o", "%i"), 2),
            indent(&store_f32("%v", "%y", &yt, "%o", "%i", Storage::Bf16), 2),
            consts = wa.consts(),
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
    /// A block per weight row.
    fn launch(&self, l: &Launch) -> GpuCall {
        let o = l.local("o");
        l.call(format!("{o} = arith.constant {} : index\n{}", self.out, l.grid(&self.symbol(), [&o, &l.one(), &l.one()], BLOCK, l.args)))
    }
    fn globals(&self) -> Vec<(String, String)> {
        vec![("m3c_fp8_e4m3_lut".into(), fp8_lut_global())]
    }
}
