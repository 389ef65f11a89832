//! `m3c bench-kernels`: the host linears at prefill and decode shapes,
//! timed alone beside this machine's measured FMA peak.

use anyhow::{bail, Context, Result};
use m3c_compiler::kernel_bench::{self, LinearCase, WeightType};
use std::time::Duration;

/// The real MiniMax-M3 linears (out × in): attention-sized 6144², one
/// expert's gate/up and down, and the vision tower's MLP.
pub const DEFAULT_SHAPES: &str = "6144x6144,1536x6144,6144x1536,5120x1280,1280x5120";

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Weight shapes as OUTxIN, comma-separated.
    #[arg(long, default_value = DEFAULT_SHAPES)]
    shapes: String,
    /// Weight types: bf16, mxfp8 (32-wide blocks) or f32, comma-separated.
    #[arg(long, default_value = "bf16,mxfp8")]
    weights: String,
    /// Activation rows of the prefill case (each shape also runs at 1 row, as decode does).
    #[arg(long, default_value_t = 512)]
    rows: usize,
    /// The LLVM CPU the kernels are compiled for, as `m3c compile --cpu`.
    #[arg(long, default_value = "x86-64-v3")]
    cpu: String,
    /// Seconds of timed calls per case (the fastest call counts).
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Measure and print the FMA peak only.
    #[arg(long)]
    peak_only: bool,
}

fn parse_shapes(s: &str) -> Result<Vec<(usize, usize)>> {
    s.split(',')
        .map(|p| {
            let (o, i) = p.trim().split_once('x').with_context(|| format!("--shapes: `{p}` is not OUTxIN"))?;
            let o: usize = o.parse().with_context(|| format!("--shapes: `{o}` in `{p}` is not a number"))?;
            let i: usize = i.parse().with_context(|| format!("--shapes: `{i}` in `{p}` is not a number"))?;
            if o == 0 || i == 0 || !i.is_multiple_of(32) || o.checked_mul(i).is_none_or(|n| n > 1 << 30) {
                bail!("--shapes: `{p}` needs OUT ≥ 1, IN a multiple of 32 and OUT·IN ≤ 2^30");
            }
            Ok((o, i))
        })
        .collect()
}

fn parse_weights(s: &str) -> Result<Vec<WeightType>> {
    s.split(',')
        .map(|w| match w.trim() {
            "bf16" => Ok(WeightType::BF16),
            "mxfp8" => Ok(WeightType::Mxfp8 { block: 32 }),
            "f32" => Ok(WeightType::F32),
            other => bail!("--weights: `{other}` is not bf16, mxfp8 or f32"),
        })
        .collect()
}

pub fn bench_kernels(a: BenchArgs) -> Result<()> {
    let shapes = parse_shapes(&a.shapes)?;
    let weights = parse_weights(&a.weights)?;
    if a.rows == 0 || a.rows > 1 << 16 {
        bail!("--rows: {} is not between 1 and 65536", a.rows);
    }
    if !(0.01..=60.0).contains(&a.seconds) {
        bail!("--seconds: {} is not between 0.01 and 60", a.seconds);
    }
    let a = BenchArgs { cpu: m3c_compiler::backend::resolve_cpu(&a.cpu)?, ..a };
    m3c_compiler::backend::check_cpu(&a.cpu)?;
    let dir = tempfile::tempdir().context("a temporary folder for the kernels")?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // A shared machine's neighbours can take a core for a while: each peak
    // is the best of three measurements, the last after the linears. The
    // true peak is the widest vector's the target has; the kernels' own
    // 8-wide chains may reach less (or, where the CPU runs a 16-wide FMA
    // as two 8-wide halves, the same).
    let widest = m3c_compiler::backend::widest_f32_lanes(&a.cpu);
    let measure = |lanes: usize| -> Result<f64> {
        let p = kernel_bench::fma_peak(&a.cpu, threads, dir.path(), lanes)?;
        Ok(p.max(kernel_bench::fma_peak(&a.cpu, threads, dir.path(), lanes)?))
    };
    let (mut eight, mut wide) = (measure(8)?, if widest > 8 { measure(widest)? } else { 0.0 });
    let say_peak = |eight: f64, wide: f64| {
        let how = format!("{threads} thread(s), each a loop of 12 independent f32 FMA chains in registers, compiled for {}", a.cpu);
        if widest > 8 {
            println!(
                "FMA peak: {:.1} GFLOP/s with {widest}-wide vectors, the widest {} has; {eight:.1} with the kernels' 8-wide ({how})",
                wide.max(eight),
                a.cpu
            )
        } else {
            println!("FMA peak: {eight:.1} GFLOP/s with 8-wide vectors, the widest {} has ({how})", a.cpu)
        }
    };
    if a.peak_only {
        say_peak(eight, wide);
        return Ok(());
    }
    let mut cases = Vec::new();
    for &(out, inp) in &shapes {
        for &weight in &weights {
            for rows in [a.rows, 1] {
                cases.push(LinearCase { out, inp, weight, rows });
            }
        }
    }
    let timings = kernel_bench::linears(&cases, &a.cpu, Duration::from_secs_f64(a.seconds), dir.path())?;
    eight = eight.max(kernel_bench::fma_peak(&a.cpu, threads, dir.path(), 8)?);
    if widest > 8 {
        wide = wide.max(kernel_bench::fma_peak(&a.cpu, threads, dir.path(), widest)?);
    }
    say_peak(eight, wide);
    let peak = wide.max(eight);
    println!("{:>12} {:>7} {:>6} {:>10} {:>9} {:>7} {:>12}", "out x in", "weight", "rows", "ms/call", "GFLOP/s", "% peak", "weight GB/s");
    for t in &timings {
        let c = t.case;
        let w = match c.weight {
            WeightType::Mxfp8 { .. } => "mxfp8",
            WeightType::BF16 => "bf16",
            WeightType::F16 => "f16",
            WeightType::F32 => "f32",
        };
        println!(
            "{:>12} {w:>7} {:>6} {:>10.3} {:>9.1} {:>6.1}% {:>12.2}",
            format!("{}x{}", c.out, c.inp),
            c.rows,
            t.seconds * 1e3,
            t.gflops(),
            100.0 * t.gflops() / peak,
            t.weight_gbytes()
        );
    }
    Ok(())
}
