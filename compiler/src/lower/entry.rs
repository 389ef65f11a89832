//! The stage entry: `m3c_stage_step`, a C-ABI function that runs the stage's
//! fused kernel calls in order over one step of a micro-batch: one or more
//! sequences, each with some rows (its whole prompt at prefill, one token at
//! decode), stacked into one activation matrix. Calls marked per-sequence
//! (cache writes, attention) run once per sequence over its rows, positions
//! and caches; every other call runs once over all rows, so a weight is read
//! once per micro-batch.
//!
//! It takes one pointer, to the contract's `StepArgs`, whose one field
//! list (`m3c_contract::stage::abi::STEP_FIELDS`) both the runtime's struct
//! and the entry's loads here follow.
//!
//! On the GPU every array the kernels touch (weights, caches, ids, x,
//! logits, out_ids, table, seen, bias, pos) is device memory; the small per-sequence arrays and
//! the tables are host memory read by the host code. Scratch buffers come from
//! the runtime (`m3c_buf_alloc/free/copy`), host or device memory by target.

use super::fuse::{Arg, FusedStage, Step};
use m3c_kernels::{GpuTarget, HostWidth, MemTy, Storage};
use std::collections::BTreeSet;
use std::fmt::Write;

pub const ENTRY_SYMBOL: &str = m3c_contract::stage::abi::ENTRY;
pub const VISION_SYMBOL: &str = m3c_contract::stage::abi::VISION;

fn indent(body: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    body.lines().map(|l| format!("{pad}{l}\n")).collect()
}

/// How the entry runs its kernels: calls on the CPU, or launches on a GPU.
#[derive(Clone, Copy, PartialEq)]
enum Flavor {
    Host,
    Gpu(GpuTarget),
}

struct Emitter {
    hidden: usize,
    /// The SSA name of the row count that buffers and launches use now:
    /// `%S`, `%M` after a vision entry's merge, `%K` for image rows.
    rows: String,
    /// Inside the vision entry's layer loop: the SSA name of the loop
    /// layer's weight table, and the slots of layer 0 it stands for.
    layer_weights: Option<(String, std::ops::Range<usize>)>,
    act: Storage,
    flavor: Flavor,
    body: String,
    views: BTreeSet<MemTy>,
    device_views: BTreeSet<MemTy>,
    funcs: Vec<(String, String)>,
    gpu_kernels: BTreeSet<String>,
    n: usize,
    /// Calls whose arguments do not match the kernel's signature (a compiler bug).
    mismatches: Vec<String>,
}

