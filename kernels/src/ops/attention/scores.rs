//! The host attention's scores and softmax for heads whose width is a
//! multiple of 8, eight keys at a time: MSA's row by row here, and the
//! pieces dense attention's row blocks (`blocked`) use.
//!
//! A key's score is its own q·k: eight lane sums in increasing column
//! order (a fused multiply-add each), added by the same tree as the
//! linear's, `((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))`. Eight keys' trees run
//! at once through shuffles that transpose as they add, so the score of a
//! key is the same bits whichever batch it falls in. The last batch is
//! padded with clamped key indices (their loads stay inside the rows
//! written) and its padding masked to -inf, whose exp is exactly 0.
//!
//! The exp is a written-out polynomial on eight lanes (Cephes' expf:
//! about one ulp), not eight calls to libm: at a head width of 80 the
//! scalar calls cost as much as the two matrix products together. The
//! softmax's sum is eight lane sums in key order (key t in lane t mod 8),
//! then the same tree.

use crate::emit::{hsum, load_f32xn};
use crate::{indent, Storage};

const V: &str = "vector<8xf32>";

/// What the eight-key batches of one (query row, KV group) need, defined
/// once before its heads: `%nk8` (`%nk` rounded up to 8), `%nkm1`, `%c8`,
/// `%ck0`..`%ck7`, and eight-lane zeros, -inf and `%scale`.
pub(super) fn batch_consts() -> String {
    let ck: String = (0..8).map(|j| format!("%ck{j} = arith.constant {j} : index\n")).collect();
    format!(
        "%c7 = arith.constant 7 : index\n\
         %c8 = arith.constant 8 : index\n\
         %nk7 = arith.addi %nk, %c7 : index\n\
         %nkb = arith.divui %nk7, %c8 : index\n\
         %nk8 = arith.muli %nkb, %c8 : index\n\
         %nkm1 = arith.subi %nk, %c1 : index\n\
         {ck}\
         %ninf8 = vector.broadcast %ninf : f32 to {V}\n\
         %z8 = arith.constant dense<0.0> : {V}\n\
         %scale8 = vector.broadcast %scale : f32 to {V}\n"
    )
}

/// The keys of the batch at `%t0`: `%tu{j}` = `%t0` + j, `%tc{j}` the same
/// clamped to the last key (a row that can be loaded), `%in{j}` whether it
/// is a key of this row at all.
/// In a paged cache (`paged`: its block size) also `%tp{j}`, the pool row
/// of key `%tc{j}` ([`super::key_row`]); [`key_rows`] names the rows to load.
///
/// Where a page holds whole batches (its size a multiple of 8: the
/// batch's keys, clamped ones included, lie in `%t0`'s page), the batch's
/// first pool row is looked up once and the others follow it.
pub(super) fn batch_keys(paged: Option<usize>) -> String {
    let mut out = batch_rows(paged, "%nkm1");
    out.extend((0..8).map(|j| format!("%in{j} = arith.cmpi ult, %tu{j}, %nk : index\n")));
    out
}

/// [`batch_keys`]' rows without the per-row test: `%tu{j}`, `%tc{j}` (the
/// key clamped to `last`, a key that can be loaded) and, paged, `%tp{j}`.
/// For a block of query rows, which clamp to the last key any of them sees
/// and test their own `%tu{j}` against their own count.
pub(super) fn batch_rows(paged: Option<usize>, last: &str) -> String {
    let whole = paged.filter(|b| b.is_multiple_of(8));
    let mut out = match whole {
        Some(_) => super::key_row(paged, "%t0", "%tpb").0,
        None => String::new(),
    };
    for j in 0..8 {
        out.push_str(&format!(
            "%tu{j} = arith.addi %t0, %ck{j} : index\n\
             %tc{j} = arith.minui %tu{j}, {last} : index\n{}",
            match whole {
                Some(_) => format!("%to{j} = arith.subi %tc{j}, %t0 : index\n%tp{j} = arith.addi %tpb, %to{j} : index\n"),
                None => super::key_row(paged, &format!("%tc{j}"), &format!("%tp{j}")).0,
            }
        ));
    }
    out
}

