//! The stage entry: `m3c_stage_step`, a C-ABI function that runs the stage's
//! fused kernel calls in order over one step (a prefill chunk or a decode
//! token) of one sequence.
//!
//! ```c
//! void m3c_stage_step(void *const *weights,   // one pointer per StageProgram::tensors slot
//!                     void *const *caches,    // one pointer per cache slot, [capacity, width] f32
//!                     int64_t tokens,         // S, rows in this step
//!                     int64_t pos0,           // position of the first row
//!                     const int64_t *ids,     // [S] token ids (first stage)
//!                     float *x,               // [S, hidden] in (unless first) and out (unless last)
//!                     float *logits,          // [S, vocab] (last stage)
//!                     int64_t *out_ids);      // [S] greedy ids (last stage)
//! ```

use super::fuse::{Arg, FusedStage, Step};
use m3c_kernels::MemTy;
use std::collections::BTreeSet;
use std::fmt::Write;

fn indent(body: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    body.lines().map(|l| format!("{pad}{l}\n")).collect()
}

pub const ENTRY_SYMBOL: &str = "m3c_stage_step";

struct Emitter {
    hidden: usize,
    /// The pointer table the device reads expert weights through.
    expert_table: &'static str,
    body: String,
    views: BTreeSet<MemTy>,
    n: usize,
    cache_ptrs: BTreeSet<usize>,
}

impl Emitter {
    fn fresh(&mut self) -> String {
        self.n += 1;
        format!("%v{}", self.n)
    }

    fn view(&mut self, ptr: &str, size: &str, ty: MemTy) -> String {
        let v = self.fresh();
        self.view_as(&v, ptr, size, ty);
        v
    }

    fn view_as(&mut self, v: &str, ptr: &str, size: &str, ty: MemTy) {
        let _ = writeln!(self.body, "{v} = func.call @{}({ptr}, {size}) : (!llvm.ptr, index) -> {}", ty.view_fn(), ty.mlir());
        self.views.insert(ty);
    }

    fn cache_ptr(&mut self, slot: usize) -> String {
        if self.cache_ptrs.insert(slot) {
            let _ = writeln!(
                self.body,
                "%cg{slot} = llvm.getelementptr %caches[{slot}] : (!llvm.ptr) -> !llvm.ptr, !llvm.ptr\n\
                 %cp{slot} = llvm.load %cg{slot} : !llvm.ptr -> !llvm.ptr"
            );
        }
        format!("%cp{slot}")
    }

    /// The SSA value and MLIR type of an argument.
    fn arg(&mut self, a: &Arg) -> (String, String) {
        let ty = a.mem_ty(self.hidden);
        let name = match a {
            Arg::X => "%x".to_string(),
            Arg::Ids => "%ids".to_string(),
            Arg::Pos => "%pos".to_string(),
            Arg::Pos0 => return ("%pos0".into(), "index".into()),
            Arg::Buf { id, .. } => format!("%b{id}"),
            Arg::Logits { .. } => "%logits".to_string(),
            Arg::OutIds => "%out_ids".to_string(),
            Arg::ExpertTable { first_slot } => {
                let v = self.fresh();
                let _ = writeln!(self.body, "{v} = llvm.getelementptr {}[{first_slot}] : (!llvm.ptr) -> !llvm.ptr, !llvm.ptr", self.expert_table);
                return (v, "!llvm.ptr".into());
            }
            Arg::Weight { slot, ty } => {
                let (g, p) = (self.fresh(), self.fresh());
                let _ = writeln!(
                    self.body,
                    "{g} = llvm.getelementptr %weights[{slot}] : (!llvm.ptr) -> !llvm.ptr, !llvm.ptr\n\
                     {p} = llvm.load {g} : !llvm.ptr -> !llvm.ptr"
                );
                self.view(&p, "%c0", ty.clone())
            }
            Arg::Cache { slot, width } => {
                let p = self.cache_ptr(*slot);
                self.view(&p, "%ctx", MemTy::rows(*width, "f32"))
            }
            Arg::CacheRows { slot, width } => {
                let p = self.cache_ptr(*slot);
                let (w, off, q) = (self.fresh(), self.fresh(), self.fresh());
                let _ = writeln!(
                    self.body,
                    "{w} = arith.constant {width} : i64\n\
                     {off} = arith.muli %pos0_i, {w} : i64\n\
                     {q} = llvm.getelementptr {p}[{off}] : (!llvm.ptr, i64) -> !llvm.ptr, f32"
                );
                self.view(&q, "%S", MemTy::rows(*width, "f32"))
            }
        };
        (name, ty.expect("memref argument").mlir())
    }
}