fn elem_bytes(elem: &str) -> usize {
    match elem {
        "i64" | "f64" => 8,
        "i8" => 1,
        "bf16" | "f16" | "i16" => 2,
        _ => 4,
    }
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

    /// `base` (a pointer) advanced by `rows` rows of `width` elements of `elem`.
    fn rows_ptr(&mut self, base: &str, rows: &str, width: usize, elem: &str) -> String {
        let (w, o, o64, q) = (self.fresh(), self.fresh(), self.fresh(), self.fresh());
        let _ = writeln!(
            self.body,
            "{w} = arith.constant {width} : index\n\
             {o} = arith.muli {rows}, {w} : index\n\
             {o64} = arith.index_cast {o} : index to i64\n\
             {q} = llvm.getelementptr {base}[{o64}] : (!llvm.ptr, i64) -> !llvm.ptr, {elem}"
        );
        q
    }

    /// Loads pointer `slot` of the pointer table `table`.
    fn table_ptr(&mut self, table: &str, slot: usize) -> String {
        let (g, p) = (self.fresh(), self.fresh());
        let _ = writeln!(
            self.body,
            "{g} = llvm.getelementptr {table}[{slot}] : (!llvm.ptr) -> !llvm.ptr, !llvm.ptr\n\
             {p} = llvm.load {g} : !llvm.ptr -> !llvm.ptr"
        );
        p
    }

    /// The SSA value and MLIR type of an argument. `seq` is set inside the
    /// per-sequence loop: then row arguments are that sequence's rows.
    fn arg(&mut self, a: &Arg, seq: bool) -> (String, String) {
        let ty = a.mem_ty(self.hidden, self.act);
        let rows_of = |e: &mut Emitter, base: &str, width: usize, elem: &'static str| {
            let q = e.rows_ptr(base, "%roff", width.max(1), elem);
            let t = if width == 0 { MemTy { dims: vec![None], elem } } else { MemTy::rows(width, elem) };
            e.view(&q, "%srows", t)
        };
        let name = match a {
            Arg::ExpertTable { first_slot } => {
                let v = self.fresh();
                let _ = writeln!(self.body, "{v} = llvm.getelementptr %weights_dev[{first_slot}] : (!llvm.ptr) -> !llvm.ptr, !llvm.ptr");
                return (v, "!llvm.ptr".into());
            }
            Arg::Weight { slot, ty } => {
                let p = match &self.layer_weights {
                    Some((table, slots)) if slots.contains(slot) => {
                        let (table, at) = (table.clone(), slot - slots.start);
                        self.table_ptr(&table, at)
                    }
                    _ => self.table_ptr("%weights", *slot),
                };
                self.view(&p, "%c0", ty.clone())
            }
            Arg::X if seq => rows_of(self, "%x_p", self.hidden, self.act.mlir_elem()),
            Arg::Pos if seq => rows_of(self, "%pos_p", 0, "i64"),
            Arg::Ids if seq => rows_of(self, "%ids_p", 0, "i64"),
            Arg::Buf { id, width, elem } if seq => rows_of(self, &format!("%b{id}_p"), *width, elem),
            Arg::Segments if seq => rows_of(self, "%segs_p", 0, "i64"),
            Arg::Pixels { .. } => "%pixels".to_string(),
            Arg::PatchPos => "%ppos".to_string(),
            Arg::Segments => "%segs".to_string(),
            Arg::Img => "%img".to_string(),
            Arg::Aux { .. } => "%aux".to_string(),
            Arg::ImgRows => "%img_rows".to_string(),
            Arg::X => "%x".to_string(),
            Arg::Ids => "%ids".to_string(),
            Arg::Pos => "%pos".to_string(),
            Arg::Buf { id, .. } => format!("%b{id}"),
            Arg::Logits { .. } => "%logits".to_string(),
            Arg::OutIds => "%out_ids".to_string(),
            Arg::Table => "%table".to_string(),
            Arg::Seen { .. } => "%seen".to_string(),
            Arg::Bias { .. } => "%bias".to_string(),
            Arg::Cache { slot, width, cache } => {
                let p = self.table_ptr("%caches", *slot);
                self.view(&p, "%pool_rows_ix", MemTy::rows(*width, cache.mlir_elem()))
            }
            Arg::BlockTable => self.view("%sbt", "%snb", MemTy { dims: vec![None], elem: "i64" }),
        };
        (name, ty.expect("memref argument").mlir())
    }

    fn call(&mut self, kernel: &m3c_kernels::Kernel, args: &[Arg], seq: bool, tag: usize) {
        let a: Vec<(String, String)> = args.iter().map(|x| self.arg(x, seq)).collect();
        // The kernel's signature, written once in its unit, is what every
        // call must pass: checked here, before MLIR's verifier would.
        let params = kernel.params();
        let passed: Vec<&str> = a.iter().map(|(_, t)| t.as_str()).collect();
        let wanted: Vec<&str> = params.iter().map(|p| p.ty.as_str()).collect();
        if passed != wanted {
            self.mismatches.push(format!(
                "{} takes ({}), the fused step passes ({})",
                kernel.symbol(),
                wanted.join(", "),
                passed.join(", ")
            ));
        }
        match self.flavor {
            Flavor::Host => {
                let (names, tys): (Vec<String>, Vec<String>) = a.into_iter().unzip();
                let _ = writeln!(self.body, "func.call @{}({}) : ({}) -> ()", kernel.symbol(), names.join(", "), tys.join(", "));
            }
            Flavor::Gpu(target) => {
                let rows = if seq { "%srows".to_string() } else { self.rows.clone() };
                let call = kernel.gpu_call(&target, &a, &rows, &tag.to_string());
                self.use_gpu_kernel(&target, kernel);
                self.device_views.extend(call.device_views);
                self.views.extend(call.host_views);
                match kernel {
                    m3c_kernels::Kernel::Linear(m3c_kernels::Linear {
                        inp,
                        out,
                        weight: weight @ (m3c_kernels::WeightType::BF16 | m3c_kernels::WeightType::Mxfp8 { .. }),
                        act,
                        out_act,
                    }) if !seq => {
                        let gemm = self.blas_gemm(&target, &a, *inp, *out, *weight, *act, *out_act, &tag.to_string());
                        let _ = writeln!(
                            self.body,
                            "%gq{tag}_rows = arith.index_cast {rows} : index to i64\n\
                             %gq{tag}_want = func.call @m3c_gemm_wanted(%gq{tag}_rows) : (i64) -> i32\n\
                             %gq{tag}_no = arith.constant 0 : i32\n\
                             %gq{tag}_go = arith.cmpi ne, %gq{tag}_want, %gq{tag}_no : i32\n\
                             scf.if %gq{tag}_go {{\n{}}} else {{\n{}}}",
                            indent(&gemm, 2),
                            indent(&call.text, 2)
                        );
                    }
                    _ => self.body.push_str(&call.text),
                }
            }
        }
    }
}

