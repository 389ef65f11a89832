//! Speculation through the engine: drafts never change what a sequence
//! generates, and the cost model drafts only where drafts pay.

use super::sim::{config, hashed, periodic, request, solo, Sim, VOCAB};
use crate::plan::{Ask, StepPlan};
use crate::speculate::eagle3::Eagle3Proposer;
use crate::speculate::ngram::NgramProposer;
use crate::speculate::{Candidate, Proposer, Speculator};
use m3c_contract::speculative::Ngram;

const EOS: i64 = VOCAB as i64 - 1;

fn ngram(k: usize) -> Speculator {
    Speculator::new(Box::new(NgramProposer { config: Ngram { tokens: k, min: 1, max: 3, disable_by_batch_size: None } }), None)
}

/// A step whose rows cost little beside the step itself (a dense model at
/// small batch).
fn cheap_rows(p: &StepPlan) -> f64 {
    1.0 + 0.02 * p.rows() as f64
}

/// A step that costs each row in full (a mixture of experts whose rows
/// each read their own experts).
fn dear_rows(p: &StepPlan) -> f64 {
    p.rows() as f64
}

fn run(model: super::sim::Model, spec: Option<Speculator>, seconds: fn(&StepPlan) -> f64, max_new: usize) -> Sim {
    let mut s = match spec {
        Some(sp) => Sim::spec(config(), model, sp),
        None => Sim::new(config(), model),
    };
    s.step_seconds = Some(seconds);
    for seq in 0..2 {
        s.add(request(seq, &[1, 2, 3, 4, 5, 6, 7, seq as i64], max_new), false).unwrap();
    }
    s.run(5000);
    s
}

#[test]
fn drafts_never_change_the_output() {
    for model in [periodic as super::sim::Model, hashed] {
        for seconds in [cheap_rows as fn(&StepPlan) -> f64, dear_rows] {
            let s = run(model, Some(ngram(3)), seconds, 40);
            for seq in 0..2 {
                assert_eq!(s.outputs[&seq], solo(model, &[1, 2, 3, 4, 5, 6, 7, seq as i64], 40, EOS));
            }
        }
    }
}

#[test]
fn predictable_text_with_cheap_rows_is_drafted_at_full_length() {
    let plain = run(periodic, None, cheap_rows, 100);
    let spec = run(periodic, Some(ngram(3)), cheap_rows, 100);
    let kept: usize = spec.verified.iter().map(|v| v.1).sum();
    assert!(kept > 100, "most tokens come from drafts: {kept}");
    assert!(spec.plans.len() * 2 < plain.plans.len(), "{} steps against {}", spec.plans.len(), plain.plans.len());
    // (Exploration takes one draft per sequence until three drafting steps
    // are measured, and again after each refreshing plain step.)
    let full = spec.verified.iter().filter(|v| v.0 == 3).count();
    assert!(full * 4 > spec.verified.len() * 3, "K = 3 once measured: {:?}", spec.verified);
}

#[test]
fn dear_rows_are_not_drafted_once_measured() {
    // (100 tokens each: the pool holds both, so no preemption mixes
    // recomputed rows, which change the sums, into decode steps.)
    let s = run(periodic, Some(ngram(3)), dear_rows, 100);
    // It tries the full K while the cost of more rows is unmeasured, then
    // stops: a verify row costs a whole step, and a draft token earns less.
    // (A choice not to draft is tried again every 256 plans.)
    let late = &s.plans[s.plans.len() / 2..];
    assert!(late.iter().filter(|p| p.verifies()).count() <= 2, "no drafts once the cost is known");
    assert!(s.plans[..12].iter().any(|p| p.verifies()), "tried first");
}

/// Text nothing predicts for its first 40 generated tokens (after a
/// prompt of 8), then text that repeats itself.
fn predictable_late(ids: &[i64]) -> i64 {
    if ids.len() < 48 {
        hashed(ids)
    } else {
        periodic(ids)
    }
}

#[test]
fn text_that_becomes_predictable_is_drafted_without_waiting_for_a_try() {
    // Its first drafts miss, so the model stops drafting; the drafts it
    // does not make are still checked against the drawn tokens, so once
    // the text repeats it drafts again within a few steps, long before
    // the next try (256 plans on).
    let s = run(predictable_late, Some(ngram(3)), cheap_rows, 160);
    let verifies = |from: usize, to: usize| s.plans[from..to].iter().filter(|p| p.verifies()).count();
    assert!(s.plans[..12].iter().any(|p| p.verifies()), "tried first");
    assert!(verifies(12, 40) <= 2, "not drafted while the text is unpredictable: {}", verifies(12, 40));
    assert!(verifies(40, 80) > 20, "drafted once it repeats: {} of 40 plans", verifies(40, 80));
}