/// The whole module of a stage: kernels, view helpers and the entry.
pub fn module(f: &FusedStage) -> String {
    let mut e = Emitter { hidden: f.hidden, expert_table: "%weights", body: String::new(), views: BTreeSet::new(), n: 0, cache_ptrs: BTreeSet::new() };
    let h = f.hidden;
    e.body.push_str(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %S = arith.index_cast %tokens : i64 to index\n\
         %pos0 = arith.index_cast %pos0_i : i64 to index\n\
         %ctx = arith.addi %pos0, %S : index\n",
    );
    let ids_ty = MemTy { dims: vec![None], elem: "i64" };
    e.view_as("%x", "%x_p", "%S", MemTy::rows(h, "f32"));
    e.view_as("%ids", "%ids_p", "%S", ids_ty.clone());
    if let super::Boundary::Logits { vocab } = f.output {
        e.view_as("%logits", "%logits_p", "%S", MemTy::rows(vocab, "f32"));
        e.view_as("%out_ids", "%out_ids_p", "%S", ids_ty);
    }
    e.body.push_str(
        "%pos = memref.alloc(%S) : memref<?xi64>\n\
         scf.for %i = %c0 to %S step %c1 {\n\
         \x20 %p = arith.addi %pos0, %i : index\n\
         \x20 %pi = arith.index_cast %p : index to i64\n\
         \x20 memref.store %pi, %pos[%i] : memref<?xi64>\n\
         }\n",
    );
    for step in &f.steps {
        let _ = writeln!(e.body, "// {}", step.to_string().trim());
        match step {
            Step::Alloc { id, width, elem } => {
                let _ = writeln!(e.body, "%b{id} = memref.alloc(%S) : memref<?x{width}x{elem}>");
            }
            Step::Free { id, width, elem } => {
                let _ = writeln!(e.body, "memref.dealloc %b{id} : memref<?x{width}x{elem}>");
            }
            Step::CopyToX { id, width } => {
                let _ = writeln!(e.body, "memref.copy %b{id}, %x : memref<?x{width}xf32> to memref<?x{width}xf32>");
            }
            Step::Call { kernel, args, .. } => {
                let (names, tys): (Vec<String>, Vec<String>) = args.iter().map(|a| e.arg(a)).unzip();
                let _ = writeln!(e.body, "func.call @{}({}) : ({}) -> ()", kernel.symbol(), names.join(", "), tys.join(", "));
            }
        }
    }
    e.body.push_str("memref.dealloc %pos : memref<?xi64>\nreturn\n");
    let entry = format!(
        "  func.func @{ENTRY_SYMBOL}(%weights: !llvm.ptr, %caches: !llvm.ptr, %tokens: i64, %pos0_i: i64, \
         %ids_p: !llvm.ptr, %x_p: !llvm.ptr, %logits_p: !llvm.ptr, %out_ids_p: !llvm.ptr) {{\n{}  }}\n",
        indent(&e.body, 4)
    );
    let views: Vec<MemTy> = e.views.into_iter().collect();
    m3c_kernels::module_with(&f.kernels, &views, &entry)
}

