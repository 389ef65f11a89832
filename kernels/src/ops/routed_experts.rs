//! Routed experts: `y[r] = Σ_j wts[r, j] · Expert_{ids[r, j]}(h[r])` with
//! SwiGLU-OAI experts, grouped by expert so each chosen expert's weights are
//! read once per step.

use crate::emit::{f32_lit, indent, load_f32, store_f32};
use crate::gpu::{device_buffer, func, warp_dots, GpuCall, GpuFunc, GpuTarget, WeightArgs, BLOCK, ROWS_PER_PASS, WARPS};
use crate::host::BASICS;
use crate::ops::{Linear, SwiGluOai};
use crate::unit::{param, KernelUnit, Launch, Param};
use crate::view::MemTy;
use crate::{num_tag, Kernel, Storage, WeightType};

/// The routed experts' SwiGLU-OAI MLPs, weighted and summed per token.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct RoutedExperts {
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
    pub top_k: usize,
    pub weight: WeightType,
    pub alpha: f64,
    pub limit: f64,
    pub beta: f64,
    pub act: Storage,
}

impl KernelUnit for RoutedExperts {
    fn symbol(&self) -> String {
        let RoutedExperts { experts, hidden, inter, top_k, weight, alpha, limit, beta, act } = self;
        format!(
            "m3c_routed_experts_e{experts}_h{hidden}_i{inter}_k{top_k}_{}_a{}_l{}_b{}{}",
            weight.tag(),
            num_tag(*alpha),
            num_tag(*limit),
            num_tag(*beta),
            act.act_suffix()
        )
    }
    fn params(&self) -> Vec<Param> {
        let RoutedExperts { hidden, top_k, act, .. } = self;
        let hat = act.rows_ty(*hidden);
        vec![
            param("h", &hat),
            param("wts", format!("memref<?x{top_k}xf32>")),
            param("ids", format!("memref<?x{top_k}xi64>")),
            param("table", "!llvm.ptr"),
            param("y", &hat),
        ]
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    fn host_body(&self) -> String {
        host(self)
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        gpu_routed_experts(target, &self.symbol(), self)
    }
    /// Grouping, gate/up, down and combine launches over scratch buffers.
    fn launch(&self, l: &Launch) -> GpuCall {
        let RoutedExperts { experts, hidden, inter, top_k, weight, .. } = self;
        let (tag, rows, args, sym, one) = (l.tag, l.rows, l.args, self.symbol(), l.one());
        let (mut text, mut host_views) = (String::new(), Vec::new());

        // args: h, wts, ids, table, y
        let (h, wts, ids, table, y) = (&args[0], &args[1], &args[2], &args[3], &args[4]);
        text.push_str(&format!(
            "%g{tag}_k = arith.constant {top_k} : index\n\
             %g{tag}_pairs = arith.muli {rows}, %g{tag}_k : index\n\
             %g{tag}_ne = arith.constant {experts} : index\n\
             %g{tag}_ne1 = arith.constant {} : index\n\
             %g{tag}_slots = arith.minui %g{tag}_ne, %g{tag}_pairs : index\n\
             %g{tag}_ib = arith.constant {} : index\n\
             %g{tag}_hb = arith.constant {} : index\n",
            experts + 1,
            inter.div_ceil(WARPS),
            hidden.div_ceil(WARPS)
        ));
        let mut bufs = Vec::new();
        for (n, count, width, elem) in [
            ("act", format!("%g{tag}_pairs"), *inter, "f32"),
            ("dn", format!("%g{tag}_pairs"), *hidden, "f32"),
            ("start", format!("%g{tag}_ne1"), 0, "i32"),
            ("order", format!("%g{tag}_pairs"), 0, "i32"),
            ("active", format!("%g{tag}_slots"), 0, "i32"),
        ] {
            let (a, t) = device_buffer(&format!("%g{tag}_{n}"), &count, width, elem);
            text.push_str(&a);
            bufs.push((format!("%g{tag}_{n}"), t.mlir()));
            host_views.push(t);
        }
        let (act, dn, start, order, active) = (&bufs[0], &bufs[1], &bufs[2], &bufs[3], &bufs[4]);
        let grouping = [start.clone(), order.clone(), active.clone()];
        let mut group_args = vec![ids.clone()];
        group_args.extend(grouping.iter().cloned());
        text.push_str(&l.grid(&format!("{sym}_group"), [&one, &one, &one], BLOCK, &group_args));
        // Gate/up then down, each as its `_r1` and multi-pair kernels, over
        // (active expert slot, blocks of 8 output rows).
        for (stage, input, output, row_blocks) in [("up", h, act, "ib"), ("down", act, dn, "hb")] {
            let mut a = vec![input.clone()];
            a.extend(grouping.iter().cloned());
            a.extend([table.clone(), output.clone()]);
            for kernel in [format!("{stage}_r1"), stage.to_string()] {
                text.push_str(&l.grid(
                    &format!("{sym}_{kernel}"),
                    [&format!("%g{tag}_slots"), &format!("%g{tag}_{row_blocks}"), &one],
                    l.target.warps_block(),
                    &a,
                ));
            }
        }
        text.push_str(&l.grid(&format!("{sym}_combine"), [rows, &one, &one], BLOCK, &[dn.clone(), wts.clone(), y.clone()]));
        for n in ["act", "dn", "start", "order", "active"] {
            text.push_str(&format!("func.call @m3c_buf_free(%g{tag}_{n}_p) : (!llvm.ptr) -> ()\n"));
        }
        let mut call = l.call(text);
        call.device_views = expert_tensor_types(*hidden, *inter, *weight);
        call.host_views = host_views;
        call
    }
    fn deps(&self) -> Vec<Kernel> {
        expert_deps(self.hidden, self.inter, self.weight, self.alpha, self.limit, self.beta)
    }
    fn globals(&self) -> Vec<(String, String)> {
        expert_tensor_types(self.hidden, self.inter, self.weight).into_iter().map(|t| (t.view_fn(), t.view_fn_text())).collect()
    }
}

/// Pointers per expert in the expert table: w1 (gate), w3 (up), w2 (down),
/// each followed by its E8M0 scales for MXFP8.
pub fn expert_table_stride(weight: WeightType) -> usize {
    match weight {
        WeightType::Mxfp8 { .. } => 6,
        _ => 3,
    }
}

/// The memref types of one expert's tensors, in table order.
pub fn expert_tensor_types(hidden: usize, inter: usize, weight: WeightType) -> Vec<MemTy> {
    let e = weight.mlir_elem();
    let mut out = Vec::new();
    for (o, i) in [(inter, hidden), (inter, hidden), (hidden, inter)] {
        out.push(MemTy::fixed(&[o, i], e));
        if let WeightType::Mxfp8 { block } = weight {
            out.push(MemTy::fixed(&[o, i / block], "i8"));
        }
    }
    out
}

/// The kernels the routed-experts kernel calls: on its own f32 scratch,
/// whatever the activations are.
pub fn expert_deps(hidden: usize, inter: usize, weight: WeightType, alpha: f64, limit: f64, beta: f64) -> Vec<Kernel> {
    let f = Storage::F32;
    vec![
        Kernel::Linear(Linear { inp: hidden, out: inter, weight, act: f, out_act: f }),
        Kernel::Linear(Linear { inp: inter, out: hidden, weight, act: f, out_act: f }),
        Kernel::SwiGluOai(SwiGluOai { width: inter, alpha, limit, beta, act: f }),
    ]
}

/// Routed experts: `y[r] = Σ_j wts[r, j] · Expert_{ids[r, j]}(h[r])` with
/// SwiGLU-OAI experts. The experts' weights come through `table`, a pointer
/// array with [`expert_table_stride`] entries per expert, so a layer's 128
/// experts are one argument and only the chosen experts' bytes are read.
///
/// Tokens are grouped by expert: each expert that any row chose runs once,
/// on all of its rows together (gathered, then scattered back with their
/// weights), so at prefill an expert's weights are read once, not once per
/// token. Each row's sum runs over its experts in expert-id order, in f32
/// (in `y` itself when `act` is f32, else in scratch stored into `y` once).
fn host(re: &RoutedExperts) -> String {
    let RoutedExperts { experts, hidden, inter, top_k: k, weight, alpha, limit, beta, act } = *re;
    let ht = format!("memref<?x{hidden}xf32>");
    // `h` and `y` as the stage stores activations; the rest is f32 scratch.
    let hat = act.rows_ty(hidden);
    let (sum, sum_alloc, sum_out) = match act {
        Storage::F32 => ("%y", String::new(), String::new()),
        Storage::Bf16 | Storage::Fp8 => (
            "%ysum",
            format!("%ysum = memref.alloc(%rows) : {ht}\n"),
            format!(
                "scf.for %r = %c0 to %rows step %c1 {{\n\
                 \x20 scf.for %c = %c0 to %ch step %c1 {{\n\
                 \x20   %sv = memref.load %ysum[%r, %c] : {ht}\n\
                 {}\
                 \x20 }}\n\
                 }}\n\
                 memref.dealloc %ysum : {ht}\n",
                indent(&store_f32("%sv", "%y", &hat, "%r", "%c", act), 4)
            ),
        ),
    };
    let it = format!("memref<?x{inter}xf32>");
    let wts = format!("memref<?x{k}xf32>");
    let ids = format!("memref<?x{k}xi64>");
    let stride = expert_table_stride(weight);
    let types = expert_tensor_types(hidden, inter, weight);
    let deps = expert_deps(hidden, inter, weight, alpha, limit, beta);
    let (up_fn, down_fn, act_fn) = (deps[0].symbol(), deps[1].symbol(), deps[2].symbol());
    let mut views = String::new();
    for (j, ty) in types.iter().enumerate() {
        views.push_str(&format!(
            "%off{j} = arith.addi %ebase, %c{j}_i64 : i64\n\
             %gp{j} = llvm.getelementptr %table[%off{j}] : (!llvm.ptr, i64) -> !llvm.ptr, !llvm.ptr\n\
             %p{j} = llvm.load %gp{j} : !llvm.ptr -> !llvm.ptr\n\
             %t{j} = func.call @{}(%p{j}, %c0) : (!llvm.ptr, index) -> {}\n",
            ty.view_fn(),
            ty.mlir()
        ));
    }
    let tys: Vec<String> = types.iter().map(MemTy::mlir).collect();
    let (gate_args, up_args, down_args, gate_ty, down_ty) = if stride == 6 {
        (
            "%hv, %t0, %t1, %gv",
            "%hv, %t2, %t3, %uv",
            "%av, %t4, %t5, %ov",
            format!("{ht}, {}, {}, {it}", tys[0], tys[1]),
            format!("{it}, {}, {}, {ht}", tys[4], tys[5]),
        )
    } else {
        ("%hv, %t0, %gv", "%hv, %t1, %uv", "%av, %t2, %ov", format!("{ht}, {}, {it}", tys[0]), format!("{it}, {}, {ht}", tys[2]))
    };
    let consts: String = (0..stride).map(|j| format!("%c{j}_i64 = arith.constant {j} : i64\n")).collect();
    let body = format!(
        "{BASICS}\
         %ch = arith.constant {hidden} : index\n\
         %ck = arith.constant {k} : index\n\
         %cstride = arith.constant {stride} : i64\n\
         {consts}\
         %rows = memref.dim %h, %c0 : {hat}\n\
         %ne = arith.constant {experts} : index\n\
         %sel = memref.alloc(%rows) : memref<?xindex>\n\
         %selw = memref.alloc(%rows) : memref<?xf32>\n\
         %hb = memref.alloc(%rows) : {ht}\n\
         %gb = memref.alloc(%rows) : {it}\n\
         %ub = memref.alloc(%rows) : {it}\n\
         %ab = memref.alloc(%rows) : {it}\n\
         %ob = memref.alloc(%rows) : {ht}\n\
         {sum_alloc}\
         scf.for %r = %c0 to %rows step %c1 {{\n\
         \x20 scf.for %c = %c0 to %ch step %c1 {{\n\
         \x20   memref.store %zero, {sum}[%r, %c] : {ht}\n\
         \x20 }}\n\
         }}\n\
         scf.for %e = %c0 to %ne step %c1 {{\n\
         \x20 %e64 = arith.index_cast %e : index to i64\n\
         \x20 // Gather the rows that chose expert e.\n\
         \x20 %n = scf.for %r = %c0 to %rows step %c1 iter_args(%cnt = %c0) -> (index) {{\n\
         \x20   %c2 = scf.for %j = %c0 to %ck step %c1 iter_args(%cj = %cnt) -> (index) {{\n\
         \x20     %id = memref.load %ids[%r, %j] : {ids}\n\
         \x20     %hit = arith.cmpi eq, %id, %e64 : i64\n\
         \x20     %cn = scf.if %hit -> (index) {{\n\
         \x20       memref.store %r, %sel[%cj] : memref<?xindex>\n\
         \x20       %wj = memref.load %wts[%r, %j] : {wts}\n\
         \x20       memref.store %wj, %selw[%cj] : memref<?xf32>\n\
         \x20       scf.for %c = %c0 to %ch step %c1 {{\n\
         {hload}\
         \x20         memref.store %hv0, %hb[%cj, %c] : {ht}\n\
         \x20       }}\n\
         \x20       %cj1 = arith.addi %cj, %c1 : index\n\
         \x20       scf.yield %cj1 : index\n\
         \x20     }} else {{\n\
         \x20       scf.yield %cj : index\n\
         \x20     }}\n\
         \x20     scf.yield %cn : index\n\
         \x20   }}\n\
         \x20   scf.yield %c2 : index\n\
         \x20 }}\n\
         \x20 %any = arith.cmpi ugt, %n, %c0 : index\n\
         \x20 scf.if %any {{\n\
         \x20   %ebase = arith.muli %e64, %cstride : i64\n\
         {views}\
         \x20   %hv = memref.reinterpret_cast %hb to offset: [0], sizes: [%n, {hidden}], strides: [{hidden}, 1] : {ht} to {ht}\n\
         \x20   %gv = memref.reinterpret_cast %gb to offset: [0], sizes: [%n, {inter}], strides: [{inter}, 1] : {it} to {it}\n\
         \x20   %uv = memref.reinterpret_cast %ub to offset: [0], sizes: [%n, {inter}], strides: [{inter}, 1] : {it} to {it}\n\
         \x20   %av = memref.reinterpret_cast %ab to offset: [0], sizes: [%n, {inter}], strides: [{inter}, 1] : {it} to {it}\n\
         \x20   %ov = memref.reinterpret_cast %ob to offset: [0], sizes: [%n, {hidden}], strides: [{hidden}, 1] : {ht} to {ht}\n\
         \x20   func.call @{up_fn}({gate_args}) : ({gate_ty}) -> ()\n\
         \x20   func.call @{up_fn}({up_args}) : ({gate_ty}) -> ()\n\
         \x20   func.call @{act_fn}(%gv, %uv, %av) : ({it}, {it}, {it}) -> ()\n\
         \x20   func.call @{down_fn}({down_args}) : ({down_ty}) -> ()\n\
         \x20   // Scatter back, weighted.\n\
         \x20   scf.for %i = %c0 to %n step %c1 {{\n\
         \x20     %r = memref.load %sel[%i] : memref<?xindex>\n\
         \x20     %wi = memref.load %selw[%i] : memref<?xf32>\n\
         \x20     scf.for %c = %c0 to %ch step %c1 {{\n\
         \x20       %ovv = memref.load %ob[%i, %c] : {ht}\n\
         \x20       %yv = memref.load {sum}[%r, %c] : {ht}\n\
         \x20       %m = arith.mulf %wi, %ovv : f32\n\
         \x20       %y2 = arith.addf %yv, %m : f32\n\
         \x20       memref.store %y2, {sum}[%r, %c] : {ht}\n\
         \x20     }}\n\
         \x20   }}\n\
         \x20 }}\n\
         }}\n\
         {sum_out}\
         memref.dealloc %sel : memref<?xindex>\n\
         memref.dealloc %selw : memref<?xf32>\n\
         memref.dealloc %hb : {ht}\n\
         memref.dealloc %gb : {it}\n\
         memref.dealloc %ub : {it}\n\
         memref.dealloc %ab : {it}\n\
         memref.dealloc %ob : {ht}\n\
         return\n",
        views = indent(&views, 4),
        hload = indent(&load_f32("%hv0", "%h", &hat, "%r", "%c", act), 10),
    );
    body
}

/// Routed experts on the GPU, grouped by expert so that each expert's
/// weights are read once per step for all the tokens that chose it (decode
/// batches share experts; a prefill's tokens share them heavily):
/// - `{name}_group` (one block): per expert, its (token, choice) pairs in
///   pair order (`order`, from `start[e]` to `start[e + 1]`), and the list
///   of experts with any pair (`active`, padded with −1); deterministic.
/// - `{name}_up`: a block per (active expert, 8 intermediate rows); a warp
///   per row walks the expert's pairs four at a time, loading each gate/up
///   weight element once per four pairs; SwiGLU-OAI into `act[pair]`.
/// - `{name}_down`: the same over the hidden rows, `act[pair]` → `dn[pair]`.
/// - `{name}_combine`: `y[r] = Σ_j wts[r, j] · dn[r·k + j]`.
///
/// `h` and `y` hold values stored as `act`; `act` and `dn` are f32 scratch.
fn gpu_routed_experts(target: &GpuTarget, name: &str, re: &RoutedExperts) -> Vec<GpuFunc> {
    let RoutedExperts { experts, hidden, inter, top_k: k, weight, alpha, limit, beta, act } = *re;
    let (idx, warp_ids) = (target.idx(), target.warp_ids());
    let ht = format!("memref<?x{hidden}xf32>");
    let hat = act.rows_ty(hidden);
    let it = format!("memref<?x{inter}xf32>");
    let ids = format!("memref<?x{k}xi64>");
    let wts = format!("memref<?x{k}xf32>");
    let i32v = "memref<?xi32>";
    let stride = expert_table_stride(weight);
    let types = expert_tensor_types(hidden, inter, weight);
    let e_n = experts;
    let group_body = group_body(&idx, k, e_n);
    // Views of expert `%e`'s tensors `first..first+n` from the device pointer table.
    let views = |first: usize, n: usize| -> String {
        let mut s = format!("%cstride = arith.constant {stride} : i64\n%e64 = arith.index_cast %e : index to i64\n%ebase = arith.muli %e64, %cstride : i64\n");
        for (j, ty) in types.iter().enumerate().skip(first).take(n) {
            s.push_str(&format!(
                "%off{j}c = arith.constant {j} : i64\n%off{j} = arith.addi %ebase, %off{j}c : i64\n\
                 %gp{j} = llvm.getelementptr %table[%off{j}] : (!llvm.ptr, i64) -> !llvm.ptr, !llvm.ptr\n\
                 %p{j} = llvm.load %gp{j} : !llvm.ptr -> !llvm.ptr\n\
                 %t{j} = func.call @{}(%p{j}, %c0) : (!llvm.ptr, index) -> {}\n",
                ty.view_fn(),
                ty.mlir()
            ));
        }
        s
    };
    let mx = matches!(weight, WeightType::Mxfp8 { .. });
    let (g_w, g_s, u_w, u_s, d_w, d_s) = if mx { ("%t0", "%t1", "%t2", "%t3", "%t4", "%t5") } else { ("%t0", "", "%t1", "", "%t2", "") };
    let gate = WeightArgs::new(target, g_w, g_s, inter, hidden, weight);
    let up = WeightArgs::new(target, u_w, u_s, inter, hidden, weight);
    let down = WeightArgs::new(target, d_w, d_s, hidden, inter, weight);
    let consts = gate.consts();
    // The block's expert and output row.
    let head = |out: usize| {
        format!(
            "{idx}{warp_ids}{consts}%slot = gpu.block_id x\n%e32 = memref.load %active[%slot] : {i32v}\n%i0 = arith.constant 0 : i32\n\
             %has = arith.cmpi sge, %e32, %i0 : i32\n%e = arith.index_cast %e32 : i32 to index\n\
             %bx = gpu.block_id y\n%cwarps = arith.constant {WARPS} : index\n%ob = arith.muli %bx, %cwarps : index\n%o = arith.addi %ob, %warp : index\n\
             %cout = arith.constant {out} : index\n%in = arith.cmpi ult, %o, %cout : index\n%ok = arith.andi %has, %in : i1\n\
             %ck = arith.constant {k} : index\n%first = arith.cmpi eq, %lane, %c0 : index\n"
        )
    };
    // The expert's pair range, and whether it has a single pair (a batch-1
    // decode: then the one-pair walk, with no clamped duplicates).
    let range =
        "%e1 = arith.addi %e, %c1 : index\n%s0i = memref.load %start[%e] : memref<?xi32>\n%s1i = memref.load %start[%e1] : memref<?xi32>\n\
                 %s0 = arith.index_cast %s0i : i32 to index\n%s1 = arith.index_cast %s1i : i32 to index\n\
                 %npairs = arith.subi %s1, %s0 : index\n%single = arith.cmpi eq, %npairs, %c1 : index\n";
    // The walk over the expert's pairs `rows` at a time (`%q{j}`: pair,
    // `%x{j}`: the activation row it reads, `%ok{j}`: not past the end).
    // `rows` dot products of weight row `%o` with the pairs' activation rows `%x{j}`.
    let dots = |rows: usize, tag: &str, wa: &WeightArgs, x: &str, xt: &str, xs: Storage, n: usize| {
        let names: Vec<String> = (0..rows).map(|j| format!("%x{j}")).collect();
        warp_dots(tag, wa, "%o", x, xt, xs, &names, n)
    };
    // One walk (gate/up or down) for `rows` pairs per pass.
    let up_walk = |rows: usize| {
        format!(
            "{}{}{}{}}}\n",
            walk_open(rows, false),
            indent(&dots(rows, "g", &gate, "%h", &hat, act, hidden), 2),
            indent(&dots(rows, "u", &up, "%h", &hat, act, hidden), 2),
            indent(&swiglu(rows, &it), 2)
        )
    };
    let down_walk = |rows: usize| {
        format!(
            "{}{}{}}}\n",
            walk_open(rows, true),
            indent(&dots(rows, "d", &down, "%act", &it, Storage::F32, inter), 2),
            indent(&down_store(rows, &ht), 2)
        )
    };
    // Two kernels per projection: `_r1` serves the experts with exactly one
    // pair (all of them in a batch-1 decode) with a one-pair walk and few
    // registers; the other serves the experts with more pairs, four per
    // pass. Both are launched over the same grid; a block whose expert is
    // the other kind's returns at once.
    let only = |rows: usize, walk: &dyn Fn(usize) -> String| {
        let cond = if rows == 1 { "%single".to_string() } else { "%multi".to_string() };
        let pre =
            if rows == 1 { String::new() } else { "%yes = arith.constant true\n%multi = arith.xori %single, %yes : i1\n".to_string() };
        format!("{pre}scf.if {cond} {{\n{}}}\n", indent(&walk(rows), 2))
    };
    let up_body = |rows: usize| {
        format!(
            "{head}%alpha = arith.constant {a} : f32\n%lim = arith.constant {l} : f32\n%nlim = arith.constant {nl} : f32\n%beta = arith.constant {b} : f32\n\
             scf.if %ok {{\n{views}{range}{walks}}}\n",
            head = head(inter),
            a = f32_lit(alpha),
            l = f32_lit(limit),
            nl = f32_lit(-limit),
            b = f32_lit(beta),
            views = indent(&views(0, if mx { 4 } else { 2 }), 2),
            range = indent(range, 2),
            walks = indent(&only(rows, &up_walk), 2),
        )
    };
    let down_first = if mx { 4 } else { 2 };
    let down_body = |rows: usize| {
        format!(
            "{head}scf.if %ok {{\n{views}{range}{walks}}}\n",
            head = head(hidden),
            views = indent(&views(down_first, if mx { 2 } else { 1 }), 2),
            range = indent(range, 2),
            walks = indent(&only(rows, &down_walk), 2),
        )
    };
    let combine_body = combine_body(&idx, hidden, k, act);
    let grouping = format!("%start: {i32v}, %order: {i32v}, %active: {i32v}");
    vec![
        GpuFunc {
            name: format!("{name}_group"),
            text: format!(
                "    gpu.func @{name}_group(%ids: {ids}, {grouping}) workgroup(%cnt: memref<{e_n}xi32, #gpu.address_space<workgroup>>) kernel{} {{\n{}      gpu.return\n    }}\n",
                target.block_attr(BLOCK),
                indent(&group_body, 6)
            ),
        },
        func(target, &format!("{name}_up_r1"), &format!("%h: {hat}, {grouping}, %table: !llvm.ptr, %out: {it}"), &up_body(1), target.warps_block()),
        func(target, &format!("{name}_up"), &format!("%h: {hat}, {grouping}, %table: !llvm.ptr, %out: {it}"), &up_body(ROWS_PER_PASS), target.warps_block()),
        func(target, &format!("{name}_down_r1"), &format!("%act: {it}, {grouping}, %table: !llvm.ptr, %out: {ht}"), &down_body(1), target.warps_block()),
        func(target, &format!("{name}_down"), &format!("%act: {it}, {grouping}, %table: !llvm.ptr, %out: {ht}"), &down_body(ROWS_PER_PASS), target.warps_block()),
        func(target, &format!("{name}_combine"), &format!("%dn: {ht}, %wts: {wts}, %y: {hat}"), &combine_body, BLOCK),
    ]
}

/// The grouping kernel's body: pairs per expert, their offsets, the active
/// experts, then each expert's pairs in pair order.
fn group_body(idx: &str, k: usize, e_n: usize) -> String {
    let ids = format!("memref<?x{k}xi64>");
    let i32v = "memref<?xi32>";
    format!(
        "{idx}%t = gpu.thread_id x\n%ck = arith.constant {k} : index\n%ce = arith.constant {e_n} : index\n\
         %rows = memref.dim %ids, %c0 : {ids}\n%pairs = arith.muli %rows, %ck : index\n%slots = memref.dim %active, %c0 : {i32v}\n\
         %i0 = arith.constant 0 : i32\n%i1 = arith.constant 1 : i32\n%neg = arith.constant -1 : i32\n\
         // Pairs per expert.\n\
         scf.for %e = %t to %ce step %c256 {{\n\
         \x20 %e64 = arith.index_cast %e : index to i64\n\
         \x20 %n = scf.for %p = %c0 to %pairs step %c1 iter_args(%a = %i0) -> (i32) {{\n\
         \x20   %r = arith.divui %p, %ck : index\n    %j = arith.remui %p, %ck : index\n\
         \x20   %x = memref.load %ids[%r, %j] : {ids}\n    %is = arith.cmpi eq, %x, %e64 : i64\n\
         \x20   %a1 = arith.addi %a, %i1 : i32\n    %a2 = arith.select %is, %a1, %a : i32\n    scf.yield %a2 : i32\n  }}\n\
         \x20 memref.store %n, %cnt[%e] : memref<{e_n}xi32, #gpu.address_space<workgroup>>\n\
         }}\n\
         gpu.barrier\n\
         // Offsets and the active list (one thread: E is small).\n\
         %lead = arith.cmpi eq, %t, %c0 : index\n\
         scf.if %lead {{\n\
         \x20 %tot:2 = scf.for %e = %c0 to %ce step %c1 iter_args(%off = %i0, %s = %c0) -> (i32, index) {{\n\
         \x20   memref.store %off, %start[%e] : {i32v}\n\
         \x20   %n = memref.load %cnt[%e] : memref<{e_n}xi32, #gpu.address_space<workgroup>>\n\
         \x20   %off2 = arith.addi %off, %n : i32\n    %any = arith.cmpi sgt, %n, %i0 : i32\n\
         \x20   %s1 = arith.addi %s, %c1 : index\n\
         \x20   %s2 = scf.if %any -> (index) {{\n\
         \x20     %fits = arith.cmpi ult, %s, %slots : index\n\
         \x20     scf.if %fits {{\n        %e32 = arith.index_cast %e : index to i32\n        memref.store %e32, %active[%s] : {i32v}\n      }}\n\
         \x20     scf.yield %s1 : index\n    }} else {{\n      scf.yield %s : index\n    }}\n\
         \x20   scf.yield %off2, %s2 : i32, index\n  }}\n\
         \x20 memref.store %tot#0, %start[%ce] : {i32v}\n\
         \x20 scf.for %s = %tot#1 to %slots step %c1 {{\n    memref.store %neg, %active[%s] : {i32v}\n  }}\n\
         }}\n\
         gpu.barrier\n\
         // Each expert's pairs, in pair order.\n\
         scf.for %e = %t to %ce step %c256 {{\n\
         \x20 %e64 = arith.index_cast %e : index to i64\n\
         \x20 %s0 = memref.load %start[%e] : {i32v}\n\
         \x20 %fin = scf.for %p = %c0 to %pairs step %c1 iter_args(%at = %s0) -> (i32) {{\n\
         \x20   %r = arith.divui %p, %ck : index\n    %j = arith.remui %p, %ck : index\n\
         \x20   %x = memref.load %ids[%r, %j] : {ids}\n    %is = arith.cmpi eq, %x, %e64 : i64\n\
         \x20   %nx = scf.if %is -> (i32) {{\n\
         \x20     %ati = arith.index_cast %at : i32 to index\n      %p32 = arith.index_cast %p : index to i32\n\
         \x20     memref.store %p32, %order[%ati] : {i32v}\n      %at1 = arith.addi %at, %i1 : i32\n      scf.yield %at1 : i32\n\
         \x20   }} else {{\n      scf.yield %at : i32\n    }}\n\
         \x20   scf.yield %nx : i32\n  }}\n\
         }}\n"
    )
}

/// The combine kernel's body: each row's weighted sum of its experts' outputs.
fn combine_body(idx: &str, hidden: usize, k: usize, act: Storage) -> String {
    let ht = format!("memref<?x{hidden}xf32>");
    let hat = act.rows_ty(hidden);
    let wts = format!("memref<?x{k}xf32>");
    format!(
        "{idx}%r = gpu.block_id x\n%t = gpu.thread_id x\n%ch = arith.constant {hidden} : index\n%ck = arith.constant {k} : index\n\
         %rk = arith.muli %r, %ck : index\n\
         scf.for %c = %t to %ch step %c256 {{\n\
         \x20 %s = scf.for %j = %c0 to %ck step %c1 iter_args(%a = %zero) -> (f32) {{\n\
         \x20   %pk = arith.addi %rk, %j : index\n    %w = memref.load %wts[%r, %j] : {wts}\n    %x = memref.load %dn[%pk, %c] : {ht}\n\
         \x20   %m = arith.mulf %w, %x : f32\n    %a2 = arith.addf %a, %m : f32\n    scf.yield %a2 : f32\n  }}\n\
         {}}}\n",
        indent(&store_f32("%s", "%y", &hat, "%r", "%c", act), 2)
    )
}

/// The walk over an expert's pairs `rows` at a time (`%q{j}`: pair,
/// `%x{j}`: the activation row it reads, `%ok{j}`: not past the end).
fn walk_open(rows: usize, xrow_of_pair: bool) -> String {
    let mut s = format!("%cr = arith.constant {rows} : index\nscf.for %pb = %s0 to %s1 step %cr {{\n");
    for j in 0..rows {
        s.push_str(&format!(
                "  %cj{j} = arith.constant {j} : index\n  %pu{j} = arith.addi %pb, %cj{j} : index\n  %ok{j} = arith.cmpi ult, %pu{j}, %s1 : index\n\
                 \x20 %pi{j} = arith.select %ok{j}, %pu{j}, %pb : index\n  %q{j}i = memref.load %order[%pi{j}] : memref<?xi32>\n\
                 \x20 %q{j} = arith.index_cast %q{j}i : i32 to index\n"
            ));
        if xrow_of_pair {
            s.push_str(&format!("  %x{j} = arith.addi %q{j}, %c0 : index\n"));
        } else {
            s.push_str(&format!("  %x{j} = arith.divui %q{j}, %ck : index\n"));
        }
    }
    s
}

/// SwiGLU-OAI of the gate and up sums of `rows` pairs, stored into `%out`.
fn swiglu(rows: usize, it: &str) -> String {
    let mut out = String::new();
    for j in 0..rows {
        out.push_str(&format!(
                "%gc{j} = arith.minimumf %gs{j}, %lim : f32\n%u1{j} = arith.minimumf %us{j}, %lim : f32\n%uc{j} = arith.maximumf %u1{j}, %nlim : f32\n\
                 %ag{j} = arith.mulf %alpha, %gc{j} : f32\n%nag{j} = arith.negf %ag{j} : f32\n%ex{j} = math.exp %nag{j} : f32\n\
                 %den{j} = arith.addf %one, %ex{j} : f32\n%sig{j} = arith.divf %one, %den{j} : f32\n%glu{j} = arith.mulf %gc{j}, %sig{j} : f32\n\
                 %upb{j} = arith.addf %uc{j}, %beta : f32\n%act{j} = arith.mulf %glu{j}, %upb{j} : f32\n\
                 %st{j} = arith.andi %first, %ok{j} : i1\nscf.if %st{j} {{\n  memref.store %act{j}, %out[%q{j}, %o] : {it}\n}}\n"
            ));
    }
    out
}

/// The down projection's sums of `rows` pairs, stored into `%out`.
fn down_store(rows: usize, ht: &str) -> String {
    let mut out = String::new();
    for j in 0..rows {
        out.push_str(&format!(
            "%st{j} = arith.andi %first, %ok{j} : i1\nscf.if %st{j} {{\n  memref.store %ds{j}, %out[%q{j}, %o] : {ht}\n}}\n"
        ));
    }
    out
}
