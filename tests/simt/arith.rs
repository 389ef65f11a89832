//! The SIMT interpreter's `arith` and `math`: integer and float arithmetic, comparisons, casts, constants.

use super::*;

impl Frame<'_> {
    /// Runs `op` if it is one of this file's; `Ok(false)` if not.
    #[allow(unused_variables)] // the shared view of the op; not every handler uses all of it
    pub(super) fn arith_op(&mut self, op: MlirOperation, info: &OpInfo, mask: &[bool]) -> Result<bool, String> {
        view!(self, info => t, name, res, out_ty, in_ty, e, ibits, in_bits, attr, operands);
        let wide = e == Some(Elem::F64);
        // f32 arithmetic, or f64 where the result is f64 (bits in the same words).
        let fl = |f: fn(f32, f32) -> f32, g: fn(f64, f64) -> f64| {
            move |a: &[u64]| Ok(if wide { g(f64::from_bits(a[0]), f64::from_bits(a[1])).to_bits() } else { fb(f(f32v(a[0]), f32v(a[1]))) })
        };
        match name {
            "arith.constant" | "llvm.mlir.constant" => {
                let cached = info.constant.borrow().as_ref().filter(|(threads, _)| *threads == t).map(|(_, d)| d.clone());
                if let Some(d) = cached {
                    self.set(res[0], d);
                    return Ok(true);
                }
                let a = attr(op, "value").ok_or("constant without a value")?;
                let ty = out_ty.ok_or("constant without a result")?;
                let w = width(&ty);
                let el = elem(&ty);
                let body = a.trim();
                let lanes: Vec<u64> = if let Some(d) = body.strip_prefix("dense<") {
                    let inner = d.split('>').next().unwrap_or("").trim_start_matches('[').trim_end_matches(']');
                    let vals: Vec<u64> = inner.split(',').map(|x| scalar_lit(x.trim(), el)).collect::<Result<_, _>>()?;
                    if vals.len() == 1 {
                        vec![vals[0]; w]
                    } else {
                        vals
                    }
                } else {
                    let lit = body.split(" : ").next().unwrap_or(body);
                    vec![scalar_lit(lit.trim(), el)?; w]
                };
                let v: Vec<u64> = (0..t).flat_map(|_| lanes.iter().copied()).collect();
                *info.constant.borrow_mut() = Some((t, Data::Bits { w, v: v.clone() }));
                self.set(res[0], Data::Bits { w, v });
            }
            "arith.addi" => self.elementwise(info, move |a| Ok(mask_bits(a[0].wrapping_add(a[1]), ibits)))?,
            "arith.subi" => self.elementwise(info, move |a| Ok(mask_bits(a[0].wrapping_sub(a[1]), ibits)))?,
            "arith.muli" => self.elementwise(info, move |a| Ok(mask_bits(a[0].wrapping_mul(a[1]), ibits)))?,
            "arith.divui" => self.elementwise(info, |a| Ok(a[0].checked_div(a[1]).unwrap_or(0)))?,
            "arith.remui" => self.elementwise(info, |a| Ok(a[0].checked_rem(a[1]).unwrap_or(0)))?,
            "arith.minui" => self.elementwise(info, |a| Ok(a[0].min(a[1])))?,
            "arith.minsi" => self.elementwise(info, move |a| Ok(if sext(a[0], ibits) <= sext(a[1], ibits) { a[0] } else { a[1] }))?,
            "arith.andi" => self.elementwise(info, |a| Ok(a[0] & a[1]))?,
            "arith.ori" => self.elementwise(info, |a| Ok(a[0] | a[1]))?,
            "arith.xori" => self.elementwise(info, move |a| Ok(mask_bits(a[0] ^ a[1], ibits)))?,
            "arith.shli" => self.elementwise(info, move |a| Ok(if a[1] >= ibits as u64 { 0 } else { mask_bits(a[0] << a[1], ibits) }))?,
            "arith.shrui" => self.elementwise(info, move |a| Ok(if a[1] >= ibits as u64 { 0 } else { a[0] >> a[1] }))?,
            "arith.extui" => self.elementwise(info, |a| Ok(a[0]))?,
            "arith.extsi" => self.elementwise(info, move |a| Ok(mask_bits(sext(a[0], in_bits) as u64, ibits)))?,
            "arith.trunci" => self.elementwise(info, move |a| Ok(mask_bits(a[0], ibits)))?,
            "arith.index_cast" => self.elementwise(info, move |a| Ok(mask_bits(sext(a[0], in_bits) as u64, ibits)))?,
            "arith.sitofp" => self.elementwise(info, move |a| {
                let v = sext(a[0], in_bits);
                Ok(if wide { (v as f64).to_bits() } else { fb(v as f32) })
            })?,
            "arith.addf" => self.elementwise(info, fl(|x, y| x + y, |x, y| x + y))?,
            "arith.subf" => self.elementwise(info, fl(|x, y| x - y, |x, y| x - y))?,
            "arith.mulf" => self.elementwise(info, fl(|x, y| x * y, |x, y| x * y))?,
            "arith.divf" => self.elementwise(info, fl(|x, y| x / y, |x, y| x / y))?,
            "arith.maximumf" => {
                self.elementwise(info, fl(|x, y| nan_or(x, y, x.max(y), f32::NAN), |x, y| nan_or(x, y, x.max(y), f64::NAN)))?
            }
            "arith.minimumf" => {
                self.elementwise(info, fl(|x, y| nan_or(x, y, x.min(y), f32::NAN), |x, y| nan_or(x, y, x.min(y), f64::NAN)))?
            }
            // One rounding, as the hardware's fused multiply-add.
            "math.fma" => self.elementwise(info, move |a| {
                Ok(if wide {
                    f64::from_bits(a[0]).mul_add(f64::from_bits(a[1]), f64::from_bits(a[2])).to_bits()
                } else {
                    fb(f32v(a[0]).mul_add(f32v(a[1]), f32v(a[2])))
                })
            })?,
            "math.ceil" => {
                self.elementwise(info, move |a| Ok(if wide { f64::from_bits(a[0]).ceil().to_bits() } else { fb(f32v(a[0]).ceil()) }))?
            }
            // Unsigned integer to float, float to integer (truncating toward
            // zero; the kernels only convert values in range).
            "arith.uitofp" => self.elementwise(info, move |a| {
                let v = mask_bits(a[0], in_bits);
                Ok(if wide { (v as f64).to_bits() } else { fb(v as f32) })
            })?,
            "arith.fptoui" | "arith.fptosi" => {
                let from64 = in_ty.as_ref().map(elem) == Some(Elem::F64);
                let signed = name == "arith.fptosi";
                self.elementwise(info, move |a| {
                    let f = if from64 { f64::from_bits(a[0]) } else { f32v(a[0]) as f64 };
                    Ok(mask_bits(if signed { f as i64 as u64 } else { f as u64 }, ibits))
                })?
            }
            "arith.negf" => self.elementwise(info, move |a| Ok(if wide { (-f64::from_bits(a[0])).to_bits() } else { fb(-f32v(a[0])) }))?,
            // f64 to f32, rounded to nearest even (the written-out math's last step).
            "arith.truncf" if in_ty.as_ref().map(elem) == Some(Elem::F64) && e == Some(Elem::F32) => {
                self.elementwise(info, |a| Ok(fb(f64::from_bits(a[0]) as f32)))?
            }
            "math.sqrt" => {
                self.elementwise(info, move |a| Ok(if wide { f64::from_bits(a[0]).sqrt().to_bits() } else { fb(f32v(a[0]).sqrt()) }))?
            }
            "math.exp" => self.elementwise(info, |a| Ok(fb(f32v(a[0]).exp())))?,
            "math.rsqrt" => self.elementwise(info, |a| Ok(fb(1.0 / f32v(a[0]).sqrt())))?,
            "math.sin" => self.elementwise(info, |a| Ok(fb(f32v(a[0]).sin())))?,
            "math.cos" => self.elementwise(info, |a| Ok(fb(f32v(a[0]).cos())))?,
            // SAFETY: erff is libm's pure function of one float.
            "math.erf" => self.elementwise(info, |a| Ok(fb(unsafe { erff(f32v(a[0])) })))?,
            "arith.extf" => {
                let from = in_ty.as_ref().map(elem);
                self.elementwise(info, move |a| {
                    let f = match from {
                        Some(Elem::F16) => fb(f16_to_f32(a[0] as u16)),
                        Some(Elem::Bf16) => a[0] << 16,
                        _ => a[0],
                    };
                    Ok(if wide { (f32v(f) as f64).to_bits() } else { f })
                })?
            }
            "arith.bitcast" | "llvm.bitcast" | "vector.bitcast" => {
                let ins = operands(op);
                let (wi, d) = self.bits(ins[0])?;
                let d = d.clone();
                let ti = in_ty.clone().unwrap();
                let to = out_ty.clone().unwrap();
                let (bi, bo) = (elem(&ti).bytes(), elem(&to).bytes());
                let wo = width(&to);
                if wi * bi != wo * bo {
                    return Err(format!("bitcast of {} B to {} B", wi * bi, wo * bo));
                }
                let mut v = vec![0u64; t * wo];
                for th in 0..t {
                    let mut bytes = Vec::with_capacity(wi * bi);
                    for k in 0..wi {
                        bytes.extend_from_slice(&d[th * wi + k].to_le_bytes()[..bi]);
                    }
                    for k in 0..wo {
                        let mut b8 = [0u8; 8];
                        b8[..bo].copy_from_slice(&bytes[k * bo..(k + 1) * bo]);
                        v[th * wo + k] = u64::from_le_bytes(b8);
                    }
                }
                self.set(res[0], Data::Bits { w: wo, v });
            }
            "arith.cmpi" => {
                let p = attr_ints(&attr(op, "predicate").ok_or("cmpi without predicate")?)[0];
                self.elementwise(info, move |a| {
                    let (x, y) = (a[0], a[1]);
                    let (sx, sy) = (sext(x, in_bits), sext(y, in_bits));
                    Ok(match p {
                        0 => x == y,
                        1 => x != y,
                        2 => sx < sy,
                        3 => sx <= sy,
                        4 => sx > sy,
                        5 => sx >= sy,
                        6 => x < y,
                        7 => x <= y,
                        8 => x > y,
                        9 => x >= y,
                        _ => return Err(format!("cmpi predicate {p}")),
                    } as u64)
                })?
            }
            "arith.cmpf" => {
                let p = attr_ints(&attr(op, "predicate").ok_or("cmpf without predicate")?)[0];
                let from64 = in_ty.as_ref().map(elem) == Some(Elem::F64);
                self.elementwise(info, move |a| {
                    let f = |b: u64| if from64 { f64::from_bits(b) } else { f32v(b) as f64 };
                    let (x, y) = (f(a[0]), f(a[1]));
                    let ord = !x.is_nan() && !y.is_nan();
                    Ok(match p {
                        1 => ord && x == y,
                        2 => ord && x > y,
                        3 => ord && x >= y,
                        4 => ord && x < y,
                        5 => ord && x <= y,
                        6 => ord && x != y,
                        7 => ord,
                        14 => !ord,
                        _ => return Err(format!("cmpf predicate {p}")),
                    } as u64)
                })?
            }
            "arith.select" => self.elementwise(info, |a| Ok(if a[0] & 1 != 0 { a[1] } else { a[2] }))?,
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// `v`, unless `x` or `y` is NaN: then `nan`. `arith.maximumf` and
/// `minimumf` propagate NaN, where Rust's `max` and `min` drop it.
#[allow(clippy::eq_op)] // `x != x` is the NaN test for any float type.
fn nan_or<T: PartialEq + Copy>(x: T, y: T, v: T, nan: T) -> T {
    if x != x || y != y {
        nan
    } else {
        v
    }
}
