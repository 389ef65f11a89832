//! What an `m3c run` has been told so far, across the jobs of one run: a
//! lost pipeline is started again, and its prompts go on where they were.
//!
//! A job's first stage streams its events (`m3c-id`, `m3c-lp`, `m3c-end`,
//! `m3c-ready`). The journal records each prompt's tokens and end, and
//! passes the events on in the run's numbering. A restarted job gets only
//! the unfinished prompts, numbered from 0 in the run's order, each with
//! what it generated before (`SeqRequest::resumed`). Such a request goes
//! on as if never stopped and reports only what follows, so what the run
//! prints reads as one job's output.

use m3c_contract::protocol::{Event, SeqRequest, TokenLogprobs};

pub(crate) struct Journal {
    generated: Vec<Vec<i64>>,
    logprobs: Vec<Vec<(u32, TokenLogprobs)>>,
    ended: Vec<bool>,
    /// The current job's sequence k is the run's prompt `map[k]`.
    map: Vec<usize>,
    /// The current job's pipeline came up (its first stage said so).
    up: bool,
}

impl Journal {
    pub(crate) fn new(prompts: usize) -> Journal {
        Journal {
            generated: vec![Vec::new(); prompts],
            logprobs: vec![Vec::new(); prompts],
            ended: vec![false; prompts],
            map: Vec::new(),
            up: false,
        }
    }

    /// The next job's requests: every unfinished prompt's, in the run's
    /// order, each with what it generated so far. They keep the run's
    /// numbering here (a prompt's images are found by it); the job numbers
    /// them from 0 (`stdin_frames`).
    pub(crate) fn next_job(&mut self, requests: &[SeqRequest]) -> Vec<SeqRequest> {
        self.up = false;
        self.map = (0..self.ended.len()).filter(|&s| !self.ended[s]).collect();
        self.map.iter().map(|&s| SeqRequest { resumed: self.generated[s].clone(), ..requests[s].clone() }).collect()
    }

    /// Takes one line of the job's output: the line to pass on, in the
    /// run's numbering (`None`: the journal's alone). A line that is no
    /// event, or an event this job cannot have sent, passes on unchanged:
    /// the reader reports it.
    pub(crate) fn line(&mut self, line: &str) -> Option<String> {
        let Some(Ok(e)) = Event::parse(line) else { return Some(line.to_string()) };
        let run_seq = |seq: usize| self.map.get(seq).copied();
        let e = match e {
            Event::Ready => {
                self.up = true;
                return None;
            }
            Event::Id { seq, id } => match run_seq(seq) {
                Some(s) => {
                    self.generated[s].push(i64::from(id));
                    Event::Id { seq: s, id }
                }
                None => return Some(line.to_string()),
            },
            Event::Logprobs { seq, id, lp } => match run_seq(seq) {
                Some(s) => {
                    self.logprobs[s].push((id, lp.clone()));
                    Event::Logprobs { seq: s, id, lp }
                }
                None => return Some(line.to_string()),
            },
            Event::End { seq, reason } => match run_seq(seq) {
                Some(s) => {
                    self.ended[s] = true;
                    Event::End { seq: s, reason }
                }
                None => return Some(line.to_string()),
            },
            _ => return Some(line.to_string()),
        };
        Some(e.encode())
    }

    /// Whether the current job's pipeline came up.
    pub(crate) fn up(&self) -> bool {
        self.up
    }

    /// Prompts not finished yet.
    pub(crate) fn unfinished(&self) -> usize {
        self.ended.iter().filter(|e| !**e).count()
    }

    /// Each prompt's generated ids and their logprobs.
    pub(crate) fn outputs(&self) -> impl Iterator<Item = (&[i64], &[(u32, TokenLogprobs)])> {
        self.generated.iter().zip(&self.logprobs).map(|(g, l)| (g.as_slice(), l.as_slice()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use m3c_contract::sampling::SamplingParams;

    fn requests(n: usize) -> Vec<SeqRequest> {
        (0..n).map(|s| SeqRequest::new(s, vec![1, 2, s as i64], 8, SamplingParams::GREEDY)).collect()
    }

    #[test]
    fn a_restarted_job_gets_the_unfinished_prompts_with_their_tokens_and_speaks_in_the_runs_numbering() {
        let reqs = requests(3);
        let mut j = Journal::new(3);
        let first = j.next_job(&reqs);
        assert_eq!(first.iter().map(|r| r.seq).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(first.iter().all(|r| r.resumed.is_empty()));
        assert_eq!(j.line("m3c-ready"), None);
        assert!(j.up());
        for l in ["m3c-id 0 5", "m3c-id 1 6", "m3c-id 2 7", "m3c-end 1 length", "m3c-id 0 8"] {
            assert_eq!(j.line(l).as_deref(), Some(l), "the first job's numbering is the run's");
        }
        assert_eq!(j.line("m3c timing: x").as_deref(), Some("m3c timing: x"));
        assert_eq!(j.unfinished(), 2);

        // The pipeline was lost: prompts 0 and 2 go on, as the job's 0 and 1.
        let second = j.next_job(&reqs);
        assert!(!j.up(), "a new job is not up until it says so");
        assert_eq!(second.iter().map(|r| (r.seq, r.resumed.clone())).collect::<Vec<_>>(), [(0, vec![5, 8]), (2, vec![7])]);
        assert_eq!(second[1].prompt, reqs[2].prompt);
        assert_eq!(j.line("m3c-id 1 9").as_deref(), Some("m3c-id 2 9"));
        assert_eq!(j.line("m3c-end 1 stop").as_deref(), Some("m3c-end 2 stop"));
        assert_eq!(j.line("m3c-end 0 length").as_deref(), Some("m3c-end 0 length"));
        // A sequence the job does not have passes on as it came.
        assert_eq!(j.line("m3c-id 2 1").as_deref(), Some("m3c-id 2 1"));
        assert_eq!(j.unfinished(), 0);
        let ids: Vec<Vec<i64>> = j.outputs().map(|(g, _)| g.to_vec()).collect();
        assert_eq!(ids, [vec![5, 8], vec![6], vec![7, 9]]);
        assert!(j.next_job(&reqs).is_empty(), "nothing is run again");
    }

    #[test]
    fn logprobs_are_kept_by_the_runs_prompt() {
        let reqs = requests(2);
        let mut j = Journal::new(2);
        j.next_job(&reqs);
        j.line("m3c-end 0 length");
        j.next_job(&reqs);
        let lp = Event::Logprobs { seq: 0, id: 4, lp: TokenLogprobs { logprob: -0.5, rank: 1, top: vec![(4, -0.5)] } };
        let passed = j.line(&lp.encode()).expect("passed on");
        assert!(passed.starts_with("m3c-lp 1 4 "), "{passed}");
        let kept: Vec<usize> = j.outputs().map(|(_, l)| l.len()).collect();
        assert_eq!(kept, [0, 1]);
    }
}
