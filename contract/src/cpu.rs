//! The x86-64 features a stage's host code may use, recorded in its
//! `StageMeta` when it is compiled and checked when it starts: a stage
//! copied to a machine whose CPU lacks one stops with a message naming
//! them, instead of dying of an illegal instruction somewhere in a step.
//!
//! Features are spelled as LLVM spells them. A psABI level (`x86-64-v2`
//! to `-v4`) has its own list; a build for the compiling machine's own CPU
//! (`--cpu native`) records what that CPU reports of [`CHECKED`]. Another
//! named CPU records none: LLVM does not say which features a name implies,
//! and such a stage is not checked.

/// The extensions a stage checks: the vector and bit-manipulation ones
/// generated code may use.
pub const CHECKED: &[&str] = &[
    "sse3",
    "ssse3",
    "sse4.1",
    "sse4.2",
    "popcnt",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi",
    "bmi2",
    "lzcnt",
    "movbe",
    "avx512f",
    "avx512bw",
    "avx512cd",
    "avx512dq",
    "avx512vl",
    "avx512bf16",
    "avx512vnni",
    "avx512vbmi",
    "avx512vbmi2",
    "avx512bitalg",
    "avx512vpopcntdq",
    "avx512ifma",
    "gfni",
    "vaes",
    "vpclmulqdq",
];

const V2: &[&str] = &["popcnt", "sse3", "sse4.1", "sse4.2", "ssse3"];
const V3: &[&str] = &["avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe"];
const V4: &[&str] = &["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"];

/// The features of a psABI level (`x86-64`, `x86-64-v2`, `-v3`, `-v4`).
pub fn level_features(cpu: &str) -> Option<Vec<String>> {
    let levels: &[&[&str]] = match cpu {
        "x86-64" => &[],
        "x86-64-v2" => &[V2],
        "x86-64-v3" => &[V2, V3],
        "x86-64-v4" => &[V2, V3, V4],
        _ => return None,
    };
    Some(levels.iter().flat_map(|l| l.iter().map(|f| f.to_string())).collect())
}

/// The features of an LLVM feature string (`+avx2,-amx-tile,...`) that are
/// on and that a stage checks, in [`CHECKED`]'s order.
pub fn checked(llvm: &str) -> Vec<String> {
    let on: Vec<&str> = llvm.split(',').filter_map(|f| f.trim().strip_prefix('+')).collect();
    CHECKED.iter().filter(|f| on.contains(f)).map(|f| f.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_include_the_levels_below_and_only_checked_features() {
        let v4 = level_features("x86-64-v4").unwrap();
        for f in level_features("x86-64-v3").unwrap() {
            assert!(v4.contains(&f), "{f}");
        }
        assert!(v4.contains(&"avx512vl".to_string()) && !level_features("x86-64-v3").unwrap().contains(&"avx512f".to_string()));
        assert!(level_features("x86-64").unwrap().is_empty());
        assert!(level_features("znver4").is_none());
        for f in v4 {
            assert!(CHECKED.contains(&f.as_str()), "{f}");
        }
    }

    #[test]
    fn an_llvm_feature_string_gives_its_checked_features_that_are_on() {
        assert_eq!(checked("+avx2,-avx512f,+fma,+amx-tile,+sse4.1,+cx16"), ["sse4.1", "avx2", "fma"]);
        assert!(checked("").is_empty());
    }
}
