//! Images a chat request brings (`image_url` content parts): `data:` URIs
//! (base64), `http(s)` URLs fetched with a size limit and a deadline, and
//! `file://` paths inside `--allowed-local-media-path` only. Every failure
//! is a 400 that names the content part and what went wrong.
//!
//! A URL a client names is fetched by the server, from inside its network:
//! without a rule, `http://169.254.169.254/` reads a cloud VM's metadata
//! and `http://127.0.0.1:PORT/` any service of the machine (server-side
//! request forgery). So, by default, every hop of a fetch (the URL, then
//! each redirect, at most [`MAX_REDIRECTS`]) must go to a public address:
//! its host is resolved here, every address it resolves to is checked
//! ([`refused_kind`]), and the connection goes to the checked address only
//! (the name is pinned to it, no proxy), so a name that resolves once to a
//! public and then to a private address (DNS rebinding) gains nothing.
//! `--allowed-media-domains` (vLLM's flag) also limits hosts to a list,
//! and `--allow-private-media-urls` lifts the address rule for media served
//! from the operator's own network.

use super::openai::ApiError;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Redirects one fetch may follow.
pub const MAX_REDIRECTS: usize = 5;

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
    /// The largest video, in bytes, from any source.
    pub max_video_bytes: u64,
    /// Videos one request may carry.
    pub max_videos: usize,
    /// `--allowed-media-domains`: when set, the only hosts fetched from
    /// (lower case, as URLs spell them).
    pub allowed_domains: Option<Vec<String>>,
    /// `--allow-private-media-urls`: loopback, private and link-local
    /// addresses may be fetched.
    pub allow_private: bool,
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
        // Each host as a URL spells it (lower case, punycode), without a
        // trailing dot: the form fetched hosts are compared in.
        let allowed_domains = match self.allowed_domains {
            None => None,
            Some(d) => Some(
                d.iter()
                    .map(|h| {
                        reqwest::Url::parse(&format!("http://{}/", h.trim()))
                            .ok()
                            .and_then(|u| u.host_str().map(|h| h.trim_end_matches('.').to_string()))
                            .filter(|h| !h.is_empty())
                            .ok_or_else(|| anyhow::anyhow!("--allowed-media-domains: `{h}` is not a host name"))
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?,
            ),
        };
        Ok(MediaPolicy { allowed_local, allowed_domains, ..self })
    }
}

impl Default for MediaPolicy {
    fn default() -> Self {
        MediaPolicy {
            allowed_local: None,
            max_bytes: 20 << 20,
            timeout: Duration::from_secs(10),
            max_images: 8,
            max_video_bytes: 256 << 20,
            max_videos: 2,
            allowed_domains: None,
            allow_private: false,
        }
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

/// An http(s) image: the whole fetch (name lookups, every hop) within the
/// deadline, the body within the size limit, every hop checked by
/// [`target`] before it connects.
async fn http(url: &str, policy: &MediaPolicy) -> Result<Vec<u8>, String> {
    let secs = policy.timeout.as_secs_f64();
    match tokio::time::timeout(policy.timeout, follow(url, policy)).await {
        Ok(r) => r,
        Err(_) => Err(format!("fetching {url}: no complete answer within {secs} s")),
    }
}

async fn follow(first: &str, policy: &MediaPolicy) -> Result<Vec<u8>, String> {
    let mut url = reqwest::Url::parse(first).map_err(|e| format!("`{first}` is not a valid URL: {e}"))?;
    for hop in 0..=MAX_REDIRECTS {
        // Which hop, in every message about it.
        let what = if hop == 0 { format!("`{url}`") } else { format!("redirect {hop} of `{first}`, to `{url}`,") };
        let pinned = target(&url, policy).await.map_err(|why| format!("{what} is refused: {why}"))?;
        let mut client = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).no_proxy();
        if let Some((name, addr)) = pinned {
            client = client.resolve(&name, addr);
        }
        let client = client.build().map_err(|e| format!("no HTTP client: {e}"))?;
        let mut resp = client.get(url.clone()).send().await.map_err(|e| format!("fetching {what}: {e}"))?;
        let status = resp.status();
        if status.is_redirection() {
            let to = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .ok_or_else(|| format!("fetching {what}: the server answered {status} without a Location"))?;
            url = url.join(to).map_err(|e| format!("fetching {what}: a redirect to `{to}`, which is not a URL: {e}"))?;
            continue;
        }
        if !status.is_success() {
            return Err(format!("fetching {what}: the server answered {status}"));
        }
        let too_big = || format!("fetching {what}: the image is larger than the server's limit of {} bytes", policy.max_bytes);
        if resp.content_length().is_some_and(|n| n > policy.max_bytes) {
            return Err(too_big());
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| format!("fetching {what}: {e}"))? {
            if body.len() as u64 + chunk.len() as u64 > policy.max_bytes {
                return Err(too_big());
            }
            body.extend_from_slice(&chunk);
        }
        return Ok(body);
    }
    Err(format!("fetching `{first}`: more than {MAX_REDIRECTS} redirects"))
}

/// Whether one hop may be fetched: an http(s) URL, its host among
/// `--allowed-media-domains` (when given), and every address it resolves
/// to public (unless `--allow-private-media-urls`). A host name comes back
/// with the checked address the connection must use.
async fn target(url: &reqwest::Url, policy: &MediaPolicy) -> Result<Option<(String, SocketAddr)>, String> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("only http and https are fetched, not {}", url.scheme()));
    }
    let shown = url.host_str().ok_or("the URL has no host")?.to_string();
    if let Some(allowed) = &policy.allowed_domains {
        if !allowed.iter().any(|d| d == shown.trim_end_matches('.')) {
            return Err(format!("its host `{shown}` is not among --allowed-media-domains ({})", allowed.join(", ")));
        }
    }
    let port = url.port_or_known_default().ok_or("the URL has no port")?;
    // An address literal (IPv6 in brackets) is its own address; a name is
    // looked up here.
    let (name, addrs) = match shown.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        Ok(ip) => (None, vec![SocketAddr::new(ip, port)]),
        Err(_) => {
            let found: Vec<SocketAddr> = tokio::net::lookup_host((shown.as_str(), port))
                .await
                .map_err(|e| format!("its host `{shown}` does not resolve: {e}"))?
                .collect();
            (Some(shown.clone()), found)
        }
    };
    let first = *addrs.first().ok_or_else(|| format!("its host `{shown}` resolves to no address"))?;
    if !policy.allow_private {
        // Every address counts: a name with one private address among
        // public ones could be steered to it.
        for a in &addrs {
            if let Some(kind) = refused_kind(a.ip()) {
                let subject = match &name {
                    Some(n) => format!("`{n}` resolves to {}, {kind}", a.ip()),
                    None => format!("{} is {kind}", a.ip()),
                };
                return Err(format!(
                    "{subject}; the server fetches media only from public addresses (start it with --allow-private-media-urls to allow this)"
                ));
            }
        }
    }
    Ok(name.map(|n| (n, first)))
}

