//! The NCCL op schedule cannot deadlock: for random layouts, every rank of both sides plans
//! alone, cuts its pairs into buckets and schedules its groups, and a simulation of NCCL's
//! matching (per peer pair FIFO order, independent progress of a group's ops) completes every
//! op with equal sizes on both ends. Also: communicator rank numbering.

use awex_core::DType;
use awex_core::layout::{ExplicitSide, RankId, Side};
use awex_core::plan::{Pair, RankPlan};
use awex_core::synthetic::{SyntheticSide, TensorSplit, catalogue};
use awex_gpu::nccl::{CommWorld, Op, OpKind, Step, pair_bucket_bytes, peer_buckets, schedule};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap, VecDeque};

/// A rank of either side.
type Who = (Side, RankId);

/// Why a simulated run did not finish.
#[derive(Debug, PartialEq, Eq)]
enum SimError {
    /// No op can progress, and these ranks still have groups left.
    Deadlock(Vec<Who>),
    /// A send and the receive it matched carry different byte counts.
    SizeMismatch {
        from: Who,
        to: Who,
        sent: u64,
        expected: u64,
    },
    /// An op names a peer that has no op for this pair left.
    Unmatched { who: Who, op: Op },
}

/// Executes every rank's groups in order under NCCL's point-to-point semantics: a rank posts
/// all ops of its current group; a send and a receive match when each is the oldest unmatched
/// op of its end for that pair and both are posted; ops of one group progress independently,
/// and the rank moves on once all of them matched. Returns the number of matched pairs.
fn simulate(schedules: &BTreeMap<Who, Vec<Step>>) -> Result<usize, SimError> {
    // per (rank, peer): the rank's ops with that peer, in issue order, as (step, op index)
    let mut fifo: HashMap<(Who, Who), VecDeque<(usize, usize)>> = HashMap::new();
    for (&who, steps) in schedules {
        for (g, step) in steps.iter().enumerate() {
            for (i, op) in step.ops.iter().enumerate() {
                let peer = (who.0.other(), op.peer);
                fifo.entry((who, peer)).or_default().push_back((g, i));
            }
        }
    }
    let mut at: BTreeMap<Who, usize> = schedules.keys().map(|&w| (w, 0)).collect();
    let mut done: HashMap<(Who, usize, usize), bool> = HashMap::new();
    let mut matched = 0usize;
    loop {
        let mut progress = false;
        let ranks: Vec<Who> = at.keys().copied().collect();
        for who in ranks {
            let g = at[&who];
            let steps = &schedules[&who];
            let Some(step) = steps.get(g) else { continue };
            for (i, op) in step.ops.iter().enumerate() {
                if done.contains_key(&(who, g, i)) {
                    continue;
                }
                let peer: Who = (who.0.other(), op.peer);
                // the op must be the oldest unmatched op of this end for the pair
                if fifo.get(&(who, peer)).and_then(|q| q.front()) != Some(&(g, i)) {
                    continue;
                }
                let Some(&(pg, pi)) = fifo.get(&(peer, who)).and_then(|q| q.front()) else {
                    return Err(SimError::Unmatched { who, op: *op });
                };
                // the peer must have posted it: it is in the peer's current group
                if at.get(&peer) != Some(&pg) {
                    continue;
                }
                let other = schedules[&peer][pg].ops[pi];
                let (send, recv, from, to) = match op.kind {
                    OpKind::Send => (op, &other, who, peer),
                    OpKind::Recv => (&other, op, peer, who),
                };
                if send.kind != OpKind::Send || recv.kind != OpKind::Recv {
                    return Err(SimError::Unmatched { who, op: *op });
                }
                if send.bytes != recv.bytes {
                    return Err(SimError::SizeMismatch {
                        from,
                        to,
                        sent: send.bytes,
                        expected: recv.bytes,
                    });
                }
                fifo.get_mut(&(who, peer)).map(VecDeque::pop_front);
                fifo.get_mut(&(peer, who)).map(VecDeque::pop_front);
                done.insert((who, g, i), true);
                done.insert((peer, pg, pi), true);
                matched += 1;
                progress = true;
            }
        }
        // ranks whose current group is fully matched move on
        for (who, g) in at.iter_mut() {
            let steps = &schedules[who];
            while let Some(step) = steps.get(*g) {
                if (0..step.ops.len()).all(|i| done.contains_key(&(*who, *g, i))) {
                    *g += 1;
                    progress = true;
                } else {
                    break;
                }
            }
        }
        if !progress {
            let stuck: Vec<Who> = at
                .iter()
                .filter(|(w, g)| **g < schedules[*w].len())
                .map(|(w, _)| *w)
                .collect();
            if stuck.is_empty() {
                return Ok(matched);
            }
            return Err(SimError::Deadlock(stuck));
        }
    }
}

