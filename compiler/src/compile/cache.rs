//! The object cache: each compiled unit (a kernel, an entry, a GPU stage)
//! stored under the SHA-256 of everything its code depends on, so a kernel
//! that many stages, splits and compiles share is compiled once per machine.
//!
//! The key covers the unit's name and MLIR text, the target, the CPU, the
//! back end's tools by content ([`crate::backend::Backend::toolchain`]) and
//! m3c itself: its executable's GNU build id (a hash the linker computes over
//! the executable, LLVM and MLIR included, as they are linked in), or the
//! SHA-256 of the whole executable where it has none. A new m3c build
//! therefore never reads an older build's objects.
//!
//! Entries are written to a temporary name and renamed, so concurrent
//! compiles never see half an entry, and each ends with the SHA-256 of its
//! bytes: a damaged entry is a miss (and is rewritten), never wrong code.
//! A compile that stored entries keeps the cache under its cap
//! (`$M3C_CACHE_MAX_GB`, 5 GB by default) by removing the least recently
//! used ones; a hit counts as a use.

use crate::backend::{Unit, UnitCode};
use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Where the cache lives unless `--cache-dir` says otherwise.
pub const CACHE_DIR_ENV: &str = "M3C_CACHE_DIR";

/// The cache's size cap in GB (default [`DEFAULT_MAX_GB`]): a compile that
/// stored entries removes the least recently used ones beyond it.
pub const CACHE_MAX_ENV: &str = "M3C_CACHE_MAX_GB";
pub const DEFAULT_MAX_GB: f64 = 5.0;

/// The cap in bytes: `$M3C_CACHE_MAX_GB`, else [`DEFAULT_MAX_GB`].
pub fn max_bytes() -> Result<u64> {
    let gb = match std::env::var(CACHE_MAX_ENV) {
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|g| g.is_finite() && *g >= 0.0)
            .with_context(|| format!("{CACHE_MAX_ENV}={v}: expected a size in GB, such as 5 or 0.5"))?,
        Err(_) => DEFAULT_MAX_GB,
    };
    Ok((gb * 1e9) as u64)
}

const MAGIC: &[u8] = b"m3c-unit-cache/1\n";

/// The default cache folder: `$M3C_CACHE_DIR`, else `$XDG_CACHE_HOME/m3c`,
/// else `~/.cache/m3c`.
pub fn default_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var(CACHE_DIR_ENV).or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("m3c"))).or_else(|| var("HOME").map(|h| h.join(".cache/m3c")))
}

pub struct ObjectCache {
    dir: PathBuf,
    /// The key's prefix: m3c, the target, the CPU and the tools.
    salt: Vec<u8>,
    /// The size cap in bytes ([`max_bytes`]).
    max: u64,
}

impl ObjectCache {
    /// The cache at `dir` (created if missing) for units compiled for
    /// `target` and `cpu` with the back end's `toolchain`.
    pub fn open(dir: &Path, target: &str, cpu: &str, toolchain: &str) -> Result<ObjectCache> {
        let objects = dir.join("objects");
        std::fs::create_dir_all(&objects).with_context(|| format!("cannot create the object cache {}", objects.display()))?;
        let mut salt = Vec::new();
        for part in [std::str::from_utf8(MAGIC).unwrap_or_default(), compiler_identity()?, target, cpu, toolchain] {
            push_field(&mut salt, part.as_bytes());
        }
        Ok(ObjectCache { dir: objects, salt, max: max_bytes()? })
    }

    /// The key of `unit`: a hex SHA-256.
    pub fn key(&self, unit: &Unit) -> String {
        let mut h = Sha256::new();
        h.update(&self.salt);
        h.update(unit_hash(unit).as_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(&key[..2]).join(key)
    }

    /// The stored code for `key` (without `emitted`, which is not kept), or
    /// `None` when there is none or it is damaged.
    pub fn get(&self, key: &str) -> Option<UnitCode> {
        let path = self.path(key);
        let code = decode(&std::fs::read(&path).ok()?)?;
        // A hit is a use: the size cap removes the least recently used.
        if let Ok(f) = std::fs::File::options().write(true).open(&path) {
            let _ = f.set_modified(std::time::SystemTime::now());
        }
        Some(code)
    }

    /// [`ObjectCache::prune`] to the cap `$M3C_CACHE_MAX_GB` sets.
    pub fn prune_to_cap(&self) -> usize {
        self.prune(self.max)
    }

    /// Removes the least recently used entries while the cache holds more
    /// than `max` bytes, down to 80% of it (so that the next compiles do not
    /// each remove a few). Returns how many it removed. Entries another
    /// compile removes or writes meanwhile are skipped: a removed entry is
    /// a miss, never wrong code.
    pub fn prune(&self, max: u64) -> usize {
        let mut entries: Vec<(std::time::SystemTime, u64, PathBuf)> = Vec::new();
        for sub in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            for e in std::fs::read_dir(sub.path()).into_iter().flatten().flatten() {
                let name = e.file_name();
                if name.to_string_lossy().starts_with(".tmp-") {
                    continue;
                }
                if let Some(m) = e.metadata().ok().filter(|m| m.is_file()) {
                    entries.push((m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len(), e.path()));
                }
            }
        }
        let mut total: u64 = entries.iter().map(|e| e.1).sum();
        if total <= max {
            return 0;
        }
        entries.sort();
        let mut removed = 0;
        for (_, len, path) in entries {
            if total <= max / 10 * 8 {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                total = total.saturating_sub(len);
                removed += 1;
            }
        }
        removed
    }