/// Why the server will not fetch from `ip` by default (`None`: a public
/// address): loopback, private, shared, link-local, unspecified, multicast,
/// broadcast and reserved ranges, and IPv6's unique-local, site-local and
/// IPv4-carrying forms by the IPv4 address they carry.
pub fn refused_kind(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => refused_v6(v6),
    }
}

fn refused_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    Some(match () {
        _ if ip.is_loopback() => "a loopback address",
        _ if ip.is_private() => "a private address",
        _ if ip.is_link_local() => "a link-local address (cloud metadata services live here)",
        _ if ip.is_unspecified() || a == 0 => "an unspecified address",
        _ if ip.is_multicast() => "a multicast address",
        _ if ip.is_broadcast() => "the broadcast address",
        _ if a == 100 && (64..128).contains(&b) => "a shared (carrier-grade NAT) address",
        _ if a == 198 && (18..20).contains(&b) => "a benchmarking address (often used inside networks)",
        _ if a == 192 && b == 0 && ip.octets()[2] == 0 => "an IETF protocol address",
        _ if a >= 240 => "a reserved address",
        _ => return None,
    })
}

fn refused_v6(ip: Ipv6Addr) -> Option<&'static str> {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return refused_v4(v4);
    }
    let s = ip.segments();
    let low_v4 = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    // Forms that reach the IPv4 address they carry: NAT64 (64:ff9b::/96),
    // IPv4-translated (::ffff:0:a.b.c.d), and 6to4 (2002:a.b.c.d::/48).
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || s[..6] == [0, 0, 0, 0, 0xffff, 0] {
        return refused_v4(low_v4);
    }
    if s[0] == 0x2002 {
        return refused_v4(Ipv4Addr::new((s[1] >> 8) as u8, s[1] as u8, (s[2] >> 8) as u8, s[2] as u8));
    }
    Some(match () {
        _ if ip.is_loopback() => "a loopback address",
        _ if ip.is_unspecified() => "an unspecified address",
        _ if ip.is_multicast() => "a multicast address",
        _ if s[0] & 0xfe00 == 0xfc00 => "a unique-local (private) address",
        _ if s[0] & 0xffc0 == 0xfe80 => "a link-local address",
        _ if s[0] & 0xffc0 == 0xfec0 => "a site-local address",
        // NAT64 for local use (64:ff9b:1::/48), whose IPv4 side is private.
        _ if s[..3] == [0x64, 0xff9b, 1] => "a local-use NAT64 address",
        // ::a.b.c.d, the deprecated IPv4-compatible form.
        _ if s[..6] == [0; 6] => return refused_v4(low_v4),
        _ => return None,
    })
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
    fn addresses_inside_a_network_are_refused_and_public_ones_are_not() {
        let refused = |s: &str| refused_kind(s.parse().unwrap());
        for ip in [
            "127.0.0.1",
            "127.8.9.10",
            "10.0.0.1",
            "172.16.5.4",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "0.1.2.3",
            "224.0.0.1",
            "255.255.255.255",
            "100.64.0.1",
            "240.0.0.1",
            "::1",
            "::",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "fec0::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "::127.0.0.1",
        ] {
            assert!(refused(ip).is_some(), "{ip} should be refused");
        }
        for ip in [
            "8.8.8.8",
            "1.1.1.1",
            "172.32.0.1",
            "100.128.0.1",
            "198.51.100.2",
            "2001:4860:4860::8888",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::1",
        ] {
            assert_eq!(refused(ip), None, "{ip} is public");
        }
        for ip in ["198.18.0.1", "192.0.0.8", "2002:7f00:1::1", "2002:a9fe:a9fe::", "::ffff:0:127.0.0.1", "64:ff9b:1::a00:1"] {
            assert!(refused(ip).is_some(), "{ip} should be refused");
        }
        assert_eq!(refused("169.254.169.254").map(|k| k.contains("metadata")), Some(true));
    }

    #[test]
    fn file_urls_are_percent_decoded() {
        assert_eq!(percent_decoded("/a%20b.png").as_deref(), Some("/a b.png"));
        assert_eq!(percent_decoded("/x%2"), None);
        assert_eq!(percent_decoded("/x%zz"), None);
    }
}
