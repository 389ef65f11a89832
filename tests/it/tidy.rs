//! The written invariants that code review alone would let slip: rustfmt
//! sees every source file; every `unsafe` says why it is sound; tensor names
//! are spelled only in the name tables (`compiler/src/model/names.rs`,
//! `compiler/src/family/*/names.rs`) and chat markers only in the chat
//! formats (`contract/src/chat_format/`); the crates are layered as the
//! pipeline is; no two top-level modules of a crate import each other; no
//! function is over 150 lines (80 in the engine).

use m3c_tests::root;
use std::path::{Path, PathBuf};

/// The workspace's Rust sources (tracked or not), without `target/`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name == "target" || name == "fixtures" || name == "snapshots" {
            continue;
        }
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
    out
}

/// The workspace's crate folders: the `members` of the root Cargo.toml, so
/// a new crate is checked without being listed here.
fn crates() -> Vec<String> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let line = manifest.lines().find(|l| l.trim_start().starts_with("members")).expect("a members line");
    let list = line.split_once('[').and_then(|(_, r)| r.split_once(']')).expect("members = [...] on one line").0;
    let crates: Vec<String> = list.split(',').map(|c| c.trim().trim_matches('"').to_string()).filter(|c| !c.is_empty()).collect();
    assert!(crates.len() >= 8 && crates.iter().all(|c| root().join(c).join("Cargo.toml").is_file()), "{crates:?}");
    crates
}

/// rustfmt checks every source file, not only those `cargo fmt` reaches
/// through `mod` items (modules declared inside a macro were once skipped).
#[test]
fn rustfmt_sees_every_source_file() {
    let files: Vec<PathBuf> = crates().iter().flat_map(|d| rust_files(&root().join(d))).collect();
    assert!(files.len() > 100, "{} files", files.len());
    let out = std::process::Command::new("rustfmt")
        .args(["--check", "--edition", "2021", "--config-path"])
        .arg(root().join("rustfmt.toml"))
        .args(&files)
        .output()
        .expect("rustfmt runs");
    assert!(out.status.success(), "files rustfmt would change:\n{}", String::from_utf8_lossy(&out.stdout));
}

/// The code of a line without its `//` comment (string literals are kept
/// whole, so a `//` inside one does not cut it).
fn code_of(line: &str) -> &str {
    let b = line.as_bytes();
    let mut in_str = false;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' if in_str => i += 1,
            b'"' => in_str = !in_str,
            b'/' if !in_str && b.get(i + 1) == Some(&b'/') => return &line[..i],
            _ => {}
        }
        i += 1;
    }
    line
}

/// `code` with the contents of its string literals blanked.
fn without_strings(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let (mut in_str, mut escaped) = (false, false);
    for c in code.chars() {
        if in_str {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_str = false;
                out.push(c);
            }
            continue;
        }
        if c == '"' {
            in_str = true;
        }
        out.push(c);
    }
    out
}

/// Whether `code` uses `unsafe` as a block, fn, impl or extern block (not in
/// a function-pointer type such as `unsafe extern "C" fn(...)`, nor in a
/// string).
fn uses_unsafe(code: &str) -> bool {
    let code = without_strings(code);
    let mut rest = code.as_str();
    while let Some(i) = rest.find("unsafe") {
        let before = rest[..i].chars().last();
        let after = &rest[i + 6..];
        let word = before.is_none_or(|c| !c.is_alphanumeric() && c != '_')
            && after.chars().next().is_none_or(|c| !c.is_alphanumeric() && c != '_');
        let a = after.trim_start();
        // After blanking strings, `extern "C" fn(` reads `extern "" fn(`.
        let after_abi = a.strip_prefix("extern").map(|r| r.trim_start().trim_start_matches('"').trim_start_matches('"').trim_start());
        let pointer_type =
            [Some(a), after_abi].into_iter().flatten().any(|r| r.strip_prefix("fn").is_some_and(|f| f.trim_start().starts_with('(')));
        if word && !pointer_type {
            return true;
        }
        rest = after;
    }
    false
}

