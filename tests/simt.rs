//! A SIMT interpreter for m3c's GPU kernels, so that CI (no GPU) runs the
//! very `gpu.func` text the CUDA back end compiles: each block's threads
//! execute in lockstep, values are per-thread, `scf.if`/`scf.for` run under
//! per-thread masks, and warp shuffles read the partner lane's value.
//!
//! It is a test instrument, not a GPU model: lockstep hides races a real GPU
//! would expose (so it cannot prove a missing barrier harmless), and `math`
//! functions are the host's. What it does catch are the bugs of never-run
//! code: wrong indices, out-of-bounds accesses (every load and store is
//! checked against its memref's sizes and its buffer), shuffles that read
//! inactive lanes, barriers in divergent code, wrong launch geometry, wrong
//! arithmetic. It covers exactly the ops m3c's GPU kernels use; any other op
//! is an error, never silently skipped.
//!
//! Memory: buffers owned by the interpreter; a pointer is `(buffer + 1) << 40
//! | byte offset`, so `!llvm.ptr` values (the experts' pointer tables) work.

use melior::ir::{Attribute, Module, Type};
use mlir_sys::*;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::rc::Rc;

/// Hashes the pointer-sized keys (MLIR values, operations, blocks) with one
/// multiply: SipHash was a tenth of the interpreter's time.
#[derive(Default)]
struct PtrHasher(u64);

impl Hasher for PtrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(20);
    }
}

type PtrMap<V> = HashMap<usize, V, BuildHasherDefault<PtrHasher>>;

/// One thread-major value: `w` 64-bit words per thread (1 for scalars, the
/// lane count for vectors, the field count for LLVM structs).
#[derive(Clone, Debug)]
enum Data {
    Bits { w: usize, v: Vec<u64> },
    Mem(Vec<Desc>),
}

/// A memref descriptor: aligned pointer, offset and strides in elements
/// (rank ≤ 4, inline so that per-thread descriptors cost no allocation).
#[derive(Clone, Copy, Debug, Default)]
struct Desc {
    ptr: u64,
    off: i64,
    rank: usize,
    sizes: [i64; 4],
    strides: [i64; 4],
}

impl Desc {
    /// A row-major descriptor of `sizes` at `ptr`.
    fn new(ptr: u64, sizes: &[i64]) -> Desc {
        let mut d = Desc { ptr, off: 0, rank: sizes.len(), ..Default::default() };
        d.sizes[..sizes.len()].copy_from_slice(sizes);
        let mut st = 1;
        for i in (0..sizes.len()).rev() {
            d.strides[i] = st;
            st *= sizes[i];
        }
        d
    }
}

/// Element kinds of the values the kernels use.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Elem {
    Int(u32),
    F16,
    Bf16,
    F32,
}

impl Elem {
    fn bytes(self) -> usize {
        match self {
            Elem::Int(b) => (b as usize).div_ceil(8).max(1),
            Elem::F16 | Elem::Bf16 => 2,
            Elem::F32 => 4,
        }
    }
}

#[derive(Clone, Debug)]
enum Ty {
    Scalar(Elem),
    Vector(Elem, usize),
    MemRef(Elem),
    Struct(usize),
}

fn elem_of(s: &str) -> Result<Elem, String> {
    Ok(match s {
        "index" | "i64" | "!llvm.ptr" | "ptr" => Elem::Int(64),
        "i1" => Elem::Int(1),
        "i8" => Elem::Int(8),
        "i16" => Elem::Int(16),
        "i32" => Elem::Int(32),
        "f16" => Elem::F16,
        "bf16" => Elem::Bf16,
        "f32" => Elem::F32,
        other => return Err(format!("simt: no element type `{other}`")),
    })
}

