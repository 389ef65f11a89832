//! A thin reader over `serde_json::Value` that remembers the key path, so that
//! every error names the file, the full key (`text_config.head_dim`) and what
//! was expected.

use super::ConfigError;
use serde_json::{Map, Value};
use std::path::Path;

/// A JSON object together with its dotted path inside the config file.
#[derive(Clone)]
pub struct Obj<'a> {
    pub file: &'a Path,
    pub path: String,
    pub map: &'a Map<String, Value>,
}

impl<'a> Obj<'a> {
    pub fn root(file: &'a Path, value: &'a Value) -> Result<Self, ConfigError> {
        match value.as_object() {
            Some(map) => Ok(Obj { file, path: String::new(), map }),
            None => Err(ConfigError::Invalid {
                file: file.to_path_buf(),
                key: "<root>".into(),
                expected: "a JSON object".into(),
                found: short(value),
            }),
        }
    }

    pub fn key(&self, k: &str) -> String {
        if self.path.is_empty() {
            k.to_string()
        } else {
            format!("{}.{}", self.path, k)
        }
    }

    pub fn has(&self, k: &str) -> bool {
        self.map.get(k).is_some_and(|v| !v.is_null())
    }

    pub fn invalid(&self, k: &str, expected: impl Into<String>, found: &Value) -> ConfigError {
        ConfigError::Invalid { file: self.file.to_path_buf(), key: self.key(k), expected: expected.into(), found: short(found) }
    }

    pub fn missing(&self, k: &str, expected: impl Into<String>) -> ConfigError {
        ConfigError::Missing { file: self.file.to_path_buf(), key: self.key(k), expected: expected.into() }
    }

    fn get(&self, k: &str, expected: &str) -> Result<&'a Value, ConfigError> {
        match self.map.get(k) {
            Some(v) if !v.is_null() => Ok(v),
            _ => Err(self.missing(k, expected)),
        }
    }

    /// `read(self, k)` when the key is present, else `None`.
    fn optional<T>(&self, k: &str, read: impl Fn(&Self, &str) -> Result<T, ConfigError>) -> Result<Option<T>, ConfigError> {
        if self.has(k) {
            read(self, k).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn obj(&self, k: &str) -> Result<Obj<'a>, ConfigError> {
        let v = self.get(k, "an object")?;
        match v.as_object() {
            Some(map) => Ok(Obj { file: self.file, path: self.key(k), map }),
            None => Err(self.invalid(k, "an object", v)),
        }
    }

    pub fn opt_obj(&self, k: &str) -> Result<Option<Obj<'a>>, ConfigError> {
        self.optional(k, Self::obj)
    }

    /// A positive integer that fits `usize`.
    pub fn positive(&self, k: &str) -> Result<usize, ConfigError> {
        let v = self.get(k, "a positive integer")?;
        match v.as_u64() {
            Some(n) if n > 0 => usize::try_from(n).map_err(|_| self.invalid(k, "a positive integer", v)),
            _ => Err(self.invalid(k, "a positive integer", v)),
        }
    }

    pub fn uint(&self, k: &str) -> Result<usize, ConfigError> {
        let v = self.get(k, "a non-negative integer")?;
        v.as_u64().and_then(|n| usize::try_from(n).ok()).ok_or_else(|| self.invalid(k, "a non-negative integer", v))
    }

    pub fn opt_uint(&self, k: &str) -> Result<Option<usize>, ConfigError> {
        self.optional(k, Self::uint)
    }

    pub fn float(&self, k: &str) -> Result<f64, ConfigError> {
        let v = self.get(k, "a number")?;
        v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| self.invalid(k, "a finite number", v))
    }

    pub fn opt_float(&self, k: &str) -> Result<Option<f64>, ConfigError> {
        self.optional(k, Self::float)
    }

    pub fn boolean(&self, k: &str) -> Result<bool, ConfigError> {
        let v = self.get(k, "true or false")?;
        v.as_bool().ok_or_else(|| self.invalid(k, "true or false", v))
    }

    pub fn opt_bool(&self, k: &str) -> Result<Option<bool>, ConfigError> {
        self.optional(k, Self::boolean)
    }

    pub fn string(&self, k: &str) -> Result<&'a str, ConfigError> {
        let v = self.get(k, "a string")?;
        v.as_str().ok_or_else(|| self.invalid(k, "a string", v))
    }

    pub fn opt_string(&self, k: &str) -> Result<Option<&'a str>, ConfigError> {
        self.optional(k, Self::string)
    }

    /// A string that must be one of `allowed`.
    pub fn one_of(&self, k: &str, allowed: &[&str]) -> Result<&'a str, ConfigError> {
        let s = self.string(k)?;
        if allowed.contains(&s) {
            Ok(s)
        } else {
            Err(self.invalid(k, format!("one of {}", quoted(allowed)), &self.map[k]))
        }
    }

    /// A list of 0/1 flags with exactly `len` entries (one per layer).
    pub fn flags(&self, k: &str, len: usize) -> Result<Vec<bool>, ConfigError> {
        let expected = format!("a list of {len} entries, each 0 or 1 (one per layer)");
        let v = self.get(k, &expected)?;
        let list = v.as_array().ok_or_else(|| self.invalid(k, &expected, v))?;
        if list.len() != len {
            return Err(ConfigError::Invalid {
                file: self.file.to_path_buf(),
                key: self.key(k),
                expected,
                found: format!("{} entries", list.len()),
            });
        }
        list.iter()
            .enumerate()
            .map(|(i, e)| match e.as_u64() {
                Some(0) => Ok(false),
                Some(1) => Ok(true),
                _ => Err(ConfigError::Invalid {
                    file: self.file.to_path_buf(),
                    key: format!("{}[{i}]", self.key(k)),
                    expected: "0 or 1".into(),
                    found: short(e),
                }),
            })
            .collect()
    }

    pub fn string_list(&self, k: &str) -> Result<Vec<String>, ConfigError> {
        let v = self.get(k, "a list of strings")?;
        let list = v.as_array().ok_or_else(|| self.invalid(k, "a list of strings", v))?;
        list.iter().map(|e| e.as_str().map(str::to_string).ok_or_else(|| self.invalid(k, "a list of strings", v))).collect()
    }
}

pub(crate) fn quoted(items: &[&str]) -> String {
    items.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ")
}

/// A short rendering of a JSON value for error messages.
pub(crate) fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        format!("{}…", &s[..s.char_indices().take_while(|(i, _)| *i < 57).last().map_or(0, |(i, c)| i + c.len_utf8())])
    } else {
        s
    }
}