impl Emitter {
    /// Each GPU kernel's device code once, however many calls it has.
    fn use_gpu_kernel(&mut self, target: &GpuTarget, kernel: &m3c_kernels::Kernel) {
        if self.gpu_kernels.insert(kernel.symbol()) {
            self.funcs.extend(kernel.gpu_funcs(target).into_iter().map(|g| (g.name, g.text)));
        }
    }

    /// A linear `y = x Wᵀ` on tensor cores: the vendor's BLAS (cuBLAS on
    /// CUDA, behind the runtime's `m3c_gemm_bf16`, f32
    /// accumulation, output f32 or rounded to bf16 as `out_act` says) on `x`
    /// as bf16 (as it is when activations are bf16, else rounded into
    /// scratch first) and W as bf16: bf16 weights as they are, MXFP8 ones
    /// decoded into scratch for this call only (exact: fp8 · 2^k fits bf16),
    /// so no stage ever holds an expanded copy. Taken when the runtime says
    /// so (`m3c_gemm_wanted`: prefill steps of enough rows, cuBLAS loaded,
    /// `--prefill-gemm vendor`), where the GEMM's reuse of each weight over
    /// many rows outweighs decoding it once.
    #[allow(clippy::too_many_arguments)]
    fn blas_gemm(
        &mut self,
        target: &GpuTarget,
        a: &[(String, String)],
        inp: usize,
        out: usize,
        weight: m3c_kernels::WeightType,
        act: Storage,
        out_act: Storage,
        tag: &str,
    ) -> String {
        let ptr = |name: &str, ty: &str, v: &str| {
            format!(
                "{v}_ix = memref.extract_aligned_pointer_as_index {name} : {ty} -> index\n\
                 {v}_i = arith.index_cast {v}_ix : index to i64\n\
                 {v} = llvm.inttoptr {v}_i : i64 to !llvm.ptr\n"
            )
        };
        let (convert, xp, free) = match act {
            Storage::Bf16 | Storage::Fp8 => (ptr(&a[0].0, &a[0].1, &format!("%gq{tag}_xp")), format!("%gq{tag}_xp"), String::new()),
            Storage::F32 => {
                let conv = m3c_kernels::Kernel::ToBf16(m3c_kernels::ToBf16 { width: inp });
                self.use_gpu_kernel(target, &conv);
                let xb = format!("%gq{tag}_xb");
                let rows = self.rows.clone();
                let (alloc, xb_ty) = m3c_kernels::gpu::device_buffer(&xb, &rows, inp, "i16");
                self.views.insert(xb_ty.clone());
                let launch = conv.gpu_call(target, &[a[0].clone(), (xb.clone(), xb_ty.mlir())], &rows, &format!("{tag}c"));
                (format!("{alloc}{}", launch.text), format!("{xb}_p"), format!("func.call @m3c_buf_free({xb}_p) : (!llvm.ptr) -> ()\n"))
            }
        };
        // The weight as bf16 and the output: `a` is (x, w, y) or, for MXFP8, (x, w, scales, y).
        let (wconv, wp, wfree, y) = match weight {
            m3c_kernels::WeightType::Mxfp8 { block } => {
                let dq = m3c_kernels::Kernel::DequantMxfp8(m3c_kernels::DequantMxfp8 { out, inp, block });
                self.use_gpu_kernel(target, &dq);
                let wb = format!("%gq{tag}_wb");
                let (alloc, wb_ty) = m3c_kernels::gpu::device_buffer(&wb, &format!("%gq{tag}_on"), inp, "i16");
                self.views.insert(wb_ty.clone());
                let launch =
                    dq.gpu_call(target, &[a[1].clone(), a[2].clone(), (wb.clone(), wb_ty.mlir())], &self.rows.clone(), &format!("{tag}d"));
                (
                    format!("%gq{tag}_on = arith.constant {out} : index\n{alloc}{}", launch.text),
                    format!("{wb}_p"),
                    format!("func.call @m3c_buf_free({wb}_p) : (!llvm.ptr) -> ()\n"),
                    &a[3],
                )
            }
            _ => (ptr(&a[1].0, &a[1].1, &format!("%gq{tag}_wp")), format!("%gq{tag}_wp"), String::new(), &a[2]),
        };
        format!(
            "{convert}{wconv}{yp}%gq{tag}_inp = arith.constant {inp} : i64\n\
             %gq{tag}_out = arith.constant {out} : i64\n\
             %gq{tag}_ybf = arith.constant {ybf} : i32\n\
             func.call @m3c_gemm_bf16({xp}, {wp}, %gq{tag}_yp, %gq{tag}_rows, %gq{tag}_inp, %gq{tag}_out, %gq{tag}_ybf) : (!llvm.ptr, !llvm.ptr, !llvm.ptr, i64, i64, i64, i32) -> ()\n\
             {free}{wfree}",
            yp = ptr(&y.0, &y.1, &format!("%gq{tag}_yp")),
            ybf = i32::from(out_act == Storage::Bf16),
        )
    }
}

