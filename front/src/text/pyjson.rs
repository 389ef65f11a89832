//! Python's spellings, where a chat template's output depends on them:
//! `json.dumps(x, ensure_ascii=False)` (what transformers' `tojson` filter
//! is) and `repr`/`str` of a float (how `{{ 2.5e-7 }}` prints). MiniJinja's
//! own `tojson` escapes `<>&'` and writes floats Rust's way, which would
//! change the rendered prompt.

use minijinja::value::{Value, ValueKind};

/// A float as Python's `repr` writes it: the shortest digits that round-trip,
/// in fixed notation for 1e-4 ≤ |x| < 1e16 (with at least one decimal), else
/// as `d.ddde±XX`.
pub fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits and the exponent.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        return format!("{sign}{first}{frac}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    let body = if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
    };
    format!("{sign}{body}")
}

/// A string as a JSON literal with raw non-ASCII (`ensure_ascii=False`).
fn json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `json.dumps(v, ensure_ascii=False)`: `", "` and `": "` separators, maps
/// in their insertion order, Python's float spelling.
pub fn dumps(v: &Value) -> Result<String, minijinja::Error> {
    let mut out = String::new();
    write(v, &mut out)?;
    Ok(out)
}

fn write(v: &Value, out: &mut String) -> Result<(), minijinja::Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => {
            let x = f64::try_from(v.clone())?;
            // json.dumps spells the non-finite ones JavaScript's way.
            out.push_str(&match x {
                x if x.is_nan() => "NaN".into(),
                x if x.is_infinite() => (if x > 0.0 { "Infinity" } else { "-Infinity" }).into(),
                x => py_float(x),
            });
        }
        ValueKind::String => json_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Map => {
            out.push('{');
            for (i, k) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                match k.as_str() {
                    Some(s) => json_str(s, out),
                    None => json_str(&k.to_string(), out),
                }
                out.push_str(": ");
                write(&v.get_item(&k)?, out)?;
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, x) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write(&x, out)?;
            }
            out.push(']');
        }
        _ => json_str(&v.to_string(), out),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        for (x, want) in [
            (2.5, "2.5"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-7, "1e-07"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (-3.25, "-3.25"),
            (123.456, "123.456"),
        ] {
            assert_eq!(py_float(x), want, "{x}");
        }
    }

    #[test]
    fn json_is_python_s() {
        // Keys in their given order (not sorted), as Python's dicts keep them.
        let v: Value = serde_json::from_str(r#"{"b": [1, 2.5, 1e-7, "é<&>'\"\n"], "a": null, "t": true}"#).unwrap();
        assert_eq!(dumps(&v).unwrap(), r#"{"b": [1, 2.5, 1e-07, "é<&>'\"\n"], "a": null, "t": true}"#);
    }
}
