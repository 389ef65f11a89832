//! The README as a test, as a doc test treats a crate's examples: every
//! command block of README.md and docs/*.md runs, top to bottom, in one
//! folder, as a new user would type it, with the tiny fixture in place of
//! the model (the substitutions are [`substitute`]'s, all of them). State
//! carries from block to block as it does for the user: `m3c plan` writes
//! the plan.yaml that `m3c compile plan.yaml` reads, whose `out/` the runs
//! use, and `m3c serve` stays up for the curl and Python blocks after it.
//!
//! A line that is a synopsis (`[--flag]`, `a|b`, `...`) is not run; its
//! subcommand, flags and listed values are checked against the CLI's own
//! definition instead, as is every `m3c` line of every block, run or not.
//! A block that cannot run here says why in a comment just before it
//! (`<!-- readme-test: not run: REASON -->`, or `skip "PREFIX": REASON`
//! for the lines starting with PREFIX); a block of anything else (YAML,
//! JSON, output, diagrams) is text.

use m3c_tests::{fixture, m3c_bin, root};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One code block of a Markdown file.
#[derive(Debug)]
struct Block {
    /// `FILE:LINE` of its first line.
    at: String,
    text: String,
    /// The `readme-test:` comment just before it.
    marker: Option<String>,
    /// A fenced block's language (` ```yaml `), empty for the others.
    lang: String,
}

/// Every code block of `file` (indented and fenced), with its marker.
fn blocks(file: &Path) -> Vec<Block> {
    use pulldown_cmark::{Event, Parser, Tag};
    let src = std::fs::read_to_string(file).unwrap();
    let name = file.strip_prefix(root()).unwrap_or(file).display().to_string();
    let mut out: Vec<Block> = Vec::new();
    let mut open: Option<Block> = None;
    for (event, range) in Parser::new(&src).into_offset_iter() {
        match event {
            Event::Start(Tag::CodeBlock(k)) => {
                let lang = match k {
                    pulldown_cmark::CodeBlockKind::Fenced(info) => info.split_whitespace().next().unwrap_or_default().to_string(),
                    pulldown_cmark::CodeBlockKind::Indented => String::new(),
                };
                let line = src[..range.start].lines().count() + 1;
                let before = src[..range.start].trim_end();
                let marker = before
                    .strip_suffix("-->")
                    .and_then(|b| b.rsplit_once("<!--"))
                    .and_then(|(_, c)| c.trim().strip_prefix("readme-test:"))
                    .map(|m| m.trim().to_string());
                open = Some(Block { at: format!("{name}:{line}"), text: String::new(), marker, lang });
            }
            Event::Text(t) => {
                if let Some(b) = open.as_mut() {
                    b.text.push_str(&t);
                }
            }
            Event::End(pulldown_cmark::TagEnd::CodeBlock) => out.extend(open.take()),
            _ => {}
        }
    }
    out
}

/// A block's logical lines as the shell reads them: `\` continuations
/// joined, a quote open across lines kept open (its newlines kept), `#`
/// comments (after whitespace, outside quotes) and blank lines dropped.
fn logical_lines(text: &str) -> Vec<String> {
    let (mut lines, mut current) = (Vec::new(), String::new());
    let (mut quote, mut comment, mut prev) = (None, false, ' ');
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (_, '\n') if comment => {
                comment = false;
                end_line(&mut lines, &mut current);
            }
            _ if comment => {}
            (None, '\\') if chars.peek() == Some(&'\n') => {
                chars.next();
                current.push(' ');
            }
            (None, '\n') => end_line(&mut lines, &mut current),
            (None, '#') if prev.is_whitespace() => comment = true,
            (None, '\'' | '"') => {
                quote = Some(c);
                current.push(c);
            }
            (Some(q), _) if c == q => {
                quote = None;
                current.push(c);
            }
            _ => current.push(c),
        }
        prev = c;
    }
    end_line(&mut lines, &mut current);
    lines
}