/// The prefix of the eight rows [`batch_keys`] defines for loading keys.
pub(super) fn key_rows(paged: Option<usize>) -> &'static str {
    if paged.is_some() {
        "%tp"
    } else {
        "%tc"
    }
}

/// Fills `sc` (`%sc`, or `%scb` for the second head of a pair; allocated
/// with `%nk8` entries, `%nk` rounded up to 8) with the unnormalised
/// softmax weights of query row `%r`'s head at column
/// `%qb` over keys `0..%nk` at column `%kb`, and defines `%sum`, their sum,
/// for MSA: only the batches of eight keys listed in `%bl[0..%nbl]` (in key
/// order; every other key's weight would be exactly 0, and `%sc` is not
/// written there). `allowed` is MLIR that defines `%allowed : i1` for key
/// `%t` (the selection; dense attention at these widths is `blocked`'s,
/// with the same operations per row). Needs [`batch_consts`] and `%cd` in
/// scope.
///
/// `whole`: the selection is by blocks that hold whole batches (a block
/// size that is a multiple of 8), so a batch's keys are allowed together
/// and `allowed` is asked once, of its first key.
pub(super) fn softmax8(
    q: (&str, Storage),
    k: (&str, Storage),
    d: usize,
    paged: Option<usize>,
    allowed: &str,
    whole: bool,
    sc: &str,
) -> String {
    debug_assert!(d.is_multiple_of(8));
    let ((qt, act), (kt, cache)) = (q, k);
    let mut keys = batch_keys(paged);
    let ask = |key: &str| {
        format!(
            "scf.execute_region -> i1 {{\n\
             \x20 %t = arith.addi {key}, %c0 : index\n\
             {}\
             \x20 scf.yield %allowed : i1\n\
             }}\n",
            indent(allowed, 2)
        )
    };
    if whole {
        keys.push_str(&format!("%okb = {}", ask("%t0")));
    }
    for j in 0..8 {
        let ok = if whole { "%okb".to_string() } else { format!("%ok{j}") };
        if !whole {
            keys.push_str(&format!("%ok{j} = {}", ask(&format!("%tc{j}"))));
        }
        keys.push_str(&format!("%val{j} = arith.andi %in{j}, {ok} : i1\n"));
    }
    let list = |f: &dyn Fn(usize) -> String| (0..8).map(f).collect::<Vec<_>>().join(", ");
    let dots = format!(
        "{}{}",
        dots8("%qk", ("%q", qt, act, "%r", "%qb"), ("%k", kt, cache, "%kb"), key_rows(paged), "%cd"),
        transposed_tree("%dvt", &(0..8).map(|j| format!("%qk#{j}")).collect::<Vec<_>>())
    );
    // A batch none of whose keys is selected skips its products.
    let dots = format!(
        "%any0 = arith.ori %val0, %val1 : i1\n%any1 = arith.ori %val2, %val3 : i1\n\
         %any2 = arith.ori %val4, %val5 : i1\n%any3 = arith.ori %val6, %val7 : i1\n\
         %any4 = arith.ori %any0, %any1 : i1\n%any5 = arith.ori %any2, %any3 : i1\n\
         %any = arith.ori %any4, %any5 : i1\n\
         %dv = scf.if %any -> ({V}) {{\n{}  scf.yield %dvt : {V}\n}} else {{\n  scf.yield %ninf8 : {V}\n}}\n",
        indent(&dots, 2)
    );
    // The weights: a batch of eight scores all -inf (no key selected, or
    // past the row's last) skips the exp, whose weights would be exactly 0.
    format!(
        "%mxv = scf.for %bi = %c0 to %nbl step %c1 iter_args(%mv = %ninf8) -> ({V}) {{\n\
         \x20 %t0 = memref.load %bl[%bi] : memref<?xindex>\n\
         {keys}\
         {dots}\
         \x20 %sv0 = arith.mulf %dv, %scale8 : {V}\n\
         \x20 %mask = vector.from_elements {vals} : vector<8xi1>\n\
         \x20 %sv = arith.select %mask, %sv0, %ninf8 : vector<8xi1>, {V}\n\
         \x20 vector.store %sv, {sc}[%t0] : memref<?xf32>, {V}\n\
         \x20 %mv2 = arith.maximumf %mv, %sv : {V}\n\
         \x20 scf.yield %mv2 : {V}\n\
         }}\n\
         %mx = vector.reduction <maximumf>, %mxv : {V} into f32\n\
         %mx8 = vector.broadcast %mx : f32 to {V}\n\
         %sumv = scf.for %bi = %c0 to %nbl step %c1 iter_args(%sa = %z8) -> ({V}) {{\n\
         \x20 %t0 = memref.load %bl[%bi] : memref<?xindex>\n\
         \x20 %sl = vector.load {sc}[%t0] : memref<?xf32>, {V}\n\
         \x20 %slmax = vector.reduction <maximumf>, %sl : {V} into f32\n\
         \x20 %slive = arith.cmpf une, %slmax, %ninf : f32\n\
         \x20 %e = scf.if %slive -> ({V}) {{\n\
         \x20   %sh = arith.subf %sl, %mx8 : {V}\n\
         {exp}\
         \x20   scf.yield %ee : {V}\n\
         \x20 }} else {{\n\
         \x20   scf.yield %z8 : {V}\n\
         \x20 }}\n\
         \x20 vector.store %e, {sc}[%t0] : memref<?xf32>, {V}\n\
         \x20 %sa2 = arith.addf %sa, %e : {V}\n\
         \x20 scf.yield %sa2 : {V}\n\
         }}\n\
         {sum}",
        keys = indent(&keys, 2),
        dots = indent(&dots, 2),
        vals = list(&|j| format!("%val{j}")),
        exp = indent(&exp8("%ee", "%sh"), 4),
        sum = hsum("%sum", "%sumv"),
    )
}