fn parse_ty(s: &str) -> Result<Ty, String> {
    let s = s.trim();
    if let Some(inner) = s.strip_prefix("vector<").and_then(|r| r.strip_suffix('>')) {
        let (n, e) = inner.split_once('x').ok_or_else(|| format!("simt: vector type {s}"))?;
        return Ok(Ty::Vector(elem_of(e)?, n.parse().map_err(|_| format!("simt: vector type {s}"))?));
    }
    if let Some(inner) = s.strip_prefix("memref<") {
        let dims = inner.split(',').next().unwrap_or(inner).trim_end_matches('>');
        let e = dims.rsplit('x').next().unwrap_or(dims);
        return Ok(Ty::MemRef(elem_of(e)?));
    }
    if let Some(inner) = s.strip_prefix("!llvm.struct<(") {
        // (ptr, ptr, i64, array<R x i64>, array<R x i64>)
        let rank: usize = inner.split("array<").nth(1).and_then(|a| a.split(' ').next()).and_then(|r| r.parse().ok()).unwrap_or(0);
        return Ok(Ty::Struct(3 + 2 * rank));
    }
    Ok(Ty::Scalar(elem_of(s)?))
}

fn width(t: &Ty) -> usize {
    match t {
        Ty::Scalar(_) | Ty::MemRef(_) => 1,
        Ty::Vector(_, n) => *n,
        Ty::Struct(n) => *n,
    }
}

fn elem(t: &Ty) -> Elem {
    match t {
        Ty::Scalar(e) | Ty::Vector(e, _) | Ty::MemRef(e) => *e,
        Ty::Struct(_) => Elem::Int(64),
    }
}

fn mask_bits(v: u64, bits: u32) -> u64 {
    if bits >= 64 {
        v
    } else {
        v & ((1u64 << bits) - 1)
    }
}

fn sext(v: u64, bits: u32) -> i64 {
    if bits >= 64 {
        v as i64
    } else {
        ((v << (64 - bits)) as i64) >> (64 - bits)
    }
}

fn f32v(b: u64) -> f32 {
    f32::from_bits(b as u32)
}

fn fb(x: f32) -> u64 {
    x.to_bits() as u64
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((h >> 10) & 0x1F) as i32;
    let man = (h & 0x3FF) as f32;
    match exp {
        0 => sign * man * 2f32.powi(-24),
        31 if man == 0.0 => sign * f32::INFINITY,
        31 => f32::NAN,
        e => sign * (1.0 + man / 1024.0) * 2f32.powi(e - 15),
    }
}

/// `float8_e4m3fn` → f16 bits, exactly (what `cvt.rn.f16x2.e4m3x2` does per byte).
fn e4m3_to_f16(b: u8) -> u16 {
    let sign = ((b & 0x80) as u16) << 8;
    let exp = ((b >> 3) & 0xF) as i32;
    let man = (b & 7) as u16;
    if exp == 0xF && man == 7 {
        return 0x7E00 | sign; // NaN
    }
    if exp == 0 {
        if man == 0 {
            return sign;
        }
        // man/8 · 2^-6 = man · 2^-9: an f16 normal (2^-9 ≥ 2^-14).
        let mut m = man as u32;
        let mut e = -9i32; // value = m · 2^e
        while m < 8 {
            m <<= 1;
            e -= 1;
        }
        // m in 8..15 = 1.xxx · 8 → value = (m/8) · 2^(e+3)
        let fe = (e + 3 + 15) as u16;
        return sign | (fe << 10) | (((m - 8) as u16) << 7);
    }
    sign | (((exp - 7 + 15) as u16) << 10) | (man << 7)
}

/// Interpreter memory: buffers addressed by tagged pointers.
#[derive(Default)]
pub struct Memory {
    bufs: Vec<Vec<u8>>,
    /// Scratch from `m3c_buf_alloc`, pooled by size and never freed, as the
    /// runtime's device pool does: so a step that allocates in the same
    /// order gets the same addresses (what CUDA graph replay relies on).
    pool: HashMap<usize, Vec<u64>>,
    pooled: HashMap<u64, usize>,
    /// Every kernel launch, in order.
    pub launches: Vec<Launch>,
}

/// One kernel launch as the interpreter saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub kernel: String,
    pub grid: [usize; 3],
    pub threads: usize,
    pub args: Vec<Arg>,
}

