//! Host sampler cost at MiniMax-M3's vocabulary (200 064 logits), the
//! number the text issue's 0.3 ms budget is about.
//!
//!     cargo run --release -p m3c-sampler --example sampling_bench

use m3c_contract::sampling::{seen_bitmap, SamplingParams};
use m3c_sampler::{sample, uniform};
use std::time::Instant;

const VOCAB: usize = 200_064;

fn main() {
    // Two rows. "peaked" is shaped like a language model's: a normal bulk
    // (sd 2.5) and a handful of tokens 16-22 above it. "flat" spreads 10 007
    // levels evenly over 14 units, so the top-p nucleus holds tens of
    // thousands of tokens: the hard case for anything that sorts it.
    let normal = |i: u64| {
        let (a, b) = (uniform(9, i, 0).max(1e-7) as f64, uniform(9, i, 1) as f64);
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    };
    let mut peaked: Vec<f32> = (0..VOCAB as u64).map(|i| 2.5 * normal(i)).collect();
    for (j, id) in [17usize, 4242, 99_001, 150_000, 200_000].into_iter().enumerate() {
        peaked[id] = 22.0 - 1.5 * j as f32;
    }
    let flat: Vec<f32> = (0..VOCAB).map(|i| ((i as u64 * 2_654_435_761) % 10_007) as f32 / 700.0).collect();
    let context = seen_bitmap((0..512u32).map(|i| i * 97 % VOCAB as u32), VOCAB);
    let cases = [
        ("greedy", SamplingParams::GREEDY),
        ("T=1 top-p 0.95 (the model's default)", SamplingParams { temperature: 1.0, top_p: 0.95, seed: 1, ..SamplingParams::GREEDY }),
        ("T=0.7 top-k 50 top-p 0.9", SamplingParams { temperature: 0.7, top_k: 50, top_p: 0.9, seed: 1, ..SamplingParams::GREEDY }),
        (
            "T=0.7 top-k 40 min-p 0.05 rep 1.1",
            SamplingParams { temperature: 0.7, top_k: 40, min_p: 0.05, repetition_penalty: 1.1, seed: 1, ..SamplingParams::GREEDY },
        ),
    ];
    // An argument keeps only the cases whose row and name contain it.
    let only = std::env::args().nth(1).unwrap_or_default();
    println!("{:<8} {:<40} {:>10} {:>10}", "logits", "case", "median ms", "p99 ms");
    for (row, logits) in [("peaked", &peaked), ("flat", &flat)] {
        for (name, p) in cases {
            if !format!("{row} {name}").contains(&only) {
                continue;
            }
            let mut times: Vec<f64> = (0..if only.is_empty() { 300u64 } else { 3000 })
                .map(|step| {
                    let t = Instant::now();
                    std::hint::black_box(sample(std::hint::black_box(logits), &context, &p, 0, step));
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            times.sort_by(f64::total_cmp);
            println!("{:<8} {:<40} {:>10.3} {:>10.3}", row, name, times[times.len() / 2], times[times.len() * 99 / 100]);
        }
    }
}