/// The runtime's tensor-core GEMM hooks (GPU entries only; names from the contract's ABI).
fn gemm_decls() -> String {
    use m3c_contract::stage::abi::{GEMM_BF16, GEMM_WANTED};
    format!(
        "  func.func private @{GEMM_WANTED}(i64) -> i32\n\
         \x20 func.func private @{GEMM_BF16}(!llvm.ptr, !llvm.ptr, !llvm.ptr, i64, i64, i64, i32)\n"
    )
}

/// The declarations of the runtime functions the entry calls.
fn runtime_decls() -> String {
    use m3c_contract::stage::abi::{BUF_ALLOC, BUF_COPY, BUF_FREE};
    format!(
        "  func.func private @{BUF_ALLOC}(i64) -> !llvm.ptr\n\
         \x20 func.func private @{BUF_FREE}(!llvm.ptr)\n\
         \x20 func.func private @{BUF_COPY}(!llvm.ptr, !llvm.ptr, i64)\n"
    )
}

fn emitter(f: &FusedStage, flavor: Flavor) -> Emitter {
    Emitter {
        hidden: f.hidden,
        rows: "%S".into(),
        layer_weights: None,
        act: f.act,
        flavor,
        body: String::new(),
        views: BTreeSet::new(),
        device_views: BTreeSet::new(),
        funcs: Vec::new(),
        gpu_kernels: BTreeSet::new(),
        n: 0,
        mismatches: Vec::new(),
    }
}

fn entry_body(f: &FusedStage, flavor: Flavor) -> Emitter {
    let mut e = emitter(f, flavor);
    let vocab = match f.text.output {
        super::Boundary::Logits { vocab } => Some(vocab),
        _ => None,
    };
    // Image rows come in where the embedding takes image features (this
    // stage's tower's, or another stage's).
    let img = f.text.steps.iter().any(|s| matches!(s, super::Step::ImageRows { .. }));
    step_views(&mut e, f, vocab, img, None);
    emit_steps(&mut e, &f.text.steps, 0);
    e.body.push_str("return\n");
    e
}