impl Memory {
    /// `m3c_buf_alloc`: a pooled buffer of `bytes`.
    fn pool_alloc(&mut self, bytes: usize) -> u64 {
        if let Some(p) = self.pool.get_mut(&bytes).and_then(|v| v.pop()) {
            return p;
        }
        let p = self.alloc(bytes);
        self.pooled.insert(p, bytes);
        p
    }

    /// `m3c_buf_free`: back to the pool.
    fn pool_free(&mut self, p: u64) -> Result<(), String> {
        let bytes = *self.pooled.get(&p).ok_or_else(|| format!("simt: m3c_buf_free of {p:#x}, which m3c_buf_alloc did not return"))?;
        let list = self.pool.entry(bytes).or_default();
        if list.contains(&p) {
            return Err(format!("simt: {p:#x} freed twice"));
        }
        list.push(p);
        Ok(())
    }

    /// Whether `ptr` points into scratch from `m3c_buf_alloc`.
    pub fn is_scratch(&self, ptr: u64) -> bool {
        self.pooled.contains_key(&(ptr >> 40 << 40))
    }

    /// Overwrites the start of the buffer `ptr` points to with `data`.
    pub fn write<T: Copy>(&mut self, ptr: u64, data: &[T]) -> Result<(), String> {
        // SAFETY: plain old data viewed as bytes.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) };
        self.slot(ptr, bytes.len())?.copy_from_slice(bytes);
        Ok(())
    }

    /// A new buffer of `bytes` zero bytes; its pointer.
    pub fn alloc(&mut self, bytes: usize) -> u64 {
        self.bufs.push(vec![0; bytes]);
        (self.bufs.len() as u64) << 40
    }

    /// A new buffer holding `data`; its pointer.
    pub fn put<T: Copy>(&mut self, data: &[T]) -> u64 {
        // SAFETY: plain old data viewed as bytes.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) };
        self.bufs.push(bytes.to_vec());
        (self.bufs.len() as u64) << 40
    }

    /// The contents of the buffer `ptr` points into, as `T`s.
    pub fn get<T: Copy + Default>(&self, ptr: u64) -> Vec<T> {
        let b = &self.bufs[(ptr >> 40) as usize - 1];
        let n = b.len() / std::mem::size_of::<T>();
        let mut out = vec![T::default(); n];
        // SAFETY: plain old data copied from bytes.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), out.as_mut_ptr() as *mut u8, n * std::mem::size_of::<T>()) };
        out
    }

    fn slot(&mut self, addr: u64, bytes: usize) -> Result<&mut [u8], String> {
        let id = (addr >> 40) as usize;
        let off = (addr & ((1 << 40) - 1)) as usize;
        let b =
            id.checked_sub(1).and_then(|i| self.bufs.get_mut(i)).ok_or_else(|| format!("simt: access through a wild pointer {addr:#x}"))?;
        let len = b.len();
        b.get_mut(off..off + bytes).ok_or_else(|| format!("simt: access of {bytes} B at byte {off} of a {len}-byte buffer"))
    }

    fn load(&mut self, addr: u64, bytes: usize) -> Result<u64, String> {
        let s = self.slot(addr, bytes)?;
        let mut v = [0u8; 8];
        v[..bytes].copy_from_slice(s);
        Ok(u64::from_le_bytes(v))
    }

    fn store(&mut self, addr: u64, bytes: usize, v: u64) -> Result<(), String> {
        let s = self.slot(addr, bytes)?;
        s.copy_from_slice(&v.to_le_bytes()[..bytes]);
        Ok(())
    }
}

/// A kernel argument.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    /// A memref over a buffer: pointer and sizes (row-major strides).
    Mem(u64, Vec<usize>),
    /// An `index` scalar.
    Index(usize),
    /// An `!llvm.ptr`.
    Ptr(u64),
}

fn str_ref(s: &str) -> MlirStringRef {
    MlirStringRef { data: s.as_ptr() as *const _, length: s.len() }
}

fn op_name(op: MlirOperation) -> String {
    // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
    unsafe {
        let id = mlirOperationGetName(op);
        let s = mlirIdentifierStr(id);
        String::from_utf8_lossy(std::slice::from_raw_parts(s.data as *const u8, s.length)).into_owned()
    }
}