/// Every rank's plan of a pair.
fn plans(pair: &Pair<'_>) -> BTreeMap<Who, RankPlan> {
    let mut out = BTreeMap::new();
    for (side, layout) in [
        (Side::Training, pair.training),
        (Side::Inference, pair.inference),
    ] {
        for r in layout.ranks() {
            out.insert((side, r), pair.plan_rank(side, r).expect("plan"));
        }
    }
    out
}

/// Every rank's schedule, with per-rank budgets `budget(who)`; also returns the buckets.
fn schedules(
    plans: &BTreeMap<Who, RankPlan>,
    budget: impl Fn(Who) -> u64,
) -> BTreeMap<Who, (Vec<Step>, Vec<u64>)> {
    let peers: HashMap<Who, usize> = plans.iter().map(|(w, p)| (*w, p.peers.len())).collect();
    plans
        .iter()
        .map(|(&who, plan)| {
            let pair_sizes: Vec<u64> = plan
                .peers
                .iter()
                .map(|p| {
                    let them = (who.0.other(), p.peer);
                    pair_bucket_bytes(budget(who), peers[&who], budget(them), peers[&them])
                })
                .collect();
            let mut i = 0;
            let buckets = peer_buckets(plan, |_| {
                i += 1;
                pair_sizes[i - 1]
            });
            (
                who,
                (schedule(plan, &buckets).expect("schedule"), pair_sizes),
            )
        })
        .collect()
}

fn split_strategy(shape: Vec<u64>, shards: u32) -> impl Strategy<Value = TensorSplit> {
    let ndim = shape.len();
    (0..ndim, 0u64..3).prop_flat_map(move |(dim, pad)| {
        let len = shape[dim];
        proptest::collection::vec(0..=len, (shards - 1) as usize).prop_map(move |mut cuts| {
            cuts.sort();
            TensorSplit { dim, cuts, pad }
        })
    })
}

fn side_strategy(side: Side, shapes: Vec<Vec<u64>>) -> impl Strategy<Value = SyntheticSide> {
    let engines = if side == Side::Training {
        1..2u32
    } else {
        1..4u32
    };
    (engines, 1..4u32, 1..5u32, any::<bool>()).prop_flat_map(
        move |(engines, replicas, shards, fuse)| {
            let splits: Vec<_> = shapes
                .iter()
                .map(|s| split_strategy(s.clone(), shards))
                .collect();
            splits.prop_map(move |splits| SyntheticSide {
                side,
                engines,
                replicas,
                shards,
                splits,
                dtype: DType::Bf16,
                fuse,
            })
        },
    )
}