/// The statements every entry over a `StepArgs` starts with: its sizes,
/// and views of the arrays its steps read (`logits`: the width of the
/// logits it samples from; `img`: it takes image rows; `aux`: the width of
/// the draft's first entry's input rows).
fn step_views(e: &mut Emitter, f: &FusedStage, logits: Option<usize>, img: bool, aux: Option<usize>) {
    let h = f.hidden;
    e.body.push_str(&format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %S = arith.index_cast %tokens : i64 to index\n\
         %K = arith.index_cast %nimg : i64 to index\n\
         %nseq = arith.index_cast %sequences : i64 to index\n\
         %pool_rows_ix = arith.index_cast %pool_rows : i64 to index\n\
         %kv_block = arith.constant {} : index\n",
        f.kv_block
    ));
    let ids_ty = MemTy { dims: vec![None], elem: "i64" };
    e.view_as("%x", "%x_p", "%S", MemTy::rows(h, f.act.mlir_elem()));
    e.view_as("%ids", "%ids_p", "%S", ids_ty.clone());
    e.view_as("%pos", "%pos_p", "%S", ids_ty.clone());
    if img {
        e.view_as("%img", "%img_p", "%K", MemTy::rows(h, f.act.mlir_elem()));
        e.view_as("%img_rows", "%img_rows_p", "%K", ids_ty.clone());
    }
    if let Some(width) = aux {
        e.view_as("%aux", "%aux_p", "%S", MemTy::rows(width, f.act.mlir_elem()));
    }
    if let Some(vocab) = logits {
        e.view_as("%logits", "%logits_p", "%S", MemTy::rows(vocab, "f32"));
        e.view_as("%out_ids", "%out_ids_p", "%S", ids_ty);
        e.view_as("%table", "%table_p", "%S", MemTy::rows(m3c_contract::sampling::ROW_WORDS, "i64"));
        // Two bitmap rows per drawing slot (a segment, or each row of a
        // verify segment): its seen ids, then its allowed tokens.
        let words = m3c_contract::sampling::seen_words(vocab);
        e.body.push_str("%seen_rows = arith.index_cast %bitmap_rows : i64 to index\n");
        e.view_as("%seen", "%seen_p", "%seen_rows", MemTy::rows(words, "i32"));
        e.body.push_str("%nbias = arith.index_cast %bias_rows : i64 to index\n");
        e.view_as("%bias", "%bias_p", "%nbias", MemTy::rows(vocab, "f32"));
    }
}

/// The EAGLE3 draft head's two entries (`abi::DRAFT_FIRST`, `DRAFT_NEXT`),
/// or, on a stage without one, two that do nothing.
fn draft_text(e: &mut Emitter, f: &FusedStage) -> String {
    use m3c_contract::stage::abi::{DRAFT_FIRST, DRAFT_NEXT};
    let mut out = String::new();
    for (symbol, first) in [(DRAFT_FIRST, true), (DRAFT_NEXT, false)] {
        let outer = std::mem::take(&mut e.body);
        // (The vision entry before may have left its merged row count.)
        e.rows = "%S".into();
        if let Some(d) = &f.draft {
            step_views(e, f, Some(d.vocab), false, first.then_some(d.aux_width));
            emit_steps(e, if first { &d.first } else { &d.next }, 0);
        }
        e.body.push_str("return\n");
        let body = std::mem::replace(&mut e.body, outer);
        out.push_str(&step_func(symbol, &body));
    }
    out
}

/// The vision entry's body (see [`vision_func`]): the stage's vision steps
/// over the patch rows of every image (`%S`), the merged rows (`%M`) after
/// the 2×2 merge, one "sequence" per image for attention.
fn vision_body(e: &mut Emitter, f: &FusedStage, v: &super::fuse::VisionProgram) {
    e.rows = "%S".into();
    e.body.push_str(&format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %S = arith.index_cast %tokens : i64 to index\n\
         %nseq = arith.index_cast %sequences : i64 to index\n\
         %cmerge = arith.constant {} : index\n\
         %M = arith.divui %S, %cmerge : index\n",
        v.merge
    ));
    e.view_as("%pixels", "%pixels_p", "%S", MemTy::rows(v.patch_row, "f32"));
    e.view_as("%ppos", "%ppos_p", "%S", MemTy::rows(3, "i64"));
    e.view_as("%segs", "%segs_p", "%S", MemTy { dims: vec![None], elem: "i64" });
    e.view_as("%x", "%x_p", "%M", MemTy::rows(f.hidden, f.act.mlir_elem()));
    match &v.layers {
        None => emit_steps(e, &v.steps, 0),
        Some(lp) => {
            // The encoder layers as one loop over layer 0's steps, each
            // turn reading its own layer's weights: 32 layers of host code
            // would be 32 times the code to compile for the same work.
            let end = lp.start + lp.len * lp.count;
            emit_steps(e, &v.steps[..lp.start], 0);
            let _ = writeln!(
                e.body,
                "%vl_n = arith.constant {count} : index\n\
                 scf.for %vl = %c0 to %vl_n step %c1 {{\n\
                 \x20 %vl_stride = arith.constant {stride} : index\n\
                 \x20 %vl_first = arith.constant {first} : index\n\
                 \x20 %vl_o = arith.muli %vl, %vl_stride : index\n\
                 \x20 %vl_s = arith.addi %vl_o, %vl_first : index\n\
                 \x20 %vl_s64 = arith.index_cast %vl_s : index to i64\n\
                 \x20 %vl_w = llvm.getelementptr %weights[%vl_s64] : (!llvm.ptr, i64) -> !llvm.ptr, !llvm.ptr",
                count = lp.count,
                stride = lp.stride,
                first = lp.first_slot
            );
            let outer = std::mem::take(&mut e.body);
            e.layer_weights = Some(("%vl_w".into(), lp.first_slot..lp.first_slot + lp.stride));
            emit_steps(e, &v.steps[lp.start..lp.start + lp.len], lp.start);
            e.layer_weights = None;
            let inner = std::mem::replace(&mut e.body, outer);
            e.body.push_str(&indent(&inner, 2));
            e.body.push_str("}\n");
            emit_steps(e, &v.steps[end..], end);
        }
    }
    e.body.push_str("return\n");
}

