//! What every kernel is: one type implementing [`KernelUnit`]. Its
//! signature is written once ([`KernelUnit::params`]) and used by its host
//! definition, its GPU functions and every call the stage entry makes; its
//! host body, GPU functions and launch live side by side in its own file
//! under `ops/`.

use crate::emit::indent;
use crate::gpu::{GpuCall, GpuFunc, GpuTarget, BLOCK, GPU_MODULE};
use crate::{HostWidth, Kernel, Storage};
use std::fmt;

/// One argument of a kernel: its SSA name (without `%`) and MLIR type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    pub name: &'static str,
    pub ty: String,
}

/// A parameter.
pub fn param(name: &'static str, ty: impl Into<String>) -> Param {
    Param { name, ty: ty.into() }
}

/// `%a: T, %b: U`: a parameter list as MLIR writes it.
pub fn params_text(params: &[Param]) -> String {
    params.iter().map(|p| format!("%{}: {}", p.name, p.ty)).collect::<Vec<_>>().join(", ")
}

/// One fused operation at one shape.
pub trait KernelUnit: fmt::Debug {
    /// The function name: a pure function of the parameters, so the same
    /// kernel generated twice has one name (and is emitted once). Includes
    /// the activation suffix ([`Storage::act_suffix`]).
    fn symbol(&self) -> String;
    /// The arguments, in order: the host `func.func`'s parameters, the GPU
    /// functions' (unless a GPU function says otherwise) and the types every
    /// call must pass.
    fn params(&self) -> Vec<Param>;
    /// How the kernel's activations are stored (`None`: it has none, or only
    /// f32 logits).
    fn act(&self) -> Option<Storage>;
    /// The host body: the statements of the `func.func`, its parameters in
    /// scope by name.
    fn host_body(&self) -> String;
    /// The host body for CPUs with vectors of `width`: [`Self::host_body`]
    /// unless the kernel has a wider form (the same bits either way).
    fn host_body_at(&self, width: HostWidth) -> String {
        let _ = width;
        self.host_body()
    }
    /// The `gpu.func` kernels it runs as on the GPU `t`.
    fn gpu_funcs(&self, t: &GpuTarget) -> Vec<GpuFunc>;
    /// Host statements launching the GPU functions over the arguments of a
    /// call (see [`Launch`]). Default: one 256-thread block per row (the
    /// block [`gpu_func`] declares).
    fn launch(&self, l: &Launch) -> GpuCall {
        l.call(l.grid(&self.symbol(), [l.rows, &l.one(), &l.one()], BLOCK, l.args))
    }
    /// Kernels this one calls (emitted with it).
    fn deps(&self) -> Vec<Kernel> {
        Vec::new()
    }
    /// Globals (lookup tables, view helpers) by name and MLIR text.
    fn globals(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// [`Self::globals`] of [`Self::host_body_at`]'s form.
    fn globals_at(&self, width: HostWidth) -> Vec<(String, String)> {
        let _ = width;
        self.globals()
    }
}

/// The host `func.func` of a kernel, for CPUs with vectors of `width`.
pub fn host_func(k: &dyn KernelUnit, width: HostWidth) -> String {
    format!(
        "  func.func @{}({}) attributes {{llvm.emit_c_interface}} {{\n{}  }}\n",
        k.symbol(),
        params_text(&k.params()),
        indent(&k.host_body_at(width), 4)
    )
}

/// A `gpu.func` with the kernel's own parameters, launched with the
/// default [`KernelUnit::launch`]'s 256 threads.
pub fn gpu_func(t: &GpuTarget, name: &str, params: &[Param], body: &str) -> GpuFunc {
    gpu_func_block(t, name, params, body, BLOCK)
}

/// [`gpu_func`] for a kernel launched with `block` threads.
pub fn gpu_func_block(t: &GpuTarget, name: &str, params: &[Param], body: &str, block: usize) -> GpuFunc {
    crate::gpu::func(t, name, &params_text(params), body, block)
}

/// Where a GPU launch is emitted: the GPU, the call's argument SSA names
/// and types (in [`KernelUnit::params`] order), the step's row count (an
/// index SSA name) and a tag that makes local names unique.
pub struct Launch<'a> {
    pub target: &'a GpuTarget,
    pub args: &'a [(String, String)],
    pub rows: &'a str,
    pub tag: &'a str,
}

impl Launch<'_> {
    /// `%g{tag}_{name}`: a local SSA name of this launch.
    pub fn local(&self, name: &str) -> String {
        format!("%g{}_{name}", self.tag)
    }

    /// The index constant 1 (defined by [`Launch::prelude`]).
    pub fn one(&self) -> String {
        self.local("one")
    }

    /// The constants every launch uses: 1 and the block sizes of a warp,
    /// of [`GpuTarget::warps_block`] and of 256 threads, each once.
    pub fn prelude(&self) -> String {
        let mut text = format!("{} = arith.constant 1 : index\n", self.one());
        let blocks: std::collections::BTreeSet<usize> = [self.target.warp, self.target.warps_block(), BLOCK].into();
        for b in blocks {
            text.push_str(&format!("{} = arith.constant {b} : index\n", self.local(&format!("b{b}"))));
        }
        text
    }

    /// `gpu.launch_func` of `name` over `grid` blocks of `block` threads.
    pub fn grid(&self, name: &str, grid: [&str; 3], block: usize, args: &[(String, String)]) -> String {
        let list: Vec<String> = args.iter().map(|(n, t)| format!("{n} : {t}")).collect();
        format!(
            "gpu.launch_func @{GPU_MODULE}::@{name} blocks in ({}, {}, {}) threads in ({}, {}, {}) args({})\n",
            grid[0],
            grid[1],
            grid[2],
            self.local(&format!("b{block}")),
            self.one(),
            self.one(),
            list.join(", ")
        )
    }

    /// A block per (row, head) of `heads` heads, a thread per channel of
    /// `head_dim`: the launch of the per-head RoPE kernels.
    pub fn per_head(&self, name: &str, heads: usize, head_dim: usize) -> GpuCall {
        let (h, d, one, rows) = (self.local("h"), self.local("d"), self.one(), self.rows);
        let list: Vec<String> = self.args.iter().map(|(n, t)| format!("{n} : {t}")).collect();
        self.call(format!(
            "{h} = arith.constant {heads} : index\n{d} = arith.constant {head_dim} : index\n\
             gpu.launch_func @{GPU_MODULE}::@{name} blocks in ({rows}, {h}, {one}) threads in ({d}, {one}, {one}) args({})\n",
            list.join(", ")
        ))
    }

    /// A call of `text` (after the prelude) needing no view helpers.
    pub fn call(&self, text: String) -> GpuCall {
        GpuCall { text: self.prelude() + &text, device_views: Vec::new(), host_views: Vec::new() }
    }
}
