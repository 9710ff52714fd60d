//! The NCCL transport's device program, executed on host memory: every rank lays out its
//! schedule on its tensors (direct buckets, staged buckets, pack/unpack pitched copies over two
//! slots), a stand-in for NCCL moves each matched send into its receive, and every inference
//! rank ends up holding exactly the canonical weights. This is the GPU data path's geometry,
//! checked without a GPU.

use awex_core::DType;
use awex_core::layout::{ExplicitSide, RankId, RankLayout, Side, SideLayout};
use awex_core::plan::{Pair, RankPlan};
use awex_core::synthetic::{SyntheticSide, TensorSplit, catalogue};
use awex_gpu::cuda::CopyDesc;
use awex_gpu::nccl::{
    CommWorld, DeviceTensor, DeviceTensors, OpKind, Program, SLOT_ALIGN, Wire, pair_bucket_bytes,
    peer_buckets, schedule,
};
use awex_runtime::TensorSet;
use awex_runtime::fill::fill_or_check;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

type Who = (Side, RankId);

/// Host memory standing in for one GPU: the rank's tensors and its two staging slots.
struct Rank {
    layout: RankLayout,
    tensors: TensorSet,
    program: Program,
    slots: [Vec<u64>; 2],
    /// copies[k][s]: step k's pack/unpack copies with slot s
    copies: Vec<[Vec<CopyDesc>; 2]>,
    /// (base, len) of every buffer of the rank, to check each copy stays inside one
    buffers: Vec<(u64, u64)>,
}

impl Rank {
    fn slot(&self, s: usize) -> u64 {
        self.slots[s].as_ptr() as u64
    }

    fn inside(&self, addr: u64, len: u64) -> bool {
        len == 0
            || self
                .buffers
                .iter()
                .any(|&(b, n)| addr >= b && addr + len <= b + n)
    }
}

/// Copies `len` bytes between two host addresses after checking both lie in known buffers.
fn copy(from: &Rank, src: u64, to: &Rank, dst: u64, len: u64) {
    assert!(
        from.inside(src, len),
        "source {src:#x}+{len} is outside every buffer"
    );
    assert!(
        to.inside(dst, len),
        "destination {dst:#x}+{len} is outside every buffer"
    );
    // SAFETY: both ranges were just checked to lie inside live buffers of these ranks; source
    // and destination are distinct buffers (tensor vs slot, or two ranks).
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize) };
}

fn run_copies(r: &Rank, descs: &[CopyDesc]) {
    for d in descs {
        d.for_each_row(|s, t, n| copy(r, s, r, t, n));
    }
}