/// The statements of `steps`; `first` is the index of `steps[0]` in its
/// program, so local names (tags) stay unique across calls.
fn emit_steps(e: &mut Emitter, steps: &[Step], first: usize) {
    for (n, step) in steps.iter().enumerate() {
        let n = n + first;
        let _ = writeln!(e.body, "// {}", step.to_string().trim());
        match step {
            Step::Alloc { id, width, elem } => {
                let bytes = width * elem_bytes(elem);
                let ty = MemTy::rows(*width, elem);
                let rows = e.rows.clone();
                let _ = writeln!(
                    e.body,
                    "%b{id}_sz = arith.constant {bytes} : index\n\
                     %b{id}_n = arith.muli {rows}, %b{id}_sz : index\n\
                     %b{id}_nb64 = arith.index_cast %b{id}_n : index to i64\n\
                     %b{id}_p = func.call @m3c_buf_alloc(%b{id}_nb64) : (i64) -> !llvm.ptr"
                );
                e.view_as(&format!("%b{id}"), &format!("%b{id}_p"), &rows, ty);
            }
            Step::Free { id, .. } => {
                let _ = writeln!(e.body, "func.call @m3c_buf_free(%b{id}_p) : (!llvm.ptr) -> ()");
            }
            Step::CopyAux { from, slot, width } => {
                // Slot k of `aux` starts after k slots of S rows.
                let bytes = width * e.act.bytes();
                let src = from.map_or("%x_p".to_string(), |id| format!("%b{id}_p"));
                let _ = writeln!(
                    e.body,
                    "%ca{n}_sz = arith.constant {bytes} : index\n\
                     %ca{n}_nb = arith.muli %S, %ca{n}_sz : index\n\
                     %ca{n}_nb64 = arith.index_cast %ca{n}_nb : index to i64\n\
                     %ca{n}_k = arith.constant {slot} : i64\n\
                     %ca{n}_o = arith.muli %ca{n}_nb64, %ca{n}_k : i64\n\
                     %ca{n}_dst = llvm.getelementptr %aux_p[%ca{n}_o] : (!llvm.ptr, i64) -> !llvm.ptr, i8\n\
                     func.call @m3c_buf_copy(%ca{n}_dst, {src}, %ca{n}_nb64) : (!llvm.ptr, !llvm.ptr, i64) -> ()"
                );
            }
            Step::CopyToX { id, .. } => {
                let _ = writeln!(e.body, "func.call @m3c_buf_copy(%x_p, %b{id}_p, %b{id}_nb64) : (!llvm.ptr, !llvm.ptr, i64) -> ()");
            }
            Step::Regroup { from, to, width, factor, elem } => {
                // The merged rows are consecutive: the same bytes, fewer and wider rows.
                let _ = writeln!(e.body, "%b{to}_p = llvm.getelementptr %b{from}_p[0] : (!llvm.ptr) -> !llvm.ptr, i8");
                e.view_as(&format!("%b{to}"), &format!("%b{to}_p"), "%M", MemTy::rows(width * factor, elem));
                e.rows = "%M".into();
            }
            Step::ImageRows { kernel, args, .. } => {
                // Only prefill steps that reach image placeholders have rows
                // here, and a GPU launch of zero blocks is an error.
                let _ = writeln!(e.body, "%img_any{n} = arith.cmpi ugt, %K, %c0 : index\nscf.if %img_any{n} {{");
                let outer = std::mem::take(&mut e.body);
                let rows = std::mem::replace(&mut e.rows, "%K".into());
                e.call(kernel, args, false, n);
                e.rows = rows;
                let inner = std::mem::replace(&mut e.body, outer);
                e.body.push_str(&indent(&inner, 2));
                e.body.push_str("}\n");
            }
            Step::Call { kernel, args, per_sequence: false, .. } => e.call(kernel, args, false, n),
            Step::Call { kernel, args, per_sequence: true, .. } => {
                let _ = writeln!(
                    e.body,
                    "%seq_end{n} = scf.for %sq = %c0 to %nseq step %c1 iter_args(%roff = %c0) -> (index) {{\n\
                     \x20 %sqi = arith.index_cast %sq : index to i64\n\
                     \x20 %srp = llvm.getelementptr %rows_p[%sqi] : (!llvm.ptr, i64) -> !llvm.ptr, i64\n\
                     \x20 %srows_i = llvm.load %srp : !llvm.ptr -> i64\n\
                     \x20 %srows = arith.index_cast %srows_i : i64 to index"
                );
                // Caches only where the call has some (the vision entry's
                // per-image calls have none).
                if args.iter().any(|a| matches!(a, Arg::Cache { .. })) {
                    let _ = writeln!(
                        e.body,
                        "\x20 %scp = llvm.getelementptr %caps_p[%sqi] : (!llvm.ptr, i64) -> !llvm.ptr, i64\n\
                         \x20 %scap_i = llvm.load %scp : !llvm.ptr -> i64\n\
                         \x20 %scap = arith.index_cast %scap_i : i64 to index\n\
                         \x20 %snb = arith.divui %scap, %kv_block : index\n\
                         \x20 %sbtp = llvm.getelementptr %blocks[%sqi] : (!llvm.ptr, i64) -> !llvm.ptr, !llvm.ptr\n\
                         \x20 %sbt = llvm.load %sbtp : !llvm.ptr -> !llvm.ptr"
                    );
                }
                let outer = std::mem::take(&mut e.body);
                e.call(kernel, args, true, n);
                let inner = std::mem::replace(&mut e.body, outer);
                e.body.push_str(&indent(&inner, 2));
                let _ = writeln!(e.body, "  %roff2 = arith.addi %roff, %srows : index\n  scf.yield %roff2 : index\n}}");
            }
        }
    }
}

