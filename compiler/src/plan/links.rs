//! Links between hosts (`links:` in a plan) and what crossing them costs:
//! each stage boundary sends a step's activation rows (rows × hidden width
//! × the activation storage's bytes) to the next stage. The report counts
//! it for a decode step and for a prefill of the workload's context.

use std::fmt;

/// A network link as a plan describes it: `"400 Gb/s, 5 us"`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Link {
    /// Bytes per second.
    pub bandwidth: f64,
    /// Seconds from send to first byte received.
    pub latency: f64,
}

impl Eq for Link {}

impl Link {
    /// Seconds to send `bytes` in one message.
    pub fn time(&self, bytes: f64) -> f64 {
        self.latency + bytes / self.bandwidth
    }

    /// Parses `BANDWIDTH, LATENCY`: a bandwidth in `b/s` or `B/s` with a
    /// decimal prefix (`400 Gb/s`, `50 GB/s`, `25Gbit/s`), then a latency
    /// in `ns`, `us` (or `µs`), `ms` or `s`.
    pub fn parse(text: &str) -> Result<Link, String> {
        let (bw, lat) = text.split_once(',').ok_or_else(|| format!("`{text}`: expected BANDWIDTH, LATENCY such as \"400 Gb/s, 5 us\""))?;
        let bandwidth = bandwidth(bw.trim()).ok_or_else(|| {
            format!("`{}`: expected a bandwidth such as `400 Gb/s` or `50 GB/s` (b: bits, B: bytes; k, M, G, T prefixes)", bw.trim())
        })?;
        let latency =
            latency(lat.trim()).ok_or_else(|| format!("`{}`: expected a latency such as `5 us` (ns, us, ms or s)", lat.trim()))?;
        Ok(Link { bandwidth, latency })
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // To the bit per second and the nanosecond: no float noise.
        write!(f, "{} Gb/s, {} us", (self.bandwidth * 8.0).round() / 1e9, (self.latency * 1e9).round() / 1e3)
    }
}

/// A number and its unit, split where the digits end.
fn number_unit(text: &str) -> Option<(f64, &str)> {
    let end = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let v: f64 = text[..end].parse().ok()?;
    (v.is_finite()).then_some((v, text[end..].trim()))
}

fn bandwidth(text: &str) -> Option<f64> {
    let (v, unit) = number_unit(text)?;
    let unit = unit.strip_suffix("/s").or_else(|| unit.strip_suffix("ps"))?;
    let (prefix, rest) = match unit.chars().next()? {
        c @ ('k' | 'K' | 'M' | 'G' | 'T') => (c, &unit[1..]),
        _ => (' ', unit),
    };
    let scale = match prefix {
        'k' | 'K' => 1e3,
        'M' => 1e6,
        'G' => 1e9,
        'T' => 1e12,
        _ => 1.0,
    };
    let per_byte = match rest {
        "b" | "bit" | "bits" => 1.0 / 8.0,
        "B" | "byte" | "bytes" => 1.0,
        _ => return None,
    };
    let b = v * scale * per_byte;
    (b > 0.0).then_some(b)
}

fn latency(text: &str) -> Option<f64> {
    let (v, unit) = number_unit(text)?;
    // Divided, not multiplied by 1e-6: 5 us is then exactly the f64 of 5e-6.
    let per_second = match unit {
        "ns" => 1e9,
        "us" | "µs" => 1e6,
        "ms" => 1e3,
        "s" => 1.0,
        _ => return None,
    };
    Some(v / per_second)
}

#[cfg(test)]
mod tests {
    use super::Link;

    #[test]
    fn links_parse_with_their_units() {
        let ib = Link::parse("400 Gb/s, 5 us").unwrap();
        assert_eq!((ib.bandwidth, ib.latency), (50e9, 5e-6));
        assert_eq!(ib.to_string(), "400 Gb/s, 5 us");
        let nv = Link::parse("900GB/s,500ns").unwrap();
        assert_eq!((nv.bandwidth, nv.latency), (900e9, 5e-7));
        assert_eq!(Link::parse("25 Gbit/s, 0.01 ms").unwrap().bandwidth, 25e9 / 8.0);
        // 1 MB over 400 Gb/s: 20 us, after the 5 us latency.
        assert!((ib.time(1e6) - 25e-6).abs() < 1e-12);
        for bad in ["400 Gb/s", "fast, 5 us", "400 Gb, 5 us", "0 Gb/s, 5 us", "400 Gb/s, 5 hours", "-1 GB/s, 1 us", "NaN GB/s, 1 us"] {
            assert!(Link::parse(bad).is_err(), "{bad}");
        }
    }
}