/// Builds every rank, runs one update through the programs, and checks every inference rank.
/// Returns the ranks (for inspection).
fn run_update(
    cat: &awex_core::Catalogue,
    train: &ExplicitSide,
    infer: &ExplicitSide,
    budget: impl Fn(Who) -> u64,
    version: u64,
) -> BTreeMap<Who, Rank> {
    let pair = Pair {
        catalogue: cat,
        training: train,
        inference: infer,
        encode_on_sender: false,
    };
    let world = CommWorld::of(train, infer).unwrap();
    let mut plans: BTreeMap<Who, RankPlan> = BTreeMap::new();
    let mut layouts: HashMap<Who, RankLayout> = HashMap::new();
    for (side, l) in [(Side::Training, train), (Side::Inference, infer)] {
        for r in l.ranks() {
            plans.insert((side, r), pair.plan_rank(side, r).unwrap());
            layouts.insert((side, r), l.rank_layout(r).unwrap());
        }
    }
    let npeers: HashMap<Who, usize> = plans.iter().map(|(w, p)| (*w, p.peers.len())).collect();
    let mut ranks: BTreeMap<Who, Rank> = BTreeMap::new();
    for (&who, plan) in &plans {
        let layout = layouts.remove(&who).unwrap();
        let tensors = TensorSet::allocate_host(&layout).unwrap();
        let dev: Vec<DeviceTensor> = tensors
            .iter()
            .map(|v| DeviceTensor {
                name: v.name.clone(),
                ptr: v.ptr() as u64,
                dtype: v.dtype,
                shape: v.shape,
            })
            .collect();
        let buffers: Vec<(u64, u64)> = tensors
            .iter()
            .map(|v| (v.ptr() as u64, v.len() as u64))
            .collect();
        // SAFETY: host memory owned by `tensors`, alive for the whole test.
        let dev = unsafe { DeviceTensors::new(dev) }.unwrap();
        let buckets = peer_buckets(plan, |peer| {
            let them = (who.0.other(), peer);
            pair_bucket_bytes(budget(who), npeers[&who], budget(them), npeers[&them])
        });
        let steps = schedule(plan, &buckets).unwrap();
        let program = Program::build(plan, &buckets, &steps, &dev, &world).unwrap();
        let words = program.slot_bytes.div_ceil(8) as usize;
        let slots = [vec![0u64; words.max(1)], vec![0u64; words.max(1)]];
        let mut r = Rank {
            layout,
            tensors,
            program,
            slots,
            copies: Vec::new(),
            buffers,
        };
        let (s0, s1) = (r.slot(0), r.slot(1));
        r.buffers.push((s0, r.program.slot_bytes));
        r.buffers.push((s1, r.program.slot_bytes));
        r.copies = r
            .program
            .steps
            .iter()
            .map(|st| [st.copies(who.0, s0), st.copies(who.0, s1)])
            .collect();
        ranks.insert(who, r);
    }
    for ((side, _), r) in &ranks {
        if *side == Side::Training {
            fill_or_check(&r.layout, cat, &r.tensors, version, false).unwrap();
        }
    }
    // step k everywhere: pack, move every matched pair, unpack (the device orders the same
    // way with events; here it is sequential)
    let steps = ranks
        .values()
        .map(|r| r.program.steps.len())
        .max()
        .unwrap_or(0);
    for k in 0..steps {
        let s = k % 2;
        for ((side, _), r) in &ranks {
            if *side == Side::Training && k < r.copies.len() {
                run_copies(r, &r.copies[k][s]);
            }
        }
        for ((side, who), r) in &ranks {
            if *side != Side::Training {
                continue;
            }
            let Some(step) = r.program.steps.get(k) else {
                continue;
            };
            for o in &step.ops {
                assert_eq!(o.op.kind, OpKind::Send);
                assert_eq!(
                    o.peer_comm,
                    world.comm_rank(Side::Inference, o.op.peer).unwrap()
                );
                let peer = &ranks[&(Side::Inference, o.op.peer)];
                let theirs = peer.program.steps[k]
                    .ops
                    .iter()
                    .find(|x| x.op.peer == *who)
                    .expect("the receiver has the bucket in the same step");
                assert_eq!(theirs.op.kind, OpKind::Recv);
                assert_eq!(theirs.op.bytes, o.op.bytes, "sizes agree");
                assert_eq!(
                    theirs.peer_comm,
                    world.comm_rank(Side::Training, *who).unwrap()
                );
                copy(
                    r,
                    o.wire.addr(r.slot(s)),
                    peer,
                    theirs.wire.addr(peer.slot(s)),
                    o.op.bytes,
                );
            }
        }
        for ((side, _), r) in &ranks {
            if *side == Side::Inference && k < r.copies.len() {
                run_copies(r, &r.copies[k][s]);
            }
        }
    }
    for ((side, who), r) in &ranks {
        if *side == Side::Inference {
            fill_or_check(&r.layout, cat, &r.tensors, version, true)
                .unwrap_or_else(|e| panic!("inference rank {who}: {e}"));
        }
    }
    ranks
}

fn split(dim: usize, cuts: Vec<u64>, pad: u64) -> TensorSplit {
    TensorSplit { dim, cuts, pad }
}

/// Rows split on one side, columns on the other, padding and a fused tensor: every kind of box.
fn mixed_pair(train_dtype: DType) -> (awex_core::Catalogue, ExplicitSide, ExplicitSide) {
    let cat = catalogue(&[vec![40, 8], vec![24, 8], vec![16], vec![9, 5]]);
    let train = SyntheticSide {
        side: Side::Training,
        engines: 1,
        replicas: 2,
        shards: 2,
        splits: vec![
            split(0, vec![20], 0),
            split(1, vec![3], 1),
            split(0, vec![8], 0),
            split(0, vec![4], 2),
        ],
        dtype: train_dtype,
        fuse: false,
    }
    .build(&cat);
    let infer = SyntheticSide {
        side: Side::Inference,
        engines: 2,
        replicas: 1,
        shards: 3,
        splits: vec![
            split(0, vec![10, 30], 0),
            split(0, vec![5, 6], 2),
            split(0, vec![1, 2], 0),
            split(1, vec![2, 4], 0),
        ],
        dtype: DType::Bf16,
        fuse: true,
    }
    .build(&cat);
    (cat, train, infer)
}

