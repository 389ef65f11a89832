//! The payload of the ids message that the last stage sends the first for
//! each micro-batch: per segment the tokens it gave (none for a prefill
//! chunk, one for a decode step, up to K + 1 for a verify step of K draft
//! tokens) with, when its sequence asked, each token's logprobs, and the
//! logprobs of the prompt tokens the segment's rows predict. One encoder
//! and one parser, on both sides of the wire.

use m3c_contract::protocol::TokenLogprobs;

/// One token the last stage drew for a sequence: its id (negative: the
/// sequence ends there without a token, for the [`Failure`] the id names)
/// and its logprobs when the sequence asked.
#[derive(Debug, Clone, PartialEq)]
pub struct Token {
    pub id: i64,
    pub logprobs: Option<TokenLogprobs>,
}

/// What the last stage drew for one segment: the tokens it accepted, in
/// order (a [`Failure`]'s id ends the list and the sequence), and, when the sequence
/// asked, the logprobs of the prompt tokens the segment's rows predict
/// (row j: prompt token `pos0 + j + 1`, with its id).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Drawn {
    pub tokens: Vec<Token>,
    pub prompt: Vec<(u32, TokenLogprobs)>,
    /// The EAGLE3 draft head's proposals for the sequence's next step
    /// (target ids), made on the last stage right after this draw.
    pub proposals: Vec<i64>,
}

/// Why the last stage ended a sequence without drawing its token: the
/// front tells a client which, so that a grammar that cannot go on is not
/// reported as broken weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Its logits held NaN or Inf.
    NonFinite,
    /// Its grammar or reasoning budget could not be applied (the last
    /// stage's log says why).
    Constraint,
}

impl Failure {
    /// The token id that carries it.
    pub fn id(self) -> i64 {
        match self {
            Failure::NonFinite => -1,
            Failure::Constraint => -2,
        }
    }

    /// The failure a negative id carries (an unknown one reads as
    /// non-finite logits, the oldest meaning of a negative id).
    pub fn of_id(id: i64) -> Option<Failure> {
        match id {
            0.. => None,
            -2 => Some(Failure::Constraint),
            _ => Some(Failure::NonFinite),
        }
    }

    /// The token that ends a sequence for this failure.
    pub fn token(self) -> Token {
        Token { id: self.id(), logprobs: None }
    }

    /// How the sequence ends.
    pub fn end_reason(self) -> m3c_contract::protocol::EndReason {
        match self {
            Failure::NonFinite => m3c_contract::protocol::EndReason::Error,
            Failure::Constraint => m3c_contract::protocol::EndReason::Constraint,
        }
    }
}

impl Drawn {
    /// A segment whose sequence ends here without a token, for `why`.
    pub fn failed(why: Failure) -> Drawn {
        Drawn { tokens: vec![why.token()], prompt: Vec::new(), proposals: Vec::new() }
    }

    /// The ids message's payload (i64 words): per segment the count of its
    /// tokens, each token's id and logprobs ([`push_lp`]: none is one 0
    /// word), then the count of prompt tokens with logprobs and each one's
    /// logprobs, then the count of the draft's proposals and their ids.
    pub fn encode(drawn: &[Drawn]) -> Vec<u8> {
        let mut w: Vec<i64> = Vec::with_capacity(drawn.len() * 4);
        for d in drawn {
            w.push(d.tokens.len() as i64);
            for t in &d.tokens {
                w.push(t.id);
                match &t.logprobs {
                    None => w.push(0),
                    Some(lp) => push_lp(&mut w, t.id as u32, lp),
                }
            }
            w.push(d.prompt.len() as i64);
            for (id, lp) in &d.prompt {
                push_lp(&mut w, *id, lp);
            }
            w.push(d.proposals.len() as i64);
            w.extend_from_slice(&d.proposals);
        }
        w.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// The inverse of [`Drawn::encode`] for `n` segments; a malformed
    /// payload (only a damaged peer sends one) is an error.
    pub fn decode(words: &[i64], n: usize) -> Result<Vec<Drawn>, String> {
        let bad = || "a malformed ids message from the last stage".to_string();
        let mut it = words.iter().copied();
        let mut out = Vec::with_capacity(n);
        let count = |it: &mut dyn Iterator<Item = i64>| -> Result<usize, String> {
            usize::try_from(it.next().ok_or_else(bad)?).ok().filter(|&c| c <= words.len()).ok_or_else(bad)
        };
        for _ in 0..n {
            let tokens = (0..count(&mut it)?)
                .map(|_| {
                    let id = it.next()?;
                    let logprobs = read_lp(&mut it)?.map(|(_, lp)| lp);
                    Some(Token { id, logprobs })
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(bad)?;
            let prompt = (0..count(&mut it)?).map(|_| read_lp(&mut it).flatten()).collect::<Option<Vec<_>>>().ok_or_else(bad)?;
            let proposals = (0..count(&mut it)?).map(|_| it.next()).collect::<Option<Vec<_>>>().ok_or_else(bad)?;
            out.push(Drawn { tokens, prompt, proposals });
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
    if pairs > 1 + m3c_contract::protocol::MAX_TOP_LOGPROBS as usize {
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
        let tok = |id: i64, logprobs: Option<TokenLogprobs>| Token { id, logprobs };
        let drawn = vec![
            Drawn {
                tokens: vec![tok(5, None)],
                prompt: vec![(7, lp(-3.0, 5)), (1, TokenLogprobs { logprob: -0.25, rank: 1, top: vec![] })],
                proposals: vec![3, 8, 1],
            },
            Drawn { tokens: vec![tok(9, Some(lp(-0.5, 1))), tok(4, Some(lp(-0.75, 2))), tok(-1, None)], prompt: vec![], proposals: vec![] },
            Drawn::default(),
            Drawn::failed(Failure::NonFinite),
            Drawn::failed(Failure::Constraint),
        ];
        let bytes = Drawn::encode(&drawn);
        let words: Vec<i64> = bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(Drawn::decode(&words, 5).unwrap(), drawn);
        for cut in 0..words.len() {
            assert!(Drawn::decode(&words[..cut], 5).is_err(), "cut at {cut}");
        }
        assert!(Drawn::decode(&words, 4).is_err(), "a word left over");
        let mut huge = words.clone();
        huge[0] = 1 << 40;
        assert!(Drawn::decode(&huge, 5).is_err());
    }
}