    /// Stores `code` under `key` (its `emitted` texts are left out).
    pub fn put(&self, key: &str, code: &UnitCode) -> Result<()> {
        let path = self.path(key);
        let dir = path.parent().context("an entry has a folder")?;
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(".tmp-{}-{n}", std::process::id()));
        let write = std::fs::write(&tmp, encode(code)).and_then(|()| std::fs::rename(&tmp, &path));
        if write.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        write.with_context(|| format!("cannot write {}", path.display()))
    }
}

/// A unit's identity: the SHA-256 of its name, stage and text, as hex.
/// Units equal in all three are compiled once in a compile; the cache key
/// adds what else their code depends on.
pub fn unit_hash(u: &Unit) -> String {
    let mut h = Sha256::new();
    let stage = u.stage.map_or(String::new(), |k| k.to_string());
    for part in [u.name.as_bytes(), stage.as_bytes(), u.mlir.as_bytes()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn push_field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// An entry: the magic, the fields as (length, bytes), then the SHA-256 of
/// everything before it.
fn encode(code: &UnitCode) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    push_field(&mut out, &code.object);
    match &code.device_code {
        Some(d) => {
            out.push(1);
            push_field(&mut out, d.as_bytes());
        }
        None => out.push(0),
    }
    push_field(&mut out, code.report.as_bytes());
    out.extend_from_slice(&(code.device_files.len() as u64).to_le_bytes());
    for (suffix, bytes) in &code.device_files {
        push_field(&mut out, suffix.as_bytes());
        push_field(&mut out, bytes);
    }
    let sum = Sha256::digest(&out);
    out.extend_from_slice(&sum);
    out
}

/// Reads fields off an entry; every read is bounds-checked.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = usize::try_from(self.u64()?).ok()?;
        self.take(n)
    }
    fn text(&mut self) -> Option<String> {
        String::from_utf8(self.bytes()?.to_vec()).ok()
    }
}

fn decode(entry: &[u8]) -> Option<UnitCode> {
    let body = entry.len().checked_sub(32).map(|n| &entry[..n])?;
    if Sha256::digest(body).as_slice() != &entry[body.len()..] {
        return None;
    }
    let mut f = Fields(body);
    if f.take(MAGIC.len())? != MAGIC {
        return None;
    }
    let object = f.bytes()?.to_vec();
    let device_code = match f.take(1)? {
        [0] => None,
        [1] => Some(f.text()?),
        _ => return None,
    };
    let report = f.text()?;
    let files = f.u64()?;
    let mut device_files = Vec::new();
    for _ in 0..files {
        device_files.push((f.text()?, f.bytes()?.to_vec()));
    }
    if !f.0.is_empty() {
        return None;
    }
    Some(UnitCode { object, emitted: Vec::new(), device_files, device_code, report })
}

/// m3c itself as the cache sees it: `build-id HEX` of the running
/// executable, or `sha256 HEX` of its bytes where it has no build id.
fn compiler_identity() -> Result<&'static str> {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(id) = ID.get() {
        return Ok(id);
    }
    let exe = std::env::current_exe().context("cannot locate the m3c executable")?;
    let id = match build_id(&exe) {
        Some(id) => format!("build-id {id}"),
        None => {
            let bytes = std::fs::read(&exe).with_context(|| format!("cannot read {}", exe.display()))?;
            format!("sha256 {}", m3c_contract::manifest::sha256_hex(&bytes))
        }
    };
    Ok(ID.get_or_init(|| id))
}