#[test]
fn programs_move_every_byte_of_a_mixed_pair_through_direct_and_staged_buckets() {
    let (cat, train, infer) = mixed_pair(DType::Bf16);
    for budget in [1u64, 48, 256, 1 << 20] {
        let ranks = run_update(&cat, &train, &infer, |_| budget, 3);
        let (mut direct, mut staged) = (0, 0);
        for ((side, _), r) in &ranks {
            let (d, s) = r.program.direct_and_staged();
            direct += d;
            staged += s;
            // double buffering: no step stages more than the slot holds, aligned
            for st in &r.program.steps {
                assert!(st.staged_bytes <= r.program.slot_bytes);
                assert_eq!(st.staged_bytes % SLOT_ALIGN, 0);
                for o in &st.ops {
                    if let Wire::Staged(off) = o.wire {
                        assert!(off + o.op.bytes <= st.staged_bytes);
                    }
                }
            }
            // a step's staged bytes stay within the budget plus alignment (rows here are
            // at most 16 bytes, so only budgets below one row per peer exceed it)
            if budget >= 256 {
                let peers = r.program.steps.first().map_or(0, |s| s.ops.len()) as u64;
                assert!(
                    r.program.slot_bytes <= budget + SLOT_ALIGN * peers,
                    "{side:?}: slot {} > budget {budget}",
                    r.program.slot_bytes
                );
            }
        }
        if budget == 1 {
            // one-byte buckets carry one row each, and a row of a box is contiguous
            assert_eq!(staged, 0, "direct {direct}");
        } else if budget >= 256 {
            // column boxes of several rows need packing, whole-row pieces go direct
            assert!(direct > 0 && staged > 0, "direct {direct}, staged {staged}");
        }
    }
}

#[test]
fn a_contiguous_single_piece_bucket_goes_straight_from_and_into_the_tensors() {
    // one 16x4 bf16 tensor, rows split 8/8 on training and whole on inference; budget 64: the
    // receiver splits it over its 2 peers, so each pair's buckets are 32 bytes (4 whole rows)
    let cat = catalogue(&[vec![16, 4]]);
    let train = SyntheticSide {
        side: Side::Training,
        engines: 1,
        replicas: 1,
        shards: 2,
        splits: vec![split(0, vec![8], 0)],
        dtype: DType::Bf16,
        fuse: false,
    }
    .build(&cat);
    let infer = SyntheticSide {
        side: Side::Inference,
        engines: 1,
        replicas: 1,
        shards: 1,
        splits: vec![split(0, vec![], 0)],
        dtype: DType::Bf16,
        fuse: false,
    }
    .build(&cat);
    let ranks = run_update(&cat, &train, &infer, |_| 64, 1);
    let t1 = &ranks[&(Side::Training, RankId::train(1))];
    let base = t1.tensors.iter().next().unwrap().ptr() as u64;
    let wires: Vec<Vec<Wire>> = t1
        .program
        .steps
        .iter()
        .map(|s| s.ops.iter().map(|o| o.wire).collect())
        .collect();
    // rows 8..16 of the canonical tensor: 64 bytes in 2 buckets, each a contiguous range
    assert_eq!(
        wires,
        vec![vec![Wire::Direct(base)], vec![Wire::Direct(base + 32)]]
    );
    assert_eq!(t1.program.slot_bytes, 0);
    let i0 = &ranks[&(Side::Inference, RankId::infer(0, 0))];
    let dst = i0.tensors.iter().next().unwrap().ptr() as u64;
    let recv: Vec<Vec<(u32, Wire)>> = i0
        .program
        .steps
        .iter()
        .map(|s| s.ops.iter().map(|o| (o.peer_comm, o.wire)).collect())
        .collect();
    assert_eq!(
        recv,
        vec![
            vec![(0, Wire::Direct(dst)), (1, Wire::Direct(dst + 64))],
            vec![(0, Wire::Direct(dst + 32)), (1, Wire::Direct(dst + 96))]
        ]
    );
    assert_eq!(i0.program.bytes(), 128);
}

#[test]
fn column_boxes_are_packed_with_pitched_copies() {
    // a 4x8 bf16 tensor split by columns 3/5 on training: training rank 0 sends a 4x3 box
    let cat = catalogue(&[vec![4, 8]]);
    let train = SyntheticSide {
        side: Side::Training,
        engines: 1,
        replicas: 1,
        shards: 2,
        splits: vec![split(1, vec![3], 0)],
        dtype: DType::Bf16,
        fuse: false,
    }
    .build(&cat);
    let infer = SyntheticSide {
        side: Side::Inference,
        engines: 1,
        replicas: 1,
        shards: 1,
        splits: vec![split(0, vec![], 0)],
        dtype: DType::Bf16,
        fuse: false,
    }
    .build(&cat);
    let ranks = run_update(&cat, &train, &infer, |_| 1 << 20, 2);
    // the sender's 4x3 local tensor is contiguous: it goes direct
    let t0 = &ranks[&(Side::Training, RankId::train(0))];
    assert!(matches!(t0.program.steps[0].ops[0].wire, Wire::Direct(_)));
    // the receiver's box is 4 rows of 6 bytes with a pitch of 16: one pitched copy unpacks it
    let i0 = &ranks[&(Side::Inference, RankId::infer(0, 0))];
    let dst = i0.tensors.iter().next().unwrap().ptr() as u64;
    let step = &i0.program.steps[0];
    assert_eq!(step.ops[0].wire, Wire::Staged(0));
    let slot = i0.slot(0);
    assert_eq!(
        step.copies(Side::Inference, slot)[0],
        CopyDesc {
            src: slot,
            dst,
            width: 6,
            height: 4,
            depth: 1,
            src_pitch: 6,
            dst_pitch: 16,
            src_rows: 4,
            dst_rows: 4,
        }
    );
    // training rank 1's 4x5 box lands at column 3 through slot offset 256 (after rank 0's 24 bytes)
    assert_eq!(step.ops[1].wire, Wire::Staged(SLOT_ALIGN));
    assert_eq!(
        step.copies(Side::Inference, slot)[1],
        CopyDesc {
            src: slot + SLOT_ALIGN,
            dst: dst + 6,
            width: 10,
            height: 4,
            depth: 1,
            src_pitch: 10,
            dst_pitch: 16,
            src_rows: 4,
            dst_rows: 4,
        }
    );
    assert_eq!(i0.program.slot_bytes, 2 * SLOT_ALIGN);
    // the other slot gets the same copies at its own address
    assert_eq!(step.copies(Side::Inference, i0.slot(1))[0].src, i0.slot(1));
}

