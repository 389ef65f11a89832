//! Stop strings: a sequence ends on the token that completes one of them
//! (the token is kept; the front cuts the text before the stop string).
//! The text is built from each token's bytes (the tokenizer's byte-level
//! table, which the runtime reads from the checkpoint), so a stop string
//! that spans tokens is found, and found once.

/// Where the first stop string ends inside `text`, looking only at matches
/// that end after byte `from` (bytes before it were checked already).
pub fn stop_end(text: &[u8], from: usize, stops: &[Vec<u8>]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let start = from.saturating_sub(s.len() - 1);
            text.get(start..)?.windows(s.len()).position(|w| w == s.as_slice()).map(|i| start + i + s.len())
        })
        .min()
}

/// A sequence's stop strings and the bytes it generated so far.
#[derive(Debug, Clone, Default)]
pub(crate) struct StopText {
    pub stops: Vec<Vec<u8>>,
    text: Vec<u8>,
}

impl StopText {
    pub fn new(stops: Vec<Vec<u8>>) -> StopText {
        StopText { stops, text: Vec::new() }
    }

    /// Whether token `id` (its bytes from `table`) completes a stop string.
    pub fn ends(&mut self, id: i64, table: Option<&[Vec<u8>]>) -> bool {
        let Some(table) = table.filter(|_| !self.stops.is_empty()) else { return false };
        let from = self.text.len();
        self.text.extend_from_slice(usize::try_from(id).ok().and_then(|i| table.get(i)).map_or(&[][..], Vec::as_slice));
        stop_end(&self.text, from, &self.stops).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_string_is_found_across_the_boundary_only_once() {
        let stops = vec![b"\n\n".to_vec(), b"END".to_vec()];
        assert_eq!(stop_end(b"ab\n", 0, &stops), None);
        assert_eq!(stop_end(b"ab\n\ncd", 3, &stops), Some(4));
        assert_eq!(stop_end(b"xxEN", 2, &stops), None);
        assert_eq!(stop_end(b"xxEND", 4, &stops), Some(5));
    }

    #[test]
    fn a_stop_string_spanning_tokens_ends_the_sequence_on_the_token_that_completes_it() {
        let table: Vec<Vec<u8>> = vec![b"E".to_vec(), b"N".to_vec(), b"D!".to_vec(), b"x".to_vec()];
        let mut s = StopText::new(vec![b"END".to_vec()]);
        assert!(!s.ends(0, Some(&table)));
        assert!(!s.ends(1, Some(&table)));
        assert!(s.ends(2, Some(&table)));
        let mut none = StopText::new(Vec::new());
        assert!(!none.ends(2, Some(&table)), "no stop strings");
        let mut no_table = StopText::new(vec![b"x".to_vec()]);
        assert!(!no_table.ends(3, None));
    }
}
