//! The reader against the corpus of model outputs in
//! `tests/fixtures/tool-calls/corpus.json` (well formed, malformed, cut,
//! parallel, nested; each with the reasoning, content and calls it must
//! give), whole and in every way of cutting it into pieces. The served
//! tests (`tests/serve/client.py`) send the same corpus through OpenAI's
//! and Anthropic's clients.

use super::*;
use proptest::prelude::*;
use serde_json::json;

const CORPUS: &str = include_str!("../../../tests/fixtures/tool-calls/corpus.json");

struct Case {
    name: String,
    think: ThinkStart,
    tools: Vec<Value>,
    text: String,
    reasoning: String,
    content: String,
    calls: Vec<(String, Value)>,
    cut: bool,
}

fn corpus() -> Vec<Case> {
    let c: Value = serde_json::from_str(CORPUS).unwrap();
    let mark = c["mark"].as_str().unwrap();
    let s = |v: &Value| v.as_str().unwrap().replace(mark, MARK);
    c["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| Case {
            name: s(&k["name"]),
            think: match k["think"].as_str() {
                Some("enabled") => ThinkStart::Open,
                Some("adaptive") => ThinkStart::Adaptive,
                _ => ThinkStart::Closed,
            },
            tools: k["tools"].as_array().unwrap().iter().map(|n| c["tools"][n.as_str().unwrap()].clone()).collect(),
            text: s(&k["text"]),
            reasoning: s(&k["reasoning"]),
            content: s(&k["content"]),
            calls: k["calls"].as_array().unwrap().iter().map(|c| (s(&c["name"]), c["arguments"].clone())).collect(),
            cut: k["cut"].as_bool().unwrap(),
        })
        .collect()
}

/// Reads `pieces` of one output; returns the reader and what it gave out.
fn read(case: &Case, pieces: &[&str]) -> (ChatOutput, Vec<Piece>) {
    let mut o = ChatOutput::new(minimax(), case.think, Reading::Free, &case.tools);
    let mut shown = Vec::new();
    for p in pieces {
        shown.extend(o.push(p));
    }
    shown.extend(o.finish());
    (o, shown)
}

/// `text` cut at these character counts.
fn cut_at(text: &str, cuts: &[usize]) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut at: Vec<usize> = cuts.iter().map(|&c| c % (chars.len() + 1)).collect();
    at.push(0);
    at.push(chars.len());
    at.sort_unstable();
    at.dedup();
    at.windows(2).map(|w| chars[w[0]..w[1]].iter().collect()).collect()
}

const MARKUP: &[&str] = &["<tool_call", "</tool_call", "<invoke", "</invoke", MARK, "<mm:think>", "</mm:think>"];

/// What the pieces add up to; checks that calls start before their
/// arguments and that every piece was counted by the reader.
fn added_up(o: &ChatOutput, shown: &[Piece]) -> (String, String, Vec<(String, String)>) {
    let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::<(String, String)>::new());
    for p in shown {
        match p {
            Piece::Reasoning(t) => r += t,
            Piece::Content(t) => c += t,
            Piece::Call { index, name } => {
                assert_eq!(*index, calls.len(), "calls are numbered in order");
                calls.push((name.clone(), String::new()));
            }
            Piece::Args { index, json } => calls.get_mut(*index).expect("arguments after their call").1 += json,
        }
    }
    assert_eq!((&r, &c), (&o.reasoning, &o.content));
    let kept: Vec<(String, String)> = o.tool_calls.iter().map(|t| (t.name.clone(), t.arguments.clone())).collect();
    assert_eq!(calls, kept);
    (r, c, calls)
}

fn check_whole(case: &Case) -> (String, String, Vec<(String, String)>) {
    let (o, shown) = read(case, &[&case.text]);
    let (reasoning, content, calls) = added_up(&o, &shown);
    let name = &case.name;
    assert_eq!(reasoning, case.reasoning, "{name}: reasoning");
    assert_eq!(content, case.content, "{name}: content");
    assert!(!MARKUP.iter().any(|m| content.contains(m)), "{name}: markup in the content {content:?}");
    let got: Vec<(String, Value)> = calls
        .iter()
        .map(|(n, a)| (n.clone(), serde_json::from_str(a).unwrap_or_else(|e| panic!("{name}: arguments {a:?} are not JSON: {e}"))))
        .collect();
    assert_eq!(got, case.calls, "{name}: calls");
    assert_eq!(o.cut(), case.cut, "{name}: cut");
    (reasoning, content, calls)
}

#[test]
fn every_corpus_case_reads_as_it_should() {
    let cases = corpus();
    assert!(cases.len() >= 40, "a corpus of {} cases", cases.len());
    for case in &cases {
        check_whole(case);
    }
}

