//! MSA's sparse attention two heads at a time, for narrow heads.
//!
//! A head's P·V keeps one sum per eight columns, each gaining one fused
//! multiply-add per key: a head of 32 columns has four, which wait on the
//! FMA latency (a 16k prefill of such a model spent a third of its sparse
//! phase there). The heads of one KV group select the same blocks and read
//! the same V rows, so two of them go through the keys together: each
//! key's V vectors load once, and eight sums advance side by side.
//!
//! Each head's operations are those of the one-head path (`super::pv` with
//! `skip_zero`) in the same order: its weights are its own softmax's, a
//! key of weight exactly 0 leaves its sums as they were, and its columns
//! are summed in key order. Only which sums advance together changes, so
//! no bit does. A batch whose sixteen weights (eight keys, two heads) are
//! all nonzero goes through its keys without a test; any other keeps, per
//! key and head, the sums with or without the key by a vector select (the
//! one-head path branches per key; two heads' branches, or a select on a
//! scalar, which LLVM turns into a branch per sum, cost more than pairing
//! saves).

use super::{key_row, pv_chunks, PAIR_MAX_VECTORS};
use crate::emit::load_f32xn;
use crate::{indent, Storage};

const V: &str = "vector<8xf32>";

/// Whether a row's heads go in pairs: MSA over batches of eight keys, f32
/// activations (the sums land in `o` itself), an even group and a head
/// narrow enough ([`PAIR_MAX_VECTORS`]).
pub(super) fn pairs(k: &super::Attention) -> bool {
    let super::Attention { heads, kv_heads, head_dim: d, sparse, act, .. } = *k;
    sparse.is_some()
        && d.is_multiple_of(8)
        && act == Storage::F32
        && (heads / kv_heads).is_multiple_of(2)
        && pv_chunks(d).iter().all(|&(_, nv)| nv <= PAIR_MAX_VECTORS)
}

/// The heads of KV group `%g` two by two: each one's softmax into a
/// buffer of its own (`softmax_a` and `softmax_b`: MLIR that fills `%sc`,
/// and `%scb`, for the head at column `%qb` and defines `%sum`), then both
/// heads' P·V together into `o`. Needs `%scb` allocated beside `%sc`.
pub(super) fn heads(k: &super::Attention, softmax_a: &str, softmax_b: &str) -> String {
    let one = |x: &str, sm: &str| {
        format!(
            "%sum{x} = scf.execute_region -> (f32) {{\n\
             \x20 %qb = arith.addi %qb{x}, %c0 : index\n\
             {}\
             \x20 scf.yield %sum : f32\n\
             }}\n\
             %inv{x} = arith.divf %one, %sum{x} : f32\n",
            indent(sm, 2)
        )
    };
    format!(
        "scf.for %hh = %c0 to %cg step %c2 {{\n\
         \x20 %gi = arith.muli %g, %cg : index\n\
         \x20 %ia = arith.addi %gi, %hh : index\n\
         \x20 %ib = arith.addi %ia, %c1 : index\n\
         \x20 %qba = arith.muli %ia, %cd : index\n\
         \x20 %qbb = arith.muli %ib, %cd : index\n\
         {}\
         {}\
         {}\
         }}\n",
        indent(&one("a", softmax_a), 2),
        indent(&one("b", softmax_b), 2),
        indent(&pv_pair(k), 2),
    )
}

