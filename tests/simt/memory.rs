//! The SIMT interpreter's `memref` loads, stores, views and allocas, and `llvm` pointers (`getelementptr`, `load`, `inttoptr`), every access bounds-checked.

use super::*;

impl Frame<'_> {
    /// Runs `op` if it is one of this file's; `Ok(false)` if not.
    #[allow(unused_variables)] // the shared view of the op; not every handler uses all of it
    pub(super) fn memory_op(&mut self, op: MlirOperation, info: &OpInfo, mask: &[bool]) -> Result<bool, String> {
        view!(self, info => t, name, res, out_ty, in_ty, e, ibits, in_bits, attr, operands);
        match name {
            "memref.dim" => {
                let ins = operands(op);
                let d = self.descs(ins[0])?;
                let (_, k) = self.bits(ins[1])?;
                let v = (0..t).map(|th| d[th].sizes[k[th] as usize] as u64).collect();
                self.set(res[0], Data::Bits { w: 1, v });
            }
            "memref.alloca" => {
                let (sizes, el) = static_memref(res[0])?;
                let n: i64 = sizes.iter().product();
                let d = (0..t).map(|_| Desc::new(self.mem.alloc(n as usize * el.bytes()), &sizes)).collect();
                self.set(res[0], Data::Mem(d));
            }
            "memref.load" | "memref.store" | "vector.load" => {
                let ins = &info.ins;
                let (mref, idx0, val) = if name == "memref.store" { (ins[1], 2, Some(ins[0])) } else { (ins[0], 1, None) };
                let mty = info.in_tys[if name == "memref.store" { 1 } else { 0 }].clone().ok_or("a memref of unknown type")?;
                let eb = elem(&mty).bytes();
                let lanes = if name == "vector.load" { width(out_ty.as_ref().unwrap()) } else { 1 };
                let mut v = if val.is_none() { self.take_buf(res[0], t * lanes) } else { Vec::new() };
                // Borrow the operands and the memory side by side (distinct fields).
                let vals = &self.vals;
                let mem = &mut *self.mem;
                let look = |v: MlirValue| vals.get(&(v.ptr as usize)).ok_or_else(|| "simt: a value used before it is defined".to_string());
                let Data::Mem(d) = look(mref)? else { return Err("a scalar where a memref was expected".into()) };
                let mut idx: Vec<&Vec<u64>> = Vec::with_capacity(ins.len() - idx0);
                for v in &ins[idx0..] {
                    match look(*v)? {
                        Data::Bits { v, .. } => idx.push(v),
                        _ => return Err("a memref index".into()),
                    }
                }
                let src = match val.map(look).transpose()? {
                    Some(Data::Bits { v, .. }) => Some(v),
                    Some(_) => return Err("storing a memref".into()),
                    None => None,
                };
                for th in 0..t {
                    if !mask[th] {
                        continue;
                    }
                    let ds = &d[th];
                    let lin = element(ds, &idx, th, lanes).map_err(|e| format!("{name} {e} in {}", self.kernel))?;
                    for l in 0..lanes {
                        let addr = ds.ptr + ((lin + l as i64) as u64) * eb as u64;
                        match src {
                            Some(s) => mem.store(addr, eb, s[th])?,
                            None => v[th * lanes + l] = mem.load(addr, eb)?,
                        }
                    }
                }
                if val.is_none() {
                    self.set(res[0], Data::Bits { w: lanes, v });
                }
            }
            "memref.atomic_rmw" => {
                // (value, memref, indices...): the threads of the block in
                // order, each reading the old value and writing the new.
                let kind = attr(op, "kind").unwrap_or_default();
                let ins = &info.ins;
                let mty = info.in_tys[1].clone().ok_or("an atomic on a memref of unknown type")?;
                let eb = elem(&mty).bytes();
                let bits = (eb * 8) as u32;
                let val = self.bits(ins[0])?.1.clone();
                let idx: Vec<Vec<u64>> = ins[2..].iter().map(|v| self.bits(*v).map(|b| b.1.clone())).collect::<Result<_, _>>()?;
                let d = self.descs(ins[1])?.to_vec();
                let mut out = vec![0u64; t];
                for th in 0..t {
                    if !mask[th] {
                        continue;
                    }
                    let ds = &d[th];
                    let refs: Vec<&Vec<u64>> = idx.iter().collect();
                    let lin = element(ds, &refs, th, 1).map_err(|e| format!("atomic_rmw {e} in {}", self.kernel))?;
                    let addr = ds.ptr + lin as u64 * eb as u64;
                    let old = self.mem.load(addr, eb)?;
                    let v = mask_bits(val[th], bits);
                    // The kind prints as its number in MLIR's AtomicRMWKind
                    // (addi = 1, maxu = 7, minu = 11, ori = 14).
                    let new = match kind.split(':').next().unwrap_or("").trim() {
                        "1" => mask_bits(old.wrapping_add(v), bits),
                        "7" => old.max(v),
                        "11" => old.min(v),
                        "14" => old | v,
                        other => return Err(format!("atomic_rmw kind {other}")),
                    };
                    self.mem.store(addr, eb, new)?;
                    out[th] = old;
                }
                self.set(res[0], Data::Bits { w: 1, v: out });
            }
            "llvm.getelementptr" => {
                let ins = operands(op);
                let (_, base) = self.bits(ins[0])?;
                let base = base.clone();
                let et = attr(op, "elem_type").unwrap_or_default();
                let size = match et.trim() {
                    "!llvm.ptr" | "i64" | "f64" => 8,
                    "i32" | "f32" => 4,
                    "i16" | "f16" | "bf16" => 2,
                    "i8" => 1,
                    other => return Err(format!("getelementptr over {other}")),
                };
                let raw = attr_ints(&attr(op, "rawConstantIndices").unwrap_or_default());
                let dynamic = if ins.len() > 1 { Some(self.bits(ins[1])?.1.clone()) } else { None };
                let v = (0..t)
                    .map(|th| {
                        let i = match (&dynamic, raw.first()) {
                            (Some(d), _) => sext(d[th], 64),
                            (None, Some(c)) => *c,
                            _ => 0,
                        };
                        (base[th] as i64 + i * size) as u64
                    })
                    .collect();
                self.set(res[0], Data::Bits { w: 1, v });
            }
            "llvm.load" => {
                let (_, p) = self.bits(operands(op)[0])?;
                let p = p.clone();
                let mut v = vec![0u64; t];
                for th in 0..t {
                    if mask[th] {
                        v[th] = self.mem.load(p[th], 8)?;
                    }
                }
                self.set(res[0], Data::Bits { w: 1, v });
            }
            "memref.extract_aligned_pointer_as_index" => {
                let d = self.descs(operands(op)[0])?;
                let v = d.iter().map(|x| x.ptr).collect();
                self.set(res[0], Data::Bits { w: 1, v });
            }
            "llvm.inttoptr" | "llvm.ptrtoint" => self.elementwise(info, |a| Ok(a[0]))?,
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// The element offset of thread `th`'s indices into `ds`, each index checked
/// against its dimension (the last one spanning `lanes` elements).
fn element(ds: &Desc, idx: &[&Vec<u64>], th: usize, lanes: usize) -> Result<i64, String> {
    let mut lin = ds.off;
    for (k, ix) in idx.iter().enumerate() {
        let i = ix[th] as i64;
        let extra = if k + 1 == idx.len() { lanes as i64 - 1 } else { 0 };
        if i < 0 || i + extra >= ds.sizes[k] {
            return Err(format!("out of bounds: index {i} (+{extra}) of dim {k} with size {} (thread {th})", ds.sizes[k]));
        }
        lin += i * ds.strides[k];
    }
    Ok(lin)
}