fn end_line(lines: &mut Vec<String>, current: &mut String) {
    let line = std::mem::take(current);
    if !line.trim().is_empty() {
        lines.push(line.trim().to_string());
    }
}

/// Words as the shell splits them (quotes removed), and whether the line
/// has synopsis notation outside quotes: `[…]`, `...`, or a `|` of
/// choices (`a|b`, or any `|` inside brackets; a `|` between spaces
/// outside them is a shell pipe).
fn words(line: &str) -> (Vec<String>, bool) {
    let (mut out, mut word, mut quote, mut synopsis, mut in_word) = (Vec::new(), String::new(), None, false, false);
    let chars: Vec<char> = line.chars().collect();
    let mut depth = 0usize;
    for (i, &c) in chars.iter().enumerate() {
        let spaced = |j: Option<usize>| j.and_then(|j| chars.get(j)).is_none_or(|c| c.is_whitespace());
        match (quote, c) {
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (Some(q), _) if c == q => quote = None,
            (Some(_), _) => word.push(c),
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                }
                in_word = false;
            }
            (None, c) => {
                match c {
                    '[' => depth += 1,
                    ']' => depth = depth.saturating_sub(1),
                    '|' => synopsis |= depth > 0 || !(spaced(i.checked_sub(1)) && spaced(Some(i + 1))),
                    _ => {}
                }
                synopsis |= c == '[';
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(word);
    }
    synopsis |= out.iter().any(|w| w.contains("..."));
    (out, synopsis)
}

/// A synopsis's least form, which runs: its `[optional]` groups dropped
/// (outside quotes); `None` when a choice (`a|b`) or an `...` is left.
fn least_form(line: &str) -> Option<String> {
    let (mut out, mut depth, mut quote) = (String::new(), 0usize, None);
    for c in line.chars() {
        match (quote, c) {
            (None, '[') => depth += 1,
            (None, ']') => depth = depth.checked_sub(1)?,
            (None, '\'' | '"') if depth == 0 => {
                quote = Some(c);
                out.push(c);
            }
            (Some(q), _) if c == q => {
                quote = None;
                out.push(c);
            }
            _ if depth > 0 => {}
            _ => out.push(c),
        }
    }
    let least = out.split_whitespace().collect::<Vec<_>>().join(" ");
    (depth == 0 && !words(&least).1).then_some(least)
}

/// An `m3c` line checked against the CLI's definition: the subcommand
/// exists, every flag is one of its own (or an alias), and every value of
/// an `a|b|c` list is one it accepts when it lists its values.
fn check_m3c_line(cli: &clap::Command, at: &str, line: &str) -> Result<(), String> {
    let (ws, _) = words(line);
    let Some(start) = ws.iter().position(|w| w == "m3c") else { return Ok(()) };
    let ws: Vec<String> = ws[start + 1..].iter().map(|w| w.trim_matches(|c| c == '[' || c == ']').to_string()).collect();
    let Some(name) = ws.first() else { return Err(format!("{at}: `m3c` without a subcommand: {line}")) };
    let sub = cli.find_subcommand(name).ok_or_else(|| format!("{at}: `m3c {name}` is no subcommand of m3c: {line}"))?;
    let mut i = 1;
    while i < ws.len() {
        let w = &ws[i];
        i += 1;
        let arg = if let Some(long) = w.strip_prefix("--") {
            let long = long.split('=').next().unwrap_or_default();
            if long.is_empty() {
                continue; // `--` ends the flags
            }
            sub.get_arguments().find(|a| a.get_long() == Some(long) || a.get_all_aliases().is_some_and(|al| al.contains(&long)))
        } else if let Some(short) = w.strip_prefix('-').filter(|s| s.chars().count() == 1) {
            let c = short.chars().next().unwrap_or_default();
            if c.is_ascii_digit() {
                continue; // a negative number
            }
            sub.get_arguments().find(|a| a.get_short() == Some(c))
        } else {
            continue;
        };
        let arg = arg.ok_or_else(|| format!("{at}: `m3c {name}` has no flag `{w}`: {line}"))?;
        let values = arg.get_possible_values();
        if let Some(v) = ws.get(i).filter(|v| v.contains('|') && !v.starts_with('-') && !values.is_empty()) {
            for alt in v.split('|').filter(|a| !a.is_empty()) {
                if !values.iter().any(|p| p.matches(alt, false)) {
                    return Err(format!("{at}: `m3c {name} {w}` does not take `{alt}`: {line}"));
                }
            }
        }
    }
    Ok(())
}