/// `dst:8`: the eight lane sums of x[xr, xb + c] · y[{rows}j, yb + c] over
/// `c < n` (an index value, a multiple of 8), for the eight key rows
/// `{rows}0` to `{rows}7` (see [`key_rows`]), in increasing `c`, a fused multiply-add each. `x` is (memref,
/// type, storage, row, base), `y` (memref, type, storage, base). Needs
/// `%c8` and `%z8` in scope.
pub(super) fn dots8(dst: &str, x: (&str, &str, Storage, &str, &str), y: (&str, &str, Storage, &str), rows: &str, n: &str) -> String {
    let p = dst.trim_start_matches('%');
    let ((xm, xt, xs, xr, xb), (ym, yt, ys, yb)) = (x, y);
    let mut lanes = load_f32xn(8, &format!("%{p}_x"), xm, xt, xr, &format!("%{p}_xc"), xs);
    for j in 0..8 {
        lanes.push_str(&load_f32xn(8, &format!("%{p}_y{j}"), ym, yt, &format!("{rows}{j}"), &format!("%{p}_yc"), ys));
        lanes.push_str(&format!(
            "%{p}_m{j} = arith.mulf %{p}_x, %{p}_y{j} fastmath<contract> : {V}\n\
             %{p}_a{j}n = arith.addf %{p}_a{j}, %{p}_m{j} fastmath<contract> : {V}\n"
        ));
    }
    let list = |f: &dyn Fn(usize) -> String| (0..8).map(f).collect::<Vec<_>>().join(", ");
    format!(
        "{dst}:8 = scf.for %{p}_c = %c0 to {n} step %c8 iter_args({inits}) -> ({tys}) {{\n\
         \x20 %{p}_xc = arith.addi {xb}, %{p}_c : index\n\
         \x20 %{p}_yc = arith.addi {yb}, %{p}_c : index\n\
         {lanes}\
         \x20 scf.yield {next} : {tys}\n\
         }}\n",
        inits = list(&|j| format!("%{p}_a{j} = %z8")),
        tys = [V; 8].join(", "),
        lanes = indent(&lanes, 2),
        next = list(&|j| format!("%{p}_a{j}n")),
    )
}

