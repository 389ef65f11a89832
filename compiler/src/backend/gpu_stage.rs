//! What the GPU back ends share: running a back end's pass pipeline on a
//! stage's module, and reading the device object it embeds.

use super::{host, BackendError};
use melior::ir::operation::OperationLike;
use melior::pass::PassManager;
use melior::utility::parse_pass_pipeline;
use std::path::Path;

/// Runs a GPU back end's `pipeline` on a stage's module (kernels and the
/// launching entry) with the verifier after every pass, and returns the
/// lowered module's text. With `M3C_DUMP_DIR` set, the module as generated
/// and as lowered are written there as `{tag}-in.mlir` and
/// `{tag}-lowered.mlir` (a debugging aid; the first also when it does not
/// parse).
pub(crate) fn lower(mlir: &str, pipeline: &str, tag: &str) -> Result<String, BackendError> {
    let dump = |suffix: &str, text: &str| {
        if let Some(d) = std::env::var_os("M3C_DUMP_DIR") {
            let _ = std::fs::write(Path::new(&d).join(format!("{tag}-{suffix}.mlir")), text);
        }
    };
    dump("in", mlir);
    host::init_once();
    let context = host::context();
    let mut module = host::parse(&context, mlir)?;
    let pm = PassManager::new(&context);
    pm.enable_verifier(true);
    let err = |e: melior::Error| BackendError::Passes { pipeline: pipeline.to_string(), message: e.to_string() };
    parse_pass_pipeline(pm.as_operation_pass_manager(), pipeline).map_err(err)?;
    pm.run(&mut module).map_err(err)?;
    if !module.as_operation().verify() {
        return Err(BackendError::Passes { pipeline: pipeline.to_string(), message: "the lowered module does not verify".into() });
    }
    let lowered = module.as_operation().to_string();
    dump("lowered", &lowered);
    Ok(lowered)
}

/// The bytes of the string that follows `key` (`assembly = "` or `bin = "`)
/// in a lowered module's `gpu.binary`, unescaped.
pub(crate) fn embedded_object(lowered: &str, key: &str) -> Option<Vec<u8>> {
    let start = lowered.find(key)? + key.len();
    let bytes = lowered.as_bytes();
    let mut out = Vec::new();
    let mut i = start;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => return Some(out),
            b'\\' => {
                let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        // `\\` or `\"`
                        out.push(*bytes.get(i + 1)?);
                        i += 2;
                    }
                }
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    None
}

/// What differs between the GPU back ends' pass pipelines. The rest is the
/// shape of MLIR's `gpu-lower-to-nvvm-pipeline`: outline the kernels, lower
/// the host side to the LLVM dialect, convert the kernels inside each
/// `gpu.module`, serialize them into a `gpu.binary`, and clean up.
pub(crate) struct PipelineParts<'a> {
    /// Passes before kernel outlining, each followed by a comma.
    pub before: &'a str,
    /// Passes right after `convert-scf-to-cf`, each followed by a comma.
    pub after_cf: &'a str,
    /// The `*-attach-target` pass with its options.
    pub attach: &'a str,
    /// The kernels' conversion, run inside each `gpu.module`.
    pub to_device: &'a str,
    /// `gpu-module-to-binary`'s `format` (`isa`: PTX; `bin`: the device's object).
    pub format: &'a str,
    /// The toolkit folder, as `option_path` gives it.
    pub toolkit: &'a str,
}

/// The whole pass pipeline, as text `parse_pass_pipeline` takes.
pub(crate) fn pipeline(p: &PipelineParts) -> String {
    const CANONICALIZE: &str =
        "canonicalize{  max-iterations=10 max-num-rewrites=-1 region-simplify=normal test-convergence=false top-down=true}";
    let PipelineParts { before, after_cf, attach, to_device, format, toolkit } = p;
    format!(
        "builtin.module({before}gpu-kernel-outlining{{data-layout-str=}},\
         convert-vector-to-scf{{full-unroll=false lower-scalable=false lower-tensors=false target-rank=1}},\
         convert-scf-to-cf{{allow-pattern-rollback=true}},{after_cf}\
         convert-func-to-llvm{{index-bitwidth=0 use-bare-ptr-memref-call-conv=false}},expand-strided-metadata,\
         {attach},\
         lower-affine,convert-arith-to-llvm{{index-bitwidth=0}},convert-index-to-llvm{{index-bitwidth=64}},\
         {CANONICALIZE},cse,\
         gpu.module({to_device}),gpu.module({CANONICALIZE}),gpu.module(cse),gpu.module(reconcile-unrealized-casts),\
         gpu-to-llvm{{intersperse-sizes-for-kernels=false use-bare-pointers-for-host=false use-bare-pointers-for-kernels=false}},\
         gpu-module-to-binary{{format={format}  opts= section= toolkit={toolkit}}},convert-math-to-llvm{{approximate-log1p=true}},\
         {CANONICALIZE},cse,reconcile-unrealized-casts)"
    )
}

/// `p` as text MLIR takes inside a pass option (`toolkit=...`): UTF-8,
/// not empty, without white space or the characters that end an option.
pub(crate) fn option_path(p: &Path) -> Option<&str> {
    p.to_str().filter(|t| !t.is_empty() && !t.contains(|c: char| c.is_whitespace() || ",{}\"'=".contains(c)))
}
