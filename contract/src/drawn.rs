//! The payload of the ids message that the last stage sends the first for
//! each micro-batch: per segment the drawn id and, when its sequence asked,
//! the token's logprobs and those of the prompt tokens the segment's rows
//! predict. One encoder and one parser, on both sides of the wire.

use crate::protocol::TokenLogprobs;

/// What the last stage drew for one segment: its id (-1: the sequence met
/// non-finite logits) and, when the sequence asked, the token's logprobs
/// and those of the prompt tokens the segment's rows predict (row j: prompt
/// token `pos0 + j + 1`, with its id).
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    pub id: i64,
    pub logprobs: Option<TokenLogprobs>,
    pub prompt: Vec<(u32, TokenLogprobs)>,
}

impl Drawn {
    /// The ids message's payload (i64 words): per segment its id and its
    /// logprobs ([`push_lp`]: none is one 0 word), then the count of prompt
    /// tokens with logprobs and each one's logprobs.
    pub fn encode(drawn: &[Drawn]) -> Vec<u8> {
        let mut w: Vec<i64> = Vec::with_capacity(drawn.len() * 3);
        for d in drawn {
            w.push(d.id);
            match &d.logprobs {
                None => w.push(0),
                Some(lp) => push_lp(&mut w, d.id as u32, lp),
            }
            w.push(d.prompt.len() as i64);
            for (id, lp) in &d.prompt {
                push_lp(&mut w, *id, lp);
            }
        }
        w.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// The inverse of [`Drawn::encode`] for `n` segments; a malformed
    /// payload (only a damaged peer sends one) is an error.
    pub fn decode(words: &[i64], n: usize) -> Result<Vec<Drawn>, String> {
        let bad = || "a malformed ids message from the last stage".to_string();
        let mut it = words.iter().copied();
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = it.next().ok_or_else(bad)?;
            let logprobs = read_lp(&mut it).ok_or_else(bad)?.map(|(_, lp)| lp);
            let count = usize::try_from(it.next().ok_or_else(bad)?).map_err(|_| bad())?;
            if count > words.len() {
                return Err(bad());
            }
            let prompt = (0..count).map(|_| read_lp(&mut it).flatten()).collect::<Option<Vec<_>>>().ok_or_else(bad)?;
            out.push(Drawn { id, logprobs, prompt });
        }
        if it.next().is_some() {
            return Err(bad());
        }
        Ok(out)
    }
}

/// A token's logprobs as words: the count of (id, logprob) pairs (the
/// token's own, then its alternatives), its rank, then the pairs (logprobs
/// as f32 bits).
fn push_lp(w: &mut Vec<i64>, id: u32, lp: &TokenLogprobs) {
    w.push(1 + lp.top.len() as i64);
    w.push(i64::from(lp.rank));
    for (i, v) in std::iter::once((id, lp.logprob)).chain(lp.top.iter().copied()) {
        w.extend([i64::from(i), i64::from(v.to_bits())]);
    }
}

/// The inverse of [`push_lp`]: `Some(None)` for a 0 count, `None` for
/// damage.
fn read_lp(it: &mut impl Iterator<Item = i64>) -> Option<Option<(u32, TokenLogprobs)>> {
    let pairs = usize::try_from(it.next()?).ok()?;
    if pairs == 0 {
        return Some(None);
    }
    if pairs > 1 + crate::protocol::MAX_TOP_LOGPROBS as usize {
        return None;
    }
    let rank = u32::try_from(it.next()?).ok()?;
    let mut list = Vec::with_capacity(pairs);
    for _ in 0..pairs {
        let (i, v) = (it.next()?, it.next()?);
        list.push((u32::try_from(i).ok()?, f32::from_bits(u32::try_from(v).ok()?)));
    }
    Some(Some((list[0].0, TokenLogprobs { logprob: list[0].1, rank, top: list[1..].to_vec() })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawn_ids_and_logprobs_round_trip_and_damage_is_an_error() {
        let lp = |logprob: f32, rank: u32| TokenLogprobs { logprob, rank, top: vec![(9, -0.5), (2, -1.25)] };
        let drawn = vec![
            Drawn { id: 5, logprobs: None, prompt: vec![(7, lp(-3.0, 5)), (1, TokenLogprobs { logprob: -0.25, rank: 1, top: vec![] })] },
            Drawn { id: 9, logprobs: Some(lp(-0.5, 1)), prompt: vec![] },
            Drawn { id: -1, logprobs: None, prompt: vec![] },
        ];
        let bytes = Drawn::encode(&drawn);
        let words: Vec<i64> = bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(Drawn::decode(&words, 3).unwrap(), drawn);
        for cut in 0..words.len() {
            assert!(Drawn::decode(&words[..cut], 3).is_err(), "cut at {cut}");
        }
        assert!(Drawn::decode(&words, 2).is_err(), "a word left over");
        let mut huge = words.clone();
        huge[3] = 1 << 40;
        assert!(Drawn::decode(&huge, 3).is_err());
    }
}
