//! Reading an AMDGPU code object (HSACO): the ELF header's machine and
//! code object version, the kernels' metadata (the msgpack note
//! `NT_AMDGPU_METADATA`), kernel descriptors and undefined symbols. The
//! ROCm back end checks every code object it makes with [`check`], and the
//! compile report shows [`KernelMeta`]'s figures, as ptxas's are shown for
//! CUDA: there is no GPU here to find a bad code object later.

use std::collections::BTreeMap;
use std::fmt::Write;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum HsacoError {
    #[error("not an AMDGPU code object: {0}")]
    Format(String),
    #[error("code object for {found}, expected {want}")]
    Chip { found: String, want: String },
    #[error("code object v{found}, expected v5 (what ROCm 6's loader takes)")]
    Version { found: u32 },
    #[error("kernel {kernel}: {what}")]
    Kernel { kernel: String, what: String },
    #[error("undefined symbols (nothing links them at load time): {0}")]
    Undefined(String),
}

/// One kernel's figures from the code object's metadata.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KernelMeta {
    pub name: String,
    pub wavefront: u64,
    pub sgprs: u64,
    pub vgprs: u64,
    pub agprs: u64,
    /// Static LDS (shared memory) bytes.
    pub lds: u64,
    /// Scratch (private memory) bytes per work-item.
    pub scratch: u64,
    pub sgpr_spills: u64,
    pub vgpr_spills: u64,
    pub max_workgroup: u64,
    pub dynamic_stack: bool,
}

/// What a code object is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct CodeObject {
    /// The processor, `gfx942`.
    pub chip: String,
    /// The code object version (5 for ROCm 6).
    pub version: u32,
    pub kernels: Vec<KernelMeta>,
    /// Symbols of kernel descriptors (`NAME.kd`).
    pub descriptors: Vec<String>,
    /// Undefined symbols other than the null one.
    pub undefined: Vec<String>,
}

const EM_AMDGPU: u16 = 224;
const ELFOSABI_AMDGPU_HSA: u8 = 64;
const NT_AMDGPU_METADATA: u32 = 32;
const SHT_SYMTAB: u32 = 2;
const SHT_NOTE: u32 = 7;
const SHT_DYNSYM: u32 = 11;

/// `e_flags`' processor field for the chips m3c targets
/// (`EF_AMDGPU_MACH_AMDGCN_GFX942`, `..._GFX950`).
const MACHS: &[(u32, &str)] = &[(0x04c, "gfx942"), (0x04f, "gfx950")];

struct Elf<'a> {
    b: &'a [u8],
}

impl<'a> Elf<'a> {
    fn bytes(&self, at: usize, n: usize) -> Result<&'a [u8], HsacoError> {
        at.checked_add(n)
            .and_then(|end| self.b.get(at..end))
            .ok_or_else(|| HsacoError::Format(format!("{n} bytes at offset {at} run past its {} bytes", self.b.len())))
    }
    fn u16(&self, at: usize) -> Result<u16, HsacoError> {
        Ok(u16::from_le_bytes(self.bytes(at, 2)?.try_into().expect("2 bytes")))
    }
    fn u32(&self, at: usize) -> Result<u32, HsacoError> {
        Ok(u32::from_le_bytes(self.bytes(at, 4)?.try_into().expect("4 bytes")))
    }
    fn u64(&self, at: usize) -> Result<usize, HsacoError> {
        let v = u64::from_le_bytes(self.bytes(at, 8)?.try_into().expect("8 bytes"));
        usize::try_from(v).map_err(|_| HsacoError::Format(format!("offset {v} out of range")))
    }

    /// (type, offset, size, link) of every section.
    fn sections(&self) -> Result<Vec<(u32, usize, usize, usize)>, HsacoError> {
        let (shoff, shentsize, shnum) = (self.u64(0x28)?, self.u16(0x3a)? as usize, self.u16(0x3c)? as usize);
        if shentsize != 64 {
            return Err(HsacoError::Format(format!("section header entries of {shentsize} bytes, expected 64")));
        }
        (0..shnum)
            .map(|i| {
                let h = shoff + i * 64;
                Ok((self.u32(h + 4)?, self.u64(h + 0x18)?, self.u64(h + 0x20)?, self.u32(h + 0x28)? as usize))
            })
            .collect()
    }

    /// A NUL-terminated name at `at` in the string table at `table`.
    fn name(&self, table: (usize, usize), at: usize) -> Result<String, HsacoError> {
        let strtab = self.bytes(table.0, table.1)?;
        let tail = strtab.get(at..).ok_or_else(|| HsacoError::Format(format!("name offset {at} past its string table")))?;
        let end = tail.iter().position(|&c| c == 0).unwrap_or(tail.len());
        Ok(String::from_utf8_lossy(&tail[..end]).into_owned())
    }
}