/// `dst` (a `vector<8xf32>`): the eight dot products x[xr, xb + c] ·
/// y[{rows}j, yb + c] over `c < n` (a multiple of 8), lane j for key row
/// `{rows}j`, each one fused multiply-add chain in increasing `c` from 0:
/// the order of a GEMM's inner loop, so the scores are the bits the
/// reference's `torch.matmul` gives (checked against it for the MSA index
/// scores, whose block choice flips on a difference in the last bit).
/// Eight keys' rows load as eight vectors and transpose in registers
/// (three rounds of shuffles), so each step multiplies one column of x
/// into all eight keys. Needs `%c8` and `%z8` in scope.
pub(super) fn chains8(dst: &str, x: (&str, &str, Storage, &str, &str), y: (&str, &str, Storage, &str), rows: &str, n: &str) -> String {
    let p = dst.trim_start_matches('%');
    let ((xm, xt, xs, xr, xb), (ym, yt, ys, yb)) = (x, y);
    let mut body = broadcast_columns(&format!("%{p}_b"), (xm, xt, xs), xr, &format!("%{p}_xc"));
    for j in 0..8 {
        body.push_str(&load_f32xn(8, &format!("%{p}_r{j}"), ym, yt, &format!("{rows}{j}"), &format!("%{p}_yc"), ys));
    }
    body.push_str(&transpose8(&format!("%{p}_col"), &(0..8).map(|j| format!("%{p}_r{j}")).collect::<Vec<_>>()));
    let mut acc = format!("%{p}_a");
    for d in 0..8 {
        body.push_str(&format!("%{p}_f{d} = math.fma %{p}_b_{d}, %{p}_col{d}, {acc} : {V}\n"));
        acc = format!("%{p}_f{d}");
    }
    format!(
        "{dst} = scf.for %{p}_c = %c0 to {n} step %c8 iter_args(%{p}_a = %z8) -> ({V}) {{\n\
         \x20 %{p}_xc = arith.addi {xb}, %{p}_c : index\n\
         \x20 %{p}_yc = arith.addi {yb}, %{p}_c : index\n\
         {body}\
         \x20 scf.yield {acc} : {V}\n\
         }}\n",
        body = indent(&body, 2),
    )
}

/// [`chains8`] for several x rows at once (`xs`: each one's row and base
/// column), into `{dst}:H` (H = `xs.len()`): per eight columns, the eight
/// key rows load and transpose once for all of them. Each x row's chain is
/// [`chains8`]'s operations in its order (a broadcast column of x, one
/// fused multiply-add per column into the lane of each key), so its
/// scores are the same bits; only which chains advance together changes.
/// MSA's index heads share their keys: scoring them together reads the
/// keys and spends the shuffles once instead of once per head.
pub(super) fn chains8_multi(
    dst: &str,
    x: (&str, &str, Storage),
    xs: &[(String, String)],
    y: (&str, &str, Storage, &str),
    rows: &str,
    n: &str,
) -> String {
    let p = dst.trim_start_matches('%');
    let (ym, yt, ys, yb) = y;
    let mut cols = format!("%{p}_yc = arith.addi {yb}, %{p}_c : index\n");
    for j in 0..8 {
        cols.push_str(&load_f32xn(8, &format!("%{p}_r{j}"), ym, yt, &format!("{rows}{j}"), &format!("%{p}_yc"), ys));
    }
    cols.push_str(&transpose8(&format!("%{p}_col0_"), &(0..8).map(|j| format!("%{p}_r{j}")).collect::<Vec<_>>()));
    column_chains(dst, x, xs, cols, 1, n)
}