#[test]
fn unpredictable_text_is_not_drafted_once_its_acceptance_is_known() {
    // Cheap rows but drafts that miss: a few tries, then plain steps.
    let s = run(hashed, Some(ngram(3)), |p| 1.0 + 0.3 * p.rows() as f64, 200);
    let drafted: usize = s.verified.iter().map(|v| v.0).sum();
    assert!(drafted < 40, "{drafted} draft tokens over 400 generated");
}

#[test]
fn a_draft_stops_at_the_sequence_max_tokens() {
    let s = run(periodic, Some(ngram(5)), cheap_rows, 7);
    for p in &s.plans {
        for x in &p.seqs {
            let st_new = s.outputs.get(&x.seq).map(Vec::len).unwrap_or(7);
            assert!(x.drafts.len() <= 5 && x.drafts.len() < st_new.max(1));
        }
    }
    assert!(s.outputs.values().all(|o| o.len() == 7));
}

#[test]
fn disable_by_batch_size_drafts_nothing_above_it() {
    let mut sp = ngram(3);
    sp.disable_by_batch_size = Some(1);
    let s = run(periodic, Some(sp), cheap_rows, 30);
    // Two sequences run together for most of the run.
    let together = s.plans.iter().filter(|p| p.seqs.len() == 2);
    assert!(together.clone().count() > 5);
    assert!(together.into_iter().all(|p| !p.verifies()));
}

#[test]
fn a_draft_head_is_never_asked_while_the_batch_size_disables_drafts() {
    let mut sp = Speculator::new(Box::new(Eagle3Proposer::new(3)), Some(1));
    let c: Vec<Candidate> = (0..2).map(|seq| Candidate { seq, rows: 1, draws: true, room: 100, decode: true }).collect();
    for plan in 0..1000 {
        assert_eq!(sp.lengths(&c, 2, 0), [0, 0]);
        sp.observe_step(2, false, 1.0);
        for seq in 0..2 {
            assert_eq!(sp.ask(seq, true), Ask::Nothing, "plan {plan}: no proposals while no step may take them");
        }
    }
}

/// An n-gram speculator (K = 4) that measured steps of 1 row at 1 s, 2
/// rows at 1.1 s and 8 rows at 1.7 s, and saw sequence 1 keep every draft
/// and sequence 2 keep `kept2` of 4, over 20 verifies each.
fn two_sequences(kept2: usize) -> Speculator {
    let mut sp = ngram(4);
    for (r, t) in [(1, 1.0), (2, 1.1), (8, 1.7)] {
        for _ in 0..3 {
            sp.observe_step(r, false, t);
        }
    }
    for _ in 0..20 {
        sp.observe_verify(1, 4, 4);
        sp.observe_verify(2, 4, kept2);
    }
    sp
}

#[test]
fn lengths_add_the_likeliest_draft_while_it_pays() {
    // Sequence 1 keeps every draft, sequence 2 none.
    let mut sp = two_sequences(0);
    let c = |seq| Candidate { seq, rows: 1, draws: true, room: 100, decode: true };
    // With requests waiting, every token kept counts: sequence 1 drafts.
    let k = sp.lengths(&[c(1), c(2)], 2, 1);
    assert_eq!(k, [4, 0]);
    // With nobody waiting, sequence 1 does not run ahead while sequence
    // 2's steps take longer: a step is worth its slower sequence's gain,
    // so each takes one draft (sequence 2's is kept with about a third's
    // chance, from the pooled rate), and no more pays.
    let k = sp.lengths(&[c(1), c(2)], 2, 0);
    assert_eq!(k, [1, 1]);
    // A prefill chunk takes none.
    let k = sp.lengths(&[Candidate { seq: 1, rows: 4, draws: false, room: 0, decode: false }], 1, 0);
    assert_eq!(k, [0]);
}