/// What a block holds.
#[derive(Debug, PartialEq)]
enum Kind {
    Shell,
    Python,
    Text,
}

/// A block's kind: by its fence's language where it names one (`sh`,
/// `bash`, `python`; any other is text), else by its lines.
fn block_kind(b: &Block) -> Kind {
    match b.lang.as_str() {
        "" => kind(&b.text),
        "sh" | "bash" | "shell" | "console" => Kind::Shell,
        "python" | "py" => Kind::Python,
        _ => Kind::Text,
    }
}

fn kind(text: &str) -> Kind {
    let lines = logical_lines(text);
    if lines.first().is_some_and(|l| l.starts_with("from ") || l.starts_with("import ")) {
        return Kind::Python;
    }
    let command = |l: &str| {
        let first = l.split_whitespace().find(|w| !w.contains('=') || w.starts_with('-')).unwrap_or_default();
        ["m3c", "mpirun", "curl", "rsync", "python3", "cargo"].contains(&first) || first.starts_with("./") || first.starts_with("OUT/")
    };
    if lines.iter().any(|l| command(l)) {
        Kind::Shell
    } else {
        Kind::Text
    }
}

/// The README's placeholders in terms of this test's folder: the tiny
/// fixture is the model (copied as `MiniMax-M3`, so the served name is the
/// README's), `out` is OUT, the tiny EAGLE3 head the draft, the fixture's
/// MSA block and context the recipe's, and the server's port `port`, the
/// running server's.
fn substitute(line: &str, port: u16) -> String {
    let draft = fixture("eagle3-tiny");
    let mut s = line.to_string();
    for (from, to) in [
        ("MODEL_DIR", "MiniMax-M3"),
        ("MODEL", "MiniMax-M3"),
        ("OUT", "out"),
        ("NEW_DIR", "tiny-2"),
        ("DRAFT_DIR", draft.to_str().unwrap()),
        ("--block-size 128", "--block-size 4"),
        // The tiny model's text is noise at any length: the README's
        // lengths are for the real one.
        ("--max-new-tokens 256", "--max-new-tokens 24"),
        ("--max-new-tokens 64", "--max-new-tokens 24"),
        ("--max-model-len 32768", "--max-model-len 4096"),
    ] {
        s = replace_words(&s, from, to);
    }
    s = s.replace("localhost:8000", &format!("localhost:{port}"));
    // The server listens where the system puts it (a port picked here and
    // released could be another test's server by the time it starts);
    // the running server's port is read from its start-up line.
    if s.starts_with("m3c serve ") {
        s.push_str(" --port 0");
    }
    s
}

/// The port in a server's start-up line (`m3c serve: http://ADDR:PORT/v1
/// serves …`), once it has said it.
fn served_port(log: &str) -> Option<u16> {
    let rest = &log[log.find("m3c serve: http://")? + "m3c serve: http://".len()..];
    rest[..rest.find("/v1")?].rsplit_once(':')?.1.parse().ok()
}