fn attr(op: MlirOperation, name: &str) -> Option<String> {
    // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
    unsafe {
        let mut a = mlirOperationGetInherentAttributeByName(op, str_ref(name));
        if a.ptr.is_null() {
            a = mlirOperationGetDiscardableAttributeByName(op, str_ref(name));
        }
        if a.ptr.is_null() {
            None
        } else {
            Some(Attribute::from_raw(a).to_string())
        }
    }
}

/// The sizes and element of a statically shaped memref value (workgroup
/// buffers, `memref.alloca`).
fn static_memref(v: MlirValue) -> Result<(Vec<i64>, Elem), String> {
    // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
    let t = unsafe { Type::from_raw(mlirValueGetType(v)) }.to_string();
    let dims = t.trim_start_matches("memref<").split(['>', ',']).next().unwrap_or("").to_string();
    let mut parts: Vec<&str> = dims.split('x').collect();
    let e = elem_of(parts.pop().unwrap_or(""))?;
    let sizes = parts.iter().map(|p| p.parse().map_err(|_| format!("simt: {t} is not statically shaped"))).collect::<Result<_, _>>()?;
    Ok((sizes, e))
}

fn value_ty(v: MlirValue) -> Result<Ty, String> {
    // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
    parse_ty(&unsafe { Type::from_raw(mlirValueGetType(v)) }.to_string())
}

fn operands(op: MlirOperation) -> Vec<MlirValue> {
    // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
    unsafe { (0..mlirOperationGetNumOperands(op)).map(|i| mlirOperationGetOperand(op, i)).collect() }
}

fn results(op: MlirOperation) -> Vec<MlirValue> {
    // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
    unsafe { (0..mlirOperationGetNumResults(op)).map(|i| mlirOperationGetResult(op, i)).collect() }
}

fn region_block(op: MlirOperation, i: isize) -> MlirBlock {
    // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
    unsafe { mlirRegionGetFirstBlock(mlirOperationGetRegion(op, i)) }
}

fn block_args(b: MlirBlock) -> Vec<MlirValue> {
    // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
    unsafe { (0..mlirBlockGetNumArguments(b)).map(|i| mlirBlockGetArgument(b, i)).collect() }
}

fn block_ops(b: MlirBlock) -> Vec<MlirOperation> {
    let mut out = Vec::new();
    // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
    unsafe {
        let mut op = mlirBlockGetFirstOperation(b);
        while !op.ptr.is_null() {
            out.push(op);
            op = mlirOperationGetNextInBlock(op);
        }
    }
    out
}

/// The integer in an attribute's text (`3 : index`, `array<i64: 3>`, `#gpu<dim x>` ...).
fn attr_ints(s: &str) -> Vec<i64> {
    let body = s.split_once(':').map(|(a, b)| if a.starts_with("array<") { b } else { a }).unwrap_or(s);
    body.split(|c: char| !(c.is_ascii_digit() || c == '-')).filter(|t| !t.is_empty() && *t != "-").filter_map(|t| t.parse().ok()).collect()
}

/// A parsed module whose `gpu.func` kernels can be launched.
pub struct Gpu {
    /// What the runtime's `m3c_gemm_wanted` answers: whether linears take the
    /// tensor-core GEMM branch (`m3c_gemm_bf16`, computed here in f32 from bf16 inputs).
    pub gemm: bool,
    funcs: HashMap<String, MlirOperation>,
    /// Per operation: its name and result/first-operand types, parsed once.
    info: PtrMap<Rc<OpInfo>>,
    blocks: PtrMap<Rc<Vec<MlirOperation>>>,
    _module: Module<'static>,
    pub mem: Memory,
}

/// What the interpreter needs of an operation, read through the C API once.
struct OpInfo {
    name: String,
    out: Option<Ty>,
    inp: Option<Ty>,
    ins: Vec<MlirValue>,
    outs: Vec<MlirValue>,
    /// Types of every operand and result (None: not a type the interpreter models).
    in_tys: Vec<Option<Ty>>,
    out_tys: Vec<Option<Ty>>,
    /// Attributes as text, read on first use.
    attrs: std::cell::RefCell<HashMap<&'static str, Option<String>>>,
}

