//! Row gather from an embedding table `[vocab, width]`.

use crate::emit::store_f32;
use crate::gpu::{GpuFunc, GpuTarget, WeightArgs};
use crate::host::row_loop;
use crate::unit::{gpu_func, param, KernelUnit, Param};
use crate::{indent, Storage, WeightType};

/// `y[r] = W[ids[r]]`.
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct Embedding {
    pub vocab: usize,
    pub width: usize,
    pub weight: WeightType,
    pub act: Storage,
}

impl KernelUnit for Embedding {
    fn symbol(&self) -> String {
        let Embedding { vocab, width, weight, act } = self;
        format!("m3c_embedding_v{vocab}_w{width}_{}{}", weight.tag(), act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let Embedding { vocab, width, weight, act } = self;
        vec![param("ids", "memref<?xi64>"), param("w", weight.memref(&[*vocab, *width])), param("y", act.rows_ty(*width))]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    /// Row gather: `y[r] = f32(W[ids[r]])`. Ids are checked against the
    /// vocabulary by the runtime before a step starts.
    fn host_body(&self) -> String {
        let Embedding { vocab, width, weight, act } = *self;
        let t = act.rows_ty(width);
        let wt = weight.memref(&[vocab, width]);
        let row = "%id64 = memref.load %ids[%r] : memref<?xi64>\n%id = arith.index_cast %id64 : i64 to index\n";
        let element = crate::emit::load_weight_f32("%wv", "%w", "%id, %i", &wt, weight) + &store_f32("%wv", "%y", &t, "%r", "%i", act);
        row_loop("ids", "memref<?xi64>", width, "", row, &element)
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let Embedding { vocab, width, weight, act } = self;

        let wa = WeightArgs::new(target, "%w", "", *vocab, *width, *weight);
        let yt = act.rows_ty(*width);
        let body = format!(
            "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%cw = arith.constant {width} : index\n\
                     %id64 = memref.load %ids[%r] : memref<?xi64>\n%id = arith.index_cast %id64 : i64 to index\n\
                     scf.for %c = %t to %cw step %c256 {{\n{}{}}}\n",
            indent(&wa.load("v", "%id", "%c"), 2),
            indent(&store_f32("%v", "%y", &yt, "%r", "%c", *act), 2)
        );
        vec![gpu_func(target, &self.symbol(), &self.params(), &body)]
    }
}