/// [`chains8`] for several x rows at once and one or more batches of
/// eight keys stored transposed ([`transpose_keys`]), into `{dst}:B·H`
/// (batch `b`'s chain of x row `h` at `#(b·H + h)`; H = `xs.len()`, each
/// x row's row and base column; `bases`: each batch's first column,
/// counted in vectors of eight). Per eight columns, each batch's column
/// vectors load as they are (transposing eight key rows there took 24
/// shuffles a step) and each x column broadcasts once for every batch.
/// Each chain is [`chains8`]'s operations in its order (a broadcast
/// column of x, one fused multiply-add per column into the lane of each
/// key) on the same values, so its scores are the same bits; only which
/// chains advance together changes. A chain waits on its last
/// multiply-add: H·B of them keep the FMA units busy where H alone (MSA's
/// four index heads) left them half idle.
pub(super) fn chains8_multi_t(dst: &str, x: (&str, &str, Storage), xs: &[(String, String)], kt: &str, bases: &[&str], n: &str) -> String {
    let p = dst.trim_start_matches('%');
    let mut cols = String::new();
    for (b, base) in bases.iter().enumerate() {
        for d in 0..8 {
            cols.push_str(&format!(
                "%{p}_k{b}_{d} = arith.constant {d} : index\n\
                 %{p}_v{b}_{d}a = arith.addi {base}, %{p}_c : index\n\
                 %{p}_v{b}_{d} = arith.addi %{p}_v{b}_{d}a, %{p}_k{b}_{d} : index\n\
                 %{p}_o{b}_{d} = arith.muli %{p}_v{b}_{d}, %c8 : index\n\
                 %{p}_col{b}_{d} = vector.load {kt}[%{p}_o{b}_{d}] : memref<?xf32>, {V}\n"
            ));
        }
    }
    column_chains(dst, x, xs, cols, bases.len(), n)
}

/// The loop of [`chains8_multi`] and [`chains8_multi_t`]: per eight
/// columns (`%{p}_c`), `cols` defines each of `batches` batches' column
/// vectors `%{p}_col{b}_{d}`; each x row's columns broadcast once, and
/// each (batch, x row) chain takes one fused multiply-add per column, in
/// column order, into `{dst}:B·H` (batch `b`, x row `h` at `#(b·H + h)`).
fn column_chains(dst: &str, x: (&str, &str, Storage), xs: &[(String, String)], cols: String, batches: usize, n: &str) -> String {
    let p = dst.trim_start_matches('%');
    let (xm, xt, xsto) = x;
    let mut body = cols;
    for (h, (xr, xb)) in xs.iter().enumerate() {
        body.push_str(&format!("%{p}_xc{h} = arith.addi {xb}, %{p}_c : index\n"));
        body.push_str(&broadcast_columns(&format!("%{p}_b{h}"), (xm, xt, xsto), xr, &format!("%{p}_xc{h}")));
    }
    let mut next = Vec::new();
    for b in 0..batches {
        for h in 0..xs.len() {
            let mut acc = format!("%{p}_a{b}_{h}");
            for d in 0..8 {
                body.push_str(&format!("%{p}_f{b}_{h}_{d} = math.fma %{p}_b{h}_{d}, %{p}_col{b}_{d}, {acc} : {V}\n"));
                acc = format!("%{p}_f{b}_{h}_{d}");
            }
            next.push(acc);
        }
    }
    let inits = (0..batches).flat_map(|b| (0..xs.len()).map(move |h| format!("%{p}_a{b}_{h} = %z8"))).collect::<Vec<_>>().join(", ");
    let tys = vec![V; next.len()].join(", ");
    format!(
        "{dst}:{} = scf.for %{p}_c = %c0 to {n} step %c8 iter_args({inits}) -> ({tys}) {{\n\
         {body}\
         \x20 scf.yield {} : {tys}\n\
         }}\n",
        next.len(),
        next.join(", "),
        body = indent(&body, 2),
    )
}