impl OpInfo {
    fn attr(&self, op: MlirOperation, name: &'static str) -> Option<String> {
        self.attrs.borrow_mut().entry(name).or_insert_with(|| attr(op, name)).clone()
    }
}

struct Frame<'m> {
    vals: PtrMap<Data>,
    threads: usize,
    block_id: [u64; 3],
    mem: &'m mut Memory,
    funcs: &'m HashMap<String, MlirOperation>,
    info: &'m mut PtrMap<Rc<OpInfo>>,
    blocks: &'m mut PtrMap<Rc<Vec<MlirOperation>>>,
    kernel: &'m str,
    gemm: bool,
}

impl Gpu {
    /// Parses `text` (a module holding a `gpu.module` of kernels). The MLIR
    /// context is leaked: a test makes a handful, and the module borrows it.
    pub fn new(text: &str) -> Result<Gpu, String> {
        let registry = melior::dialect::DialectRegistry::new();
        melior::utility::register_all_dialects(&registry);
        let context: &'static melior::Context = Box::leak(Box::new(melior::Context::new()));
        context.append_dialect_registry(&registry);
        context.load_all_available_dialects();
        let module = Module::parse(context, text).ok_or("simt: the module does not parse")?;
        let mut funcs = HashMap::new();
        let mut stack = vec![module.as_operation().to_raw()];
        while let Some(op) = stack.pop() {
            let n = op_name(op);
            if n == "gpu.func" || n == "func.func" {
                if let Some(sym) = attr(op, "sym_name") {
                    funcs.insert(sym.trim_matches('"').to_string(), op);
                }
                continue;
            }
            // SAFETY: `op`, `v`, `b` are handles into the module this interpreter owns and keeps alive; the MLIR C API calls only read them.
            unsafe {
                for r in 0..mlirOperationGetNumRegions(op) {
                    let mut b = mlirRegionGetFirstBlock(mlirOperationGetRegion(op, r));
                    while !b.ptr.is_null() {
                        stack.extend(block_ops(b));
                        b = mlirBlockGetNextInRegion(b);
                    }
                }
            }
        }
        Ok(Gpu { gemm: false, funcs, info: PtrMap::default(), blocks: PtrMap::default(), _module: module, mem: Memory::default() })
    }

    /// Runs kernel `name` over `grid` blocks of `threads` threads (x only).
    pub fn launch(&mut self, name: &str, grid: [usize; 3], threads: usize, args: &[Arg]) -> Result<(), String> {
        launch(&self.funcs, &mut self.info, &mut self.blocks, &mut self.mem, name, grid, threads, args)
    }

    /// Runs the host function `name` (one thread): what the stage entry
    /// does around a kernel, its `gpu.launch_func`s run as launches here and
    /// `m3c_buf_alloc`/`m3c_buf_free` served from this memory.
    pub fn call_host(&mut self, name: &str, args: &[Arg]) -> Result<(), String> {
        let f = *self.funcs.get(name).ok_or_else(|| format!("simt: no function {name}"))?;
        let entry = region_block(f, 0);
        let mut fr = Frame {
            vals: PtrMap::default(),
            threads: 1,
            block_id: [0; 3],
            mem: &mut self.mem,
            funcs: &self.funcs,
            info: &mut self.info,
            blocks: &mut self.blocks,
            kernel: name,
            gemm: self.gemm,
        };
        for (p, a) in block_args(entry).iter().zip(args) {
            fr.vals.insert(p.ptr as usize, arg_data(a, 1));
        }
        fr.block(entry, &[true]).map(|_| ())
    }
}

fn arg_data(a: &Arg, threads: usize) -> Data {
    match a {
        Arg::Mem(ptr, sizes) => {
            let sizes: Vec<i64> = sizes.iter().map(|&s| s as i64).collect();
            Data::Mem(vec![Desc::new(*ptr, &sizes); threads])
        }
        Arg::Index(x) => Data::Bits { w: 1, v: vec![*x as u64; threads] },
        Arg::Ptr(x) => Data::Bits { w: 1, v: vec![*x; threads] },
    }
}