/// Both heads' P·V over the selected batches (`%bl[0..%nbl]`), the sums
/// stored into `o`'s row `%r` at columns `%qba` and `%qbb`.
fn pv_pair(k: &super::Attention) -> String {
    let super::Attention { kv_heads, head_dim: d, paged, cache, .. } = *k;
    let kt = cache.rows_ty(kv_heads * d);
    let ot = Storage::F32.rows_ty(k.heads * d);
    let tp = key_row(paged, "%t", "%tp").1;
    let (row, batch_row) = super::msa_key_rows(paged);
    let mut out = format!("%pvz = arith.constant dense<0.0> : {V}\n");
    for (ch, (c0, nv)) in pv_chunks(d).into_iter().enumerate() {
        let tys = vec![V; 2 * nv].join(", ");
        let names = |f: &dyn Fn(&str, usize) -> String| {
            ["a", "b"].iter().flat_map(|x| (0..nv).map(move |i| (x.to_string(), i))).map(|(x, i)| f(&x, i)).collect::<Vec<_>>().join(", ")
        };
        let key = |checked: bool| {
            let mut key = String::new();
            for x in ["a", "b"] {
                let sc = if x == "a" { "%sc" } else { "%scb" };
                key.push_str(&format!(
                    "%e{x} = memref.load {sc}[%t] : memref<?xf32>\n\
                     %pw{x} = arith.mulf %e{x}, %inv{x} : f32\n\
                     %pwv{x} = vector.broadcast %pw{x} : f32 to {V}\n"
                ));
                if checked {
                    key.push_str(&format!(
                        "%enz{x} = arith.cmpf une, %e{x}, %zero : f32\n\
                         %enzv{x} = vector.broadcast %enz{x} : i1 to vector<8xi1>\n"
                    ));
                }
            }
            key.push_str(&row);
            for i in 0..nv {
                key.push_str(&format!("%pvc{i} = arith.constant {} : index\n%vc{i} = arith.addi %kb, %pvc{i} : index\n", c0 + 8 * i));
                key.push_str(&load_f32xn(8, &format!("%vv{i}"), "%v", &kt, &tp, &format!("%vc{i}"), cache));
                for x in ["a", "b"] {
                    key.push_str(&format!(
                        "%pvv{x}{i} = arith.mulf %pwv{x}, %vv{i} fastmath<contract> : {V}\n\
                         %o{x}{i}f = arith.addf %o{x}{i}, %pvv{x}{i} fastmath<contract> : {V}\n"
                    ));
                    if checked {
                        key.push_str(&format!("%o{x}{i}n = arith.select %enzv{x}, %o{x}{i}f, %o{x}{i} : vector<8xi1>, {V}\n"));
                    }
                }
            }
            let next = if checked { "n" } else { "f" };
            key.push_str(&format!("scf.yield {} : {tys}\n", names(&|x, i| format!("%o{x}{i}{next}"))));
            format!(
                "scf.for %t = %tb0 to %tb1 step %c1 iter_args({carried}) -> ({tys}) {{\n{}}}\n",
                indent(&key, 2),
                carried = names(&|x, i| format!("%o{x}{i} = %ob{x}{i}")),
            )
        };
        out.push_str(&format!(
            "%pacc{ch}:{n2} = scf.for %tbi = %c0 to %nbl step %c1 iter_args({outer}) -> ({tys}) {{\n\
             \x20 %tb0 = memref.load %bl[%tbi] : memref<?xindex>\n\
             \x20 %ebva = vector.load %sc[%tb0] : memref<?xf32>, {V}\n\
             \x20 %ebvb = vector.load %scb[%tb0] : memref<?xf32>, {V}\n\
             \x20 %ebnza = arith.cmpf une, %ebva, %z8 : {V}\n\
             \x20 %ebnzb = arith.cmpf une, %ebvb, %z8 : {V}\n\
             \x20 %ebnz = arith.ori %ebnza, %ebnzb : vector<8xi1>\n\
             \x20 %eany = vector.reduction <or>, %ebnz : vector<8xi1> into i1\n\
             \x20 %eboth = arith.andi %ebnza, %ebnzb : vector<8xi1>\n\
             \x20 %eall = vector.reduction <and>, %eboth : vector<8xi1> into i1\n\
             \x20 %pbr:{n2} = scf.if %eany -> ({tys}) {{\n\
             {batch_row}\
             \x20   %tb1a = arith.addi %tb0, %c8 : index\n\
             \x20   %tb1 = arith.minui %tb1a, %nk : index\n\
             \x20   %pin:{n2} = scf.if %eall -> ({tys}) {{\n\
             {plain}\
             \x20     scf.yield {plain_res} : {tys}\n\
             \x20   }} else {{\n\
             {checked}\
             \x20     scf.yield {checked_res} : {tys}\n\
             \x20   }}\n\
             \x20   scf.yield {inner} : {tys}\n\
             \x20 }} else {{\n\
             \x20   scf.yield {pass} : {tys}\n\
             \x20 }}\n\
             \x20 scf.yield {batch} : {tys}\n\
             }}\n",
            n2 = 2 * nv,
            outer = names(&|x, i| format!("%ob{x}{i} = %pvz")),
            plain = indent(&format!("%pl:{} = {}", 2 * nv, key(false)), 6),
            checked = indent(&format!("%pk:{} = {}", 2 * nv, key(true)), 6),
            plain_res = results("%pl", 2 * nv),
            checked_res = results("%pk", 2 * nv),
            pass = names(&|x, i| format!("%ob{x}{i}")),
            inner = results("%pin", 2 * nv),
            batch = results("%pbr", 2 * nv),
            batch_row = indent(&batch_row, 4),
        ));
        for (h, x) in ["a", "b"].iter().enumerate() {
            for i in 0..nv {
                out.push_str(&format!(
                    "%oc{x}{ch}_{i}k = arith.constant {} : index\n\
                     %oc{x}{ch}_{i} = arith.addi %qb{x}, %oc{x}{ch}_{i}k : index\n\
                     vector.store %pacc{ch}#{}, %o[%r, %oc{x}{ch}_{i}] : {ot}, {V}\n",
                    c0 + 8 * i,
                    h * nv + i
                ));
            }
        }
    }
    out
}

/// `{op}#0, ..., {op}#{n - 1}`: an operation's n results, listed.
fn results(op: &str, n: usize) -> String {
    (0..n).map(|i| format!("{op}#{i}")).collect::<Vec<_>>().join(", ")
}
