//! Reading files a user names (plans, configs, prompts files, indexes):
//! regular files only, with a size limit checked before reading, so
//! `/dev/zero` or a folder is an error instead of an endless read; a UTF-8
//! byte-order mark (which Windows editors add) is dropped.

use std::io::Read;
use std::path::{Path, PathBuf};

/// Size limits of the text inputs m3c reads.
pub mod limits {
    /// config.json: the real one is 12 KB.
    pub const CONFIG: u64 = 4 << 20;
    /// A partition plan.
    pub const PLAN: u64 = 1 << 20;
    /// A prompts file.
    pub const PROMPTS: u64 = 256 << 20;
    /// model.safetensors.index.json: the real one is about 4 MB.
    pub const INDEX: u64 = 64 << 20;
    /// tokenizer.json and friends.
    pub const TOKENIZER: u64 = 64 << 20;
}

#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{what} {}: no such file", file.display())]
    Missing { what: String, file: PathBuf },
    #[error("{what} {}: {kind}, not a regular file", file.display())]
    NotAFile { what: String, file: PathBuf, kind: &'static str },
    #[error("{what} {}: {size} bytes, more than the {limit} bytes m3c reads from such a file", file.display())]
    TooLarge { what: String, file: PathBuf, size: u64, limit: u64 },
    #[error("{what} {}: not UTF-8 text (byte {offset})", file.display())]
    NotUtf8 { what: String, file: PathBuf, offset: usize },
    #[error("{what} {}: {err}", file.display())]
    Io { what: String, file: PathBuf, err: std::io::Error },
}

/// What a path is, in words, when it is not a regular file.
pub fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a folder"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Checks that `file` (symlinks followed) is a regular file and returns its size.
pub fn regular_file(file: &Path, what: &str) -> Result<u64, InputError> {
    match std::fs::metadata(file) {
        Ok(m) if m.is_file() => Ok(m.len()),
        Ok(m) => Err(InputError::NotAFile { what: what.into(), file: file.into(), kind: kind_of(&m) }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::fs::symlink_metadata(file).is_ok() {
                Err(InputError::NotAFile { what: what.into(), file: file.into(), kind: "a dangling symbolic link" })
            } else {
                Err(InputError::Missing { what: what.into(), file: file.into() })
            }
        }
        Err(err) => Err(InputError::Io { what: what.into(), file: file.into(), err }),
    }
}

/// Reads at most `limit` bytes of a regular file (checked before reading,
/// and again while reading, in case it grows).
pub fn read_bytes(file: &Path, what: &str, limit: u64) -> Result<Vec<u8>, InputError> {
    let size = regular_file(file, what)?;
    let too_large = |size| InputError::TooLarge { what: what.into(), file: file.into(), size, limit };
    if size > limit {
        return Err(too_large(size));
    }
    let io = |err| InputError::Io { what: what.into(), file: file.into(), err };
    let f = std::fs::File::open(file).map_err(io)?;
    let mut bytes = Vec::with_capacity(size as usize);
    f.take(limit + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Drops a leading UTF-8 byte-order mark.
pub fn strip_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

/// A user's text file: a regular file of at most `limit` bytes, UTF-8, without its BOM.
pub fn read_user_file(file: &Path, what: &str, limit: u64) -> Result<String, InputError> {
    let bytes = read_bytes(file, what, limit)?;
    match String::from_utf8(bytes) {
        Ok(s) => Ok(match s.strip_prefix('\u{feff}') {
            Some(rest) => rest.to_string(),
            None => s,
        }),
        Err(e) => Err(InputError::NotUtf8 { what: what.into(), file: file.into(), offset: e.utf8_error().valid_up_to() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_folders_and_large_files_are_refused() {
        let e = read_user_file(Path::new("/dev/zero"), "--prompts", 100).unwrap_err();
        assert!(e.to_string().contains("character device"), "{e}");
        let e = read_user_file(Path::new("/"), "plan", 100).unwrap_err();
        assert!(e.to_string().contains("a folder"), "{e}");
        let dir = std::env::temp_dir().join(format!("m3c-input-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("big");
        std::fs::write(&f, vec![b'a'; 101]).unwrap();
        let e = read_user_file(&f, "plan", 100).unwrap_err();
        assert!(matches!(e, InputError::TooLarge { size: 101, .. }), "{e}");
        std::fs::write(&f, "\u{feff}stages: []").unwrap();
        assert_eq!(read_user_file(&f, "plan", 100).unwrap(), "stages: []");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