/// `from` replaced where it stands as a whole word (letters, digits and
/// `_` around it end a word; `MODEL` is not in `MODEL_DIR`).
fn replace_words(s: &str, from: &str, to: &str) -> String {
    let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find(from) {
        let (before, after) = (rest[..i].chars().last(), rest[i + from.len()..].chars().next());
        out.push_str(&rest[..i]);
        let edge = |c: Option<char>| !word(c) || !from.chars().all(|f| f.is_ascii_alphanumeric() || f == '_');
        out.push_str(if edge(before) && edge(after) { to } else { from });
        rest = &rest[i + from.len()..];
    }
    out.push_str(rest);
    out
}

/// The folder the README runs in, as a user's would look: the model, and
/// the files its examples name.
struct Session {
    dir: tempfile::TempDir,
    /// The running server's port, as its start-up line said (0 before).
    port: u16,
    server: Option<(Child, String)>,
}

impl Session {
    fn new() -> Session {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let bin = d.join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::os::unix::fs::symlink(m3c_bin(), bin.join("m3c")).unwrap();
        let model = d.join("MiniMax-M3");
        std::fs::create_dir(&model).unwrap();
        for f in std::fs::read_dir(fixture("tiny-m3")).unwrap().flatten().filter(|f| f.path().is_file()) {
            std::fs::copy(f.path(), model.join(f.file_name())).unwrap();
        }
        let png = fixture("vision").join("B_rgb_70x126_roundhalfeven.png");
        image::open(&png).unwrap().to_rgb8().save(d.join("photo.jpg")).unwrap();
        std::fs::copy(&png, d.join("second.png")).unwrap();
        std::fs::copy(&png, d.join("cat.png")).unwrap();
        std::fs::copy(fixture("video").join("clip.mp4"), d.join("clip.mp4")).unwrap();
        std::fs::write(d.join("prompts.txt"), "1,2,3\n4,5\n").unwrap();
        Session { dir, port: 0, server: None }
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        let path = format!("{}:{}", self.dir.path().join("bin").display(), std::env::var("PATH").unwrap_or_default());
        c.current_dir(self.dir.path())
            .env("PATH", path)
            .env("M3C", m3c_bin())
            .env("M3C_CACHE_DIR", m3c_tests::cache_dir())
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        c
    }

    /// Runs one shell line; its output, or why it failed.
    fn shell(&mut self, at: &str, line: &str) -> Result<String, String> {
        if line.starts_with("m3c serve ") {
            return self.serve(at, line);
        }
        let mut cmd = self.command("timeout");
        // The quick start's scripts run where the user cloned m3c.
        if line.starts_with("./scripts/") {
            cmd.current_dir(root());
        }
        // Every line has a deadline (coreutils' timeout): a hung command
        // fails the test rather than the run.
        let o = cmd.args(["300", "bash", "-euo", "pipefail", "-c", line]).stdin(Stdio::null()).output().unwrap();
        let (out, err) = (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned());
        if !o.status.success() {
            return Err(format!("{at}: `{line}` failed ({}):\n{err}\n{out}", o.status));
        }
        if line.starts_with("curl ") && out.contains("\"error\"") {
            return Err(format!("{at}: `{line}` got an error:\n{out}"));
        }
        Ok(out)
    }