/// Keys `y` (memref, type, storage; `n` columns, a multiple of 8) stored
/// transposed into `kt` (`memref<?xf32>`, f32 whatever `y` holds), for
/// [`chains8_multi_t`]: batch `b` of eight keys, column `c` is the vector
/// at `(b·n + c)·8`, lane j key `8b + j`. Batches `0..nb`, keys past `last`
/// clamped to it (loadable rows; their scores are masked). A paged `y` is
/// read through `%bt` ([`super::key_row`]). Needs `%c0`, `%c1`, `%c8`, `%ck0`..`%ck7`.
pub(super) fn transpose_keys(y: (&str, &str, Storage), n: &str, kt: &str, nb: &str, last: &str, paged: Option<usize>) -> String {
    let (ym, yt, ys) = y;
    let mut step = String::new();
    for j in 0..8 {
        step.push_str(&load_f32xn(8, &format!("%tk_r{j}"), ym, yt, &format!("{}{j}", key_rows(paged)), "%tk_c", ys));
    }
    step.push_str(&transpose8("%tk_col", &(0..8).map(|j| format!("%tk_r{j}")).collect::<Vec<_>>()));
    for d in 0..8 {
        step.push_str(&format!(
            "%tk_k{d} = arith.constant {d} : index\n\
             %tk_v{d}a = arith.addi %tk_base, %tk_c : index\n\
             %tk_v{d} = arith.addi %tk_v{d}a, %tk_k{d} : index\n\
             %tk_o{d} = arith.muli %tk_v{d}, %c8 : index\n\
             vector.store %tk_col{d}, {kt}[%tk_o{d}] : memref<?xf32>, {V}\n"
        ));
    }
    format!(
        "scf.for %tk_b = %c0 to {nb} step %c1 {{\n\
         \x20 %t0 = arith.muli %tk_b, %c8 : index\n\
         \x20 %tk_base = arith.muli %tk_b, {n} : index\n\
         {}\
         \x20 scf.for %tk_c = %c0 to {n} step %c8 {{\n\
         {}\
         \x20 }}\n\
         }}\n",
        indent(&batch_rows(paged, last), 2),
        indent(&step, 4),
    )
}

/// `{dst}_0`..`{dst}_7`: columns `c..c + 8` of x's row `r`, each broadcast
/// to eight lanes. f32 rows broadcast straight from memory (a load port's
/// work); the transposes already keep the shuffle unit busy, and splatting
/// lanes of a loaded vector took eight more shuffles per head. Narrower
/// storage loads a vector, widens it and splats its lanes.
fn broadcast_columns(dst: &str, x: (&str, &str, Storage), r: &str, c: &str) -> String {
    let (xm, xt, xsto) = x;
    let d = dst.trim_start_matches('%');
    if xsto != Storage::F32 {
        let mut out = load_f32xn(8, &format!("%{d}_x"), xm, xt, r, c, xsto);
        for j in 0..8 {
            out.push_str(&format!("{dst}_{j} = vector.shuffle %{d}_x, %{d}_x [{j}, {j}, {j}, {j}, {j}, {j}, {j}, {j}] : {V}, {V}\n"));
        }
        return out;
    }
    (0..8)
        .map(|j| {
            format!(
                "%{d}_k{j} = arith.constant {j} : index\n\
                 %{d}_c{j} = arith.addi {c}, %{d}_k{j} : index\n\
                 %{d}_s{j} = memref.load {xm}[{r}, %{d}_c{j}] : {xt}\n\
                 {dst}_{j} = vector.broadcast %{d}_s{j} : f32 to {V}\n"
            )
        })
        .collect()
}

/// `{dst}0`..`{dst}7`: the columns of the 8×8 matrix whose rows are `rows`
/// (`{dst}d` lane j = `rows[j]` lane d), by three rounds of two-vector
/// shuffles (pairs of elements, then pairs of pairs, then halves).
fn transpose8(dst: &str, rows: &[String]) -> String {
    let d = dst.trim_start_matches('%');
    let mut out = String::new();
    // Round 1, rows (2i, 2i+1): even columns interleaved, odd columns interleaved.
    for i in 0..4 {
        let (a, b) = (&rows[2 * i], &rows[2 * i + 1]);
        out.push_str(&format!(
            "%{d}_e{i} = vector.shuffle {a}, {b} [0, 8, 2, 10, 4, 12, 6, 14] : {V}, {V}\n\
             %{d}_o{i} = vector.shuffle {a}, {b} [1, 9, 3, 11, 5, 13, 7, 15] : {V}, {V}\n"
        ));
    }
    // Round 2, row quads (4h..4h+3): columns (c, c + 4) for c = 0, 2 (from
    // the even pairs) and 1, 3 (from the odd ones), four rows each.
    for h in 0..2 {
        for (par, lo, hi) in [("e", 0, 2), ("o", 1, 3)] {
            let (a, b) = (format!("%{d}_{par}{}", 2 * h), format!("%{d}_{par}{}", 2 * h + 1));
            out.push_str(&format!(
                "%{d}_q{h}c{lo} = vector.shuffle {a}, {b} [0, 1, 8, 9, 4, 5, 12, 13] : {V}, {V}\n\
                 %{d}_q{h}c{hi} = vector.shuffle {a}, {b} [2, 3, 10, 11, 6, 7, 14, 15] : {V}, {V}\n"
            ));
        }
    }
    // Round 3: the two quads' halves make each column, rows 0..8.
    for c in 0..4 {
        out.push_str(&format!(
            "{dst}{c} = vector.shuffle %{d}_q0c{c}, %{d}_q1c{c} [0, 1, 2, 3, 8, 9, 10, 11] : {V}, {V}\n\
             {dst}{} = vector.shuffle %{d}_q0c{c}, %{d}_q1c{c} [4, 5, 6, 7, 12, 13, 14, 15] : {V}, {V}\n",
            c + 4
        ));
    }
    out
}

