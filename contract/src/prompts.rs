//! Prompts as token ids and the numbers of the run command line: parsed the
//! same way by `m3c run` and by every stage, and property-tested.

/// The longest wait a user may ask for (`--timeout-s`): a week. Longer is a
/// typo, and `inf` or 1e300 cannot become a `Duration`.
pub const MAX_TIMEOUT_S: f64 = 7.0 * 24.0 * 3600.0;

/// `1,2,3` (commas or white space between ids) → ids; at least one.
pub fn parse_ids(text: &str, what: &str) -> Result<Vec<i64>, String> {
    let ids: Result<Vec<i64>, String> = text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<i64>().map_err(|_| format!("{what}: `{}` is not a token id (expected integers separated by commas)", short(s))))
        .collect();
    let ids = ids?;
    if ids.is_empty() {
        return Err(format!("{what}: a prompt needs at least one token id"));
    }
    Ok(ids)
}

/// A prompts file: one prompt per line (ids separated by commas); blank
/// lines and `#` comments are skipped. `file` names it in messages.
pub fn parse_prompts_file(text: &str, file: &str) -> Result<Vec<Vec<i64>>, String> {
    let text = crate::input::strip_bom(text);
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        prompts.push(parse_ids(line, &format!("{file}:{}", i + 1))?);
    }
    if prompts.is_empty() {
        return Err(format!("--prompts {file}: no prompts in the file (one per line, ids separated by commas)"));
    }
    Ok(prompts)
}

/// A count flag (`--max-new-tokens`, `--micro-batch`, ...); `positive`
/// refuses 0.
pub fn parse_count(v: &str, flag: &str, positive: bool) -> Result<usize, String> {
    match v.trim().parse::<usize>() {
        Ok(n) if n > 0 || !positive => Ok(n),
        _ => Err(format!("{flag}: `{}` is not a {}count", short(v), if positive { "positive " } else { "" })),
    }
}

/// A finite number flag (the sampling settings; their ranges are checked
/// by `SamplingParams::check`).
pub fn parse_number(v: &str, flag: &str) -> Result<f32, String> {
    v.trim().parse::<f32>().ok().filter(|x| x.is_finite()).ok_or_else(|| format!("{flag}: `{}` is not a number", short(v)))
}

/// `--timeout-s`: a finite number of seconds in (0, a week].
pub fn parse_timeout_s(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(t) if t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_S => Ok(t),
        _ => Err(format!("--timeout-s: `{}` is not a number of seconds between 0 and {MAX_TIMEOUT_S:.0} (a week)", short(v))),
    }
}

/// At most 40 characters of a bad value, for messages.
fn short(s: &str) -> String {
    if s.chars().count() > 40 {
        format!("{}…", s.chars().take(40).collect::<String>())
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_that_cannot_be_used_are_refused() {
        assert_eq!(parse_ids("1, 2 3", "p").unwrap(), vec![1, 2, 3]);
        assert!(parse_ids(" , ", "p").is_err());
        assert!(parse_ids("1,x", "p").unwrap_err().contains("`x`"));
        for t in ["inf", "1e300", "NaN", "-1", "0", "nan", "604801"] {
            assert!(parse_timeout_s(t).is_err(), "{t}");
        }
        assert_eq!(parse_timeout_s("2.5").unwrap(), 2.5);
        assert!(parse_count("18446744073709551616", "--max-new-tokens", false).is_err());
        assert_eq!(parse_count("0", "--max-new-tokens", false).unwrap(), 0);
        assert!(parse_count("0", "--micro-batch", true).is_err());
        assert_eq!(parse_prompts_file("\u{feff}# c\n1,2\n\n3\n", "f").unwrap(), vec![vec![1, 2], vec![3]]);
    }
}
