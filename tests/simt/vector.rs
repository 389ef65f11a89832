//! The SIMT interpreter's `vector`: broadcasts, extracts, shuffles, reductions, vector loads, vectors from elements.

use super::*;

impl Frame<'_> {
    /// Runs `op` if it is one of this file's; `Ok(false)` if not.
    #[allow(unused_variables)] // the shared view of the op; not every handler uses all of it
    pub(super) fn vector_op(&mut self, op: MlirOperation, info: &OpInfo, mask: &[bool]) -> Result<bool, String> {
        view!(self, info => t, name, res, out_ty, in_ty, e, ibits, in_bits, attr, operands);
        match name {
            "vector.broadcast" => self.elementwise(info, |a| Ok(a[0]))?,
            "vector.extract" => {
                let ins = operands(op);
                let (w, d) = self.bits(ins[0])?;
                let pos = attr_ints(&attr(op, "static_position").ok_or("extract without position")?);
                let k = if pos.first().copied().unwrap_or(i64::MIN) < 0 || pos.is_empty() {
                    // dynamic position: the second operand
                    let (_, p) = self.bits(ins[1])?;
                    p.clone()
                } else {
                    vec![pos[0] as u64; t]
                };
                let v = (0..t).map(|th| d[th * w + (k[th] as usize).min(w - 1)]).collect();
                self.set(res[0], Data::Bits { w: 1, v });
            }
            "vector.shuffle" => {
                let ins = operands(op);
                let (wa, a) = self.bits(ins[0])?;
                let (wb, b) = self.bits(ins[1])?;
                let m = attr_ints(&attr(op, "mask").ok_or("shuffle without mask")?);
                let wo = m.len();
                let mut v = vec![0u64; t * wo];
                for th in 0..t {
                    for (k, &s) in m.iter().enumerate() {
                        let s = s as usize;
                        v[th * wo + k] = if s < wa { a[th * wa + s] } else { b[th * wb + s - wa] };
                    }
                }
                self.set(res[0], Data::Bits { w: wo, v });
            }
            "vector.from_elements" => {
                let ins = operands(op);
                let lanes = ins.iter().map(|v| self.bits(*v).map(|(_, d)| d.clone())).collect::<Result<Vec<_>, _>>()?;
                let w = lanes.len();
                let v = (0..t * w).map(|i| lanes[i % w][i / w]).collect();
                self.set(res[0], Data::Bits { w, v });
            }
            "vector.reduction" => {
                require(attr(op, "kind"), "add")?;
                let ins = operands(op);
                let (w, d) = self.bits(ins[0])?;
                let v = (0..t).map(|th| fb((0..w).map(|k| f32v(d[th * w + k])).fold(0.0f32, |s, x| s + x))).collect();
                self.set(res[0], Data::Bits { w: 1, v });
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}