#[allow(clippy::too_many_arguments)]
fn launch(
    funcs: &HashMap<String, MlirOperation>,
    info: &mut PtrMap<Rc<OpInfo>>,
    blocks: &mut PtrMap<Rc<Vec<MlirOperation>>>,
    mem: &mut Memory,
    name: &str,
    grid: [usize; 3],
    threads: usize,
    args: &[Arg],
) -> Result<(), String> {
    let f = *funcs.get(name).ok_or_else(|| format!("simt: no kernel {name}"))?;
    let entry = region_block(f, 0);
    let all = block_args(entry);
    // Workgroup buffers are entry-block arguments after the parameters.
    let n_wg = attr(f, "workgroup_attributions").map_or(0, |a| attr_ints(&a).first().copied().unwrap_or(0) as usize);
    let (params, wg_args) = all.split_at(all.len() - n_wg);
    if params.len() != args.len() {
        return Err(format!("{name}: {} parameters, {} arguments", params.len(), args.len()));
    }
    let mut wg = Vec::new();
    for v in wg_args {
        let (sizes, e) = static_memref(*v)?;
        wg.push((*v, sizes.iter().product::<i64>() as usize, e));
    }
    if threads == 0 || threads > 1024 {
        return Err(format!("{name}: {threads} threads per block"));
    }
    for bz in 0..grid[2] {
        for by in 0..grid[1] {
            for bx in 0..grid[0] {
                let mut fr = Frame {
                    vals: PtrMap::default(),
                    threads,
                    block_id: [bx as u64, by as u64, bz as u64],
                    mem,
                    funcs,
                    info,
                    blocks,
                    kernel: name,
                    gemm: false,
                };
                for (p, a) in params.iter().zip(args) {
                    fr.vals.insert(p.ptr as usize, arg_data(a, threads));
                }
                for (v, n, e) in &wg {
                    let p = fr.mem.alloc(n * e.bytes());
                    fr.vals.insert(v.ptr as usize, Data::Mem(vec![Desc::new(p, &[*n as i64]); threads]));
                }
                let mask = vec![true; threads];
                fr.block(entry, &mask).map_err(|e| format!("{name} block ({bx}, {by}, {bz}): {e}"))?;
            }
        }
    }
    Ok(())
}

