//! The bytes each token id decodes to, read from a byte-level BPE
//! `tokenizer.json` without the tokenizer library: what the first stage
//! needs to end a sequence on a stop string, which may span tokens. Special
//! tokens decode to nothing (as with `skip_special_tokens`), other added
//! tokens to their text, vocabulary entries through GPT-2's byte-to-unicode
//! alphabet that the ByteLevel decoder inverts.

use serde_json::Value;

/// GPT-2's alphabet: printable bytes stand for themselves, the other 68
/// bytes for the code points from 256 up, in byte order.
fn unicode_to_byte() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut map = std::collections::HashMap::with_capacity(256);
    let mut next = 256u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        map.insert(char::from_u32(c).expect("code points below 512 are chars"), b);
    }
    map
}

/// Whether the decoder is ByteLevel (alone or in a sequence).
fn byte_level_decoder(d: &Value) -> bool {
    match d.get("type").and_then(Value::as_str) {
        Some("ByteLevel") => true,
        Some("Sequence") => d.get("decoders").and_then(Value::as_array).is_some_and(|a| a.iter().any(byte_level_decoder)),
        _ => false,
    }
}

/// Bytes per id (index = id) of the tokenizer in `json`; the message of an
/// error says what in the file is not as expected.
pub fn byte_level_table(json: &str) -> Result<Vec<Vec<u8>>, String> {
    let t: Value = serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
    if !t.get("decoder").is_some_and(byte_level_decoder) {
        return Err("its decoder is not ByteLevel; stop strings need a byte-level BPE tokenizer".into());
    }
    let vocab = t.pointer("/model/vocab").and_then(Value::as_object).ok_or("no model.vocab object")?;
    let added = t.get("added_tokens").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    let id_of = |v: &Value| v.as_u64().filter(|&i| i < 1 << 24).map(|i| i as usize);
    let top = vocab.values().filter_map(id_of).chain(added.iter().filter_map(|a| a.get("id").and_then(id_of))).max().unwrap_or(0);
    let mut table = vec![Vec::new(); top + 1];
    let alphabet = unicode_to_byte();
    for (token, id) in vocab {
        let id = id_of(id).ok_or_else(|| format!("model.vocab[{token:?}]: not an id"))?;
        table[id] = token
            .chars()
            .map(|c| alphabet.get(&c).copied())
            .collect::<Option<Vec<u8>>>()
            .ok_or_else(|| format!("model.vocab[{token:?}]: not in the byte-level alphabet"))?;
    }
    for a in added {
        let id = a.get("id").and_then(id_of).ok_or("added_tokens: an entry without an id")?;
        let special = a.get("special").and_then(Value::as_bool).unwrap_or(false);
        let content = a.get("content").and_then(Value::as_str).ok_or("added_tokens: an entry without content")?;
        table[id] = if special { Vec::new() } else { content.as_bytes().to_vec() };
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alphabet_covers_every_byte_once() {
        let m = unicode_to_byte();
        assert_eq!(m.len(), 256);
        assert_eq!(m[&'Ġ'], b' ');
        assert_eq!(m[&'Ċ'], b'\n');
        assert_eq!(m[&'a'], b'a');
    }
}