/// `m3c_stage_vision` (see `m3c_contract::stage::abi::VISION`): the
/// stage's vision entry, or, on a stage without the tower, one that does
/// nothing (the runtime links the symbol in every stage and calls it only
/// where the metadata says the stage encodes images).
fn vision_func(body: &str) -> String {
    use m3c_contract::stage::abi::{Word, VISION_PARAMS};
    let params: Vec<String> = VISION_PARAMS
        .iter()
        .zip(VISION_SSA)
        .map(|((_, word), ssa)| format!("%{ssa}: {}", if *word == Word::I64 { "i64" } else { "!llvm.ptr" }))
        .collect();
    format!("  func.func @{VISION_SYMBOL}({}) {{\n{}  }}\n", params.join(", "), indent(body, 4))
}

/// The SSA name the vision body knows each of `abi::VISION_PARAMS` by:
/// the step's names where they mean the same (images are its sequences,
/// patch rows its tokens, the merged features its `x`).
const VISION_SSA: [&str; 9] = ["weights", "weights_dev", "sequences", "rows_p", "tokens", "pixels_p", "ppos_p", "segs_p", "x_p"];
const _: () = assert!(VISION_SSA.len() == m3c_contract::stage::abi::VISION_PARAMS.len());

/// The vision entry's text, with the emitter that holds its views and GPU functions.
fn vision_text(e: &mut Emitter, f: &FusedStage) -> String {
    let step_body = std::mem::take(&mut e.body);
    match &f.vision {
        Some(v) => vision_body(e, f, v),
        None => e.body.push_str("return\n"),
    }
    let body = std::mem::replace(&mut e.body, step_body);
    vision_func(&body)
}

/// The step entry: one pointer to the contract's `StepArgs`, whose fields
/// (`abi::STEP_FIELDS`, field `k` at byte `8k`) are loaded into the SSA
/// names the body uses (an array as `%NAME_p`, but for the pointer tables);
/// a layout version other than the contract's traps.
fn entry_func(body: &str) -> String {
    step_func(ENTRY_SYMBOL, body)
}