fn case() -> impl Strategy<Value = (Vec<Vec<u64>>, SyntheticSide, SyntheticSide)> {
    let shape = prop_oneof![
        (1u64..40).prop_map(|r| vec![r]),
        (1u64..40).prop_map(|r| vec![r, 6]),
        (1u64..16, 1u64..9).prop_map(|(r, c)| vec![r, c]),
    ];
    proptest::collection::vec(shape, 1..6).prop_flat_map(|shapes| {
        (
            Just(shapes.clone()),
            side_strategy(Side::Training, shapes.clone()),
            side_strategy(Side::Inference, shapes),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn schedules_of_random_plans_never_deadlock_and_match_sizes(
        (shapes, t, i) in case(),
        budgets in proptest::collection::vec(1u64..600, 1..8),
    ) {
        let cat = catalogue(&shapes);
        let (train, infer) = (t.build(&cat), i.build(&cat));
        let pair = Pair { catalogue: &cat, training: &train, inference: &infer, encode_on_sender: false };
        let plans = plans(&pair);
        // budgets differ per rank, so the two ends of a pair must agree on the smaller share
        let budget = |w: Who| budgets[(w.1.engine as usize * 5 + w.1.rank as usize + w.0 as usize) % budgets.len()];
        let scheds = schedules(&plans, budget);
        let steps: BTreeMap<Who, Vec<Step>> =
            scheds.iter().map(|(w, (s, _))| (*w, s.clone())).collect();
        let matched = simulate(&steps).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        // every bucket of every training rank was matched exactly once
        let sends: usize = steps
            .iter()
            .filter(|(w, _)| w.0 == Side::Training)
            .map(|(_, s)| s.iter().map(|g| g.ops.len()).sum::<usize>())
            .sum();
        let recvs: usize = steps
            .iter()
            .filter(|(w, _)| w.0 == Side::Inference)
            .map(|(_, s)| s.iter().map(|g| g.ops.len()).sum::<usize>())
            .sum();
        prop_assert_eq!(matched, sends);
        prop_assert_eq!(matched, recvs);
        for (who, (sched, sizes)) in &scheds {
            let plan = &plans[who];
            // each step holds one bucket per peer at most, all of the same index
            for (k, g) in sched.iter().enumerate() {
                prop_assert_eq!(g.index, k);
                prop_assert!(g.ops.iter().all(|o| o.bucket == k));
                prop_assert!(!g.ops.is_empty());
                let mut peers: Vec<RankId> = g.ops.iter().map(|o| o.peer).collect();
                peers.dedup();
                prop_assert_eq!(peers.len(), g.ops.len());
            }
            // the pair sizes of a rank sum to at most its budget (one step's staging)
            let total: u64 = sizes.iter().sum();
            prop_assert!(total <= budget(*who).max(sizes.len() as u64), "{} > {}", total, budget(*who));
            // every planned byte is scheduled exactly once
            let bytes: u64 = sched.iter().map(Step::bytes).sum();
            prop_assert_eq!(bytes, plan.bytes());
        }
    }
}

#[test]
fn simulator_detects_a_cross_ordered_deadlock() {
    // training A sends to I0 then I1, training B to I1 then I0; I0 receives from B first,
    // I1 from A first: a cycle of waits, which the schedule never produces
    let op = |kind, peer, bytes| Op {
        kind,
        peer,
        peer_index: 0,
        bucket: 0,
        bytes,
    };
    let step = |ops: Vec<Op>| Step { index: 0, ops };
    let (a, b) = (RankId::train(0), RankId::train(1));
    let (i0, i1) = (RankId::infer(0, 0), RankId::infer(0, 1));
    let s = OpKind::Send;
    let r = OpKind::Recv;
    let mut sched = BTreeMap::new();
    sched.insert(
        (Side::Training, a),
        vec![step(vec![op(s, i0, 8)]), step(vec![op(s, i1, 8)])],
    );
    sched.insert(
        (Side::Training, b),
        vec![step(vec![op(s, i1, 8)]), step(vec![op(s, i0, 8)])],
    );
    sched.insert(
        (Side::Inference, i0),
        vec![step(vec![op(r, b, 8)]), step(vec![op(r, a, 8)])],
    );
    sched.insert(
        (Side::Inference, i1),
        vec![step(vec![op(r, a, 8)]), step(vec![op(r, b, 8)])],
    );
    assert_eq!(
        simulate(&sched),
        Err(SimError::Deadlock(vec![
            (Side::Training, a),
            (Side::Training, b),
            (Side::Inference, i0),
            (Side::Inference, i1),
        ]))
    );
    // the same ops grouped per step (what `schedule` does) complete
    let mut ok = BTreeMap::new();
    ok.insert(
        (Side::Training, a),
        vec![step(vec![op(s, i0, 8), op(s, i1, 8)])],
    );
    ok.insert(
        (Side::Training, b),
        vec![step(vec![op(s, i0, 8), op(s, i1, 8)])],
    );
    ok.insert(
        (Side::Inference, i0),
        vec![step(vec![op(r, a, 8), op(r, b, 8)])],
    );
    ok.insert(
        (Side::Inference, i1),
        vec![step(vec![op(r, a, 8), op(r, b, 8)])],
    );
    assert_eq!(simulate(&ok), Ok(4));
}

#[test]
fn simulator_detects_a_size_mismatch() {
    let a = RankId::train(0);
    let i0 = RankId::infer(0, 0);
    let mut sched = BTreeMap::new();
    let op = |kind, peer, bytes| Op {
        kind,
        peer,
        peer_index: 0,
        bucket: 0,
        bytes,
    };
    sched.insert(
        (Side::Training, a),
        vec![Step {
            index: 0,
            ops: vec![op(OpKind::Send, i0, 16)],
        }],
    );
    sched.insert(
        (Side::Inference, i0),
        vec![Step {
            index: 0,
            ops: vec![op(OpKind::Recv, a, 8)],
        }],
    );
    assert_eq!(
        simulate(&sched),
        Err(SimError::SizeMismatch {
            from: (Side::Training, a),
            to: (Side::Inference, i0),
            sent: 16,
            expected: 8
        })
    );
}

/// A 2-rank training side (tp=2 rows) and 2 engines of 3 ranks (rows), one 24x4 bf16 tensor.
fn small_pair() -> (awex_core::Catalogue, ExplicitSide, ExplicitSide) {
    let cat = catalogue(&[vec![24, 4]]);
    let train = SyntheticSide {
        side: Side::Training,
        engines: 1,
        replicas: 1,
        shards: 2,
        splits: vec![TensorSplit {
            dim: 0,
            cuts: vec![12],
            pad: 0,
        }],
        dtype: DType::Bf16,
        fuse: false,
    }
    .build(&cat);
    let infer = SyntheticSide {
        side: Side::Inference,
        engines: 2,
        replicas: 1,
        shards: 3,
        splits: vec![TensorSplit {
            dim: 0,
            cuts: vec![8, 16],
            pad: 0,
        }],
        dtype: DType::Bf16,
        fuse: false,
    }
    .build(&cat);
    (cat, train, infer)
}

#[test]
fn a_small_pair_schedules_exact_buckets_per_step() {
    let (cat, train, infer) = small_pair();
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    let plans = plans(&pair);
    // training rank 0 holds rows 0..12: rows 0..8 to inference ranks */0, rows 8..12 to */1;
    // budget 64 bytes over its peers; rows are 8 bytes
    let scheds = schedules(&plans, |_| 64);
    let (t0, sizes) = &scheds[&(Side::Training, RankId::train(0))];
    let peers: Vec<RankId> = plans[&(Side::Training, RankId::train(0))]
        .peers
        .iter()
        .map(|p| p.peer)
        .collect();
    assert_eq!(
        peers,
        [
            RankId::infer(0, 0),
            RankId::infer(0, 1),
            RankId::infer(1, 0),
            RankId::infer(1, 1)
        ]
    );
    // 64 / 4 peers = 16 on this end; inference */0 has 1 peer (64), */1 has 2 (32)
    assert_eq!(sizes, &vec![16, 16, 16, 16]);
    let shape: Vec<Vec<(RankId, usize, u64)>> = t0
        .iter()
        .map(|s| s.ops.iter().map(|o| (o.peer, o.bucket, o.bytes)).collect())
        .collect();
    assert_eq!(
        shape,
        vec![
            vec![
                (RankId::infer(0, 0), 0, 16),
                (RankId::infer(0, 1), 0, 16),
                (RankId::infer(1, 0), 0, 16),
                (RankId::infer(1, 1), 0, 16)
            ],
            vec![
                (RankId::infer(0, 0), 1, 16),
                (RankId::infer(0, 1), 1, 16),
                (RankId::infer(1, 0), 1, 16),
                (RankId::infer(1, 1), 1, 16)
            ],
            vec![(RankId::infer(0, 0), 2, 16), (RankId::infer(1, 0), 2, 16)],
            vec![(RankId::infer(0, 0), 3, 16), (RankId::infer(1, 0), 3, 16)],
        ]
    );
    assert!(
        t0.iter()
            .all(|s| s.ops.iter().all(|o| o.kind == OpKind::Send))
    );
    let steps: BTreeMap<Who, Vec<Step>> =
        scheds.iter().map(|(w, (s, _))| (*w, s.clone())).collect();
    // 8 buckets of rank 0's rows 0..8 (x2 engines) + 2 of rows 8..12 (x2) + the same from rank 1
    assert_eq!(simulate(&steps), Ok(24));
}

#[test]
fn schedule_refuses_bucket_lists_that_do_not_match_the_peers() {
    let (cat, train, infer) = small_pair();
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    let plan = pair.plan_rank(Side::Training, RankId::train(1)).unwrap();
    assert_eq!(
        schedule(&plan, &[]).unwrap_err().to_string(),
        "training rank 0/1 has 4 peers but 0 bucket lists were given"
    );
}

#[test]
fn comm_ranks_put_training_first_then_inference_engine_major() {
    let w = CommWorld::new(4, 2, 3).unwrap();
    assert_eq!(w.nranks(), 10);
    let t = |r| w.comm_rank(Side::Training, RankId::train(r)).unwrap();
    let i = |e, r| w.comm_rank(Side::Inference, RankId::infer(e, r)).unwrap();
    assert_eq!([t(0), t(1), t(2), t(3)], [0, 1, 2, 3]);
    assert_eq!([i(0, 0), i(0, 1), i(0, 2)], [4, 5, 6]);
    assert_eq!([i(1, 0), i(1, 1), i(1, 2)], [7, 8, 9]);
    // the inverse, over the whole world
    for c in 0..10 {
        let (side, r) = w.rank_of(c).unwrap();
        assert_eq!(w.comm_rank(side, r).unwrap(), c);
    }
    assert_eq!(
        w.rank_of(10).unwrap_err().to_string(),
        "communicator rank 10 is outside the NCCL world of 10 ranks"
    );
    assert_eq!(
        w.comm_rank(Side::Inference, RankId::infer(2, 0))
            .unwrap_err()
            .to_string(),
        "inference rank 2/0 is not in the NCCL world (4 training ranks + 2 engine(s) x 3 inference ranks)"
    );
    assert_eq!(
        w.comm_rank(Side::Training, RankId::infer(1, 0))
            .unwrap_err()
            .to_string(),
        "training rank 1/0 is not in the NCCL world (4 training ranks + 2 engine(s) x 3 inference ranks)"
    );
    assert_eq!(
        CommWorld::new(0, 1, 1).unwrap_err().to_string(),
        "bad NCCL world: 0 training ranks + 1 engine(s) x 1 inference ranks: every count must be at least 1"
    );
}

#[test]
fn comm_world_of_a_pair_counts_engines_and_ranks() {
    let (_, train, infer) = small_pair();
    let w = CommWorld::of(&train, &infer).unwrap();
    assert_eq!(w, CommWorld::new(2, 2, 3).unwrap());
    assert_eq!(w.nranks(), 8);
}

proptest! {
    #[test]
    fn comm_rank_numbering_is_a_bijection(t in 1u32..20, e in 1u32..6, r in 1u32..9) {
        let w = CommWorld::new(t, e, r).unwrap();
        let mut seen = vec![false; w.nranks() as usize];
        for x in 0..t {
            let c = w.comm_rank(Side::Training, RankId::train(x)).unwrap();
            prop_assert_eq!(c, x);
            seen[c as usize] = true;
        }
        for en in 0..e {
            for x in 0..r {
                let c = w.comm_rank(Side::Inference, RankId::infer(en, x)).unwrap();
                prop_assert_eq!(c, t + en * r + x);
                prop_assert!(!seen[c as usize]);
                seen[c as usize] = true;
                prop_assert_eq!(w.rank_of(c).unwrap(), (Side::Inference, RankId::infer(en, x)));
            }
        }
        prop_assert!(seen.iter().all(|s| *s));
    }
}