/// The module of a stage for NVIDIA GPUs: the kernels as `gpu.func`s in one
/// `gpu.module`, and the entry, which launches them in order. Its C
/// signature adds the device copy of the weight table (the routed experts
/// read expert pointers on the device) and a device array of positions:
///
/// ```c
/// void m3c_stage_step(void *const *weights, void *const *weights_dev, void *const *caches,
///                     int64_t tokens, int64_t pos0, const int64_t *ids, float *x,
///                     float *logits, int64_t *out_ids, const int64_t *pos);
/// ```
pub fn cuda_module(f: &FusedStage) -> String {
    let mut e = Emitter { hidden: f.hidden, expert_table: "%weights_dev", body: String::new(), views: BTreeSet::new(), n: 0, cache_ptrs: BTreeSet::new() };
    let h = f.hidden;
    e.body.push_str(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %S = arith.index_cast %tokens : i64 to index\n\
         %pos0 = arith.index_cast %pos0_i : i64 to index\n\
         %ctx = arith.addi %pos0, %S : index\n",
    );
    let ids_ty = MemTy { dims: vec![None], elem: "i64" };
    e.view_as("%x", "%x_p", "%S", MemTy::rows(h, "f32"));
    e.view_as("%ids", "%ids_p", "%S", ids_ty.clone());
    e.view_as("%pos", "%pos_p", "%S", ids_ty.clone());
    if let super::Boundary::Logits { vocab } = f.output {
        e.view_as("%logits", "%logits_p", "%S", MemTy::rows(vocab, "f32"));
        e.view_as("%out_ids", "%out_ids_p", "%S", ids_ty);
    }
    let mut funcs: Vec<(String, String)> = Vec::new();
    let mut device_views: BTreeSet<MemTy> = BTreeSet::new();
    for (n, step) in f.steps.iter().enumerate() {
        let _ = writeln!(e.body, "// {}", step.to_string().trim());
        match step {
            Step::Alloc { id, width, elem } => {
                let (text, ty) = m3c_kernels::gpu::device_buffer(&format!("%b{id}"), "%S", *width, elem);
                e.body.push_str(&text);
                e.views.insert(ty);
            }
            Step::Free { id, .. } => {
                let _ = writeln!(e.body, "func.call @m3c_device_free(%b{id}_p) : (!llvm.ptr) -> ()");
            }
            Step::CopyToX { id, .. } => {
                let _ = writeln!(e.body, "func.call @m3c_device_copy(%x_p, %b{id}_p, %b{id}_nb64) : (!llvm.ptr, !llvm.ptr, i64) -> ()");
            }
            Step::Call { kernel, args, .. } => {
                let a: Vec<(String, String)> = args.iter().map(|a| e.arg(a)).collect();
                let call = kernel.gpu_call(&a, "%S", &n.to_string());
                e.body.push_str(&call.text);
                device_views.extend(call.device_views);
                e.views.extend(call.host_views);
                for g in kernel.gpu_funcs() {
                    if !funcs.iter().any(|(name, _)| *name == g.name) {
                        funcs.push((g.name, g.text));
                    }
                }
            }
        }
    }
    e.body.push_str("return\n");
    let entry = format!(
        "  func.func @{ENTRY_SYMBOL}(%weights: !llvm.ptr, %weights_dev: !llvm.ptr, %caches: !llvm.ptr, %tokens: i64, %pos0_i: i64, \
         %ids_p: !llvm.ptr, %x_p: !llvm.ptr, %logits_p: !llvm.ptr, %out_ids_p: !llvm.ptr, %pos_p: !llvm.ptr) {{\n{}  }}\n",
        indent(&e.body, 4)
    );
    let mut out = String::from("module attributes {gpu.container_module} {\n");
    // Device memory and copies come from the runtime (runtime/src/cuda.rs).
    out.push_str(
        "  func.func private @m3c_device_alloc(i64) -> !llvm.ptr\n\
         \x20 func.func private @m3c_device_free(!llvm.ptr)\n\
         \x20 func.func private @m3c_device_copy(!llvm.ptr, !llvm.ptr, i64)\n",
    );
    for v in &e.views {
        out.push_str(&v.view_fn_text());
    }
    out.push_str(&format!("  gpu.module @{} {{\n", m3c_kernels::gpu::GPU_MODULE));
    for v in &device_views {
        out.push_str(&indent(&v.view_fn_text(), 2));
    }
    for (_, text) in &funcs {
        out.push_str(text);
    }
    out.push_str("  }\n");
    out.push_str(&entry);
    out.push_str("}\n");
    out
}
