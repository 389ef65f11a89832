//! The SIMT interpreter's `gpu`: thread and block ids, shuffles, barriers, all-reduce, nested launches.

use super::*;

impl Frame<'_> {
    /// Runs `op` if it is one of this file's; `Ok(false)` if not.
    #[allow(unused_variables)] // the shared view of the op; not every handler uses all of it
    pub(super) fn gpu_op(&mut self, op: MlirOperation, info: &OpInfo, mask: &[bool]) -> Result<bool, String> {
        view!(self, info => t, name, res, out_ty, in_ty, e, ibits, in_bits, attr, operands);
        match name {
            "gpu.thread_id" | "gpu.block_id" => {
                let dim = attr(op, "dimension").unwrap_or_default();
                let k = if dim.contains('x') {
                    0
                } else if dim.contains('y') {
                    1
                } else {
                    2
                };
                let v = (0..t)
                    .map(|th| {
                        if name == "gpu.thread_id" {
                            if k == 0 {
                                th as u64
                            } else {
                                0
                            }
                        } else {
                            self.block_id[k]
                        }
                    })
                    .collect();
                self.set(res[0], Data::Bits { w: 1, v });
            }
            "gpu.shuffle" => {
                require(attr(op, "mode"), "xor")?;
                let ins = operands(op);
                let (_, x) = self.bits(ins[0])?;
                let (_, off) = self.bits(ins[1])?;
                let (_, width) = self.bits(ins[2])?;
                let mut v = vec![0u64; t];
                for th in 0..t {
                    if !mask[th] {
                        continue;
                    }
                    // Lanes trade within their warp (or wave) of `width`.
                    let w = width[th] as usize;
                    if !w.is_power_of_two() {
                        return Err(format!("shuffle: a width of {w} lanes"));
                    }
                    let src = (th & !(w - 1)) | ((th % w) ^ off[th] as usize);
                    if src >= t || !mask[src] {
                        return Err(format!("shuffle: thread {th} reads lane {src}, which is not active"));
                    }
                    v[th] = x[src];
                }
                self.set(res[0], Data::Bits { w: 1, v });
                self.set(res[1], Data::Bits { w: 1, v: vec![1; t] });
            }
            "gpu.barrier" => {
                if mask.iter().any(|m| !m) {
                    return Err("barrier reached by only some threads of the block".into());
                }
            }
            "gpu.all_reduce" => {
                if mask.iter().any(|m| !m) {
                    return Err("all_reduce reached by only some threads of the block".into());
                }
                let o = attr(op, "op").unwrap_or_default();
                if !o.contains("add") {
                    return Err(format!("all_reduce {o}"));
                }
                let (_, x) = self.bits(operands(op)[0])?;
                let s = fb(x.iter().map(|&b| f32v(b)).fold(0.0f32, |a, b| a + b));
                self.set(res[0], Data::Bits { w: 1, v: vec![s; t] });
            }
            "gpu.launch_func" => {
                // Operands: grid x y z, block x y z, then the kernel's (no async, cluster or dynamic shared memory).
                let ins = operands(op);
                let seg = attr_ints(&attr(op, "operandSegmentSizes").ok_or("launch without operand segments")?);
                let kernel = attr(op, "kernel").ok_or("launch without kernel")?;
                let kname = kernel.rsplit("::@").next().unwrap_or("").trim_matches('"').to_string();
                if seg.first() != Some(&0) || seg.len() < 10 {
                    return Err(format!("launch of {kname}: operand segments {seg:?}"));
                }
                let first = seg[..seg.len() - 2].iter().sum::<i64>() as usize;
                let scalar = |k: usize| -> Result<usize, String> { Ok(self.bits(ins[k])?.1[0] as usize) };
                let grid = [scalar(0)?, scalar(1)?, scalar(2)?];
                let threads = scalar(3)?;
                if scalar(4)? != 1 || scalar(5)? != 1 {
                    return Err(format!("launch of {kname}: 2-D blocks"));
                }
                let mut args = Vec::new();
                for v in &ins[first..] {
                    args.push(match self.get(*v)? {
                        Data::Mem(d) => {
                            let d = &d[0];
                            if d.off != 0 {
                                return Err(format!("launch of {kname}: a memref argument with an offset"));
                            }
                            Arg::Mem(d.ptr, d.sizes[..d.rank].iter().map(|&x| x as usize).collect())
                        }
                        // index scalars and !llvm.ptr values alike: one word.
                        Data::Bits { v, .. } => Arg::Ptr(v[0]),
                    });
                }
                self.mem.launches.push(Launch { kernel: kname.clone(), grid, threads, args: args.clone() });
                launch(self.funcs, self.info, self.blocks, self.mem, &kname, grid, threads, &args)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}