/// `dst`: the eight sums of `v[0..8]`'s lanes, in that order, each by the
/// tree `((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))`: three rounds of shuffles
/// that pair halves across two vectors and add them.
pub(super) fn transposed_tree(dst: &str, v: &[String]) -> String {
    let d = dst.trim_start_matches('%');
    let mut out = String::new();
    // Round 1: [lo4 of a | lo4 of b] + [hi4 of a | hi4 of b] → per key
    // [l0+l4, l1+l5, l2+l6, l3+l7], keys (2i, 2i+1).
    for i in 0..4 {
        let (a, b) = (&v[2 * i], &v[2 * i + 1]);
        out.push_str(&format!(
            "%{d}_x1{i} = vector.shuffle {a}, {b} [0, 1, 2, 3, 8, 9, 10, 11] : {V}, {V}\n\
             %{d}_y1{i} = vector.shuffle {a}, {b} [4, 5, 6, 7, 12, 13, 14, 15] : {V}, {V}\n\
             %{d}_r1{i} = arith.addf %{d}_x1{i}, %{d}_y1{i} : {V}\n"
        ));
    }
    // Round 2: per key [(l0+l4)+(l2+l6), (l1+l5)+(l3+l7)]; keys in the
    // order (4i, 4i+2, 4i+1, 4i+3).
    for i in 0..2 {
        let (a, b) = (format!("%{d}_r1{}", 2 * i), format!("%{d}_r1{}", 2 * i + 1));
        out.push_str(&format!(
            "%{d}_x2{i} = vector.shuffle {a}, {b} [0, 1, 8, 9, 4, 5, 12, 13] : {V}, {V}\n\
             %{d}_y2{i} = vector.shuffle {a}, {b} [2, 3, 10, 11, 6, 7, 14, 15] : {V}, {V}\n\
             %{d}_r2{i} = arith.addf %{d}_x2{i}, %{d}_y2{i} : {V}\n"
        ));
    }
    // Round 3: the two halves of each key's tree; keys (0, 2, 4, 6, 1, 3,
    // 5, 7), then put in order.
    out.push_str(&format!(
        "%{d}_x3 = vector.shuffle %{d}_r20, %{d}_r21 [0, 2, 8, 10, 4, 6, 12, 14] : {V}, {V}\n\
         %{d}_y3 = vector.shuffle %{d}_r20, %{d}_r21 [1, 3, 9, 11, 5, 7, 13, 15] : {V}, {V}\n\
         %{d}_r3 = arith.addf %{d}_x3, %{d}_y3 : {V}\n\
         {dst} = vector.shuffle %{d}_r3, %{d}_r3 [0, 4, 1, 5, 2, 6, 3, 7] : {V}, {V}\n"
    ));
    out
}

