//! `m3c serve` as agents use it, through OpenAI's and Anthropic's official
//! Python clients (`tests/serve/agents.py`) on the tiny fixture's random
//! weights: constraints that hold under sampling in every thinking mode,
//! and a corpus of model outputs (well formed, malformed, cut, parallel,
//! nested) read the same whole and streamed, tool-call arguments streamed
//! as the model writes them, no markup in the content.

use crate::serve::Server;
use m3c_tests::fixture;

/// Forced tool calls (`required`, named; Anthropic's `any` and `tool`)
/// and JSON schemas at temperature 1, over 32 seeds in each thinking mode,
/// with no logit steering: every answer is a call or JSON valid under its
/// schema (Pydantic, strict), or ends in finish `length`. The model's
/// reasoning can only close (or the budget closes it); EOS, whatever id
/// the checkpoint gives it, cannot end the answer before the constraint.
#[test]
fn forced_calls_and_schemas_hold_under_sampling_in_every_thinking_mode() {
    let (out, model) = crate::shared::tiny(1);
    let s = Server::start(&out, &model, &[]);
    // 32 seeds: each of the four ways of forcing a call 8 times per mode.
    let got = s.script("agents.py", &["sweep", "32"]);
    for mode in ["adaptive", "enabled", "disabled"] {
        for what in ["tools", "schema"] {
            let t = &got["tally"][mode][what];
            eprintln!("{mode:9} {what:6}: {} valid, {} cut by max_tokens", t["valid"], t["length"]);
            assert_eq!(t["valid"].as_u64().unwrap() + t["length"].as_u64().unwrap(), 32, "{got}");
            assert!(t["valid"].as_u64() >= Some(16), "most answers finish within max_tokens: {got}");
        }
    }
}

/// Every output of `tests/fixtures/tool-calls/corpus.json`, made the
/// model's by a `structured_outputs` choice of its exact text beside the
/// tools (the server's grammars bind the reasoning too, vLLM's
/// `enable_in_reasoning`, so the corpus chooses it), read by both clients
/// whole and through their stream helpers: the reasoning, content, calls
/// and finish the corpus gives, the same each way, arguments in more than
/// one delta.
#[test]
fn the_corpus_reads_the_same_whole_and_streamed_through_both_clients() {
    let (out, model) = crate::shared::tiny(1);
    let s = Server::start(&out, &model, &["--structured-outputs-config", r#"{"enable_in_reasoning": true}"#]);
    let corpus = fixture("tool-calls/corpus.json");
    let got = s.script("agents.py", &["corpus", corpus.to_str().unwrap()]);
    let rows = got["rows"].as_array().unwrap();
    assert!(rows.len() >= 40, "{got}");
    for r in rows {
        eprintln!(
            "{:58} calls {:40} finish {:10} content {}",
            r["case"].as_str().unwrap(),
            r["calls"].to_string(),
            r["finish"].as_str().unwrap(),
            r["content"]
        );
    }
}