/// Reads a code object.
pub fn read(bytes: &[u8]) -> Result<CodeObject, HsacoError> {
    let elf = Elf { b: bytes };
    if elf.bytes(0, 64)?[..4] != *b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return Err(HsacoError::Format("not a 64-bit little-endian ELF".into()));
    }
    if elf.u16(0x12)? != EM_AMDGPU || bytes[7] != ELFOSABI_AMDGPU_HSA {
        return Err(HsacoError::Format(format!("machine {} and OS ABI {}, expected AMDGPU for the HSA runtime", elf.u16(0x12)?, bytes[7])));
    }
    // EI_ABIVERSION: 2 is code object v4, 3 is v5, 4 is v6.
    let version = bytes[8] as u32 + 2;
    let mach = elf.u32(0x30)? & 0xff;
    let chip = MACHS.iter().find(|m| m.0 == mach).map_or_else(|| format!("mach 0x{mach:03x}"), |m| m.1.to_string());
    let sections = elf.sections()?;
    let mut kernels = Vec::new();
    for &(_, off, size, _) in sections.iter().filter(|s| s.0 == SHT_NOTE) {
        kernels.extend(note_kernels(&elf, off, size)?);
    }
    let (mut descriptors, mut undefined) = (Vec::new(), Vec::new());
    for &(_, off, size, link) in sections.iter().filter(|s| s.0 == SHT_SYMTAB || s.0 == SHT_DYNSYM) {
        let strtab = sections.get(link).ok_or_else(|| HsacoError::Format("a symbol table without its string table".into()))?;
        for i in 1..size / 24 {
            let s = off + i * 24;
            let name = elf.name((strtab.1, strtab.2), elf.u32(s)? as usize)?;
            let shndx = elf.u16(s + 6)?;
            if shndx == 0 && !name.is_empty() {
                undefined.push(name);
            } else if name.ends_with(".kd") && !descriptors.contains(&name) {
                descriptors.push(name);
            }
        }
    }
    undefined.sort();
    undefined.dedup();
    Ok(CodeObject { chip, version, kernels, descriptors, undefined })
}

/// The kernels of the metadata notes in a note section.
fn note_kernels(elf: &Elf, off: usize, size: usize) -> Result<Vec<KernelMeta>, HsacoError> {
    let mut out = Vec::new();
    let mut at = off;
    while at + 12 <= off + size {
        let (namesz, descsz, ty) = (elf.u32(at)? as usize, elf.u32(at + 4)? as usize, elf.u32(at + 8)?);
        let name = elf.bytes(at + 12, namesz)?;
        let desc_at = at + 12 + namesz.next_multiple_of(4);
        if ty == NT_AMDGPU_METADATA && name.starts_with(b"AMDGPU") {
            let meta = Msgpack { b: elf.bytes(desc_at, descsz)?, at: 0 }.value(0)?;
            out.extend(kernels_of(&meta)?);
        }
        at = desc_at + descsz.next_multiple_of(4);
    }
    Ok(out)
}

fn kernels_of(meta: &Value) -> Result<Vec<KernelMeta>, HsacoError> {
    let Some(Value::Array(ks)) = meta.get("amdhsa.kernels") else {
        return Err(HsacoError::Format("metadata without `amdhsa.kernels`".into()));
    };
    ks.iter()
        .map(|k| {
            let int = |key: &str| k.get(key).and_then(Value::int).unwrap_or(0);
            let name = match k.get(".name") {
                Some(Value::Str(s)) => s.clone(),
                _ => return Err(HsacoError::Format("a kernel without `.name`".into())),
            };
            Ok(KernelMeta {
                name,
                wavefront: int(".wavefront_size"),
                sgprs: int(".sgpr_count"),
                vgprs: int(".vgpr_count"),
                agprs: int(".agpr_count"),
                lds: int(".group_segment_fixed_size"),
                scratch: int(".private_segment_fixed_size"),
                sgpr_spills: int(".sgpr_spill_count"),
                vgpr_spills: int(".vgpr_spill_count"),
                max_workgroup: int(".max_flat_workgroup_size"),
                dynamic_stack: matches!(k.get(".uses_dynamic_stack"), Some(Value::Bool(true))),
            })
        })
        .collect()
}