/// Streamed a character at a time and in pieces of 2 to 7: the same
/// reasoning, content and calls, and every call's arguments in more than
/// one fragment (a string streams as it is written, and the object's `{`
/// goes out with its first key).
#[test]
fn every_corpus_case_streams_as_it_reads_whole() {
    for case in corpus() {
        let whole = check_whole(&case);
        for size in 1..=7 {
            let cuts: Vec<usize> = (1..case.text.chars().count()).filter(|i| i % size == 0).collect();
            let pieces = cut_at(&case.text, &cuts);
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (o, shown) = read(&case, &refs);
            assert_eq!(added_up(&o, &shown), whole, "{}: in pieces of {size}", case.name);
            if size == 1 {
                for (i, (name, args)) in whole.2.iter().enumerate() {
                    let fragments: Vec<&str> = shown
                        .iter()
                        .filter_map(|p| if let Piece::Args { index, json } = p { (*index == i).then_some(json.as_str()) } else { None })
                        .collect();
                    assert!(args == "{}" || fragments.len() > 1, "{}: call {i} ({name}) came in {fragments:?}", case.name);
                    // A string parameter streams: no fragment holds a whole
                    // value of two characters or more (but one written
                    // without its opening tag, whose name comes after it).
                    let elided = case.name.contains("without its opening tag");
                    for s in streamed_strings(&case, name, args).into_iter().filter(|_| !elided) {
                        let quoted = Value::String(s.clone()).to_string();
                        assert!(!fragments.iter().any(|f| f.contains(&quoted)), "{}: {s:?} came whole: {fragments:?}", case.name);
                    }
                }
            }
        }
    }
}

/// The values of a call's string-typed parameters (two characters or more).
fn streamed_strings(case: &Case, name: &str, args: &str) -> Vec<String> {
    let Some(tool) = case.tools.iter().find(|t| t["function"]["name"] == name) else { return Vec::new() };
    let props = &tool["function"]["parameters"]["properties"];
    let args: Value = serde_json::from_str(args).unwrap_or_default();
    let Some(o) = args.as_object() else { return Vec::new() };
    o.iter()
        .filter(|(k, _)| props[k.as_str()]["type"] == "string")
        .filter_map(|(_, v)| v.as_str().filter(|s| s.chars().count() >= 2).map(str::to_string))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    /// Over random cuts of random corpus cases, streamed equals whole.
    #[test]
    fn any_chunking_reads_as_the_whole(which in 0usize..1000, cuts in proptest::collection::vec(0usize..4000, 0..24)) {
        let cases = corpus();
        let case = &cases[which % cases.len()];
        let whole = check_whole(case);
        let pieces = cut_at(&case.text, &cuts);
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let (o, shown) = read(case, &refs);
        prop_assert_eq!(added_up(&o, &shown), whole);
    }
}

/// A string value goes out as it is written; a number waits for its
/// closing tag.
#[test]
fn strings_stream_and_numbers_wait_for_their_closing_tag() {
    let tools = vec![json!({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"}}}}})];
    let mut o = ChatOutput::new(minimax(), ThinkStart::Closed, Reading::Free, &tools);
    let mut args = |text: &str| -> String {
        o.push(text).into_iter().filter_map(|p| if let Piece::Args { json, .. } = p { Some(json) } else { None }).collect()
    };
    assert_eq!(args(&format!("{MARK}<tool_call>\n{MARK}<invoke name=\"f\">{MARK}<s>Hel")), "{\"s\":\"Hel");
    assert_eq!(args("lo wor"), "lo wor");
    assert_eq!(args(&format!("ld{MARK}</s>{MARK}<n>12")), "ld\",\"n\":");
    assert_eq!(args("3"), "");
    assert_eq!(args(&format!("{MARK}</n>")), "123");
    assert_eq!(args(&format!("{MARK}</invoke>")), "}");
}

/// Without tools there is nothing to call: a block is text (marks
/// removed); a constrained answer is the grammar's text as it is.
#[test]
fn without_tools_a_block_is_text_and_a_constrained_answer_is_verbatim() {
    let text = format!("Hi {MARK}<tool_call>\n{MARK}<invoke name=\"f\">{MARK}<x>1");
    let mut o = ChatOutput::new(minimax(), ThinkStart::Closed, Reading::Free, &[]);
    o.push(&text);
    o.finish();
    assert_eq!(o.content, "Hi <tool_call>\n<invoke name=\"f\"><x>1");
    assert!(o.tool_calls.is_empty() && !o.cut());
    let mut o = ChatOutput::new(minimax(), ThinkStart::Closed, Reading::Constrained, &[]);
    o.push(&text);
    o.finish();
    assert_eq!(o.content, text);
}

/// The format the cases are written in.
fn minimax() -> &'static m3c_contract::chat_format::ChatFormat {
    m3c_contract::chat_format::ChatFormat::of_family("minimax_m3").unwrap()
}

/// MiniMax-M3's call mark.
const MARK: &str = "]<]minimax[>[";
