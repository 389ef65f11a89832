//! The words a stage ends with when a peer fell silent (no message and no
//! heartbeat for `--timeout-s`), and how a front reads that peer back out
//! of them: the runtime writes them, and `m3c serve` and `m3c run` take the
//! silent peer's host as lost (a spare takes its place on a restart).

use std::time::Duration;

const WORDS: &str = "no sign of life from stage ";

/// The error a stage ends with when rank `rank` was silent for `timeout`.
pub fn message(rank: usize, timeout: Duration) -> String {
    format!("{WORDS}{rank} for {:.0} s (--timeout-s): that stage stopped or was lost", timeout.as_secs_f64())
}

/// The silent rank named in a stage's error (`None`: the error is of
/// another kind).
pub fn rank_in(error: &str) -> Option<usize> {
    let rest = error.split(WORDS).nth(1)?;
    rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_silent_rank_is_read_back_from_the_words_around_it() {
        let why = format!("the pipeline stopped: m3c stage 0/2: error: {}", message(1, Duration::from_secs(3)));
        assert_eq!(rank_in(&why), Some(1));
        assert_eq!(rank_in(&message(12, Duration::from_secs(30))), Some(12));
        assert_eq!(rank_in("the pipeline stopped (a stage ended or was lost)"), None);
        assert_eq!(rank_in("no sign of life from stage x"), None);
    }
}
