//! Planner properties over random synthetic layouts: exact, correct, deterministic, agreed by both ends, balanced.

use awex_core::DType;
use awex_core::layout::copy::StridedBox;
use awex_core::layout::{ExplicitSide, RankId, Side, SideLayout, materialize};
use awex_core::model::Catalogue;
use awex_core::plan::{Pair, PlanError, RankBuffers, RankPlan, simulate};
use awex_core::synthetic::{SyntheticSide, TensorSplit, canonical_bytes, catalogue};
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

fn all_plans(pair: &Pair<'_>, side: Side) -> Vec<RankPlan> {
    let layout = match side {
        Side::Training => pair.training,
        Side::Inference => pair.inference,
    };
    layout
        .ranks()
        .into_iter()
        .map(|r| pair.plan_rank(side, r).expect("plan"))
        .collect()
}

fn buffers(side: &ExplicitSide, cat: &Catalogue, canon: &HashMap<String, Vec<u8>>) -> RankBuffers {
    let get = |n: &str| canon.get(n).map(|v| v.as_slice());
    side.rank_layouts()
        .iter()
        .map(|l| {
            let bufs = materialize(l, cat, &get).expect("materialize");
            (
                l.rank,
                l.tensors
                    .iter()
                    .zip(bufs)
                    .map(|(t, b)| (t.name.clone(), b))
                    .collect(),
            )
        })
        .collect()
}

fn zeroed(side: &ExplicitSide) -> RankBuffers {
    side.rank_layouts()
        .iter()
        .map(|l| {
            (
                l.rank,
                l.tensors
                    .iter()
                    .map(|t| (t.name.clone(), vec![0u8; t.nbytes() as usize]))
                    .collect(),
            )
        })
        .collect()
}

/// Checks every property on one pair; returns the training plans.
fn check_pair(cat: &Catalogue, train: &ExplicitSide, infer: &ExplicitSide) -> Vec<RankPlan> {
    let pair = Pair {
        catalogue: cat,
        training: train,
        inference: infer,
        encode_on_sender: false,
    };
    let tplans = all_plans(&pair, Side::Training);
    let iplans = all_plans(&pair, Side::Inference);

    // both ends agree on every peer pair, transfer for transfer
    for tp in &tplans {
        for peer in &tp.peers {
            let ip = iplans.iter().find(|p| p.rank == peer.peer).expect("peer");
            let mirror = ip.peer(tp.rank).expect("mirror peer plan");
            assert_eq!(
                mirror.transfers, peer.transfers,
                "{} <-> {}",
                tp.rank, peer.peer
            );
            assert_eq!(mirror.fingerprint, peer.fingerprint);
        }
    }
    let sent: usize = tplans.iter().map(|p| p.transfers()).sum();
    let recv: usize = iplans.iter().map(|p| p.transfers()).sum();
    assert_eq!(sent, recv);

    // correct: executing the plans yields exactly the materialized destination tensors
    let canon: HashMap<String, Vec<u8>> = cat
        .tensors()
        .iter()
        .map(|c| {
            (
                c.name.clone(),
                canonical_bytes(&c.name, 7, c.nbytes() as usize),
            )
        })
        .collect();
    let src = buffers(train, cat, &canon);
    let want = buffers(infer, cat, &canon);
    let mut got = zeroed(infer);
    simulate(&tplans, &src, &mut got).expect("simulate");
    assert_eq!(got, want);

    // exact: every covered destination element written once, nothing else written
    let mut counts: HashMap<(RankId, Arc<str>), Vec<u8>> = HashMap::new();
    for l in infer.rank_layouts() {
        for t in &l.tensors {
            counts.insert((l.rank, t.name.clone()), vec![0; t.shape.numel() as usize]);
        }
    }
    for p in &tplans {
        for peer in &p.peers {
            for t in &peer.transfers {
                let c = counts.get_mut(&(t.dst_rank, t.dst_tensor.clone())).unwrap();
                let b = t.strided_box().unwrap();
                b.for_each_run(|_, d, n| {
                    for e in d..d + n {
                        c[e as usize] += 1;
                    }
                });
            }
        }
    }
    for l in infer.rank_layouts() {
        for t in &l.tensors {
            let mut covered = vec![0u8; t.shape.numel() as usize];
            for p in &t.placements {
                let b = StridedBox::new(
                    &t.shape,
                    &p.local_offset,
                    &t.shape,
                    &p.local_offset,
                    &p.local_extent(),
                )
                .unwrap();
                b.for_each_run(|_, d, n| {
                    for e in d..d + n {
                        covered[e as usize] = 1;
                    }
                });
            }
            assert_eq!(
                counts[&(l.rank, t.name.clone())],
                covered,
                "{} {}",
                l.rank,
                t.name
            );
        }
    }
    tplans
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
    (engines, 1..4u32, 1..5u32, any::<bool>(), any::<bool>()).prop_flat_map(
        move |(engines, replicas, shards, fuse, fp32)| {
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
                dtype: if fp32 && side == Side::Training {
                    DType::F32
                } else {
                    DType::Bf16
                },
                fuse,
            })
        },
    )
}