/// The GNU build id (`NT_GNU_BUILD_ID` in a `PT_NOTE` segment) of a
/// little-endian ELF64 file, as hex.
fn build_id(path: &Path) -> Option<String> {
    let mut f = std::fs::File::open(path).ok()?;
    let mut header = [0u8; 64];
    f.read_exact(&mut header).ok()?;
    // ELF magic, 64-bit, little-endian.
    if header[..4] != *b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return None;
    }
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]) as u64;
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default()) as u64;
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
    let (phoff, phentsize, phnum) = (u64_at(&header, 32), u16_at(&header, 54), u16_at(&header, 56));
    if phentsize < 56 || phnum > 256 {
        return None;
    }
    let mut table = vec![0u8; (phentsize * phnum) as usize];
    f.seek(SeekFrom::Start(phoff)).ok()?;
    f.read_exact(&mut table).ok()?;
    for ph in table.chunks_exact(phentsize as usize) {
        const PT_NOTE: u64 = 4;
        let (offset, size) = (u64_at(ph, 8), u64_at(ph, 32));
        if u32_at(ph, 0) != PT_NOTE || size > 1 << 20 {
            continue;
        }
        let mut notes = vec![0u8; size as usize];
        f.seek(SeekFrom::Start(offset)).ok()?;
        f.read_exact(&mut notes).ok()?;
        let mut at = 0usize;
        while at + 12 <= notes.len() {
            let (namesz, descsz, kind) = (u32_at(&notes, at) as usize, u32_at(&notes, at + 4) as usize, u32_at(&notes, at + 8));
            let name_at = at + 12;
            let desc_at = name_at + namesz.div_ceil(4) * 4;
            let end = desc_at + descsz.div_ceil(4) * 4;
            if end > notes.len() {
                break;
            }
            const NT_GNU_BUILD_ID: u64 = 3;
            if kind == NT_GNU_BUILD_ID && &notes[name_at..name_at + namesz] == b"GNU\0" && descsz > 0 {
                return Some(notes[desc_at..desc_at + descsz].iter().map(|b| format!("{b:02x}")).collect());
            }
            at = end;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code() -> UnitCode {
        UnitCode {
            object: b"\x7fELF object bytes".to_vec(),
            emitted: Vec::new(),
            device_files: vec![(".ptx".into(), b"ptx".to_vec()), (".cubin".into(), vec![0, 1, 2])],
            device_code: Some("cubin sm_90a".into()),
            report: "0 k 1 2 3 4 5\n".into(),
        }
    }

    #[test]
    fn entries_round_trip_and_any_damage_is_a_miss() {
        let bytes = encode(&code());
        assert_eq!(decode(&bytes), Some(code()));
        let plain = UnitCode { object: vec![7; 100], ..UnitCode::default() };
        assert_eq!(decode(&encode(&plain)), Some(plain));
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert_eq!(decode(&bad), None, "byte {i} flipped");
        }
        for n in 0..bytes.len() {
            assert_eq!(decode(&bytes[..n]), None, "cut at {n}");
        }
    }

    #[test]
    fn this_test_binary_has_a_build_id() {
        let exe = std::env::current_exe().unwrap();
        let id = build_id(&exe).expect("rustc links with --build-id on this toolchain");
        assert!(id.len() >= 16 && id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        assert_eq!(build_id(Path::new("/dev/null")), None);
    }

    #[test]
    fn the_cap_removes_the_least_recently_used_entries() {
        let dir = tempfile::tempdir().unwrap();
        let c = ObjectCache::open(dir.path(), "host", "x86-64-v3", "").unwrap();
        let t0 = std::time::SystemTime::now() - std::time::Duration::from_secs(1000);
        let mut keys = Vec::new();
        for i in 0..10u64 {
            let u = Unit { name: format!("k{i}"), stage: None, mlir: String::new() };
            let k = c.key(&u);
            c.put(&k, &UnitCode { object: vec![0; 1000], ..UnitCode::default() }).unwrap();
            let f = std::fs::File::options().write(true).open(c.path(&k)).unwrap();
            f.set_modified(t0 + std::time::Duration::from_secs(i)).unwrap();
            keys.push(k);
        }
        let size = std::fs::metadata(c.path(&keys[0])).unwrap().len();
        assert_eq!(c.prune(10 * size), 0, "at the cap nothing goes");
        // A hit makes the oldest the newest.
        assert!(c.get(&keys[0]).is_some());
        // Over a cap of 5 entries: down to 80% of it, 4, the least recently used first.
        assert_eq!(c.prune(5 * size), 6);
        let kept: Vec<usize> = (0..10).filter(|&i| c.path(&keys[i]).exists()).collect();
        assert_eq!(kept, vec![0, 7, 8, 9]);
    }

    #[test]
    fn the_key_covers_name_stage_text_and_salt() {
        let dir = tempfile::tempdir().unwrap();
        let c = ObjectCache::open(dir.path(), "host", "x86-64-v3", "").unwrap();
        let u = Unit { name: "k".into(), stage: None, mlir: "module {}".into() };
        let k = c.key(&u);
        assert_ne!(k, c.key(&Unit { name: "j".into(), ..u.clone() }));
        assert_ne!(k, c.key(&Unit { stage: Some(0), ..u.clone() }));
        assert_ne!(k, c.key(&Unit { mlir: "module { }".into(), ..u.clone() }));
        for other in [
            ObjectCache::open(dir.path(), "cuda sm_90a", "x86-64-v3", "").unwrap(),
            ObjectCache::open(dir.path(), "host", "x86-64", "").unwrap(),
            ObjectCache::open(dir.path(), "host", "x86-64-v3", "ptxas 00").unwrap(),
        ] {
            assert_ne!(k, other.key(&u));
        }
        assert_eq!(c.get(&k), None);
        c.put(&k, &code()).unwrap();
        assert_eq!(c.get(&k), Some(code()));
    }
}