impl Frame<'_> {
    fn get(&self, v: MlirValue) -> Result<&Data, String> {
        self.vals.get(&(v.ptr as usize)).ok_or_else(|| "simt: a value used before it is defined".to_string())
    }

    fn bits(&self, v: MlirValue) -> Result<(usize, &Vec<u64>), String> {
        match self.get(v)? {
            Data::Bits { w, v } => Ok((*w, v)),
            Data::Mem(_) => Err("simt: a memref where a scalar was expected".into()),
        }
    }

    fn descs(&self, v: MlirValue) -> Result<&Vec<Desc>, String> {
        match self.get(v)? {
            Data::Mem(d) => Ok(d),
            _ => Err("simt: a scalar where a memref was expected".into()),
        }
    }

    fn set(&mut self, v: MlirValue, d: Data) {
        self.vals.insert(v.ptr as usize, d);
    }

    /// Runs a block's operations under `mask`; returns the terminator's operand values.
    fn block(&mut self, b: MlirBlock, mask: &[bool]) -> Result<Vec<Data>, String> {
        let ops = self.blocks.entry(b.ptr as usize).or_insert_with(|| Rc::new(block_ops(b))).clone();
        for &op in ops.iter() {
            let info = self.info(op)?;
            match info.name.as_str() {
                "scf.yield" | "gpu.return" | "func.return" | "scf.reduce" | "gpu.yield" => {
                    return info.ins.iter().map(|v| self.get(*v).cloned()).collect();
                }
                name => self.op(op, &info, mask).map_err(|e| {
                    if e.starts_with("simt:") || e.contains(" at ") {
                        e
                    } else {
                        format!("{name}: {e}")
                    }
                })?,
            }
        }
        Ok(Vec::new())
    }

    fn elementwise(&mut self, info: &OpInfo, f: impl Fn(&[u64]) -> Result<u64, String>) -> Result<(), String> {
        let w = info.out.as_ref().map_or(1, width);
        let n = self.threads * w;
        let mut srcs: Vec<(usize, &Vec<u64>)> = Vec::with_capacity(info.ins.len());
        for v in &info.ins {
            srcs.push(self.bits(*v)?);
        }
        let mut res = vec![0u64; n];
        let mut a = [0u64; 4];
        for (i, r) in res.iter_mut().enumerate() {
            for (k, (wi, s)) in srcs.iter().enumerate() {
                // A scalar operand next to vectors (a select's i1) is broadcast.
                a[k] = if *wi == w { s[i] } else { s[i / w] };
            }
            *r = f(&a[..srcs.len()])?;
        }
        self.set(info.outs[0], Data::Bits { w, v: res });
        Ok(())
    }

    fn info(&mut self, op: MlirOperation) -> Result<Rc<OpInfo>, String> {
        if let Some(i) = self.info.get(&(op.ptr as usize)) {
            return Ok(i.clone());
        }
        let (ins, outs) = (operands(op), results(op));
        let i = Rc::new(OpInfo {
            name: op_name(op),
            out: outs.first().map(|r| value_ty(*r)).transpose()?,
            inp: ins.first().and_then(|v| value_ty(*v).ok()),
            in_tys: ins.iter().map(|v| value_ty(*v).ok()).collect(),
            out_tys: outs.iter().map(|v| value_ty(*v).ok()).collect(),
            ins,
            outs,
            attrs: Default::default(),
        });
        self.info.insert(op.ptr as usize, i.clone());
        Ok(i)
    }

    fn op(&mut self, op: MlirOperation, info: &OpInfo, mask: &[bool]) -> Result<(), String> {
        let t = self.threads;
        let name = info.name.as_str();
        let res = &info.outs;
        let attr = |op: MlirOperation, n: &'static str| info.attr(op, n);
        let operands = |_: MlirOperation| &info.ins[..];
        let out_ty = info.out.clone();
        let e = out_ty.as_ref().map(elem);
        let ibits = match e {
            Some(Elem::Int(b)) => b,
            _ => 64,
        };
        let in_ty = info.inp.clone();
        let in_bits = match in_ty.as_ref().map(elem) {
            Some(Elem::Int(b)) => b,
            _ => 64,
        };
        let fl = |f: fn(f32, f32) -> f32| move |a: &[u64]| Ok(fb(f(f32v(a[0]), f32v(a[1]))));
        match name {
            "arith.constant" | "llvm.mlir.constant" => {
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
                self.set(res[0], Data::Bits { w, v });
            }
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
            "arith.sitofp" => self.elementwise(info, move |a| Ok(fb(sext(a[0], in_bits) as f32)))?,
            "arith.addf" => self.elementwise(info, fl(|x, y| x + y))?,
            "arith.subf" => self.elementwise(info, fl(|x, y| x - y))?,
            "arith.mulf" => self.elementwise(info, fl(|x, y| x * y))?,
            "arith.divf" => self.elementwise(info, fl(|x, y| x / y))?,
            "arith.maximumf" => self.elementwise(info, fl(|x, y| if x.is_nan() || y.is_nan() { f32::NAN } else { x.max(y) }))?,
            "arith.minimumf" => self.elementwise(info, fl(|x, y| if x.is_nan() || y.is_nan() { f32::NAN } else { x.min(y) }))?,
            "arith.negf" => self.elementwise(info, |a| Ok(fb(-f32v(a[0]))))?,
            "math.exp" => self.elementwise(info, |a| Ok(fb(f32v(a[0]).exp())))?,
            "math.rsqrt" => self.elementwise(info, |a| Ok(fb(1.0 / f32v(a[0]).sqrt())))?,
            "math.sin" => self.elementwise(info, |a| Ok(fb(f32v(a[0]).sin())))?,
            "math.cos" => self.elementwise(info, |a| Ok(fb(f32v(a[0]).cos())))?,
            // SAFETY: erff is libm's pure function of one float.
            "math.erf" => self.elementwise(info, |a| Ok(fb(unsafe { erff(f32v(a[0])) })))?,
            "arith.extf" => {
                let from = in_ty.as_ref().map(elem);
                self.elementwise(info, move |a| {
                    Ok(match from {
                        Some(Elem::F16) => fb(f16_to_f32(a[0] as u16)),
                        Some(Elem::Bf16) => a[0] << 16,
                        _ => a[0],
                    })
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
                self.elementwise(info, move |a| {
                    let (x, y) = (f32v(a[0]), f32v(a[1]));
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
            "vector.reduction" => {
                let kind = attr(op, "kind").unwrap_or_default();
                if !kind.contains("add") {
                    return Err(format!("reduction {kind}"));
                }
                let ins = operands(op);
                let (w, d) = self.bits(ins[0])?;
                let v = (0..t).map(|th| fb((0..w).map(|k| f32v(d[th * w + k])).fold(0.0f32, |s, x| s + x))).collect();
                self.set(res[0], Data::Bits { w: 1, v });
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
            "gpu.shuffle" => {
                let mode = attr(op, "mode").unwrap_or_default();
                if !mode.contains("xor") {
                    return Err(format!("shuffle mode {mode}"));
                }
                let ins = operands(op);
                let (_, x) = self.bits(ins[0])?;
                let (_, off) = self.bits(ins[1])?;
                let mut v = vec![0u64; t];
                for th in 0..t {
                    if !mask[th] {
                        continue;
                    }
                    let src = (th & !31) | ((th % 32) ^ off[th] as usize);
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
                let mut v = if val.is_none() { vec![0u64; t * lanes] } else { Vec::new() };
                for th in 0..t {
                    if !mask[th] {
                        continue;
                    }
                    let ds = &d[th];
                    let mut lin = ds.off;
                    for (k, ix) in idx.iter().enumerate() {
                        let i = ix[th] as i64;
                        let extra = if k + 1 == idx.len() { lanes as i64 - 1 } else { 0 };
                        if i < 0 || i + extra >= ds.sizes[k] {
                            return Err(format!(
                                "{} out of bounds in {}: index {i} (+{extra}) of dim {k} with size {} (thread {th})",
                                name, self.kernel, ds.sizes[k]
                            ));
                        }
                        lin += i * ds.strides[k];
                    }
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
            "memref.extract_aligned_pointer_as_index" => {
                let d = self.descs(operands(op)[0])?;
                let v = d.iter().map(|x| x.ptr).collect();
                self.set(res[0], Data::Bits { w: 1, v });
            }
            "llvm.inttoptr" | "llvm.ptrtoint" => self.elementwise(info, |a| Ok(a[0]))?,
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
            other => return Err(format!("simt: no semantics for `{other}`")),
        }
        Ok(())
    }
}

/// The bits of a scalar literal of element kind `e`.
fn scalar_lit(s: &str, e: Elem) -> Result<u64, String> {
    let s = s.trim();
    Ok(match e {
        Elem::F32 | Elem::F16 | Elem::Bf16 => {
            if let Some(h) = s.strip_prefix("0x") {
                u64::from_str_radix(h, 16).map_err(|_| format!("float literal {s}"))?
            } else {
                let x: f32 = s.parse().map_err(|_| format!("float literal {s}"))?;
                if e == Elem::F32 {
                    fb(x)
                } else {
                    return Err("f16 literal".into());
                }
            }
        }
        Elem::Int(b) => match s {
            "true" => 1,
            "false" => 0,
            _ => mask_bits(s.parse::<i64>().map_err(|_| format!("integer literal {s}"))? as u64, b),
        },
    })
}

/// f32 → bf16 bits, nearest even (NaN kept a quiet NaN), as the kernels round.
fn bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    let b = x.to_bits();
    (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

extern "C" {
    /// libm's erf in f32: what the host kernels call, so the interpreter's
    /// `math.erf` is the host's (as its other `math` functions are).
    fn erff(x: f32) -> f32;
}