fn case() -> impl Strategy<Value = (Vec<Vec<u64>>, SyntheticSide, SyntheticSide)> {
    let shape = prop_oneof![
        (1u64..24).prop_map(|r| vec![r]),
        (1u64..24).prop_map(|r| vec![r, 6]),
        (1u64..12, 1u64..9).prop_map(|(r, c)| vec![r, c]),
    ];
    proptest::collection::vec(shape, 1..5).prop_flat_map(|shapes| {
        (
            Just(shapes.clone()),
            side_strategy(Side::Training, shapes.clone()),
            side_strategy(Side::Inference, shapes),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn plans_are_exact_correct_and_agreed_for_random_layouts((shapes, t, i) in case()) {
        let cat = catalogue(&shapes);
        check_pair(&cat, &t.build(&cat), &i.build(&cat));
    }

    #[test]
    fn plans_do_not_depend_on_input_order((shapes, t, i) in case(), seed in any::<u64>()) {
        let cat = catalogue(&shapes);
        let (train, infer) = (t.build(&cat), i.build(&cat));
        let pair = Pair { catalogue: &cat, training: &train, inference: &infer, encode_on_sender: false };
        let base = all_plans(&pair, Side::Training);
        // shuffle ranks and each rank's tensor order, rebuild the sides
        let shuffle = |mut v: Vec<awex_core::RankLayout>| {
            let mut s = seed | 1;
            for l in &mut v {
                l.tensors.reverse();
            }
            for k in (1..v.len()).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                v.swap(k, (s >> 33) as usize % (k + 1));
            }
            v
        };
        let train2 = ExplicitSide::new(Side::Training, shuffle(t.rank_layouts(&cat)));
        let infer2 = ExplicitSide::new(Side::Inference, shuffle(i.rank_layouts(&cat)));
        let pair2 = Pair { catalogue: &cat, training: &train2, inference: &infer2, encode_on_sender: false };
        let again = all_plans(&pair2, Side::Training);
        prop_assert_eq!(base, again);
    }
}

/// The inference side with every local tensor of at least two dims whose boxes all have at
/// least two dims stored transposed (an engine holding `[.., out, in]` where the checkpoint
/// has `[.., in, out]`): its last two dims swapped, each placement's offset too.
fn transposed(side: &ExplicitSide) -> ExplicitSide {
    let mut ranks = side.rank_layouts().to_vec();
    for l in &mut ranks {
        for t in &mut l.tensors {
            let n = t.shape.ndim();
            if n < 2 || t.placements.iter().any(|p| p.region.ndim() < 2) {
                continue;
            }
            let swap = |d: &mut awex_core::layout::Dims| {
                let (a, b) = (d.get(n - 2), d.get(n - 1));
                d.set(n - 2, b);
                d.set(n - 1, a);
            };
            swap(&mut t.shape);
            for p in &mut t.placements {
                swap(&mut p.local_offset);
                p.transposed = true;
            }
        }
    }
    ExplicitSide::new(side.side(), ranks)
}

fn case_3d() -> impl Strategy<Value = (Vec<Vec<u64>>, SyntheticSide, SyntheticSide)> {
    let shape = prop_oneof![
        (1u64..12, 1u64..9).prop_map(|(r, c)| vec![r, c]),
        (1u64..4, 1u64..7, 1u64..9).prop_map(|(e, r, c)| vec![e, r, c]),
    ];
    proptest::collection::vec(shape, 1..4).prop_flat_map(|shapes| {
        (
            Just(shapes.clone()),
            side_strategy(Side::Training, shapes.clone()),
            side_strategy(Side::Inference, shapes),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn plans_into_transposed_destinations_are_exact_and_correct((shapes, t, i) in case_3d()) {
        let cat = catalogue(&shapes);
        let infer = transposed(&i.build(&cat));
        for l in infer.rank_layouts() {
            awex_core::layout::validate_rank(l, &cat).unwrap();
        }
        let plans = check_pair(&cat, &t.build(&cat), &infer);
        // every transfer into a transposed tensor is transposed, and only those
        for p in &plans {
            for peer in &p.peers {
                for x in &peer.transfers {
                    let l = infer.rank_layout(x.dst_rank).unwrap();
                    let want = l.tensor(&x.dst_tensor).unwrap().placements[0].transposed;
                    prop_assert_eq!(x.transposed, want);
                }
            }
        }
        // and the destination bytes read back (transposed back) as the checkpoint
        let canon: HashMap<String, Vec<u8>> = cat
            .tensors()
            .iter()
            .map(|c| (c.name.clone(), canonical_bytes(&c.name, 7, c.nbytes() as usize)))
            .collect();
        let got = buffers(&infer, &cat, &canon);
        let layouts = infer.rank_layouts();
        let bufs: Vec<Vec<Vec<u8>>> = layouts
            .iter()
            .map(|l| l.tensors.iter().map(|t| got[&l.rank][&t.name].clone()).collect())
            .collect();
        let back = awex_core::layout::reconstruct(layouts, &bufs, &cat).unwrap();
        for c in cat.tensors() {
            prop_assert_eq!(&back[&c.name], &canon[&c.name]);
        }
    }
}

#[test]
fn a_transposed_training_tensor_is_refused_by_name() {
    let cat = catalogue(&[vec![4, 6]]);
    let train = transposed(&replicated(Side::Training, 1, 1, 1, 4).build(&cat));
    let train = ExplicitSide::new(Side::Training, train.rank_layouts().to_vec());
    let infer = replicated(Side::Inference, 1, 1, 2, 4).build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    let e = pair
        .plan_rank(Side::Training, RankId::train(0))
        .unwrap_err();
    assert!(matches!(e, PlanError::Transposed { .. }), "{e:?}");
    assert!(e.to_string().contains("only an inference tensor"), "{e}");
}

#[test]
fn transposed_transfers_never_coalesce() {
    // as `contiguous_pieces_coalesce_into_one_transfer`, into a destination that holds the
    // fused tensor transposed: the two boxes stay two transfers
    let cat = catalogue(&[vec![16, 4], vec![8, 4]]);
    let mut t = replicated(Side::Training, 1, 1, 1, 16);
    t.splits.push(TensorSplit {
        dim: 0,
        cuts: vec![],
        pad: 0,
    });
    t.fuse = true;
    let mut i = t.clone();
    i.side = Side::Inference;
    let (train, infer) = (t.build(&cat), transposed(&i.build(&cat)));
    let plans = check_pair(&cat, &train, &infer);
    assert_eq!(plans[0].transfers(), 2);
    let ts = &plans[0].peers[0].transfers;
    assert!(ts.iter().all(|t| t.transposed));
    assert_eq!(ts[1].dst_offset.as_slice(), &[0, 16]);
    assert_eq!(ts[1].dst_extent().as_slice(), &[4, 8]);
}

fn replicated(side: Side, engines: u32, replicas: u32, shards: u32, rows: u64) -> SyntheticSide {
    let cuts = (1..shards)
        .map(|s| rows * s as u64 / shards as u64)
        .collect();
    SyntheticSide {
        side,
        engines,
        replicas,
        shards,
        splits: vec![TensorSplit {
            dim: 0,
            cuts,
            pad: 0,
        }],
        dtype: DType::Bf16,
        fuse: false,
    }
}

#[test]
fn dp8_feeding_tp8_uses_every_replica_equally() {
    // training TP=1 x DP=8 (8 full replicas) -> inference TP=8 (rows split 8 ways)
    let cat = catalogue(&[vec![64, 16]]);
    let train = replicated(Side::Training, 1, 8, 1, 64).build(&cat);
    let infer = replicated(Side::Inference, 1, 1, 8, 64).build(&cat);
    let plans = check_pair(&cat, &train, &infer);
    let egress: Vec<u64> = plans.iter().map(|p| p.bytes()).collect();
    assert_eq!(
        egress,
        vec![8 * 16 * 2; 8],
        "each DP replica sends one eighth"
    );
}

#[test]
fn replicated_destinations_spread_over_sources() {
    // 3 source replicas, 2 engines x 4 replicated destination ranks = 8 full copies to send
    let cat = catalogue(&[vec![30, 4]]);
    let train = replicated(Side::Training, 1, 3, 1, 30).build(&cat);
    let infer = replicated(Side::Inference, 2, 4, 1, 30).build(&cat);
    let plans = check_pair(&cat, &train, &infer);
    let mut copies: Vec<u64> = plans.iter().map(|p| p.bytes() / (30 * 4 * 2)).collect();
    copies.sort();
    assert_eq!(copies, vec![2, 3, 3]);
}

#[test]
fn contiguous_pieces_coalesce_into_one_transfer() {
    // source shards rows in 4 pieces; one destination holds all rows: 4 transfers from one source
    // merge into one when a single source holds everything
    let cat = catalogue(&[vec![16, 4], vec![8, 4]]);
    let mut t = replicated(Side::Training, 1, 1, 1, 16);
    t.splits.push(TensorSplit {
        dim: 0,
        cuts: vec![],
        pad: 0,
    });
    t.fuse = true;
    let mut i = t.clone();
    i.side = Side::Inference;
    let (train, infer) = (t.build(&cat), i.build(&cat));
    let plans = check_pair(&cat, &train, &infer);
    // t0 rows and t1 rows are adjacent in both fused tensors: one transfer of 24 rows
    assert_eq!(plans[0].transfers(), 1);
    let tr = &plans[0].peers[0].transfers[0];
    assert_eq!(tr.extent.as_slice(), &[24, 4]);
}

#[test]
fn missing_source_coverage_is_a_clear_error() {
    let cat = catalogue(&[vec![8, 2]]);
    let train_layouts: Vec<_> = replicated(Side::Training, 1, 1, 2, 8)
        .rank_layouts(&cat)
        .into_iter()
        .filter(|l| l.rank.rank == 0)
        .collect();
    let train = ExplicitSide::new(Side::Training, train_layouts);
    let infer = replicated(Side::Inference, 1, 1, 1, 8).build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    let e = pair
        .plan_rank(Side::Inference, RankId::infer(0, 0))
        .unwrap_err();
    assert_eq!(
        e,
        PlanError::Uncovered {
            canonical: "t0".into(),
            region: "[4..8, 0..2]".into(),
            dst: RankId::infer(0, 0)
        }
    );
    assert_eq!(
        e.to_string(),
        "inference rank 0/0 needs [4..8, 0..2] of `t0`, which no training rank holds"
    );
    assert!(matches!(
        pair.plan_rank(Side::Training, RankId::train(5)),
        Err(PlanError::NoSuchRank { .. })
    ));
}

/// Training shards rows on four ranks, one each (sources apart: a rank cuts into cells only
/// the destination boxes that may involve it, and checks the others whole); the inference side
/// halves the rows over two ranks. `alter` changes the training ranks' layouts. The error of
/// inference rank 0's plan, which training rank 0's plan (rows 0..2, sent to inference rank 0
/// only) must give too.
fn apart_pair_error(alter: impl Fn(&mut Vec<awex_core::layout::RankLayout>)) -> PlanError {
    let cat = catalogue(&[vec![8, 2]]);
    let mut train_layouts = replicated(Side::Training, 1, 1, 4, 8).rank_layouts(&cat);
    alter(&mut train_layouts);
    let train = ExplicitSide::new(Side::Training, train_layouts);
    let infer = replicated(Side::Inference, 1, 1, 2, 8).build(&cat);
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    let e = pair
        .plan_rank(Side::Inference, RankId::infer(0, 0))
        .expect_err("another rank's box is not delivered");
    let t = pair
        .plan_rank(Side::Training, RankId::train(0))
        .expect_err("a box the training rank does not send to is not delivered");
    assert_eq!(t, e, "both sides name the same failure");
    e
}

#[test]
fn another_ranks_uncovered_box_still_fails_the_plan_of_every_rank() {
    // rank 3 (rows 6..8) is missing: inference rank 1 needs them, and rank 0's plan says so
    let e = apart_pair_error(|l| l.retain(|r| r.rank.rank != 3));
    assert_eq!(
        e,
        PlanError::Uncovered {
            canonical: "t0".into(),
            region: "[6..8, 0..2]".into(),
            dst: RankId::infer(0, 1)
        }
    );
}

#[test]
fn another_ranks_box_from_a_dtype_that_cannot_convert_still_fails_the_plan() {
    // rank 2 (rows 4..6, for inference rank 1) holds integers: no conversion into bf16
    let e = apart_pair_error(|l| {
        for t in &mut l.iter_mut().find(|r| r.rank.rank == 2).unwrap().tensors {
            t.dtype = DType::I64;
            t.encoding = awex_core::encoding::Encoding::Plain(DType::I64);
        }
    });
    assert_eq!(
        e,
        PlanError::DType {
            canonical: "t0".into(),
            src: DType::I64,
            dst: DType::Bf16
        }
    );
}

#[test]
fn fp32_training_converts_at_the_sender() {
    let cat = catalogue(&[vec![4, 4]]);
    let mut t = replicated(Side::Training, 1, 1, 2, 4);
    t.dtype = DType::F32;
    let train = t.build(&cat);
    let infer = replicated(Side::Inference, 1, 1, 1, 4).build(&cat);
    let plans = check_pair(&cat, &train, &infer);
    for p in &plans {
        for peer in &p.peers {
            for tr in &peer.transfers {
                assert!(tr.converts());
                assert_eq!((tr.src_dtype, tr.dst_dtype), (DType::F32, DType::Bf16));
                assert_eq!(tr.bytes(), 2 * 4 * 2);
            }
        }
    }
}
