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

/// The names every op handler works with ([`View`], plus `attr(op, name)`
/// and `operands(op)`), bound in the handler's scope under the names given.
macro_rules! view {
    ($self:ident, $info:ident => $t:ident, $name:ident, $res:ident, $out_ty:ident, $in_ty:ident, $e:ident, $ibits:ident, $in_bits:ident, $attr:ident, $operands:ident) => {
        let View { t: $t, name: $name, res: $res, out_ty: $out_ty, in_ty: $in_ty, e: $e, ibits: $ibits, in_bits: $in_bits } =
            View::of($self.threads, $info);
        let $attr = |op: MlirOperation, n: &'static str| $info.attr(op, n);
        let $operands = |_: MlirOperation| &$info.ins[..];
    };
}

mod arith;
mod control;
mod gpu;
mod llvm;
mod memory;
mod vector;

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
    F64,
}

impl Elem {
    fn bytes(self) -> usize {
        match self {
            Elem::Int(b) => (b as usize).div_ceil(8).max(1),
            Elem::F16 | Elem::Bf16 => 2,
            Elem::F32 => 4,
            Elem::F64 => 8,
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
        "f64" => Elem::F64,
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
/// What every op handler looks at first: the thread count, the op's name
/// and results, its result and first operand types, and their integer widths.
struct View<'a> {
    t: usize,
    name: &'a str,
    res: &'a [MlirValue],
    out_ty: Option<Ty>,
    in_ty: Option<Ty>,
    e: Option<Elem>,
    ibits: u32,
    in_bits: u32,
}

impl<'a> View<'a> {
    fn of(t: usize, info: &'a OpInfo) -> View<'a> {
        let bits = |ty: Option<&Ty>| match ty.map(elem) {
            Some(Elem::Int(b)) => b,
            _ => 64,
        };
        let (out_ty, in_ty) = (info.out.clone(), info.inp.clone());
        View {
            t,
            name: info.name.as_str(),
            res: &info.outs,
            e: out_ty.as_ref().map(elem),
            ibits: bits(out_ty.as_ref()),
            in_bits: bits(in_ty.as_ref()),
            out_ty,
            in_ty,
        }
    }
}

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
    /// Which dialect's handler runs the op (0: not yet known), found on
    /// its first run: later runs skip the other dialects' name matches.
    handler: std::cell::Cell<u8>,
    /// A constant's value for a thread count, parsed on its first run (a
    /// constant in a loop body runs once per iteration).
    constant: std::cell::RefCell<Option<(usize, Data)>>,
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
    // A kernel that declares its block size is compiled for exactly that
    // many threads (AMDGPU sizes its workgroup and registers by it).
    if let Some(known) = attr(f, "known_block_size") {
        let dims = attr_ints(&known);
        if dims != [threads as i64, 1, 1] {
            return Err(format!("{name}: launched with {threads} threads, declares known_block_size {dims:?}"));
        }
    }
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

impl<'m> Frame<'m> {
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

    /// A zeroed buffer of `n` words for a new value of `v`: the buffer of
    /// its value from the previous run of the op when it has one (an op in
    /// a loop redefines its value every iteration), so that a loop body
    /// allocates nothing.
    fn take_buf(&mut self, v: MlirValue, n: usize) -> Vec<u64> {
        match self.vals.remove(&(v.ptr as usize)) {
            Some(Data::Bits { mut v, .. }) => {
                v.clear();
                v.resize(n, 0);
                v
            }
            _ => vec![0u64; n],
        }
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
        // (An SSA result is never its own operand, so its old buffer is free.)
        let mut res = self.take_buf(info.outs[0], n);
        let empty: &[u64] = &[];
        let mut srcs: [(usize, &[u64]); 4] = [(0, empty); 4];
        if info.ins.len() > srcs.len() {
            return Err(format!("{} operands; elementwise ops take at most 4", info.ins.len()));
        }
        for (k, v) in info.ins.iter().enumerate() {
            let (wi, s) = self.bits(*v)?;
            srcs[k] = (wi, s.as_slice());
        }
        let srcs = &srcs[..info.ins.len()];
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
            handler: Default::default(),
            constant: Default::default(),
        });
        self.info.insert(op.ptr as usize, i.clone());
        Ok(i)
    }

    fn op(&mut self, op: MlirOperation, info: &OpInfo, mask: &[bool]) -> Result<(), String> {
        // Each dialect's file says whether the op is one of its own; the
        // one that did is asked first next time.
        type Handler<'m> = fn(&mut Frame<'m>, MlirOperation, &OpInfo, &[bool]) -> Result<bool, String>;
        let handlers: [Handler<'m>; 6] =
            [Frame::arith_op, Frame::llvm_op, Frame::memory_op, Frame::vector_op, Frame::gpu_op, Frame::control_op];
        if let Some(h) = (info.handler.get() as usize).checked_sub(1) {
            if handlers[h](self, op, info, mask)? {
                return Ok(());
            }
        }
        for (h, handler) in handlers.iter().enumerate() {
            if handler(self, op, info, mask)? {
                info.handler.set(h as u8 + 1);
                return Ok(());
            }
        }
        Err(format!("simt: no semantics for `{}`", info.name))
    }
}

/// An attribute must mention `what` (a shuffle's `xor` mode, a reduction's
/// `add` kind): the only forms m3c's kernels use, and so the only ones the
/// interpreter gives meaning to.
fn require(attr: Option<String>, what: &str) -> Result<(), String> {
    match attr {
        Some(a) if a.contains(what) => Ok(()),
        other => Err(format!("unsupported attribute {other:?} (expected {what})")),
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
        Elem::F64 => {
            if let Some(h) = s.strip_prefix("0x") {
                u64::from_str_radix(h, 16).map_err(|_| format!("float literal {s}"))?
            } else {
                s.parse::<f64>().map_err(|_| format!("float literal {s}"))?.to_bits()
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