#[test]
fn conversions_and_unregistered_tensors_are_refused() {
    let (cat, train, infer) = mixed_pair(DType::F32);
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    let world = CommWorld::of(&train, &infer).unwrap();
    let plan = pair.plan_rank(Side::Training, RankId::train(0)).unwrap();
    let buckets = peer_buckets(&plan, |_| 1 << 20);
    let steps = schedule(&plan, &buckets).unwrap();
    let layout = train.rank_layout(RankId::train(0)).unwrap();
    let set = TensorSet::allocate_host(&layout).unwrap();
    let tensors: Vec<DeviceTensor> = set
        .iter()
        .map(|v| DeviceTensor {
            name: v.name.clone(),
            ptr: v.ptr() as u64,
            dtype: v.dtype,
            shape: v.shape,
        })
        .collect();
    // SAFETY: host memory owned by `set`.
    let dev = unsafe { DeviceTensors::new(tensors.clone()) }.unwrap();
    let e = Program::build(&plan, &buckets, &steps, &dev, &world).unwrap_err();
    let first = &plan.peers[0].transfers[0];
    assert_eq!(
        e.to_string(),
        format!(
            "`{}`: the CUDA path copies bytes only, but this transfer converts f32 to bf16; keep both sides in the same dtype or use a CPU transport",
            first.dst_tensor
        )
    );
    // same dtype, but a tensor missing from the registration
    let (cat, train, infer) = mixed_pair(DType::Bf16);
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    let plan = pair.plan_rank(Side::Training, RankId::train(0)).unwrap();
    let buckets = peer_buckets(&plan, |_| 1 << 20);
    let steps = schedule(&plan, &buckets).unwrap();
    let missing = &plan.peers[0].transfers[0].src_tensor;
    let partial: Vec<DeviceTensor> = tensors
        .into_iter()
        .filter(|t| t.name != *missing)
        .map(|mut t| {
            t.dtype = DType::Bf16;
            t
        })
        .collect();
    // SAFETY: as above (never dereferenced by `build`).
    let dev = unsafe { DeviceTensors::new(partial) }.unwrap();
    assert_eq!(
        Program::build(&plan, &buckets, &steps, &dev, &world)
            .unwrap_err()
            .to_string(),
        format!("training tensor `{missing}` is in the plan but not registered on the device")
    );
    // registering a name twice is refused
    let t = DeviceTensor {
        name: "w".into(),
        ptr: 0x1000,
        dtype: DType::Bf16,
        shape: awex_core::Dims::new(&[2, 2]),
    };
    // SAFETY: never dereferenced.
    let e = unsafe { DeviceTensors::new(vec![t.clone(), t]) }.unwrap_err();
    assert_eq!(e.to_string(), "device tensor `w` is registered twice");
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
        1..3u32
    };
    (engines, 1..3u32, 1..4u32, any::<bool>()).prop_flat_map(
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
        (1u64..24).prop_map(|r| vec![r]),
        (1u64..12, 1u64..9).prop_map(|(r, c)| vec![r, c]),
        (1u64..5, 1u64..4, 1u64..6).prop_map(|(a, b, c)| vec![a, b, c]),
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
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn programs_of_random_layouts_deliver_the_canonical_weights(
        (shapes, t, i) in case(),
        budget in 1u64..400,
    ) {
        let cat = catalogue(&shapes);
        let (train, infer) = (t.build(&cat), i.build(&cat));
        run_update(&cat, &train, &infer, |w| budget + 37 * w.1.rank as u64, 5);
    }
}
