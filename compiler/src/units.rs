//! Human-readable numbers for tables.

/// `1234567` → `1,234,567`.
pub fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes as decimal gigabytes (the unit GPU memory is sold in).
pub fn gb(bytes: f64) -> String {
    format!("{:.2}", bytes / 1e9)
}

/// Bytes with a fitting unit.
pub fn bytes(b: u64) -> String {
    let f = b as f64;
    if f >= 1e9 {
        format!("{:.2} GB", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.2} MB", f / 1e6)
    } else if f >= 1e3 {
        format!("{:.1} kB", f / 1e3)
    } else {
        format!("{b} B")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn groups_thousands() {
        assert_eq!(super::grouped(427040140160), "427,040,140,160");
        assert_eq!(super::grouped(12), "12");
        assert_eq!(super::grouped(1000), "1,000");
    }
}
