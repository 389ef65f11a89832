//! `y[S, out] = x[S, inp] · W[out, inp]ᵀ` with f32 accumulation, for every
//! weight type; on the host a register-tiled vector path (`tiled`) when the
//! widths allow.

mod tiled;

use crate::emit::{e8m0_to_f32, fp8_lut_global, load_f32, load_weight_f32, mul_add_yield, store_f32, E8M0_CONSTANTS};
use crate::gpu::{warp_dots, GpuCall, GpuFunc, GpuTarget, WeightArgs, ROWS_PER_PASS, WARPS};
use crate::host::index_consts;
use crate::unit::{gpu_func_block, param, KernelUnit, Launch, Param};
use crate::{indent, HostWidth, Storage, WeightType};

/// `y = x Wᵀ` with `W: [out, inp]`; `x` stored as `act`, `y` as `out_act`
/// (f32 for the logits whatever the activations are).
#[derive(Debug, Clone, PartialEq, PartialOrd)]
pub struct Linear {
    pub inp: usize,
    pub out: usize,
    pub weight: WeightType,
    pub act: Storage,
    pub out_act: Storage,
}

impl KernelUnit for Linear {
    fn symbol(&self) -> String {
        let Linear { inp, out, weight, act, out_act } = self;
        // The output type is named only when it differs (the logits).
        let y = if out_act != act { format!("_y{}", out_act.name()) } else { String::new() };
        format!("m3c_linear_i{inp}_o{out}_{}{y}{}", weight.tag(), act.act_suffix())
    }
    fn params(&self) -> Vec<Param> {
        let Linear { inp, out, weight, act, out_act } = self;
        let mut p = vec![param("x", act.rows_ty(*inp)), param("w", weight.memref(&[*out, *inp]))];
        if let WeightType::Mxfp8 { block } = weight {
            p.push(param("s", format!("memref<{out}x{}xi8>", inp / block)));
        }
        p.push(param("y", out_act.rows_ty(*out)));
        p
    }
    fn act(&self) -> Option<Storage> {
        Some(self.act)
    }
    /// `y[S, out] = x[S, inp] · W[out, inp]ᵀ`, f32 accumulation. MXFP8 weights are
    /// decoded in the inner loop (fp8 through a 256-entry table, one E8M0 scale
    /// per block applied to the block's partial sum), so each weight byte is read
    /// once and never expanded in memory. `x` is stored as `act`, `y` as `out_act`.
    fn host_body(&self) -> String {
        self.host_body_at(HostWidth::Lanes8)
    }
    fn host_body_at(&self, width: HostWidth) -> String {
        let Linear { inp, out, weight, act, out_act } = *self;
        if tiled::vectorizes(inp, weight) {
            return tiled::body(inp, out, weight, act, out_act, width);
        }
        let x = act.rows_ty(inp);
        let y = out_act.rows_ty(out);
        let xload = load_f32("%xv", "%x", &x, "%r", "%i", act);
        let ystore = indent(&store_f32("%acc", "%y", &y, "%r", "%o", out_act), 4);
        let wt = weight.memref(&[out, inp]);
        let head = "%c0 = arith.constant 0 : index\n\
                    %c1 = arith.constant 1 : index\n\
                    %zero = arith.constant 0.0 : f32\n";
        // The reduction over the inputs of output `%o` for row `%r` into `%acc`
        // (written 4 columns in), and the constants it needs.
        let (consts, acc) = match weight {
            WeightType::Mxfp8 { block } => {
                let nb = inp / block;
                let st = format!("memref<{out}x{nb}xi8>");
                let consts = format!(
                    "{E8M0_CONSTANTS}{}%lut = memref.get_global @m3c_fp8_e4m3_lut : memref<256xf32>\n",
                    index_consts(&[("cout", out), ("cnb", nb), ("cb", block)])
                );
                let acc = format!(
                    "%acc = scf.for %b = %c0 to %cnb step %c1 iter_args(%a = %zero) -> (f32) {{\n\
                     \x20 %base = arith.muli %b, %cb : index\n\
                     \x20 %part = scf.for %j = %c0 to %cb step %c1 iter_args(%p = %zero) -> (f32) {{\n\
                     \x20   %i = arith.addi %base, %j : index\n\
                     {xload}\
                     \x20   %q = memref.load %w[%o, %i] : {wt}\n\
                     \x20   %qi = arith.extui %q : i8 to i32\n\
                     \x20   %qx = arith.index_cast %qi : i32 to index\n\
                     \x20   %wv = memref.load %lut[%qx] : memref<256xf32>\n\
                     {inner}\
                     \x20 }}\n\
                     \x20 %sb = memref.load %s[%o, %b] : {st}\n\
                     {dec}\
                     {outer}\
                     }}\n",
                    xload = indent(&xload, 4),
                    dec = indent(&e8m0_to_f32("%scale", "%sb"), 2),
                    inner = indent(&mul_add_yield("%p", "%m", "%xv", "%wv", "f32"), 4),
                    outer = indent(&mul_add_yield("%a", "%ps", "%part", "%scale", "f32"), 2),
                );
                (consts, acc)
            }
            _ => {
                let acc = format!(
                    "%acc = scf.for %i = %c0 to %cin step %c1 iter_args(%a = %zero) -> (f32) {{\n\
                     {xload}\
                     {load}\
                     {mac}\
                     }}\n",
                    xload = indent(&xload, 2),
                    load = indent(&load_weight_f32("%wv", "%w", "%o, %i", &wt, weight), 2),
                    mac = indent(&mul_add_yield("%a", "%m", "%xv", "%wv", "f32"), 2),
                );
                (index_consts(&[("cout", out), ("cin", inp)]), acc)
            }
        };
        format!(
            "{head}{consts}\
             %rows = memref.dim %x, %c0 : {x}\n\
             scf.for %r = %c0 to %rows step %c1 {{\n\
             \x20 scf.for %o = %c0 to %cout step %c1 {{\n\
             {acc}\
             {ystore}\
             \x20 }}\n\
             }}\n\
             return\n",
            acc = indent(&acc, 4),
        )
    }
    fn gpu_funcs(&self, target: &GpuTarget) -> Vec<GpuFunc> {
        let idx = target.idx();
        let sym = self.symbol();
        let Linear { inp, out, weight, act, out_act } = self;

        // A warp per output row, looping over the activation rows
        // four at a time: each weight element is loaded (and, for
        // MXFP8, decoded) once per four rows, so a decode
        // micro-batch of up to four sequences reads each weight byte
        // once. Rows past the end are clamped for the loads and not stored.
        // `{sym}_r1` takes one row per pass: a batch-1 decode step
        // then does no clamped duplicate work.
        let wa = WeightArgs::new(target, "%w", "%s", *out, *inp, *weight);
        let xt = act.rows_ty(*inp);
        let yt = out_act.rows_ty(*out);
        let mut funcs = Vec::new();
        for (rows, name) in [(ROWS_PER_PASS, sym.clone()), (1, format!("{sym}_r1"))] {
            let mut clamp = String::new();
            for j in 0..rows {
                clamp.push_str(&format!(
                    "%cj{j} = arith.constant {j} : index\n%ru{j} = arith.addi %rb, %cj{j} : index\n\
                             %ok{j} = arith.cmpi ult, %ru{j}, %rows : index\n%r{j} = arith.select %ok{j}, %ru{j}, %rb : index\n"
                ));
            }
            let names: Vec<String> = (0..rows).map(|j| format!("%r{j}")).collect();
            let mut stores = String::new();
            for j in 0..rows {
                stores.push_str(&format!(
                    "%st{j} = arith.andi %first, %ok{j} : i1\n\
                             scf.if %st{j} {{\n{}}}\n",
                    indent(&store_f32(&format!("%ys{j}"), "%y", &yt, &format!("%r{j}"), "%o", *out_act), 2)
                ));
            }
            let body = format!(
                "{idx}{warp_ids}{consts}%bx = gpu.block_id x\n%cwarps = arith.constant {WARPS} : index\n\
                         %ob = arith.muli %bx, %cwarps : index\n%o = arith.addi %ob, %warp : index\n\
                         %cout = arith.constant {out} : index\n%ok = arith.cmpi ult, %o, %cout : index\n\
                         %rows = memref.dim %x, %c0 : {xt}\n%cr = arith.constant {rows} : index\n\
                         %first = arith.cmpi eq, %lane, %c0 : index\n\
                         scf.if %ok {{\n\
                         \x20 scf.for %rb = %c0 to %rows step %cr {{\n\
                         {clamp}\
                         {dots}\
                         {stores}\
                         \x20 }}\n\
                         }}\n",
                warp_ids = target.warp_ids(),
                consts = wa.consts(),
                clamp = indent(&clamp, 4),
                dots = indent(&warp_dots("y", &wa, "%o", "%x", &xt, *act, &names, *inp), 4),
                stores = indent(&stores, 4),
            );
            funcs.push(gpu_func_block(target, &name, &self.params(), &body, target.warps_block()));
        }
        funcs
    }
    /// One block of 8 warps per 8 output rows; each warp covers every
    /// activation row (one at a time for a single row, else four at a time).
    fn launch(&self, l: &Launch) -> GpuCall {
        let sym = self.symbol();
        let (ob, single, one, rows) = (l.local("ob"), l.local("single"), l.one(), l.rows);
        l.call(format!(
            "{ob} = arith.constant {} : index\n\
             {single} = arith.cmpi eq, {rows}, {one} : index\nscf.if {single} {{\n{}}} else {{\n{}}}\n",
            self.out.div_ceil(WARPS),
            indent(&l.grid(&format!("{sym}_r1"), [&ob, &one, &one], l.target.warps_block(), l.args), 2),
            indent(&l.grid(&sym, [&ob, &one, &one], l.target.warps_block(), l.args), 2)
        ))
    }
    fn globals(&self) -> Vec<(String, String)> {
        self.globals_at(HostWidth::Lanes8)
    }
    fn globals_at(&self, width: HostWidth) -> Vec<(String, String)> {
        let Linear { inp, weight, act, out_act, .. } = *self;
        if tiled::vectorizes(inp, weight) {
            return tiled::globals(inp, weight, act, out_act, width);
        }
        match weight {
            WeightType::Mxfp8 { .. } => vec![("m3c_fp8_e4m3_lut".into(), fp8_lut_global())],
            _ => Vec::new(),
        }
    }
}
