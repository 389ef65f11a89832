//! What structured output and logprobs cost per generated token at
//! MiniMax-M3's vocabulary size (200,064 ids), on this machine's CPU:
//!
//!     cargo run --release -p m3c-constrain --example mask_bench
//!
//! The vocabulary is synthetic (the real tokenizer is not shipped with the
//! fixtures): the 256 byte tokens, then words of 2 to 12 characters drawn
//! from English-like letters, digits, punctuation and space-prefixed forms,
//! as a byte-level BPE vocabulary is. The grammar is a JSON schema of the
//! size clients send (an object of a string, an integer, a boolean, an
//! enum and an array of strings); the output followed is a fixed valid
//! answer, tokenised greedily by the longest allowed token at each step.

use m3c_constrain::{Grammar, Vocabulary};
use std::time::Instant;

const VOCAB: usize = 200_064;

/// A byte-level tokenizer.json of `VOCAB` ids (ids past the words are
/// special tokens), and the table of each id's bytes.
fn synthetic_tokenizer() -> (String, Vec<Vec<u8>>) {
    // GPT-2's byte alphabet: printable Latin-1 maps to itself, the rest to 256+.
    let mut alphabet = Vec::new();
    let mut n = 0u32;
    for b in 0..=255u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        alphabet.push(if printable {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        });
    }
    let spell = |bytes: &[u8]| bytes.iter().map(|&b| alphabet[b as usize]).collect::<String>();
    let mut table: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let mut seen: std::collections::HashSet<Vec<u8>> = table.iter().cloned().collect();
    let chars = b"etaoinshrdlcumwfgypbvkjxqzETAOINSHRD0123456789.,:;\"'{}[]_-";
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    while table.len() < VOCAB - 16 {
        let len = 2 + (next() % 11) as usize;
        let mut w: Vec<u8> = (0..len).map(|_| chars[(next() % chars.len() as u64) as usize]).collect();
        if next() % 2 == 0 {
            w.insert(0, b' ');
        }
        if seen.insert(w.clone()) {
            table.push(w);
        }
    }
    let mut vocab = serde_json::Map::new();
    for (i, w) in table.iter().enumerate() {
        vocab.insert(spell(w), serde_json::json!(i));
    }
    let first_special = table.len();
    let added: Vec<serde_json::Value> =
        (first_special..VOCAB).map(|i| serde_json::json!({"id": i, "content": format!("<special_{i}>"), "special": true})).collect();
    table.extend((first_special..VOCAB).map(|_| Vec::new()));
    let json = serde_json::json!({"model": {"type": "BPE", "vocab": vocab, "merges": []}, "decoder": {"type": "ByteLevel"}, "added_tokens": added});
    (json.to_string(), table)
}

fn main() {
    let t0 = Instant::now();
    let (json, table) = synthetic_tokenizer();
    let eos = (VOCAB - 1) as u32;
    let v = Vocabulary::from_tokenizer_json(&json, Some(VOCAB), &[eos]).expect("the synthetic vocabulary loads");
    println!("vocabulary of {VOCAB} ids built in {:.2} s (once per process)", t0.elapsed().as_secs_f64());
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "active": {"type": "boolean"},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8}
        },
        "required": ["name", "age", "active", "role", "tags"],
        "additionalProperties": false
    });
    let target = br#"{"name":"Ada Lovelace","age":36,"active":true,"role":"editor","tags":["math","poetry","engines"]}"#;
    let t1 = Instant::now();
    let mut c = v.compile(&Grammar::JsonSchema(schema).to_text()).expect("the schema compiles");
    println!("schema compiled in {:.2} ms (once per request)", t1.elapsed().as_secs_f64() * 1e3);
    let (mut times, mut pos) = (Vec::new(), 0usize);
    while pos < target.len() {
        let t = Instant::now();
        let mask = c.mask().expect("a mask");
        times.push(t.elapsed().as_secs_f64());
        let allowed = |i: usize| mask[i / 32] >> (i % 32) & 1 == 1;
        // The longest allowed token that spells the answer's next bytes.
        let id = (0..table.len())
            .filter(|&i| allowed(i) && !table[i].is_empty() && target[pos..].starts_with(&table[i]))
            .max_by_key(|&i| table[i].len())
            .expect("some allowed token continues the answer");
        pos += table[id].len();
        c.consume(id as u32).expect("the token is accepted");
    }
    let eos_allowed = c.mask().map(|m| m[eos as usize / 32] >> (eos % 32) & 1 == 1).unwrap_or(false);
    times.sort_by(f64::total_cmp);
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    println!(
        "mask per token over {} tokens: mean {:.3} ms, median {:.3} ms, max {:.3} ms; EOS allowed at the end: {eos_allowed}",
        times.len(),
        mean * 1e3,
        times[times.len() / 2] * 1e3,
        times[times.len() - 1] * 1e3
    );
    // Logprobs: a log-softmax over the row and the top alternatives.
    let logits: Vec<f32> = (0..VOCAB).map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 20.0).collect();
    for k in [0usize, 5, 20] {
        let reps = 50;
        let t = Instant::now();
        for r in 0..reps {
            std::hint::black_box(m3c_sampler::logprobs::logprobs(std::hint::black_box(&logits), r as u32, k));
        }
        println!("logprobs per token (k = {k}): {:.3} ms", t.elapsed().as_secs_f64() / reps as f64 * 1e3);
    }
}