    /// Starts a server (stopping the one before) and waits for its /health.
    fn serve(&mut self, at: &str, line: &str) -> Result<String, String> {
        self.stop()?;
        let log = self.dir.path().join(format!("serve-{}.log", at.replace([':', '/'], "_")));
        let file = std::fs::File::create(&log).unwrap();
        let child = self
            .command("bash")
            .args(["-c", &format!("exec {line}")])
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        self.server = Some((child, at.to_string()));
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            // Its own /health: the port it said it listens on.
            if let Some(port) = served_port(&std::fs::read_to_string(&log).unwrap_or_default()) {
                let url = format!("http://127.0.0.1:{port}/health");
                if Command::new("curl").args(["-sf", "-m", "2", &url]).output().is_ok_and(|o| o.status.success()) {
                    self.port = port;
                    return Ok(String::new());
                }
            }
            let exited = self.server.as_mut().and_then(|(c, _)| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() > deadline {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("{at}: `{line}` did not come up ({exited:?}):\n{text}"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops the running server as a user would (SIGTERM); it must stop cleanly.
    fn stop(&mut self) -> Result<(), String> {
        let Some((mut child, at)) = self.server.take() else { return Ok(()) };
        // SAFETY: kill has no memory-safety preconditions; the pid is our
        // child's, not yet waited for.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                return if s.success() { Ok(()) } else { Err(format!("{at}: the server stopped with {s} on SIGTERM")) };
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err(format!("{at}: the server did not stop within 60 s of SIGTERM"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn python(&self, at: &str, text: &str) -> Result<String, String> {
        let python = root().join(".venv-serve/bin/python");
        let o = self.command(python.to_str().unwrap()).args(["-c", text]).stdin(Stdio::null()).output().unwrap();
        if !o.status.success() {
            return Err(format!("{at}: the Python block failed:\n{}", String::from_utf8_lossy(&o.stderr)));
        }
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some((mut c, _)) = self.server.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The Markdown files whose blocks are tested.
fn documents() -> Vec<PathBuf> {
    let mut docs = vec![root().join("README.md")];
    let mut more: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    more.sort();
    docs.extend(more);
    docs
}

/// A block's marker as what to leave out: everything (`not run`), or the
/// lines starting with a prefix (`skip "PREFIX"`).
fn left_out(marker: Option<&str>, at: &str) -> Result<(bool, Option<String>), String> {
    let Some(m) = marker else { return Ok((false, None)) };
    let has_reason = |rest: &str| rest.trim_start().strip_prefix(':').is_some_and(|r| !r.trim().is_empty());
    if let Some(rest) = m.strip_prefix("not run") {
        return if has_reason(rest) { Ok((true, None)) } else { Err(format!("{at}: `not run` without a reason")) };
    }
    if let Some((prefix, rest)) = m.strip_prefix("skip \"").and_then(|r| r.split_once('"')) {
        return if has_reason(rest) { Ok((false, Some(prefix.to_string()))) } else { Err(format!("{at}: `skip` without a reason")) };
    }
    Err(format!("{at}: unknown readme-test marker `{m}` (expected `not run: REASON` or `skip \"PREFIX\": REASON`)"))
}

#[test]
fn every_documented_m3c_line_names_real_subcommands_flags_and_values() {
    let cli = m3c::command();
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        for b in blocks(&doc) {
            if block_kind(&b) != Kind::Shell {
                continue;
            }
            for line in logical_lines(&b.text) {
                if words(&line).0.iter().any(|w| w == "m3c") {
                    checked += 1;
                    problems.extend(check_m3c_line(&cli, &b.at, &line).err());
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(checked >= 25, "only {checked} documented m3c lines found: is the block reader broken?");
    // The checker itself: a renamed flag, a value it does not take and an
    // unknown subcommand are each caught.
    for bad in ["m3c run OUT --max-new-token 4", "m3c plan --kv-cache f32|f16", "m3c launch OUT", "m3c compile [--pp 4] [--bogus]"] {
        assert!(check_m3c_line(&cli, "x", bad).is_err(), "{bad} passed the check");
    }
}

#[test]
fn the_readme_and_docs_command_blocks_run_as_written() {
    let mut s = Session::new();
    let (mut ran, mut blocks_run) = (Vec::new(), 0);
    for doc in documents() {
        for b in blocks(&doc) {
            let (not_run, skip) = left_out(b.marker.as_deref(), &b.at).unwrap_or_else(|e| panic!("{e}"));
            let kind = block_kind(&b);
            if not_run || kind == Kind::Text {
                continue;
            }
            blocks_run += 1;
            if kind == Kind::Python {
                let text = substitute(&b.text, s.port);
                s.python(&b.at, &text).unwrap_or_else(|e| panic!("{e}"));
                ran.push(format!("{}: python", b.at));
                continue;
            }
            for line in logical_lines(&b.text) {
                if skip.as_deref().is_some_and(|p| line.starts_with(p)) {
                    continue;
                }
                // A synopsis runs in its least form, when it has one.
                let Some(line) = (if words(&line).1 { least_form(&line) } else { Some(line) }) else { continue };
                let line = substitute(&line, s.port);
                let t0 = Instant::now();
                s.shell(&b.at, &line).unwrap_or_else(|e| panic!("{e}"));
                ran.push(format!("{}: {line} ({:.1} s)", b.at, t0.elapsed().as_secs_f64()));
            }
        }
    }
    s.stop().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("ran:\n{}", ran.join("\n"));
    // What a new user's first hour needs is among what ran.
    for must in
        ["./scripts/demo.sh", "m3c plan --model", "m3c compile plan.yaml", "m3c run out", "m3c serve MiniMax-M3", "curl ", ": python"]
    {
        assert!(ran.iter().any(|r| r.contains(must)), "nothing ran `{must}`:\n{}", ran.join("\n"));
    }
    assert!(blocks_run >= 10, "{blocks_run} blocks ran:\n{}", ran.join("\n"));
}

#[test]
fn the_block_reader_splits_lines_comments_and_synopses_as_the_shell_would() {
    let text = "m3c run OUT --chat \"a # b\" \\\n  --max-new-tokens 4   # a comment\n\nm3c plan [--pp 4] -o p.yaml\n";
    let lines = logical_lines(text);
    assert_eq!(lines, ["m3c run OUT --chat \"a # b\"    --max-new-tokens 4", "m3c plan [--pp 4] -o p.yaml"]);
    assert_eq!(
        words(&lines[0]),
        (vec!["m3c", "run", "OUT", "--chat", "a # b", "--max-new-tokens", "4"].into_iter().map(String::from).collect(), false)
    );
    assert!(words(&lines[1]).1 && words("mpirun -np 1 a : ...").1 && !words("m3c run --regex 'a|b'").1);
    assert!(words("m3c plan --kv-cache f32|bf16").1 && words("m3c plan [--gpu H200 | --gpu-mem 141]").1);
    assert!(!words("m3c run OUT --chat hi | jq .").1, "a pipe is no synopsis");
    assert_eq!(replace_words("--model MODEL_DIR MODEL OUT/run.sh OUTPUT", "OUT", "out"), "--model MODEL_DIR MODEL out/run.sh OUTPUT");
    assert_eq!(
        least_form("m3c plan --model M [--batch 16] [--gpu H200 | --gpu-mem 141] -o p.yaml").as_deref(),
        Some("m3c plan --model M -o p.yaml")
    );
    assert_eq!(least_form("m3c run --chat 'a [b]' [--x]").as_deref(), Some("m3c run --chat 'a [b]'"));
    assert_eq!(least_form("m3c plan --kv-cache f32|bf16"), None);
    assert_eq!(least_form("mpirun -np 1 a : ..."), None);
    assert_eq!(kind("from openai import OpenAI\n"), Kind::Python);
    assert_eq!(kind("version: 1\nstages:\n"), Kind::Text);
    assert_eq!(kind("m3c: error: the hosts are not ready\n"), Kind::Text);
    assert_eq!(kind("A=\"x\"\nmpirun -np 1 a\n"), Kind::Shell);
    let log = "m3c serve: compiling\nm3c serve: http://0.0.0.0:41234/v1 serves `tiny` (1 stage(s))\n";
    assert_eq!(served_port(log), Some(41234));
    assert_eq!(served_port("m3c serve: compiling\n"), None);
    assert!(substitute("m3c serve MODEL_DIR", 9).ends_with(" --port 0"));
    assert_eq!(substitute("curl -s localhost:8000/health", 41234), "curl -s localhost:41234/health");
}