/// `dst` = e^x on eight lanes, for softmax weights: Cephes' expf (x =
/// n·ln 2 + r, |r| ≤ ln 2 / 2, a degree-7 polynomial in r, times 2^n built
/// in the exponent bits). Below ln 2^-126 (including -inf) the result is 0,
/// NaN stays NaN, and above 88 it is clamped (softmax arguments are ≤ 0).
pub(super) fn exp8(dst: &str, x: &str) -> String {
    let d = dst.trim_start_matches('%');
    let c = |name: &str, v: &str| format!("%{d}_{name} = arith.constant dense<{v}> : {V}\n");
    let mut out = String::new();
    out.push_str(&c("lo", "-87.3365402"));
    out.push_str(&c("hi", "88.0"));
    out.push_str(&c("l2e", "1.44269502"));
    out.push_str(&c("c1", "0.693359375"));
    out.push_str(&c("c2", "-2.12194440e-4"));
    out.push_str(&c("n126", "-126.0"));
    out.push_str(&c("p127", "127.0"));
    out.push_str(&c("one", "1.0"));
    out.push_str(&c("zero", "0.0"));
    for (i, p) in ["1.9875691500e-4", "1.3981999507e-3", "8.3334519073e-3", "4.1665795894e-2", "1.6666665459e-1", "5.0000001201e-1"]
        .iter()
        .enumerate()
    {
        out.push_str(&c(&format!("p{i}"), p));
    }
    out.push_str(&format!(
        "%{d}_xl = arith.maximumf {x}, %{d}_lo : {V}\n\
         %{d}_xc = arith.minimumf %{d}_xl, %{d}_hi : {V}\n\
         %{d}_t = arith.mulf %{d}_xc, %{d}_l2e : {V}\n\
         %{d}_fx = math.roundeven %{d}_t : {V}\n\
         %{d}_q1 = arith.mulf %{d}_fx, %{d}_c1 : {V}\n\
         %{d}_r1 = arith.subf %{d}_xc, %{d}_q1 : {V}\n\
         %{d}_q2 = arith.mulf %{d}_fx, %{d}_c2 : {V}\n\
         %{d}_r = arith.subf %{d}_r1, %{d}_q2 : {V}\n\
         %{d}_z = arith.mulf %{d}_r, %{d}_r : {V}\n"
    ));
    let mut y = format!("%{d}_p0");
    for i in 1..6 {
        out.push_str(&format!(
            "%{d}_h{i} = arith.mulf {y}, %{d}_r fastmath<contract> : {V}\n\
             %{d}_y{i} = arith.addf %{d}_h{i}, %{d}_p{i} fastmath<contract> : {V}\n"
        ));
        y = format!("%{d}_y{i}");
    }
    out.push_str(&format!(
        "%{d}_hz = arith.mulf {y}, %{d}_z fastmath<contract> : {V}\n\
         %{d}_yr = arith.addf %{d}_hz, %{d}_r fastmath<contract> : {V}\n\
         %{d}_y1p = arith.addf %{d}_yr, %{d}_one : {V}\n\
         // 2^n from its exponent bits; n clamped with the NaN-ignoring max/min so a\n\
         // NaN input converts a number (it stays NaN through r).\n\
         %{d}_fl = arith.maxnumf %{d}_fx, %{d}_n126 : {V}\n\
         %{d}_fn = arith.minnumf %{d}_fl, %{d}_p127 : {V}\n\
         %{d}_n = arith.fptosi %{d}_fn : {V} to vector<8xi32>\n\
         %{d}_b127 = arith.constant dense<127> : vector<8xi32>\n\
         %{d}_s23 = arith.constant dense<23> : vector<8xi32>\n\
         %{d}_nb = arith.addi %{d}_n, %{d}_b127 : vector<8xi32>\n\
         %{d}_ns = arith.shli %{d}_nb, %{d}_s23 : vector<8xi32>\n\
         %{d}_pow = arith.bitcast %{d}_ns : vector<8xi32> to {V}\n\
         %{d}_y = arith.mulf %{d}_y1p, %{d}_pow : {V}\n\
         %{d}_uf = arith.cmpf olt, {x}, %{d}_lo : {V}\n\
         {dst} = arith.select %{d}_uf, %{d}_zero, %{d}_y : vector<8xi1>, {V}\n"
    ));
    out
}
