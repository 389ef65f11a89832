//! Images a chat request brings (`image_url` content parts): `data:` URIs
//! (base64), `http(s)` URLs fetched with a size limit and a deadline, and
//! `file://` paths inside `--allowed-local-media-path` only. Every failure
//! is a 400 that names the content part and what went wrong.

use super::openai::ApiError;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where images may come from, and how much of them.
#[derive(Debug, Clone)]
pub struct MediaPolicy {
    /// `file://` URLs must resolve inside this folder (canonical); none: refused.
    pub allowed_local: Option<PathBuf>,
    /// The largest image, in bytes, from any source.
    pub max_bytes: u64,
    /// The deadline of a whole fetch (connect, headers and body).
    pub timeout: Duration,
    /// Images one request may carry.
    pub max_images: usize,
}

impl MediaPolicy {
    /// The policy with its local folder made canonical; an error if that
    /// is not a folder (named by the flag that gave it).
    pub fn checked(self) -> anyhow::Result<MediaPolicy> {
        let allowed_local = match self.allowed_local {
            None => None,
            Some(d) => Some(
                d.canonicalize()
                    .ok()
                    .filter(|p| p.is_dir())
                    .ok_or_else(|| anyhow::anyhow!("--allowed-local-media-path {}: not a folder", d.display()))?,
            ),
        };
        Ok(MediaPolicy { allowed_local, ..self })
    }
}

impl Default for MediaPolicy {
    fn default() -> Self {
        MediaPolicy { allowed_local: None, max_bytes: 20 << 20, timeout: Duration::from_secs(10), max_images: 8 }
    }
}

/// The bytes of the image at `url` (field `at` for errors).
pub async fn fetch(url: &str, policy: &MediaPolicy, at: &str) -> Result<Vec<u8>, ApiError> {
    let bad = |m: String| ApiError::bad(at, format!("{at}: {m}"));
    if let Some(rest) = url.strip_prefix("data:") {
        return data_uri(rest, policy.max_bytes).map_err(bad);
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        return http(url, policy).await.map_err(bad);
    }
    if let Some(path) = url.strip_prefix("file://") {
        let path = percent_decoded(path).ok_or_else(|| bad("a file:// URL with a bad %-escape or not UTF-8".into()))?;
        let policy = policy.clone();
        return tokio::task::spawn_blocking(move || local(Path::new(&path), &policy))
            .await
            .map_err(|e| bad(format!("reading the file: {e}")))?
            .map_err(bad);
    }
    let shown: String = url.chars().take(40).collect();
    Err(bad(format!("`{shown}` is not a data:, http(s):// or file:// URL")))
}

/// `[<mediatype>][;base64],<data>`: base64 only (images are binary).
fn data_uri(rest: &str, max: u64) -> Result<Vec<u8>, String> {
    use base64::Engine as _;
    let (meta, data) = rest.split_once(',').ok_or("a data: URI without a comma")?;
    if !meta.ends_with(";base64") {
        return Err("a data: URI must be base64 (`data:image/png;base64,...`)".into());
    }
    // 4 base64 characters carry 3 bytes: refuse before decoding.
    if data.len() as u64 / 4 * 3 > max {
        return Err(format!("the image is larger than the server's limit of {max} bytes"));
    }
    base64::engine::general_purpose::STANDARD.decode(data.trim()).map_err(|e| format!("the data: URI is not valid base64: {e}"))
}

/// An http(s) image: the whole fetch within the deadline, the body within the size limit.
async fn http(url: &str, policy: &MediaPolicy) -> Result<Vec<u8>, String> {
    let client = reqwest::Client::builder()
        .timeout(policy.timeout)
        .connect_timeout(policy.timeout)
        .redirect(reqwest::redirect::Policy::limited(5))
        .build()
        .map_err(|e| format!("no HTTP client: {e}"))?;
    let secs = policy.timeout.as_secs_f64();
    let describe = |e: reqwest::Error| {
        if e.is_timeout() {
            format!("fetching {url}: no complete answer within {secs} s")
        } else {
            format!("fetching {url}: {e}")
        }
    };
    let mut resp = client.get(url).send().await.map_err(describe)?;
    if !resp.status().is_success() {
        return Err(format!("fetching {url}: the server answered {}", resp.status()));
    }
    if resp.content_length().is_some_and(|n| n > policy.max_bytes) {
        return Err(format!("fetching {url}: the image is larger than the server's limit of {} bytes", policy.max_bytes));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(describe)? {
        if body.len() as u64 + chunk.len() as u64 > policy.max_bytes {
            return Err(format!("fetching {url}: the image is larger than the server's limit of {} bytes", policy.max_bytes));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// `%XX` escapes of a URL path decoded (`a%20b.png` → `a b.png`).
fn percent_decoded(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A local file, only inside the allowed folder (after resolving links).
fn local(path: &Path, policy: &MediaPolicy) -> Result<Vec<u8>, String> {
    let Some(root) = &policy.allowed_local else {
        return Err("file:// URLs are refused: the server was started without --allowed-local-media-path".into());
    };
    // The same answer for a missing file and one outside the folder, so
    // requests cannot probe what exists elsewhere.
    let outside = || format!("{} is outside the allowed media folder {} (or does not exist)", path.display(), root.display());
    let real = path.canonicalize().map_err(|_| outside())?;
    if !real.starts_with(root) {
        return Err(outside());
    }
    m3c_contract::input::read_bytes(&real, "image", policy.max_bytes).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_uris() {
        assert_eq!(data_uri("image/png;base64,aGVsbG8=", 100).unwrap(), b"hello");
        assert!(data_uri("image/png,hello", 100).unwrap_err().contains("base64"));
        assert!(data_uri("image/png;base64,aGVsbG8=", 2).unwrap_err().contains("limit"));
        assert!(data_uri("image/png;base64,@@@@", 100).unwrap_err().contains("not valid base64"));
    }

    #[test]
    fn file_urls_are_percent_decoded() {
        assert_eq!(percent_decoded("/a%20b.png").as_deref(), Some("/a b.png"));
        assert_eq!(percent_decoded("/x%2"), None);
        assert_eq!(percent_decoded("/x%zz"), None);
    }
}
