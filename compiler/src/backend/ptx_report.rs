//! The compile report of a CUDA compile: per kernel, the registers, shared
//! memory, stack and spills that `ptxas -v` reports for the stage's PTX.

use anyhow::{Context, Result};
use std::fmt::Write;
use std::path::Path;

pub fn header() -> String {
    format!("{:<6} {:<72} {:>5} {:>9} {:>7} {:>12} {:>11}\n", "stage", "kernel", "regs", "smem B", "stack B", "spill st B", "spill ld B")
}

/// One kernel's figures from `ptxas -v`.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct KernelFigures {
    pub name: String,
    pub registers: u32,
    pub shared: u32,
    pub stack: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// Parses `ptxas -v` output (its `info` lines) into per-kernel figures.
pub fn parse_ptxas(text: &str) -> Vec<KernelFigures> {
    let num_before = |line: &str, unit: &str| -> u32 {
        line.split(',').find(|p| p.contains(unit)).and_then(|p| p.split_whitespace().find_map(|w| w.parse().ok())).unwrap_or(0)
    };
    let mut out: Vec<KernelFigures> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            out.push(KernelFigures { name: rest.trim().to_string(), ..Default::default() });
        } else if let Some(k) = out.last_mut() {
            if line.contains("stack frame") {
                k.stack = num_before(line, "stack frame");
                k.spill_stores = num_before(line, "spill stores");
                k.spill_loads = num_before(line, "spill loads");
            } else if line.contains("Used") && line.contains("registers") {
                k.registers =
                    line.split("Used ").nth(1).and_then(|s| s.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap_or(0);
                k.shared = line
                    .split(',')
                    .find(|p| p.contains("bytes smem"))
                    .and_then(|p| p.split_whitespace().find_map(|w| w.parse().ok()))
                    .unwrap_or(0);
            }
        }
    }
    out
}

/// A stage's PTX assembled by ptxas: the cubin and the report lines.
pub struct Assembled {
    /// `None` when the toolkit has no ptxas (the stage then embeds PTX).
    pub cubin: Option<Vec<u8>>,
    pub report: String,
}

/// Runs ptxas on a stage's PTX (when the toolkit has it): the cubin to
/// embed, and the report of its figures.
pub fn assemble(stage: usize, ptx: &str, work: &Path) -> Result<Assembled> {
    let root = crate::backend::cuda::cuda_root()?;
    let Some(ptxas) = crate::backend::cuda::ptxas(&root) else {
        return Ok(Assembled {
            cubin: None,
            report: format!("{stage:<6} (no ptxas in {}: PTX not assembled, no figures; the stage embeds PTX)\n", root.display()),
        });
    };
    let file = work.join(format!("stage-{stage}.ptx"));
    std::fs::write(&file, ptx)?;
    let arch = ptx.lines().find_map(|l| l.strip_prefix(".target ")).unwrap_or("sm_90a").trim().to_string();
    let cubin = work.join(format!("stage-{stage}.cubin"));
    let o = std::process::Command::new(&ptxas)
        .arg(format!("-arch={arch}"))
        .args(["-v", "-o"])
        .arg(&cubin)
        .arg(&file)
        .output()
        .with_context(|| format!("cannot run {}", ptxas.display()))?;
    let text = String::from_utf8_lossy(&o.stderr).into_owned();
    anyhow::ensure!(o.status.success(), "stage {stage}: ptxas rejected the generated PTX:\n{text}");
    let mut s = String::new();
    for k in parse_ptxas(&text) {
        let _ = writeln!(
            s,
            "{stage:<6} {:<72} {:>5} {:>9} {:>7} {:>12} {:>11}",
            k.name, k.registers, k.shared, k.stack, k.spill_stores, k.spill_loads
        );
    }
    let cubin = std::fs::read(&cubin).with_context(|| format!("stage {stage}: ptxas wrote no {}", cubin.display()))?;
    Ok(Assembled { cubin: Some(cubin), report: s })
}