/// The msgpack values code object metadata uses.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bin,
    Array(Vec<Value>),
    Map(BTreeMap<String, Value>),
}

impl Value {
    fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(m) => m.get(key),
            _ => None,
        }
    }
    fn int(&self) -> Option<u64> {
        match self {
            Value::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        }
    }
}

/// A msgpack reader over untrusted bytes: every length is checked, nesting
/// is bounded.
struct Msgpack<'a> {
    b: &'a [u8],
    at: usize,
}

impl Msgpack<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], HsacoError> {
        let s = self.at.checked_add(n).and_then(|end| self.b.get(self.at..end));
        let s = s.ok_or_else(|| HsacoError::Format(format!("metadata: {n} bytes at {} run past its end", self.at)))?;
        self.at += n;
        Ok(s)
    }
    fn uint(&mut self, n: usize) -> Result<u64, HsacoError> {
        Ok(self.take(n)?.iter().fold(0u64, |v, &b| v << 8 | b as u64))
    }
    fn sint(&mut self, n: usize) -> Result<i128, HsacoError> {
        let u = self.uint(n)?;
        Ok(match n {
            1 => u as i8 as i128,
            2 => u as i16 as i128,
            4 => u as i32 as i128,
            _ => u as i64 as i128,
        })
    }
    fn str(&mut self, n: usize) -> Result<Value, HsacoError> {
        Ok(Value::Str(String::from_utf8_lossy(self.take(n)?).into_owned()))
    }
    fn array(&mut self, n: usize, depth: usize) -> Result<Value, HsacoError> {
        // Each element is at least one byte: a count past the bytes left is damage.
        if n > self.b.len() - self.at {
            return Err(HsacoError::Format(format!("metadata: an array of {n} in {} bytes", self.b.len() - self.at)));
        }
        (0..n).map(|_| self.value(depth + 1)).collect::<Result<_, _>>().map(Value::Array)
    }
    fn map(&mut self, n: usize, depth: usize) -> Result<Value, HsacoError> {
        if n > self.b.len() - self.at {
            return Err(HsacoError::Format(format!("metadata: a map of {n} in {} bytes", self.b.len() - self.at)));
        }
        let mut m = BTreeMap::new();
        for _ in 0..n {
            let key = match self.value(depth + 1)? {
                Value::Str(s) => s,
                other => format!("{other:?}"),
            };
            m.insert(key, self.value(depth + 1)?);
        }
        Ok(Value::Map(m))
    }
    fn value(&mut self, depth: usize) -> Result<Value, HsacoError> {
        if depth > 32 {
            return Err(HsacoError::Format("metadata nested over 32 deep".into()));
        }
        let t = self.take(1)?[0];
        Ok(match t {
            0x00..=0x7f => Value::Int(t as i128),
            0x80..=0x8f => return self.map((t & 0x0f) as usize, depth),
            0x90..=0x9f => return self.array((t & 0x0f) as usize, depth),
            0xa0..=0xbf => return self.str((t & 0x1f) as usize),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.uint(1 << (t - 0xc4))? as usize;
                self.take(n)?;
                Value::Bin
            }
            0xca => Value::Float(f32::from_bits(self.uint(4)? as u32) as f64),
            0xcb => Value::Float(f64::from_bits(self.uint(8)?)),
            0xcc..=0xcf => Value::Int(self.uint(1 << (t - 0xcc))? as i128),
            0xd0..=0xd3 => Value::Int(self.sint(1 << (t - 0xd0))?),
            0xd9..=0xdb => {
                let n = self.uint(1 << (t - 0xd9))? as usize;
                return self.str(n);
            }
            0xdc | 0xdd => {
                let n = self.uint(if t == 0xdc { 2 } else { 4 })? as usize;
                return self.array(n, depth);
            }
            0xde | 0xdf => {
                let n = self.uint(if t == 0xde { 2 } else { 4 })? as usize;
                return self.map(n, depth);
            }
            0xe0..=0xff => Value::Int((t as i8) as i128),
            _ => return Err(HsacoError::Format(format!("metadata: msgpack type 0x{t:02x} is not used by code object metadata"))),
        })
    }
}

