//! The SIMT interpreter's `llvm` ops: what the lowering leaves of memref descriptors and inline PTX (`llvm.mlir.undef`,
//! `llvm.insertvalue`, casts, `llvm.inline_asm`), and the one vendor intrinsic the kernels call, gfx942's fp8 converter
//! (`rocdl.cvt.f32.fp8`).

use super::*;

impl Frame<'_> {
    /// Runs `op` if it is one of this file's; `Ok(false)` if not.
    #[allow(unused_variables)] // the shared view of the op; not every handler uses all of it
    pub(super) fn llvm_op(&mut self, op: MlirOperation, info: &OpInfo, mask: &[bool]) -> Result<bool, String> {
        view!(self, info => t, name, res, out_ty, in_ty, e, ibits, in_bits, attr, operands);
        match name {
            "llvm.mlir.undef" => {
                let w = width(out_ty.as_ref().unwrap());
                self.set(res[0], Data::Bits { w, v: vec![0; t * w] });
            }
            "llvm.insertvalue" => {
                let ins = operands(op);
                let pos = attr_ints(&attr(op, "position").ok_or("insertvalue without position")?);
                let st = out_ty.as_ref().unwrap();
                let n = width(st);
                let rank = (n - 3) / 2;
                let idx = match pos.as_slice() {
                    [p] if *p < 3 => *p as usize,
                    [3, k] => 3 + *k as usize,
                    [4, k] => 3 + rank + *k as usize,
                    other => return Err(format!("insertvalue at {other:?}")),
                };
                // Operands: the container, then the value inserted.
                let (_, x) = self.bits(ins[1])?;
                let x = x.clone();
                let (_, s) = self.bits(ins[0])?;
                let mut s = s.clone();
                for th in 0..t {
                    s[th * n + idx] = x[th];
                }
                self.set(res[0], Data::Bits { w: n, v: s });
            }
            "builtin.unrealized_conversion_cast" => {
                let ins = operands(op);
                let (n, s) = self.bits(ins[0])?;
                let rank = (n - 3) / 2;
                let d = (0..t)
                    .map(|th| {
                        let f = &s[th * n..(th + 1) * n];
                        let mut d = Desc { ptr: f[1], off: f[2] as i64, rank, ..Default::default() };
                        for k in 0..rank {
                            d.sizes[k] = f[3 + k] as i64;
                            d.strides[k] = f[3 + rank + k] as i64;
                        }
                        d
                    })
                    .collect();
                self.set(res[0], Data::Mem(d));
            }
            "llvm.inline_asm" => {
                let s = attr(op, "asm_string").unwrap_or_default();
                if !s.contains("cvt.rn.f16x2.e4m3x2") {
                    return Err(format!("inline asm {s}"));
                }
                self.elementwise(info, |a| {
                    let lo = e4m3_to_f16(a[0] as u8) as u64;
                    let hi = e4m3_to_f16((a[0] >> 8) as u8) as u64;
                    Ok(lo | (hi << 16))
                })?
            }
            "rocdl.cvt.f32.fp8" => {
                // gfx942's `v_cvt_f32_fp8`: byte `byteSel` of the i32 as float8_e4m3fnuz.
                let sel = attr_ints(&attr(op, "byteSel").ok_or("cvt.f32.fp8 without byteSel")?)[0];
                if !(0..4).contains(&sel) {
                    return Err(format!("cvt.f32.fp8 byteSel {sel}"));
                }
                self.elementwise(info, move |a| Ok(fb(e4m3fnuz_to_f32((a[0] >> (8 * sel)) as u8))))?
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// A `float8_e4m3fnuz` byte's value: exponent bias 8, NaN only at `0x80`
/// (negative zero's pattern), no infinities, ±240 at the top.
pub(super) fn e4m3fnuz_to_f32(b: u8) -> f32 {
    if b == 0x80 {
        return f32::NAN;
    }
    let (e, m) = (((b >> 3) & 0xF) as i32, (b & 7) as f32);
    let mag = if e == 0 { m * 2f32.powi(-10) } else { (8.0 + m) * 2f32.powi(e - 11) };
    if b & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}