#[test]
fn with_nobody_waiting_every_sequence_that_keeps_drafts_takes_them() {
    let mut sp = two_sequences(4);
    let c = |seq| Candidate { seq, rows: 1, draws: true, room: 100, decode: true };
    assert_eq!(sp.lengths(&[c(1), c(2)], 2, 0), [4, 4]);
    assert_eq!(sp.lengths(&[c(1), c(2)], 2, 3), [4, 4]);
}

#[test]
fn a_choice_not_to_speculate_is_tried_again_after_a_while() {
    let mut sp = ngram(2);
    for (r, t) in [(1, 1.0), (2, 2.0), (3, 3.0)] {
        for _ in 0..3 {
            sp.observe_step(r, false, t);
        }
    }
    let c = [Candidate { seq: 1, rows: 1, draws: true, room: 100, decode: true }];
    let mut tried = 0;
    for _ in 0..600 {
        if sp.lengths(&c, 1, 0)[0] > 0 {
            tried += 1;
        }
    }
    assert!((1..=4).contains(&tried), "{tried} tries in 600 plans");
}

#[test]
fn tries_that_change_nothing_back_off_and_a_choice_to_draft_resets_them() {
    let mut sp = ngram(2);
    // A verify row costs a whole step, and drafts are never kept.
    let seconds = |rows: usize| rows as f64;
    for r in 1..=3 {
        for _ in 0..3 {
            sp.observe_step(r, false, seconds(r));
        }
    }
    let c = [Candidate { seq: 1, rows: 1, draws: true, room: 100, decode: true }];
    let mut tries = Vec::new();
    for plan in 0..8000 {
        let k = sp.lengths(&c, 1, 0)[0];
        sp.observe_step(1 + k, false, seconds(1 + k));
        if k > 0 {
            sp.observe_verify(1, k, 0);
            tries.push(plan);
        }
    }
    // Without the back-off that is 31 tries; with it, the gaps double
    // (256, 512, ...) up to 4096 plans.
    let gaps: Vec<usize> = tries.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(tries.len() <= 6, "{tries:?}");
    assert!(gaps.windows(2).all(|g| g[1] >= g[0]) && gaps.last().is_some_and(|&g| g >= 2048), "{gaps:?}");
    // Drafts start to be kept and rows get cheap: the next try makes the
    // model draft, and tries are frequent again.
    let cheap = |rows: usize| 1.0 + 0.01 * rows as f64;
    for r in 1..=3 {
        for _ in 0..15 {
            sp.observe_step(r, false, cheap(r));
        }
    }
    let mut drafted = 0;
    for _ in 0..5000 {
        let k = sp.lengths(&c, 1, 0)[0];
        sp.observe_step(1 + k, false, cheap(1 + k));
        if k > 0 {
            sp.observe_verify(1, k, k);
            drafted += 1;
        }
    }
    assert!(drafted > 4000, "{drafted} drafting plans of 5000 once drafts pay");
}

#[test]
fn eagle3_drafts_its_head_proposals_and_asks_for_more_only_when_they_pay() {
    let mut p = Eagle3Proposer::new(3);
    assert_eq!(p.draft(1, &[], 3), Vec::<i64>::new());
    p.proposed(1, &[7, 8, 9]);
    assert_eq!(p.draft(1, &[], 2), [7, 8]);
    assert_eq!(p.ask(1, 2), Ask::Drafts(2));
    assert_eq!(p.ask(1, 9), Ask::Drafts(3));
    assert_eq!(p.ask(1, 0), Ask::Nothing);
    p.forget(1);
    assert_eq!(p.draft(1, &[], 3), Vec::<i64>::new());
}

#[test]
fn eagle3_through_the_engine_changes_nothing() {
    // The simulated head proposes what the model will say next.
    let mut s = Sim::spec(config(), periodic, Speculator::new(Box::new(Eagle3Proposer::new(2)), None));
    s.step_seconds = Some(cheap_rows);
    s.add(request(1, &[1, 2, 3, 4, 5], 20), false).unwrap();
    s.run(200);
    assert_eq!(s.outputs[&1], solo(periodic, &[1, 2, 3, 4, 5], 20, EOS));
    assert!(s.verified.iter().any(|v| v.1 == 2), "proposals were verified and kept");
}

/// A draft head's step: its rows, plus `overhead` whenever it is asked
/// for proposals (its K passes), on top of a plain step of 1 s.
fn head_step(p: &StepPlan, overhead: f64) -> f64 {
    let asked = p.seqs.iter().any(|s| matches!(s.ask, Ask::Drafts(_)));
    1.0 + 0.1 * (p.rows() - p.seqs.len()) as f64 + if asked { overhead } else { 0.0 }
}