/// A function named `symbol` over one `StepArgs` pointer (see [`entry_func`]).
fn step_func(symbol: &str, body: &str) -> String {
    use m3c_contract::stage::abi::{Word, STEP_FIELDS, STEP_VERSION};
    let mut loads = String::new();
    for (k, (name, word)) in STEP_FIELDS.iter().enumerate() {
        let (ssa, ty) = match word {
            Word::I64 => (format!("%{name}"), "i64"),
            Word::Ptr if ["weights", "weights_dev", "caches", "blocks"].contains(name) => (format!("%{name}"), "!llvm.ptr"),
            Word::Ptr => (format!("%{name}_p"), "!llvm.ptr"),
        };
        let _ = writeln!(
            loads,
            "%args_{k} = llvm.getelementptr %args[{k}] : (!llvm.ptr) -> !llvm.ptr, i64
{ssa} = llvm.load %args_{k} : !llvm.ptr -> {ty}"
        );
    }
    let _ = writeln!(
        loads,
        "%args_version = arith.constant {STEP_VERSION} : i64\n\
         %args_other = arith.cmpi ne, %version, %args_version : i64\n\
         scf.if %args_other {{\n  llvm.intr.trap\n}}"
    );
    format!("  func.func @{symbol}(%args: !llvm.ptr) {{\n{}{}  }}\n", indent(&loads, 4), indent(body, 4))
}

/// Calls that disagree with their kernel's signature, as an error.
fn check(e: &Emitter) -> Result<(), String> {
    match e.mismatches.first() {
        None => Ok(()),
        Some(m) => Err(format!("internal: a kernel call does not match its signature: {m}")),
    }
}

/// The whole module of a stage for the host (CPUs with vectors of
/// `width`): kernels, view helpers and the entry.
pub fn module(f: &FusedStage, width: HostWidth) -> Result<String, String> {
    let mut e = entry_body(f, Flavor::Host);
    let vision = vision_text(&mut e, f);
    let draft = draft_text(&mut e, f);
    check(&e)?;
    let views: Vec<MemTy> = e.views.iter().cloned().collect();
    Ok(m3c_kernels::module_with(&f.kernels, &views, &format!("{}{}{vision}{draft}", runtime_decls(), entry_func(&e.body)), width))
}

/// The same stage as separately compiled modules: one per kernel (see
/// [`m3c_kernels::host_units`]) and, last, `entry`: the view helpers, the
/// runtime's and the kernels' declarations and the two entries.
pub fn host_units(f: &FusedStage, width: HostWidth) -> Result<Vec<(String, String)>, String> {
    let mut e = entry_body(f, Flavor::Host);
    let vision = vision_text(&mut e, f);
    let draft = draft_text(&mut e, f);
    check(&e)?;
    let mut units = m3c_kernels::host_units(&f.kernels, width);
    let mut entry = String::from("module {\n");
    for v in &e.views {
        entry.push_str(&v.view_fn_text());
    }
    entry.push_str(&runtime_decls());
    let decls: BTreeSet<String> = f.kernels.iter().map(m3c_kernels::host_decl).collect();
    for d in decls {
        entry.push_str(&d);
    }
    entry.push_str(&entry_func(&e.body));
    entry.push_str(&vision);
    entry.push_str(&draft);
    entry.push_str("}\n");
    units.push(("entry".into(), entry));
    Ok(units)
}

/// The module of a stage for the GPU `target`: the kernels as `gpu.func`s
/// in one `gpu.module`, and the same entry, launching them.
pub fn gpu_module(f: &FusedStage, target: &GpuTarget) -> Result<String, String> {
    let mut e = entry_body(f, Flavor::Gpu(*target));
    let vision = vision_text(&mut e, f);
    let draft = draft_text(&mut e, f);
    check(&e)?;
    let mut out = String::from("module attributes {gpu.container_module} {\n");
    out.push_str(&runtime_decls());
    out.push_str(&gemm_decls());
    for v in &e.views {
        out.push_str(&v.view_fn_text());
    }
    out.push_str(&format!("  gpu.module @{} {{\n", m3c_kernels::gpu::GPU_MODULE));
    for v in &e.device_views {
        out.push_str(&indent(&v.view_fn_text(), 2));
    }
    for (_, text) in &e.funcs {
        out.push_str(text);
    }
    out.push_str("  }\n");
    out.push_str(&entry_func(&e.body));
    out.push_str(&vision);
    out.push_str(&draft);
    out.push_str("}\n");
    Ok(out)
}
