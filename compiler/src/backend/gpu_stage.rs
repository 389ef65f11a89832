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

/// `p` as text MLIR takes inside a pass option (`toolkit=...`): UTF-8,
/// not empty, without white space or the characters that end an option.
pub(crate) fn option_path(p: &Path) -> Option<&str> {
    p.to_str().filter(|t| !t.is_empty() && !t.contains(|c: char| c.is_whitespace() || ",{}\"'=".contains(c)))
}