fn eagle3_run(seconds: fn(&StepPlan) -> f64) -> Sim {
    let mut s = Sim::spec(config(), periodic, Speculator::new(Box::new(Eagle3Proposer::new(3)), None));
    s.step_seconds = Some(seconds);
    s.add(request(1, &[1, 2, 3, 4, 5], 200), false).unwrap();
    s.run(2000);
    assert_eq!(s.outputs[&1], solo(periodic, &[1, 2, 3, 4, 5], 200, EOS));
    s
}

#[test]
fn a_draft_head_s_fixed_cost_is_weighed_over_all_its_drafts() {
    // Asking costs 1.5 s: one draft alone would not pay (2 tokens in
    // 2.6 s against 1 in 1 s), three do (4 in 2.8 s).
    let s = eagle3_run(|p| head_step(p, 1.5));
    let late = &s.plans[s.plans.len() / 2..];
    let verifying = late.iter().filter(|p| p.verifies()).count();
    assert!(verifying * 10 > late.len() * 8, "{verifying} of {} late steps verify", late.len());
    assert!(late.iter().filter(|p| p.verifies()).all(|p| p.seqs[0].drafts.len() == 3));
}

#[test]
fn a_draft_head_that_costs_more_than_its_drafts_earn_is_not_asked() {
    // Asking costs 5 s: even four tokens a step (6.3 s) lose to plain steps.
    let s = eagle3_run(|p| head_step(p, 5.0));
    let late = &s.plans[s.plans.len() / 2..];
    let asking = late.iter().filter(|p| p.seqs.iter().any(|x| matches!(x.ask, Ask::Drafts(_)))).count();
    assert!(asking * 20 < late.len(), "{asking} of {} late steps ask the head", late.len());
    assert!(s.verified.iter().any(|v| v.0 > 0), "it was tried");
}

#[test]
fn a_fixed_k_drafts_k_on_every_decode_step_whatever_it_costs() {
    let mut sp = ngram(3);
    sp.fixed = Some(2);
    let s = run(hashed, Some(sp), dear_rows, 30);
    let decode_steps: Vec<_> = s.plans.iter().filter(|p| p.seqs.iter().all(|x| x.pos0 >= 8)).collect();
    assert!(decode_steps.len() > 10);
    // Every decode step asked for two drafts (the lookup may find fewer).
    assert!(s.verified.iter().all(|v| v.0 <= 2) && s.verified.len() > decode_steps.len() / 2, "{:?}", s.verified);
}

#[test]
fn drafts_that_only_break_even_are_not_taken() {
    let decide = |t2: f64| {
        let mut sp = ngram(1);
        for _ in 0..3 {
            sp.observe_step(1, false, 1.0);
            sp.observe_step(2, false, t2);
        }
        for _ in 0..20 {
            sp.observe_verify(1, 1, 1);
        }
        sp.lengths(&[Candidate { seq: 1, rows: 1, draws: true, room: 100, decode: true }], 1, 0)[0]
    };
    // Nearly two tokens a step: in 1.9 s that is 3% faster than plain
    // steps (within the noise), in 1.7 s 16%.
    assert_eq!(decide(1.9), 0);
    assert_eq!(decide(1.7), 1);
}

#[test]
fn a_draft_head_s_longer_steps_are_not_guessed_as_cheap_as_its_one_measured_count() {
    let mut sp = Speculator::new(Box::new(Eagle3Proposer::new(3)), None);
    // Plain steps of 8 rows take 1 s; drafting ones of 16 rows (one draft
    // each, with the head's proposals) 2 s: each added row costs 1/8 s.
    for _ in 0..3 {
        sp.observe_step(8, false, 1.0);
        sp.observe_step(16, true, 2.0);
    }
    // Two of three drafts kept: 3 drafts each would earn 19.3 tokens a
    // step, more per second than plain steps if 32 rows cost what 16 do.
    for seq in 0..8 {
        for _ in 0..20 {
            sp.observe_verify(seq, 3, 2);
        }
    }
    let cands: Vec<Candidate> = (0..8).map(|seq| Candidate { seq, rows: 1, draws: true, room: 100, decode: true }).collect();
    assert_eq!(sp.lengths(&cands, 8, 0), [0; 8], "32 rows cost 4 s by the rows' measured price, not 2 s");
}
