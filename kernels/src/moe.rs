use crate::emit::{f32_lit, indent, load_f32, load_weight_f32, parallel_or_serial, store_f32};
use crate::view::MemTy;
use crate::{Kernel, Storage, WeightType};

/// The MoE router, in f32: `s = σ(h Wᵀ)`, top-k of `s + bias` (the bias only
/// selects; first index on ties), weights `scale · s[idx] / Σ s[idx]`.
/// Whatever the scores, the k ids are distinct and in range: a NaN score
/// ranks as -inf, and each round takes the first free expert unless a
/// later one scores strictly higher (the routed experts index by these ids).
/// `h`: `[S, width]`, `w`: `[experts, width]`, `bias`: `[experts]`;
/// out: `wts` `[S, k]` f32 and `ids` `[S, k]` i64, in selection order.
/// `h` holds values stored as `act`.
#[allow(clippy::too_many_arguments)]
pub fn router(
    name: &str,
    width: usize,
    experts: usize,
    k: usize,
    scale: f64,
    weight: WeightType,
    bias: Option<WeightType>,
    act: Storage,
) -> String {
    let ht = format!("memref<?x{width}x{}>", act.mlir_elem());
    let wt = format!("memref<{experts}x{width}x{}>", weight.mlir_elem());
    let wts = format!("memref<?x{k}xf32>");
    let ids = format!("memref<?x{k}xi64>");
    let mut args = format!("%h: {ht}, %w: {wt}");
    let add_bias = match bias {
        Some(bt) => {
            let bty = format!("memref<{experts}x{}>", bt.mlir_elem());
            args.push_str(&format!(", %bias: {bty}"));
            format!("{}%ch = arith.addf %sg, %bv : f32\n", load_weight_f32("%bv", "%bias", "%e", &bty, bt))
        }
        None => "%ch = arith.addf %sg, %zero : f32\n".into(),
    };
    args.push_str(&format!(", %wts: {wts}, %ids: {ids}"));
    // One token: logits, sigmoid, top-k, renormalised weights.
    let row = format!(
        "%s = memref.alloc() : memref<{experts}xf32>\n\
         %choice = memref.alloc() : memref<{experts}xf32>\n\
         %taken = memref.alloc() : memref<{experts}xi32>\n\
         \x20 scf.for %e = %c0 to %ce step %c1 {{\n\
         \x20   %l = scf.for %i = %c0 to %cw step %c1 iter_args(%a = %zero) -> (f32) {{\n\
         {xload}\
         {wload}\
         \x20     %m = arith.mulf %xv, %wv : f32\n\
         \x20     %a2 = arith.addf %a, %m : f32\n\
         \x20     scf.yield %a2 : f32\n\
         \x20   }}\n\
         \x20   %nl = arith.negf %l : f32\n\
         \x20   %ex = math.exp %nl : f32\n\
         \x20   %den = arith.addf %one, %ex : f32\n\
         \x20   %sg = arith.divf %one, %den : f32\n\
         \x20   memref.store %sg, %s[%e] : memref<{experts}xf32>\n\
         {add_bias}\
         \x20   memref.store %ch, %choice[%e] : memref<{experts}xf32>\n\
         \x20   memref.store %i32_0, %taken[%e] : memref<{experts}xi32>\n\
         \x20 }}\n\
         \x20 %sum = scf.for %j = %c0 to %ck step %c1 iter_args(%acc = %zero) -> (f32) {{\n\
         \x20   %best:2 = scf.for %e = %c0 to %ce step %c1 iter_args(%bv = %ninf, %bi = %ce) -> (f32, index) {{\n\
         \x20     %t = memref.load %taken[%e] : memref<{experts}xi32>\n\
         \x20     %free = arith.cmpi eq, %t, %i32_0 : i32\n\
         \x20     %v0 = memref.load %choice[%e] : memref<{experts}xf32>\n\
         \x20     %isnan = arith.cmpf uno, %v0, %v0 : f32\n\
         \x20     %v = arith.select %isnan, %ninf, %v0 : f32\n\
         \x20     %gt = arith.cmpf ogt, %v, %bv : f32\n\
         \x20     %none = arith.cmpi eq, %bi, %ce : index\n\
         \x20     %better = arith.ori %gt, %none : i1\n\
         \x20     %ok = arith.andi %free, %better : i1\n\
         \x20     %nv = arith.select %ok, %v, %bv : f32\n\
         \x20     %ni = arith.select %ok, %e, %bi : index\n\
         \x20     scf.yield %nv, %ni : f32, index\n\
         \x20   }}\n\
         \x20   memref.store %i32_1, %taken[%best#1] : memref<{experts}xi32>\n\
         \x20   %id = arith.index_cast %best#1 : index to i64\n\
         \x20   memref.store %id, %ids[%r, %j] : {ids}\n\
         \x20   %sv = memref.load %s[%best#1] : memref<{experts}xf32>\n\
         \x20   memref.store %sv, %wts[%r, %j] : {wts}\n\
         \x20   %acc2 = arith.addf %acc, %sv : f32\n\
         \x20   scf.yield %acc2 : f32\n\
         \x20 }}\n\
         \x20 scf.for %j = %c0 to %ck step %c1 {{\n\
         \x20   %sv = memref.load %wts[%r, %j] : {wts}\n\
         \x20   %nw = arith.divf %sv, %sum : f32\n\
         \x20   %sw = arith.mulf %nw, %scale : f32\n\
         \x20   memref.store %sw, %wts[%r, %j] : {wts}\n\
         \x20 }}\n\
         memref.dealloc %s : memref<{experts}xf32>\n\
         memref.dealloc %choice : memref<{experts}xf32>\n\
         memref.dealloc %taken : memref<{experts}xi32>\n",
        xload = indent(&load_f32("%xv", "%h", &ht, "%r", "%i", act), 6),
        wload = indent(&load_weight_f32("%wv", "%w", "%e, %i", &wt, weight), 6),
        add_bias = indent(&add_bias, 4),
    );
    let body = format!(
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %cw = arith.constant {width} : index\n\
         %ce = arith.constant {experts} : index\n\
         %ck = arith.constant {k} : index\n\
         %zero = arith.constant 0.0 : f32\n\
         %one = arith.constant 1.0 : f32\n\
         %scale = arith.constant {scale} : f32\n\
         %ninf = arith.constant 0xFF800000 : f32\n\
         %i32_0 = arith.constant 0 : i32\n\
         %i32_1 = arith.constant 1 : i32\n\
         %rows = memref.dim %h, %c0 : {ht}\n\
         %work0 = arith.constant {macs} : index\n\
         %work = arith.muli %rows, %work0 : index\n\
         {rows_loop}\
         return\n",
        scale = f32_lit(scale),
        macs = experts * width,
        rows_loop = parallel_or_serial("%work", &["%r"], &["%c0"], &["%rows"], &["%c1"], &row),
    );
    format!("  func.func @{name}({args}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n", indent(&body, 4))
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
        Kernel::Linear { inp: hidden, out: inter, weight, act: f, out_act: f },
        Kernel::Linear { inp: inter, out: hidden, weight, act: f, out_act: f },
        Kernel::SwiGluOai { width: inter, alpha, limit, beta, act: f },
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
#[allow(clippy::too_many_arguments)]
pub fn routed_experts(
    name: &str,
    experts: usize,
    hidden: usize,
    inter: usize,
    k: usize,
    weight: WeightType,
    alpha: f64,
    limit: f64,
    beta: f64,
    act: Storage,
) -> String {
    let ht = format!("memref<?x{hidden}xf32>");
    // `h` and `y` as the stage stores activations; the rest is f32 scratch.
    let hat = format!("memref<?x{hidden}x{}>", act.mlir_elem());
    let (sum, sum_alloc, sum_out) = match act {
        Storage::F32 => ("%y", String::new(), String::new()),
        Storage::Bf16 => (
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
        "%c0 = arith.constant 0 : index\n\
         %c1 = arith.constant 1 : index\n\
         %ch = arith.constant {hidden} : index\n\
         %ck = arith.constant {k} : index\n\
         %cstride = arith.constant {stride} : i64\n\
         {consts}\
         %zero = arith.constant 0.0 : f32\n\
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
    format!(
        "  func.func @{name}(%h: {hat}, %wts: {wts}, %ids: {ids}, %table: !llvm.ptr, %y: {hat}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n",
        indent(&body, 4)
    )
}
