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

use m3c_contract::protocol::{EndReason, Event, SeqRequest, TokenLogprobs};

pub(crate) struct Journal {
    generated: Vec<Vec<i64>>,
    logprobs: Vec<Vec<(u32, TokenLogprobs)>>,
    ended: Vec<bool>,
    /// A token's logprobs come before its id: held until the id, so a job
    /// lost between the two leaves no logprobs without their token.
    held: Vec<Option<(u32, TokenLogprobs)>>,
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
            held: vec![None; prompts],
            map: Vec::new(),
            up: false,
        }
    }

    /// The next job's requests: every unfinished prompt's, in the run's
    /// order, each with what it generated so far. They keep the run's
    /// numbering here (a prompt's images are found by it); the job numbers
    /// them from 0 (`stdin_frames`).
    ///
    /// A lost job's last words can be lost with it: a prompt whose tokens
    /// already end it (its EOS or a stop id, or `max_new` of them) but whose
    /// end never came ends now, as the stage would have ended it. The
    /// lines that say so are returned, to pass on before the next job's.
    pub(crate) fn next_job(&mut self, requests: &[SeqRequest], eos: &[i64]) -> (Vec<SeqRequest>, Vec<String>) {
        self.up = false;
        self.held.iter_mut().for_each(|h| *h = None);
        let mut ends = Vec::new();
        for (s, r) in requests.iter().enumerate() {
            if self.ended[s] {
                continue;
            }
            let g = &self.generated[s];
            let stopped = g.last().is_some_and(|id| (!r.ignore_eos && eos.contains(id)) || r.stop_ids.contains(id));
            let reason = if stopped {
                Some(EndReason::Stop)
            } else if g.len() >= r.max_new {
                Some(EndReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                self.ended[s] = true;
                ends.push(Event::End { seq: s, reason }.encode());
            }
        }
        self.map = (0..self.ended.len()).filter(|&s| !self.ended[s]).collect();
        (self.map.iter().map(|&s| SeqRequest { resumed: self.generated[s].clone(), ..requests[s].clone() }).collect(), ends)
    }

    /// Takes one line of the job's output: the lines to pass on, in the
    /// run's numbering (none: the journal's alone, or held). A line that is
    /// no event, or an event this job cannot have sent, passes on
    /// unchanged: the reader reports it.
    pub(crate) fn line(&mut self, line: &str) -> Vec<String> {
        let Some(Ok(e)) = Event::parse(line) else { return vec![line.to_string()] };
        let run_seq = |seq: usize| self.map.get(seq).copied();
        match e {
            Event::Ready => {
                self.up = true;
                Vec::new()
            }
            Event::Id { seq, id } => match run_seq(seq) {
                Some(s) => {
                    self.generated[s].push(i64::from(id));
                    let mut out = Vec::new();
                    if let Some((lid, lp)) = self.held[s].take() {
                        self.logprobs[s].push((lid, lp.clone()));
                        out.push(Event::Logprobs { seq: s, id: lid, lp }.encode());
                    }
                    out.push(Event::Id { seq: s, id }.encode());
                    out
                }
                None => vec![line.to_string()],
            },
            Event::Logprobs { seq, id, lp } => match run_seq(seq) {
                Some(s) => {
                    self.held[s] = Some((id, lp));
                    Vec::new()
                }
                None => vec![line.to_string()],
            },
            Event::End { seq, reason } => match run_seq(seq) {
                Some(s) => {
                    self.ended[s] = true;
                    vec![Event::End { seq: s, reason }.encode()]
                }
                None => vec![line.to_string()],
            },
            _ => vec![line.to_string()],
        }
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
        let (first, ends) = j.next_job(&reqs, &[]);
        assert!(ends.is_empty());
        assert_eq!(first.iter().map(|r| r.seq).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(first.iter().all(|r| r.resumed.is_empty()));
        assert!(j.line("m3c-ready").is_empty());
        assert!(j.up());
        for l in ["m3c-id 0 5", "m3c-id 1 6", "m3c-id 2 7", "m3c-end 1 length", "m3c-id 0 8"] {
            assert_eq!(j.line(l), [l], "the first job's numbering is the run's");
        }
        assert_eq!(j.line("m3c timing: x"), ["m3c timing: x"]);
        assert_eq!(j.unfinished(), 2);

        // The pipeline was lost: prompts 0 and 2 go on, as the job's 0 and 1.
        let (second, _) = j.next_job(&reqs, &[]);
        assert!(!j.up(), "a new job is not up until it says so");
        assert_eq!(second.iter().map(|r| (r.seq, r.resumed.clone())).collect::<Vec<_>>(), [(0, vec![5, 8]), (2, vec![7])]);
        assert_eq!(second[1].prompt, reqs[2].prompt);
        assert_eq!(j.line("m3c-id 1 9"), ["m3c-id 2 9"]);
        assert_eq!(j.line("m3c-end 1 stop"), ["m3c-end 2 stop"]);
        assert_eq!(j.line("m3c-end 0 length"), ["m3c-end 0 length"]);
        // A sequence the job does not have passes on as it came.
        assert_eq!(j.line("m3c-id 2 1"), ["m3c-id 2 1"]);
        assert_eq!(j.unfinished(), 0);
        let ids: Vec<Vec<i64>> = j.outputs().map(|(g, _)| g.to_vec()).collect();
        assert_eq!(ids, [vec![5, 8], vec![6], vec![7, 9]]);
        assert!(j.next_job(&reqs, &[]).0.is_empty(), "nothing is run again");
    }

    #[test]
    fn logprobs_go_on_with_their_token_and_a_lost_job_leaves_none_alone() {
        let reqs = requests(2);
        let mut j = Journal::new(2);
        j.next_job(&reqs, &[]);
        j.line("m3c-end 0 length");
        j.next_job(&reqs, &[]);
        let lp = |id| Event::Logprobs { seq: 0, id, lp: TokenLogprobs { logprob: -0.5, rank: 1, top: vec![(id, -0.5)] } }.encode();
        assert!(j.line(&lp(4)).is_empty(), "held until its token");
        let passed = j.line("m3c-id 0 4");
        assert!(passed.len() == 2 && passed[0].starts_with("m3c-lp 1 4 ") && passed[1] == "m3c-id 1 4", "{passed:?}");
        // The job is lost between a token's logprobs and the token: the
        // held logprobs go with it, and the next job draws that token again.
        assert!(j.line(&lp(7)).is_empty());
        j.next_job(&reqs, &[]);
        assert_eq!(j.line("m3c-id 0 7"), ["m3c-id 1 7"]);
        let kept: Vec<usize> = j.outputs().map(|(_, l)| l.len()).collect();
        assert_eq!(kept, [0, 1]);
    }

    /// A lost job's ends that never came: its EOS, a stop id or max_new
    /// tokens end the prompt, as the stage would have; otherwise it resumes.
    #[test]
    fn a_prompt_whose_tokens_already_end_it_is_not_resumed() {
        let mut reqs = requests(4);
        reqs[1].stop_ids = vec![9];
        reqs[3].ignore_eos = true;
        let mut j = Journal::new(4);
        j.next_job(&reqs, &[2]);
        for l in ["m3c-id 0 2", "m3c-id 1 9", "m3c-id 3 2"] {
            j.line(l);
        }
        for _ in 0..8 {
            j.line("m3c-id 2 5");
        }
        let (next, ends) = j.next_job(&reqs, &[2]);
        assert_eq!(ends, ["m3c-end 0 stop", "m3c-end 1 stop", "m3c-end 2 length"]);
        assert_eq!(next.iter().map(|r| r.seq).collect::<Vec<_>>(), [3], "EOS is ignored where the request says so");
    }
}
