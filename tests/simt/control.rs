//! The SIMT interpreter's `scf` (`if`, `for`, `yield`, under per-thread masks) and `func.call` (the runtime hooks).

use super::*;

impl Frame<'_> {
    /// Runs `op` if it is one of this file's; `Ok(false)` if not.
    #[allow(unused_variables)] // the shared view of the op; not every handler uses all of it
    pub(super) fn control_op(&mut self, op: MlirOperation, info: &OpInfo, mask: &[bool]) -> Result<bool, String> {
        view!(self, info => t, name, res, out_ty, in_ty, e, ibits, in_bits, attr, operands);
        match name {
            "func.call" if attr(op, "callee").is_some_and(|c| c.contains("m3c_buf_alloc")) => {
                let (_, n) = self.bits(operands(op)[0])?;
                let p = self.mem.pool_alloc(n[0] as usize);
                self.set(res[0], Data::Bits { w: 1, v: vec![p; t] });
            }
            "func.call" if attr(op, "callee").is_some_and(|c| c.contains("m3c_buf_free")) => {
                let p = self.bits(operands(op)[0])?.1[0];
                self.mem.pool_free(p)?;
            }
            "func.call" if attr(op, "callee").is_some_and(|c| c.contains("m3c_buf_copy")) => {
                let ins = operands(op);
                let (d, s, n) = (self.bits(ins[0])?.1[0], self.bits(ins[1])?.1[0], self.bits(ins[2])?.1[0] as usize);
                for i in 0..n as u64 {
                    let b = self.mem.load(s + i, 1)?;
                    self.mem.store(d + i, 1, b)?;
                }
            }
            "func.call" if attr(op, "callee").is_some_and(|c| c.contains("m3c_gemm_wanted")) => {
                self.set(res[0], Data::Bits { w: 1, v: vec![self.gemm as u64; t] });
            }
            "func.call" if attr(op, "callee").is_some_and(|c| c.contains("m3c_gemm_bf16")) => {
                // y[r, o] = Σ_i x[r, i] · w[o, i], bf16 inputs, f32 sums; y f32 or bf16 (rounded to nearest even).
                let a: Vec<u64> = operands(op).iter().map(|v| self.bits(*v).map(|(_, x)| x[0])).collect::<Result<_, _>>()?;
                let (x, w, y, rows, inp, out, ybf) = (a[0], a[1], a[2], a[3] as usize, a[4] as usize, a[5] as usize, a[6] != 0);
                let bf = |m: &mut Memory, p: u64| -> Result<f32, String> { Ok(f32::from_bits((m.load(p, 2)? as u32) << 16)) };
                for r in 0..rows {
                    for o in 0..out {
                        let mut acc = 0f32;
                        for i in 0..inp {
                            acc += bf(self.mem, x + 2 * (r * inp + i) as u64)? * bf(self.mem, w + 2 * (o * inp + i) as u64)?;
                        }
                        if ybf {
                            self.mem.store(y + 2 * (r * out + o) as u64, 2, bf16_bits(acc) as u64)?;
                        } else {
                            self.mem.store(y + 4 * (r * out + o) as u64, 4, acc.to_bits() as u64)?;
                        }
                    }
                }
            }
            "func.call" => {
                let callee = attr(op, "callee").ok_or("call without callee")?;
                let callee = callee.trim_start_matches('@').trim_matches('"').to_string();
                let f = *self.funcs.get(&callee).ok_or_else(|| format!("call of unknown {callee}"))?;
                let entry = region_block(f, 0);
                for (p, a) in block_args(entry).iter().zip(operands(op)) {
                    let d = self.get(*a)?.clone();
                    self.set(*p, d);
                }
                let outs = self.block(entry, mask)?;
                for (r, d) in res.iter().zip(outs) {
                    self.set(*r, d);
                }
            }
            "scf.if" => {
                let (_, c) = self.bits(operands(op)[0])?;
                let then_m: Vec<bool> = (0..t).map(|th| mask[th] && c[th] & 1 != 0).collect();
                let else_m: Vec<bool> = (0..t).map(|th| mask[th] && c[th] & 1 == 0).collect();
                let a = if then_m.iter().any(|&m| m) { Some(self.block(region_block(op, 0), &then_m)?) } else { None };
                // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
                let has_else = unsafe { !mlirRegionGetFirstBlock(mlirOperationGetRegion(op, 1)).ptr.is_null() };
                let b = if has_else && else_m.iter().any(|&m| m) { Some(self.block(region_block(op, 1), &else_m)?) } else { None };
                for (k, r) in res.iter().enumerate() {
                    let w = width(info.out_tys[k].as_ref().ok_or("an scf.if result of unknown type")?);
                    let mut v = vec![0u64; t * w];
                    for th in 0..t {
                        let src = if then_m[th] {
                            a.as_ref()
                        } else if else_m[th] {
                            b.as_ref()
                        } else {
                            None
                        };
                        if let Some(Data::Bits { v: s, .. }) = src.map(|x| &x[k]) {
                            v[th * w..(th + 1) * w].copy_from_slice(&s[th * w..(th + 1) * w]);
                        }
                    }
                    self.set(*r, Data::Bits { w, v });
                }
            }
            "scf.for" => {
                let ins = operands(op);
                let (_, lb) = self.bits(ins[0])?;
                let (_, ub) = self.bits(ins[1])?;
                let (_, st) = self.bits(ins[2])?;
                let (lb, ub, st) = (lb.clone(), ub.clone(), st.clone());
                let mut iters: Vec<Data> = ins[3..].iter().map(|v| self.get(*v).cloned()).collect::<Result<_, _>>()?;
                let body = region_block(op, 0);
                let args = block_args(body);
                let mut iv = lb.clone();
                loop {
                    let m: Vec<bool> = (0..t).map(|th| mask[th] && iv[th] < ub[th]).collect();
                    if !m.iter().any(|&x| x) {
                        break;
                    }
                    self.set(args[0], Data::Bits { w: 1, v: iv.clone() });
                    for (a, d) in args[1..].iter().zip(&iters) {
                        self.set(*a, d.clone());
                    }
                    let ys = self.block(body, &m)?;
                    for (it, y) in iters.iter_mut().zip(ys) {
                        if let (Data::Bits { w, v }, Data::Bits { v: yv, .. }) = (it, y) {
                            for th in 0..t {
                                if m[th] {
                                    v[th * *w..(th + 1) * *w].copy_from_slice(&yv[th * *w..(th + 1) * *w]);
                                }
                            }
                        }
                    }
                    for th in 0..t {
                        if m[th] {
                            iv[th] += st[th];
                        }
                    }
                }
                for (r, d) in res.iter().zip(iters) {
                    self.set(*r, d);
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}