#[test]
fn every_unsafe_says_why_it_is_sound() {
    let mut missing = Vec::new();
    for f in crates().iter().flat_map(|d| rust_files(&root().join(d))) {
        let text = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if line.trim_start().starts_with("//") || !uses_unsafe(code_of(line)) {
                continue;
            }
            let window = &lines[i.saturating_sub(4)..=i];
            let said = window.iter().any(|l| l.contains("SAFETY:") || l.contains("# Safety"));
            if !said {
                missing.push(format!("{}:{}: {}", f.strip_prefix(root()).unwrap().display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "{} `unsafe` without a SAFETY comment (on the line or the 4 above):\n{}",
        missing.len(),
        missing.join("\n")
    );
}

/// Fragments of hub tensor names.
const TENSOR_NAME_PARTS: &[&str] = &[
    "embed_tokens",
    "self_attn",
    "block_sparse_moe",
    "layernorm",
    "layrnorm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "out_proj",
    "weight_scale_inv",
    "e_score_correction",
    ".shared_experts",
    "vision_tower",
    "multi_modal_projector",
    "patch_merge_mlp",
    ".weight",
];

#[test]
fn tensor_names_are_spelled_only_in_the_name_tables() {
    // The hub's shared conventions, and each family's own names.
    let is_table = |f: &Path| {
        let rel = f.strip_prefix(root()).unwrap();
        rel == Path::new("compiler/src/model/names.rs")
            || (rel.starts_with("compiler/src/family") && rel.file_name().is_some_and(|n| n == "names.rs"))
    };
    let dirs = ["compiler/src", "kernels/src", "runtime/src", "front/src", "serve/src", "cli/src"];
    // (Unit tests may name tensors to check the table.)
    let found = literals_holding(&dirs, TENSOR_NAME_PARTS, is_table);
    assert!(found.is_empty(), "tensor names outside the name tables (model/names.rs, family/*/names.rs):\n{}", found.join("\n"));
}

/// Every string literal in the non-test code of `dirs` (files `skip` says
/// aside) that holds one of `parts`, as `FILE:LINE: `part` in "literal"`.
fn literals_holding(dirs: &[&str], parts: &[&str], skip: impl Fn(&Path) -> bool) -> Vec<String> {
    let mut found = Vec::new();
    for f in dirs.iter().flat_map(|d| rust_files(&root().join(d))).filter(|f| !skip(f)) {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut in_tests = false;
        for (i, line) in text.lines().enumerate() {
            in_tests |= line.trim_start().starts_with("#[cfg(test)]");
            if in_tests || line.trim_start().starts_with("//") {
                continue;
            }
            for lit in code_of(line).split('"').skip(1).step_by(2) {
                if let Some(p) = parts.iter().find(|p| lit.contains(*p)) {
                    found.push(format!("{}:{}: `{p}` in \"{lit}\"", f.strip_prefix(root()).unwrap().display(), i + 1));
                }
            }
        }
    }
    found
}

/// Fragments of a chat format's markers (MiniMax-M3's).
const CHAT_MARKERS: &[&str] = &["mm:think", "]<]", "[>[", "]~b]", "[e~["];

/// A chat's markers are spelled only in its format
/// (`contract/src/chat_format/`): the readers of reasoning, tool calls and
/// media take them from there, so a family with its own markers touches
/// none of them.
#[test]
fn chat_markers_are_spelled_only_in_the_chat_formats() {
    let formats = root().join("contract/src/chat_format");
    let dirs =
        ["compiler/src", "runtime/src", "front/src", "serve/src", "cli/src", "constrain/src", "contract/src", "engine/src", "sampler/src"];
    // Unit-test files spell the markers of the cases they check.
    let found = literals_holding(&dirs, CHAT_MARKERS, |f| f.starts_with(&formats) || f.file_name().is_some_and(|n| n == "tests.rs"));
    assert!(found.is_empty(), "chat markers outside contract/src/chat_format/ (take them from the ChatFormat):\n{}", found.join("\n"));
}

#[test]
fn the_tidy_checks_can_fail() {
    assert!(uses_unsafe("    unsafe { f() };"));
    assert!(uses_unsafe("pub unsafe extern \"C\" fn m3c_buf_free(p: *mut u8) {"));
    assert!(!uses_unsafe("type F = unsafe extern \"C\" fn(*mut u8) -> i32;"));
    assert!(!uses_unsafe("let unsafe_count = 3;"));
    assert!(!uses_unsafe("say(\"an unsafe { call }\");"));
    assert_eq!(code_of("let a = \"x // y\"; // note"), "let a = \"x // y\"; ");
    // The literal scan finds what the formats and name tables spell.
    assert!(!literals_holding(&["contract/src/chat_format"], CHAT_MARKERS, |_| false).is_empty());
    assert!(!literals_holding(&["compiler/src/family"], TENSOR_NAME_PARTS, |_| false).is_empty());
}

/// The packages `package` depends on for its normal (non-dev) build, by
/// name, through `cargo tree` on the locked workspace.
fn dependencies_of(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .current_dir(root())
        .args(["tree", "--locked", "--offline", "-e", "normal", "--prefix", "none", "--format", "{p}", "-p", package])
        .output()
        .expect("cargo tree runs");
    assert!(out.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&out.stderr));
    let mut names: Vec<String> =
        String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect();
    names.sort();
    names.dedup();
    names
}

/// The crates follow the pipeline: the contract at the bottom; the
/// compiler (MLIR and LLVM) beside the front (text and images) and the
/// runtime, none of them knowing the others; the server on the front; the
/// CLI on top. A server edit then never rebuilds the crate that links
/// MLIR, and a stage executable links nothing of HTTP or the tokenizer.
#[test]
fn the_crates_are_layered_as_the_pipeline_is() {
    const COMPILER: &[&str] = &["melior", "inkwell", "mlir-sys", "m3c-compiler", "m3c-kernels"];
    const SERVING: &[&str] = &["axum", "tokio", "reqwest", "m3c-serve"];
    const FRONT: &[&str] = &["tokenizers", "minijinja", "image", "m3c-front"];
    let rules: &[(&str, &[&[&str]])] = &[
        ("m3c-contract", &[COMPILER, SERVING, FRONT, &["m3c-runtime", "m3c-signals"]]),
        ("m3c-compiler", &[SERVING, FRONT, &["m3c-runtime"]]),
        ("m3c-front", &[COMPILER, SERVING, &["m3c-runtime"]]),
        ("m3c-serve", &[COMPILER, &["m3c-runtime"]]),
        ("m3c-runtime", &[COMPILER, SERVING, FRONT]),
        ("m3c-constrain", &[COMPILER, SERVING, FRONT, &["m3c-runtime"]]),
        // Algorithms of their own, with no MPI: what the stages run, testable alone.
        ("m3c-sampler", &[COMPILER, SERVING, FRONT, &["m3c-runtime", "mpi"]]),
        ("m3c-kvpool", &[COMPILER, SERVING, FRONT, &["m3c-runtime", "mpi"]]),
        // The scheduler is a pure function of its events: no MPI, device or HTTP.
        ("m3c-engine", &[COMPILER, SERVING, FRONT, &["m3c-runtime", "mpi", "cudarc", "libloading"]]),
    ];
    let mut broken = Vec::new();
    for (package, forbidden) in rules {
        let deps = dependencies_of(package);
        assert!(deps.iter().any(|d| d == package), "cargo tree lists {package} itself: {deps:?}");
        for f in forbidden.iter().flat_map(|set| set.iter()).filter(|f| *f != package) {
            if deps.iter().any(|d| d == f) {
                broken.push(format!("{package} depends on {f}"));
            }
        }
    }
    assert!(broken.is_empty(), "layering broken:\n{}", broken.join("\n"));
    // The query sees through to what the command line links.
    let cli = dependencies_of("m3c");
    for d in ["m3c-compiler", "m3c-front", "m3c-serve", "melior", "axum", "tokenizers"] {
        assert!(cli.iter().any(|c| c == d), "m3c depends on {d}: {cli:?}");
    }
}

/// `text` with comments, string and char literals blanked (their line
/// breaks kept), so that braces and `fn` are counted only as code.
fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let keep_lines = |s: &[char], out: &mut String| out.extend(s.iter().filter(|&&c| c == '\n'));
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        let word_before = i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_');
        if rest.starts_with(&['/', '/']) {
            i += rest.iter().position(|&c| c == '\n').unwrap_or(rest.len());
        } else if rest.starts_with(&['/', '*']) {
            let (mut depth, mut j) = (0, 0);
            while j < rest.len() {
                if rest[j..].starts_with(&['/', '*']) {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with(&['*', '/']) {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            keep_lines(&rest[..j.min(rest.len())], &mut out);
            i += j;
        } else if let Some(hashes) = (!word_before).then(|| raw_string_start(rest)).flatten() {
            // r#"..."#: ends at the quote followed by as many hashes.
            let open = rest.iter().position(|&c| c == '"').unwrap_or(0) + 1;
            let mut j = open;
            while j < rest.len() && !(rest[j] == '"' && rest[j + 1..].iter().take(hashes).filter(|&&c| c == '#').count() == hashes) {
                j += 1;
            }
            let end = (j + 1 + hashes).min(rest.len());
            out.push_str("\"\"");
            keep_lines(&rest[..end], &mut out);
            i += end;
        } else if b[i] == '"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != '"' {
                j += if rest[j] == '\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            keep_lines(&rest[..j.min(rest.len())], &mut out);
            i += j + 1;
        } else if b[i] == '\'' && rest.get(1) == Some(&'\\') {
            let j = rest[2..].iter().position(|&c| c == '\'').map_or(rest.len(), |p| p + 3);
            out.push_str("' '");
            i += j;
        } else if b[i] == '\'' && rest.get(2) == Some(&'\'') {
            out.push_str("' '");
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// The number of `#`s of a raw string literal that starts `s` (`r"`,
/// `r#"`, `br"`...).
fn raw_string_start(s: &[char]) -> Option<usize> {
    let s = if s.first() == Some(&'b') { &s[1..] } else { s };
    if s.first() != Some(&'r') {
        return None;
    }
    let hashes = s[1..].iter().take_while(|&&c| c == '#').count();
    (s.get(1 + hashes) == Some(&'"')).then_some(hashes)
}

/// Each function with a body in `text`: its name, first line and length in
/// lines (from `fn` to its closing brace).
fn function_lengths(text: &str) -> Vec<(String, usize, usize)> {
    let code: Vec<char> = code_only(text).chars().collect();
    let line_at = |k: usize| code[..k].iter().filter(|&&c| c == '\n').count() + 1;
    let mut found = Vec::new();
    for k in 0..code.len().saturating_sub(3) {
        let starts_word = k == 0 || !(code[k - 1].is_alphanumeric() || code[k - 1] == '_');
        if !(starts_word && code[k..].starts_with(&['f', 'n']) && code[k + 2].is_whitespace()) {
            continue;
        }
        let name: String =
            code[k + 2..].iter().skip_while(|c| c.is_whitespace()).take_while(|c| c.is_alphanumeric() || **c == '_').collect();
        // The body starts at the first `{` after the signature; a `;` first
        // is a declaration without one.
        let Some(open) = code[k..].iter().position(|&c| c == '{' || c == ';').map(|p| k + p).filter(|&p| code[p] == '{') else {
            continue;
        };
        let mut depth = 0usize;
        let close = (open..code.len()).find(|&j| {
            match code[j] {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            depth == 0
        });
        if let (false, Some(close)) = (name.is_empty(), close) {
            found.push((name, line_at(k), line_at(close) - line_at(k) + 1));
        }
    }
    found
}

/// Small functions: none over 150 lines, tests included. The SIMT
/// interpreter's per-dialect op dispatch (`tests/simt/*::*_op`) may stay
/// one long match, as the structure issue allowed.
#[test]
fn no_function_is_longer_than_150_lines() {
    let mut long = Vec::new();
    let files: Vec<PathBuf> = crates().iter().flat_map(|d| rust_files(&root().join(d))).collect();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let interpreter = f.starts_with(root().join("tests/simt"));
        for (name, line, len) in function_lengths(&text) {
            if len > 150 && !(interpreter && name.ends_with("_op")) {
                long.push(format!("{}:{line}: fn {name} has {len} lines", f.strip_prefix(root()).unwrap().display()));
            }
        }
    }
    assert!(long.is_empty(), "split these functions:\n{}", long.join("\n"));
}

/// The engine's functions are shorter still: each scheduling rule is read
/// (and tested) on its own.
#[test]
fn no_engine_function_is_longer_than_80_lines() {
    let mut long = Vec::new();
    for f in rust_files(&root().join("engine")) {
        let text = std::fs::read_to_string(&f).unwrap();
        for (name, line, len) in function_lengths(&text).into_iter().filter(|(_, _, len)| *len > 80) {
            long.push(format!("{}:{line}: fn {name} has {len} lines", f.strip_prefix(root()).unwrap().display()));
        }
    }
    assert!(long.is_empty(), "split these functions:\n{}", long.join("\n"));
}

#[test]
fn the_function_length_check_can_fail() {
    let text = "fn short() {\n    let s = \"}\";\n}\n\
                // fn commented() {\n\
                fn long<'a>(x: &'a str) -> char {\n    let c = '{';\n    let r = r#\"}\"#;\n    /* } */\n    c\n}\n\
                trait T { fn declared(&self); }\n";
    let lens = function_lengths(text);
    assert_eq!(lens, vec![("short".to_string(), 1, 3), ("long".to_string(), 5, 6)], "{lens:?}");
}

/// The modules of one crate that the code of each top-level module names
/// (`crate::m`, `crate::{m, ...}`), tests left out: module → (module →
/// the files that name it).
type ModuleEdges = std::collections::BTreeMap<String, std::collections::BTreeMap<String, Vec<String>>>;

fn module_edges(src: &Path) -> ModuleEdges {
    let top_of = |p: &Path| -> Option<String> {
        let first = p.strip_prefix(src).ok()?.components().next()?.as_os_str().to_string_lossy().into_owned();
        let name = first.strip_suffix(".rs").unwrap_or(&first).to_string();
        (name != "lib" && name != "main").then_some(name)
    };
    let files = rust_files(src);
    let tops: std::collections::BTreeSet<String> = files.iter().filter_map(|f| top_of(f)).collect();
    let mut edges = ModuleEdges::new();
    for f in &files {
        let Some(from) = top_of(f) else { continue };
        let text = code_only(&std::fs::read_to_string(f).unwrap());
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let mut named = Vec::new();
        for (at, _) in code.match_indices("crate::") {
            let rest = &code[at + "crate::".len()..];
            let group = rest.strip_prefix('{').map(|g| &g[..g.find('}').unwrap_or(g.len())]);
            let words: Vec<&str> = match group {
                // `crate::{a, b::c}`: each item's first word.
                Some(g) => g.split(',').filter_map(|item| item.trim().split("::").next()).collect(),
                None => rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).take(1).collect(),
            };
            named.extend(words.into_iter().filter(|w| tops.contains(*w) && *w != from).map(str::to_string));
        }
        for to in named {
            let rel = f.strip_prefix(root()).unwrap().display().to_string();
            let files = edges.entry(from.clone()).or_default().entry(to).or_default();
            if !files.contains(&rel) {
                files.push(rel);
            }
        }
    }
    edges
}

/// Each pair of modules that reach each other through `edges`.
fn circles(edges: &ModuleEdges) -> Vec<(String, String)> {
    let reach = |from: &str| {
        let mut seen = std::collections::BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for next in edges.get(&m).into_iter().flat_map(|e| e.keys()) {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let mut out = Vec::new();
    for a in edges.keys() {
        for b in reach(a).into_iter().filter(|b| b > a) {
            if reach(&b).contains(a) {
                out.push((a.clone(), b));
            }
        }
    }
    out
}

/// No import circles between a crate's top-level modules: a type both
/// sides need lives a floor down, in a module both use.
#[test]
fn no_module_imports_one_that_imports_it() {
    let mut found = Vec::new();
    for krate in crates() {
        let src = root().join(&krate).join("src");
        if !src.is_dir() {
            continue;
        }
        let edges = module_edges(&src);
        for (a, b) in circles(&edges) {
            let via = |x: &str, y: &str| edges.get(x).and_then(|e| e.get(y)).map(|f| f.join(", ")).unwrap_or_default();
            found.push(format!("{krate}: {a} -> {b} [{}] and back [{}]", via(&a, &b), via(&b, &a)));
        }
    }
    assert!(found.is_empty(), "import circles (an indirect way back leaves a side's list empty):\n{}", found.join("\n"));
}

#[test]
fn the_circle_check_can_fail() {
    let mut edges = ModuleEdges::new();
    for (a, b) in [("config", "family"), ("family", "graph"), ("graph", "config"), ("plan", "config")] {
        edges.entry(a.into()).or_default().insert(b.into(), vec![]);
    }
    let c = circles(&edges);
    assert_eq!(c.len(), 3, "{c:?}");
    assert!(c.contains(&("config".into(), "graph".into())) && !c.iter().any(|(a, b)| a == "plan" || b == "plan"));
}
