//! One scheduling rule per test.

use super::sim::{config, hashed, periodic, request, solo, Sim, VOCAB};
use crate::drawn::{Drawn, Failure, Token};
use crate::plan::Segment;
use crate::{Effect, Engine, Phase};
use m3c_contract::protocol::{EndReason, Event};

const EOS: i64 = VOCAB as i64 - 1;

fn prompt(n: usize, salt: i64) -> Vec<i64> {
    (0..n as i64).map(|i| (i * 7 + salt) % (VOCAB as i64 - 1)).collect()
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_of_the_budget() {
    let mut s = Sim::new(config(), hashed);
    s.add(request(1, &prompt(10, 0), 2), false).unwrap();
    s.run(100);
    let steps: Vec<(usize, usize)> = s.plans.iter().map(|p| (p.seqs[0].pos0, p.seqs[0].ids.len())).collect();
    assert_eq!(steps, [(0, 4), (4, 4), (8, 2), (10, 1)]);
    assert_eq!(s.outputs[&1], solo(hashed, &prompt(10, 0), 2, EOS));
}

#[test]
fn a_micro_batch_holds_at_most_per_batch_sequences() {
    let mut cfg = config();
    cfg.per_batch = 2;
    let mut s = Sim::new(cfg, hashed);
    for seq in 0..5 {
        s.add(request(seq, &prompt(3, seq as i64), 3), false).unwrap();
    }
    s.run(200);
    assert!(s.plans.iter().all(|p| p.seqs.len() <= 2));
    assert_eq!(s.plans[0].seqs.iter().map(|x| x.seq).collect::<Vec<_>>(), [0, 1], "oldest first");
    assert_eq!(s.ended.len(), 5);
}

#[test]
fn one_micro_batch_per_stage_is_in_flight() {
    let mut cfg = config();
    cfg.stages = 3;
    cfg.per_batch = 1;
    let mut s = Sim::new(cfg, hashed);
    for seq in 0..5 {
        s.add(request(seq, &prompt(3, seq as i64), 2), false).unwrap();
    }
    assert!(s.launch() && s.launch() && s.launch());
    assert!(!s.launch(), "a fourth waits for a stage");
    assert_eq!(s.e.in_flight(), 3);
    assert!(s.land());
    assert!(s.launch());
    s.run(200);
    for seq in 0..5 {
        assert_eq!(s.outputs[&seq], solo(hashed, &prompt(3, seq as i64), 2, EOS));
    }
}

#[test]
fn prefill_and_decode_share_a_micro_batch() {
    let mut s = Sim::new(config(), hashed);
    s.add(request(1, &prompt(2, 1), 5), false).unwrap();
    s.launch();
    s.land();
    s.add(request(2, &prompt(12, 2), 1), false).unwrap();
    s.launch();
    let p = s.plans.last().unwrap();
    assert_eq!(p.segments(), [Segment { seq: 1, pos0: 2, rows: 1 }, Segment { seq: 2, pos0: 0, rows: 4 }]);
}

#[test]
fn eos_ends_a_sequence_unless_it_is_ignored() {
    // The model always says EOS.
    fn eos(_: &[i64]) -> i64 {
        EOS
    }
    let mut s = Sim::new(config(), eos);
    s.add(request(1, &[1, 2], 5), false).unwrap();
    let mut r = request(2, &[1, 2], 3);
    r.ignore_eos = true;
    s.add(r, false).unwrap();
    s.run(100);
    assert_eq!(s.outputs[&1], [EOS]);
    assert_eq!(s.outputs[&2], [EOS, EOS, EOS]);
    assert!(s.ended.contains(&(1, EndReason::Stop, true)) && s.ended.contains(&(2, EndReason::Length, true)));
}

#[test]
fn a_stop_id_ends_the_sequence_and_is_kept() {
    let mut s = Sim::new(config(), periodic);
    let p = [3, 4, 5, 6];
    let mut r = request(1, &p, 10);
    r.stop_ids = vec![5];
    s.add(r, false).unwrap();
    s.run(100);
    assert_eq!(s.outputs[&1], [3, 4, 5]);
    assert_eq!(s.ended, [(1, EndReason::Stop, true)]);
}

#[test]
fn a_stop_string_needs_the_token_bytes_and_ends_on_the_completing_token() {
    let mut s = Sim::new(config(), periodic);
    let mut r = request(1, &[1, 2, 3, 4], 10);
    r.stops = vec![b"bc".to_vec()];
    assert!(s.e.needs_token_bytes(&r));
    s.e.set_token_bytes((0..VOCAB).map(|i| vec![b'a' + (i % 26) as u8]).collect());
    assert!(!s.e.needs_token_bytes(&r));
    s.add(r, false).unwrap();
    s.run(100);
    assert_eq!(s.outputs[&1], [1, 2], "ids 1 and 2 spell \"bc\"");
}

#[test]
fn max_new_ends_with_length() {
    let mut s = Sim::new(config(), periodic);
    s.add(request(1, &[1, 2, 3, 4, 5], 7), false).unwrap();
    s.run(100);
    assert_eq!(s.outputs[&1].len(), 7);
    assert_eq!(s.ended, [(1, EndReason::Length, true)]);
}

#[test]
fn a_failed_draw_ends_only_its_sequence_and_says_why() {
    for (why, reason) in [(Failure::NonFinite, EndReason::Error), (Failure::Constraint, EndReason::Constraint)] {
        let mut e = Engine::new(config(), None);
        e.add(request(1, &[1, 2], 4), false);
        e.add(request(2, &[3, 4], 4), false);
        e.admit();
        let p = e.next_plan().unwrap().unwrap();
        let good = Drawn { tokens: vec![Token { id: 9, logprobs: None }], ..Drawn::default() };
        e.returned(&p.segments(), &[Drawn::failed(why), good]).unwrap();
        let ends: Vec<Effect> = e.effects().into_iter().filter(|x| matches!(x, Effect::Ended { .. })).collect();
        assert_eq!(ends, [Effect::Ended { seq: 1, reason, joined: true }]);
        assert_eq!(e.state(2).unwrap().generated, [9]);
    }
}

#[test]
fn results_that_do_not_fit_the_plan_are_errors() {
    let mut e = Engine::new(config(), None);
    e.add(request(1, &prompt(9, 0), 4), false);
    e.admit();
    let p = e.next_plan().unwrap().unwrap();
    assert!(e.returned(&p.segments(), &[]).unwrap_err().0.contains("one entry per segment"));
    let tok = Drawn { tokens: vec![Token { id: 3, logprobs: None }], ..Drawn::default() };
    let err = e.returned(&p.segments(), &[tok]).unwrap_err();
    assert!(err.0.contains("prefill chunk"), "{err}");
    let stranger = [Segment { seq: 77, pos0: 0, rows: 1 }];
    assert!(e.returned(&stranger, &[Drawn::default()]).unwrap_err().0.contains("not live"));
}

#[test]
fn requests_are_checked_before_they_join() {
    let mut cfg = config();
    cfg.max_positions = 20;
    cfg.blocks = 3;
    let e = Engine::new(cfg, None);
    assert!(e.check(&request(1, &[], 1)).unwrap_err().contains("empty"));
    assert!(e.check(&request(1, &[VOCAB as i64], 1)).unwrap_err().contains("outside the vocabulary"));
    assert!(e.check(&request(1, &[-1], 1)).unwrap_err().contains("outside the vocabulary"));
    assert!(e.check(&request(1, &[1; 15], 6)).unwrap_err().contains("max_position_embeddings"));
    assert!(e.check(&request(1, &[1; 10], 5)).unwrap_err().contains("the KV pool has 3"));
    let mut r = request(1, &[1], 1);
    r.stop_ids = vec![99];
    assert!(e.check(&r).unwrap_err().contains("stop id"));
    assert!(e.check(&request(1, &[1, 2], 3)).is_ok());
    let mut e = e;
    e.add(request(1, &[1, 2], 3), false);
    assert!(e.check(&request(1, &[1, 2], 3)).unwrap_err().contains("already live"));
}

#[test]
fn the_latest_arrival_is_preempted_first_and_preemption_changes_nothing() {
    let mut cfg = config();
    // Two sequences whose whole needs do not fit: 5 blocks of 4.
    cfg.blocks = 5;
    cfg.per_batch = 2;
    let mut s = Sim::new(cfg, hashed);
    s.add(request(1, &prompt(4, 1), 8), false).unwrap();
    s.add(request(2, &prompt(4, 2), 8), false).unwrap();
    s.run(500);
    assert!(!s.resets.is_empty(), "the pool ran out");
    assert_eq!(s.resets[0], 2, "the newer one gives its blocks back");
    assert!(s.events.iter().any(|e| matches!(e, Event::Preempted { seq: 2 })));
    for seq in [1, 2] {
        assert_eq!(s.outputs[&seq], solo(hashed, &prompt(4, seq as i64), 8, EOS), "seq {seq}: preemption changes nothing");
    }
    assert_eq!(s.e.blocks().0, 0, "every block is back");
}

#[test]
fn a_preempted_sequence_keeps_what_it_generated() {
    let mut cfg = config();
    cfg.blocks = 5;
    cfg.per_batch = 2;
    let mut s = Sim::new(cfg, hashed);
    s.add(request(1, &prompt(4, 1), 8), false).unwrap();
    s.add(request(2, &prompt(4, 2), 8), false).unwrap();
    while s.resets.is_empty() {
        assert!(s.launch() || s.land());
        s.land();
    }
    let st = s.e.state(2).unwrap();
    assert_eq!(st.phase, Phase::Preempted);
    assert_eq!(st.preemptions, 1);
    assert!(!st.generated.is_empty());
    assert_eq!(s.e.waiting(), 1);
}

#[test]
fn a_resumed_request_goes_on_as_if_never_stopped() {
    // A request re-admitted with the tokens it generated on a lost
    // pipeline recomputes its rows and draws what it would have drawn.
    let p = prompt(9, 3);
    let whole = solo(hashed, &p, 12, EOS);
    assert!(whole.len() > 6, "{whole:?}");
    for k in [1, 5] {
        let mut s = Sim::new(config(), hashed);
        let mut r = request(1, &p, 12);
        r.resumed = whole[..k].to_vec();
        s.add(r, false).unwrap();
        s.run(200);
        assert_eq!(s.outputs[&1], whole, "resumed after {k}");
        let drawn = s.events.iter().filter(|e| matches!(e, Event::Id { seq: 1, .. })).count();
        assert_eq!(drawn, whole.len() - k, "only the tokens after the {k} resumed are reported");
    }
    // Its stop strings see the text it generated before.
    let mut s = Sim::new(config(), periodic);
    s.e.set_token_bytes((0..VOCAB).map(|i| vec![b'a' + (i % 26) as u8]).collect());
    let mut r = request(1, &[1, 2, 3, 4], 10);
    r.stops = vec![b"bc".to_vec()];
    r.resumed = vec![1];
    s.add(r, false).unwrap();
    s.run(100);
    assert_eq!(s.outputs[&1], [1, 2], "\"b\" came before the pipeline was lost, \"c\" completes the stop");
    // A request with nothing left to generate is refused.
    let mut r = request(2, &[1, 2], 3);
    r.resumed = vec![5, 6, 7];
    assert!(s.add(r, false).unwrap_err().contains("resumed"));
}

#[test]
fn a_cached_prefix_is_counted_and_not_computed_again() {
    let mut s = Sim::new(config(), hashed);
    let p = prompt(10, 3);
    s.add(request(1, &p, 2), false).unwrap();
    s.run(100);
    s.add(request(2, &p, 2), false).unwrap();
    s.run(100);
    let hits: Vec<(usize, usize, usize)> = s
        .events
        .iter()
        .filter_map(|e| if let Event::Prefix { seq, queried, hit } = e { Some((*seq, *queried, *hit)) } else { None })
        .collect();
    // The draw row (9) is computed again: the hit stops at its block.
    assert_eq!(hits, [(1, 10, 0), (2, 10, 8)]);
    let second: Vec<Segment> = s.plans.iter().flat_map(|p| p.segments()).filter(|g| g.seq == 2).collect();
    assert_eq!(second[0], Segment { seq: 2, pos0: 8, rows: 2 });
    assert_eq!(s.outputs[&1], s.outputs[&2]);
}

#[test]
fn kv_events_report_each_stored_block_once_and_each_eviction() {
    let mut cfg = config();
    cfg.kv_events = true;
    cfg.blocks = 8;
    let mut s = Sim::new(cfg, hashed);
    let p = prompt(10, 3);
    s.add(request(1, &p, 2), false).unwrap();
    s.run(100);
    let stored: Vec<(Option<_>, _, Vec<i64>)> = s
        .events
        .iter()
        .filter_map(|e| if let Event::BlockStored { parent, hash, tokens } = e { Some((*parent, *hash, tokens.clone())) } else { None })
        .collect();
    // Ten prompt ids and one fed token fill two blocks of 4: each stored
    // once, with its tokens and the block before it.
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert_eq!((stored[0].0, &stored[0].2[..]), (None, &p[0..4]));
    assert_eq!((stored[1].0, &stored[1].2[..]), (Some(stored[0].1), &p[4..8]));
    // The same prompt again hits the cache and stores nothing new.
    s.add(request(2, &p, 2), false).unwrap();
    s.run(100);
    assert_eq!(s.events.iter().filter(|e| matches!(e, Event::BlockStored { .. })).count(), 2);
    // Other prompts need the whole pool of 8: the cached blocks are evicted, and said to be.
    for seq in 3..6 {
        s.add(request(seq, &prompt(20, seq as i64 * 11), 2), false).unwrap();
        s.run(200);
    }
    let removed: Vec<_> = s
        .events
        .iter()
        .filter_map(|e| if let Event::BlocksRemoved { hashes } = e { Some(hashes.clone()) } else { None })
        .flatten()
        .collect();
    assert!(removed.contains(&stored[0].1) && removed.contains(&stored[1].1), "{removed:?}");
    // Without the switch, none.
    let mut quiet = Sim::new(config(), hashed);
    quiet.add(request(1, &p, 2), false).unwrap();
    quiet.run(100);
    assert!(!quiet.events.iter().any(|e| matches!(e, Event::BlockStored { .. } | Event::BlocksRemoved { .. })));
}

#[test]
fn a_shared_prefix_being_computed_is_waited_for() {
    let mut cfg = config();
    cfg.per_batch = 4;
    let mut s = Sim::new(cfg, hashed);
    let p = prompt(12, 4);
    s.add(request(1, &p, 1), false).unwrap();
    s.add(request(2, &p, 1), false).unwrap();
    s.launch();
    assert_eq!(s.plans[0].seqs.len(), 1, "the second waits for the first's blocks");
    s.run(100);
    let hit = s.events.iter().find_map(|e| if let Event::Prefix { seq: 2, hit, .. } = e { Some(*hit) } else { None });
    assert_eq!(hit, Some(8));
}

#[test]
fn without_prefix_caching_nothing_is_shared() {
    let mut cfg = config();
    cfg.prefix_caching = false;
    let mut s = Sim::new(cfg, hashed);
    let p = prompt(10, 3);
    for seq in [1, 2] {
        s.add(request(seq, &p, 2), false).unwrap();
        s.run(100);
    }
    assert!(s.events.iter().all(|e| !matches!(e, Event::Prefix { hit, .. } if *hit > 0)));
    assert_eq!(s.e.blocks().1, 0, "nothing is cached");
}

#[test]
fn prompt_logprobs_and_score_last_compute_every_row() {
    let mut s = Sim::new(config(), hashed);
    let p = prompt(10, 3);
    s.add(request(1, &p, 2), false).unwrap();
    s.run(100);
    let mut r = request(2, &p, 2);
    r.prompt_logprobs = true;
    s.add(r, false).unwrap();
    s.run(100);
    assert!(s.events.contains(&Event::Prefix { seq: 2, queried: 10, hit: 0 }));

    let mut cfg = config();
    cfg.score_last = true;
    let mut s = Sim::new(cfg, hashed);
    s.add(request(1, &p, 2), false).unwrap();
    s.run(100);
    // Prefill 3 chunks (the last draws), a decode step, and one step that
    // scores the last token.
    assert_eq!(s.plans.len(), 5);
    assert_eq!(s.outputs[&1].len(), 2);
    assert_eq!(s.ended, [(1, EndReason::Length, true)]);
}

#[test]
fn max_new_zero_scores_the_prompt_and_ends() {
    let mut s = Sim::new(config(), hashed);
    s.add(request(1, &[1, 2, 3], 0), false).unwrap();
    s.run(10);
    assert_eq!(s.outputs[&1], Vec::<i64>::new());
    assert_eq!(s.ended, [(1, EndReason::Length, true)]);
}

#[test]
fn a_request_with_images_joins_when_its_encodes_are_done() {
    let mut s = Sim::new(config(), hashed);
    s.add(request(1, &[1, 2, 3], 2), true).unwrap();
    assert_eq!(s.e.encoding(), 1);
    assert!(!s.launch(), "nothing runs before its features are in");
    assert_eq!(s.e.state(1).unwrap().phase, Phase::Encoding);
    assert!(s.encoded(1));
    s.run(100);
    assert_eq!(s.outputs[&1], solo(hashed, &[1, 2, 3], 2, EOS));
    assert!(!s.encoded(1), "only once");
}

#[test]
fn a_request_cancelled_while_encoding_ends_when_its_encode_does() {
    let mut s = Sim::new(config(), hashed);
    s.add(request(1, &[1, 2, 3], 2), true).unwrap();
    s.cancel(1);
    assert!(s.ended.is_empty(), "its encode holds it");
    assert!(!s.encoded(1));
    assert_eq!(s.ended, [(1, EndReason::Cancelled, false)], "it never joined the stages");
    assert!(s.e.idle());
}

#[test]
fn images_change_the_cache_keys_of_their_blocks() {
    let mut s = Sim::new(config(), hashed);
    let p = prompt(10, 3);
    let mut a = request(1, &p, 1);
    a.images = vec![([1; 32], vec![1, 2])];
    s.add(a, false).unwrap();
    s.run(100);
    let mut b = request(2, &p, 1);
    b.images = vec![([2; 32], vec![1, 2])];
    s.add(b, false).unwrap();
    s.run(100);
    assert!(s.events.contains(&Event::Prefix { seq: 2, queried: 10, hit: 0 }), "another image: no hit");
}

#[test]
fn a_cancelled_sequence_ends_at_once_or_when_its_step_returns() {
    let mut s = Sim::new(config(), hashed);
    s.add(request(1, &[1, 2], 50), false).unwrap();
    s.add(request(2, &[3, 4], 50), false).unwrap();
    s.cancel(2);
    assert_eq!(s.ended, [(2, EndReason::Cancelled, true)], "waiting: at once");
    s.launch();
    s.cancel(1);
    assert_eq!(s.ended.len(), 1, "in flight: not yet");
    s.land();
    assert_eq!(s.ended[1], (1, EndReason::Cancelled, true));
    assert!(s.outputs[&1].is_empty(), "the token of the cancelled step is not kept");
    assert!(s.e.idle());
    assert_eq!(s.e.blocks().0, 0);
}

#[test]
fn cancelling_an_unknown_sequence_does_nothing() {
    let mut s = Sim::new(config(), hashed);
    s.cancel(9);
    assert!(s.ended.is_empty() && s.e.idle());
}

#[test]
fn a_state_lists_prompt_generated_and_phase() {
    let mut s = Sim::new(config(), periodic);
    s.add(request(1, &[1, 2, 3, 4, 5], 10), false).unwrap();
    s.launch();
    s.land();
    s.launch();
    s.land();
    let st = s.e.state(1).unwrap();
    assert_eq!((st.prompt.as_slice(), st.generated.as_slice(), st.phase), (&[1, 2, 3, 4, 5][..], &[2][..], Phase::Decoding));
    assert_eq!(s.e.states(), [st]);
    assert_eq!(s.e.running(), 1);
}

#[test]
fn a_pipeline_of_three_gives_what_one_stage_does() {
    let prompts: Vec<Vec<i64>> = (0..6).map(|i| prompt(3 + 3 * i, i as i64)).collect();
    let mut outs = Vec::new();
    for stages in [1, 3] {
        let mut cfg = config();
        cfg.stages = stages;
        cfg.per_batch = 2;
        let mut s = Sim::new(cfg, hashed);
        for (i, p) in prompts.iter().enumerate() {
            s.add(request(i, p, 6), false).unwrap();
        }
        s.run(1000);
        outs.push(s.outputs);
    }
    assert_eq!(outs[0], outs[1]);
}
