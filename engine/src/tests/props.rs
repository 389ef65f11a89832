//! Property tests over random event sequences: whatever is added,
//! cancelled, encoded, stepped and returned, in whatever order, every
//! request finishes exactly once with what it generates alone, no block
//! leaks, and the same events give the same plans.

use super::sim::{config, hashed, periodic, request, solo, Model, Sim, VOCAB};
use crate::speculate::ngram::NgramProposer;
use crate::speculate::Speculator;
use crate::StepPlan;
use m3c_contract::protocol::EndReason;
use m3c_contract::speculative::Ngram;
use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Op {
    /// A request: prompt length, a shared-prefix choice, max_new, whether
    /// it has images to encode first.
    Add {
        len: usize,
        family: u8,
        max_new: usize,
        encoding: bool,
    },
    Cancel(usize),
    /// An encode finishes (of the oldest request still encoding).
    Encoded,
    Launch,
    Land,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..14, 0u8..3, 0usize..10, prop::bool::weighted(0.2))
            .prop_map(|(len, family, max_new, encoding)| Op::Add { len, family, max_new, encoding }),
        1 => (0usize..12).prop_map(Op::Cancel),
        1 => Just(Op::Encoded),
        4 => Just(Op::Launch),
        4 => Just(Op::Land),
    ]
}

#[derive(Debug, Clone)]
struct Setup {
    stages: usize,
    per_batch: usize,
    chunk: usize,
    blocks: usize,
    block: usize,
    caching: bool,
    spec: bool,
    periodic: bool,
}

fn setup() -> impl Strategy<Value = Setup> {
    (1usize..4, 1usize..5, 1usize..7, 6usize..40, 1usize..5, any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
        |(stages, per_batch, chunk, blocks, block, caching, spec, periodic)| Setup {
            stages,
            per_batch,
            chunk,
            blocks,
            block,
            caching,
            spec,
            periodic,
        },
    )
}

/// What one run of `ops` gives: each request's (end, output), the plans,
/// and whether the pool ended clean.
struct Outcome {
    ended: BTreeMap<usize, Vec<(EndReason, Vec<i64>)>>,
    added: BTreeMap<usize, (Vec<i64>, usize)>,
    plans: Vec<StepPlan>,
    model: Model,
}

fn play(su: &Setup, ops: &[Op]) -> Outcome {
    let mut cfg = config();
    (cfg.stages, cfg.per_batch, cfg.chunk, cfg.blocks, cfg.block, cfg.prefix_caching) =
        (su.stages, su.per_batch, su.chunk, su.blocks, su.block, su.caching);
    let model: Model = if su.periodic { periodic } else { hashed };
    let mut s = if su.spec {
        let n = Ngram { tokens: 3, min: 1, max: 3, disable_by_batch_size: None };
        let mut sim = Sim::spec(cfg, model, Speculator::new(Box::new(NgramProposer { config: n }), None));
        sim.step_seconds = Some(|p| 1.0 + 0.1 * p.rows() as f64);
        sim
    } else {
        Sim::new(cfg, model)
    };
    let mut added = BTreeMap::new();
    let mut encoding = Vec::new();
    let mut next = 0;
    for o in ops {
        match *o {
            Op::Add { len, family, max_new, encoding: enc } => {
                let prompt: Vec<i64> = (0..len).map(|i| ((i * 3 + usize::from(family) * (i / 5)) % (VOCAB - 1)) as i64).collect();
                if s.add(request(next, &prompt, max_new), enc).is_ok() {
                    added.insert(next, (prompt, max_new));
                    if enc {
                        encoding.push(next);
                    }
                }
                next += 1;
            }
            Op::Cancel(seq) => s.cancel(seq),
            Op::Encoded => {
                if !encoding.is_empty() {
                    s.encoded(encoding.remove(0));
                }
            }
            Op::Launch => {
                s.launch();
            }
            Op::Land => {
                s.land();
            }
        }
        let (used, cached, total) = s.e.blocks();
        assert!(used + cached <= total, "{used} used + {cached} cached > {total}");
    }
    for seq in encoding {
        s.encoded(seq);
    }
    s.run(20_000);
    assert_eq!(s.e.blocks().0, 0, "no block is held once every request ended");
    assert!(s.e.idle() && s.e.waiting() == 0 && s.e.running() == 0);
    let mut ended: BTreeMap<usize, Vec<(EndReason, Vec<i64>)>> = BTreeMap::new();
    for (seq, reason, _) in &s.ended {
        ended.entry(*seq).or_default().push((*reason, s.outputs[seq].clone()));
    }
    Outcome { ended, added, plans: s.plans, model }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_request_finishes_once_with_its_solo_output(su in setup(), ops in prop::collection::vec(op(), 0..60)) {
        let out = play(&su, &ops);
        for (seq, (prompt, max_new)) in &out.added {
            let ends = out.ended.get(seq).cloned().unwrap_or_default();
            prop_assert_eq!(ends.len(), 1, "seq {} ended {:?}", seq, ends);
            let (reason, got) = &ends[0];
            let want = solo(out.model, prompt, *max_new, VOCAB as i64 - 1);
            if *reason == EndReason::Cancelled {
                prop_assert!(want.starts_with(got), "seq {}: {:?} is not a prefix of {:?}", seq, got, want);
            } else {
                prop_assert_eq!(got, &want, "seq {}", seq);
                let stop = want.last() == Some(&(VOCAB as i64 - 1));
                prop_assert_eq!(*reason, if stop { EndReason::Stop } else { EndReason::Length });
            }
        }
        prop_assert_eq!(out.ended.len(), out.added.len());
    }

    #[test]
    fn the_same_events_give_the_same_plans(su in setup(), ops in prop::collection::vec(op(), 0..40)) {
        let a = play(&su, &ops);
        let b = play(&su, &ops);
        prop_assert_eq!(a.plans, b.plans);
        prop_assert_eq!(a.ended, b.ended);
    }
}

/// A case the properties found: an older request that joins late (its
/// images encoded) while a later one holds most of the pool, two
/// micro-batches in flight. Were the victim the last one *started*, or
/// could an older one give way while a later one is in flight, the two
/// would preempt each other forever.
#[test]
fn an_older_request_never_gives_way_to_a_later_one_so_both_finish() {
    let su = Setup { stages: 2, per_batch: 2, chunk: 2, blocks: 6, block: 2, caching: false, spec: false, periodic: false };
    let add = |len, max_new, encoding| Op::Add { len, family: 0, max_new, encoding };
    let ops = [add(2, 5, false), add(4, 2, false), add(9, 0, true), add(8, 4, false), add(1, 9, false), Op::Launch, Op::Land];
    let out = play(&su, &ops);
    assert_eq!(out.ended.len(), out.added.len());
}
