//! The stage's CPU against the features its host code was compiled to use
//! (`StageMeta::cpu_features`, see `m3c_contract::cpu`): a stage built for
//! another machine's CPU (`--cpu native` there, or `x86-64-v4`) says which
//! features this one lacks before any kernel runs, rather than dying of an
//! illegal instruction in its first step.
//!
//! `M3C_TEST_CPU_LACKS=avx512f,...` makes this check treat those features
//! as absent: the tests' way to run the refusal on a CPU that has them.

use crate::meta::StageMeta;

/// `Err` naming the features this CPU lacks, and what to do.
pub(crate) fn check(meta: &StageMeta) -> Result<(), String> {
    let pretend: Vec<String> = std::env::var("M3C_TEST_CPU_LACKS").unwrap_or_default().split(',').map(|f| f.trim().to_string()).collect();
    let missing: Vec<&str> =
        meta.cpu_features.iter().filter(|f| pretend.contains(f) || detected(f) == Some(false)).map(String::as_str).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let host = hostname();
    Err(format!(
        "this stage was compiled for CPU `{}` and uses {}, which this machine's CPU{host} lacks; compile again on this machine \
         (--cpu native, the default of `m3c serve MODEL_DIR`), or with --cpu naming the oldest CPU the stages run on \
         (x86-64-v3 runs on any AVX2 machine)",
        meta.cpu,
        missing.join(", ")
    ))
}

/// Whether this CPU has `feature` (LLVM's spelling); `None` for a name
/// this check does not know.
fn detected(feature: &str) -> Option<bool> {
    #[cfg(target_arch = "x86_64")]
    {
        Some(match feature {
            "sse3" => std::arch::is_x86_feature_detected!("sse3"),
            "ssse3" => std::arch::is_x86_feature_detected!("ssse3"),
            "sse4.1" => std::arch::is_x86_feature_detected!("sse4.1"),
            "sse4.2" => std::arch::is_x86_feature_detected!("sse4.2"),
            "popcnt" => std::arch::is_x86_feature_detected!("popcnt"),
            "avx" => std::arch::is_x86_feature_detected!("avx"),
            "avx2" => std::arch::is_x86_feature_detected!("avx2"),
            "fma" => std::arch::is_x86_feature_detected!("fma"),
            "f16c" => std::arch::is_x86_feature_detected!("f16c"),
            "bmi" => std::arch::is_x86_feature_detected!("bmi1"),
            "bmi2" => std::arch::is_x86_feature_detected!("bmi2"),
            "lzcnt" => std::arch::is_x86_feature_detected!("lzcnt"),
            "movbe" => std::arch::is_x86_feature_detected!("movbe"),
            "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
            "avx512bw" => std::arch::is_x86_feature_detected!("avx512bw"),
            "avx512cd" => std::arch::is_x86_feature_detected!("avx512cd"),
            "avx512dq" => std::arch::is_x86_feature_detected!("avx512dq"),
            "avx512vl" => std::arch::is_x86_feature_detected!("avx512vl"),
            "avx512bf16" => std::arch::is_x86_feature_detected!("avx512bf16"),
            "avx512vnni" => std::arch::is_x86_feature_detected!("avx512vnni"),
            "avx512vbmi" => std::arch::is_x86_feature_detected!("avx512vbmi"),
            "avx512vbmi2" => std::arch::is_x86_feature_detected!("avx512vbmi2"),
            "avx512bitalg" => std::arch::is_x86_feature_detected!("avx512bitalg"),
            "avx512vpopcntdq" => std::arch::is_x86_feature_detected!("avx512vpopcntdq"),
            "avx512ifma" => std::arch::is_x86_feature_detected!("avx512ifma"),
            "gfni" => std::arch::is_x86_feature_detected!("gfni"),
            "vaes" => std::arch::is_x86_feature_detected!("vaes"),
            "vpclmulqdq" => std::arch::is_x86_feature_detected!("vpclmulqdq"),
            _ => return None,
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = feature;
        None
    }
}

/// ` (on HOST)` for the message, when the host has a name.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(0);
    match std::str::from_utf8(&buf[..end]) {
        Ok(h) if ok && !h.is_empty() => format!(" (on {h})"),
        _ => String::new(),
    }
}