/// Reads the code object m3c made for `chip` and checks what the runtime
/// relies on: the chip, code object v5, one descriptor per kernel, waves of
/// 64, no spills or dynamic stack, nothing left undefined. (Scratch is
/// allowed: a private array, such as attention's accumulator, lives there,
/// as in CUDA's local memory.)
pub fn check(bytes: &[u8], chip: &str) -> Result<Vec<KernelMeta>, HsacoError> {
    let co = read(bytes)?;
    if co.chip != chip {
        return Err(HsacoError::Chip { found: co.chip, want: chip.into() });
    }
    if co.version != 5 {
        return Err(HsacoError::Version { found: co.version });
    }
    if !co.undefined.is_empty() {
        return Err(HsacoError::Undefined(co.undefined.join(", ")));
    }
    if co.kernels.is_empty() {
        return Err(HsacoError::Format("no kernels".into()));
    }
    for k in &co.kernels {
        let bad = |what: String| Err(HsacoError::Kernel { kernel: k.name.clone(), what });
        if !co.descriptors.contains(&format!("{}.kd", k.name)) {
            return bad("no kernel descriptor".into());
        }
        if k.wavefront != 64 {
            return bad(format!("waves of {}, expected 64", k.wavefront));
        }
        if k.sgpr_spills + k.vgpr_spills > 0 || k.dynamic_stack {
            return bad(format!("{} SGPR and {} VGPR spills, dynamic stack {}", k.sgpr_spills, k.vgpr_spills, k.dynamic_stack));
        }
    }
    if co.descriptors.len() != co.kernels.len() {
        return Err(HsacoError::Format(format!("{} kernel descriptors for {} kernels", co.descriptors.len(), co.kernels.len())));
    }
    Ok(co.kernels)
}

pub fn header() -> String {
    format!(
        "{:<6} {:<72} {:>5} {:>5} {:>5} {:>7} {:>9} {:>7} {:>7}\n",
        "stage", "kernel", "vgpr", "agpr", "sgpr", "lds B", "scratch B", "spills", "max wg"
    )
}

/// The report lines of one stage's kernels.
pub fn report(stage: usize, kernels: &[KernelMeta]) -> String {
    let mut s = String::new();
    let mut sorted: Vec<&KernelMeta> = kernels.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    for k in sorted {
        let _ = writeln!(
            s,
            "{stage:<6} {:<72} {:>5} {:>5} {:>5} {:>7} {:>9} {:>7} {:>7}",
            k.name,
            k.vgprs,
            k.agprs,
            k.sgprs,
            k.lds,
            k.scratch,
            k.sgpr_spills + k.vgpr_spills,
            k.max_workgroup
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msgpack_reads_what_code_object_metadata_holds_and_refuses_damage() {
        // {"amdhsa.kernels": [{".name": "k", ".wavefront_size": 64, ".vgpr_count": 300, ".x": -2, ".b": true}]}
        let mut m = vec![0x81, 0xae];
        m.extend(b"amdhsa.kernels");
        m.extend([0x91, 0x85, 0xa5]);
        m.extend(b".name");
        m.extend([0xa1, b'k', 0xaf]);
        m.extend(b".wavefront_size");
        m.extend([0x40, 0xab]);
        m.extend(b".vgpr_count");
        m.extend([0xcd, 0x01, 0x2c, 0xa2]);
        m.extend(b".x");
        m.extend([0xfe, 0xa2]);
        m.extend(b".b");
        m.push(0xc3);
        let v = Msgpack { b: &m, at: 0 }.value(0).unwrap();
        let ks = kernels_of(&v).unwrap();
        assert_eq!((ks[0].name.as_str(), ks[0].wavefront, ks[0].vgprs), ("k", 64, 300));
        for n in 0..m.len() {
            assert!(Msgpack { b: &m[..n], at: 0 }.value(0).is_err(), "truncated to {n}");
        }
        // A huge count is an error, not an allocation.
        assert!(Msgpack { b: &[0xdd, 0xff, 0xff, 0xff, 0xff], at: 0 }.value(0).is_err());
        let deep = vec![0x91; 100];
        assert!(Msgpack { b: &deep, at: 0 }.value(0).is_err());
    }

    #[test]
    fn damaged_code_objects_are_errors_never_panics() {
        assert!(read(b"").is_err());
        assert!(read(&[0x7f, b'E', b'L', b'F']).is_err());
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        assert!(matches!(read(&elf), Err(HsacoError::Format(_))));
        elf[0x12] = 224;
        elf[7] = 64;
        elf[0x28] = 0xff; // section headers past the end
        elf[0x3a] = 64;
        elf[0x3c] = 3;
        assert!(matches!(read(&elf), Err(HsacoError::Format(_))));
    }
}
