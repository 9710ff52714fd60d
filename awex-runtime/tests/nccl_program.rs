//! The NCCL transport's device program, executed on host memory: every rank lays out its
//! schedule on its tensors (direct buckets, staged buckets, pack/unpack pitched copies over two
//! slots), a stand-in for NCCL moves each matched send into its receive, and every inference
//! rank ends up holding exactly the canonical weights. This is the GPU data path's geometry,
//! checked without a GPU.

use awex_core::DType;
use awex_core::layout::{ExplicitSide, RankId, RankLayout, Side, SideLayout};
use awex_core::plan::bucket::Bucket;
use awex_core::plan::{Pair, RankPlan};
use awex_core::synthetic::{SyntheticSide, TensorSplit, catalogue};
use awex_core::weights::{Stepped, Weights};
use awex_gpu::cuda::CopyDesc;
use awex_gpu::cuda::delta_wire::host;
use awex_gpu::cuda::transpose::{Conversion, TransposeJob};
use awex_gpu::nccl::{
    CommWorld, DeviceTensor, DeviceTensors, OpKind, OpSeg, Program, SLOT_ALIGN, Wire,
    max_frame_len, pair_bucket_bytes, peer_buckets, schedule, wire_table,
};
use awex_runtime::TensorSet;
use awex_runtime::fill::{fill_or_check, fill_or_check_from};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

type Who = (Side, RankId);

/// Host memory standing in for one GPU: the rank's tensors and its two staging slots.
struct Rank {
    layout: RankLayout,
    tensors: TensorSet,
    plan: RankPlan,
    /// per peer (the plan's order), its buckets
    buckets: Vec<Vec<Bucket>>,
    program: Program,
    slots: [Vec<u64>; 2],
    /// copies[k][s]: step k's pack/unpack copies with slot s
    copies: Vec<[Vec<CopyDesc>; 2]>,
    /// transposes[k][s]: step k's transposed unpacks with slot s (inference)
    transposes: Vec<[Vec<TransposeJob>; 2]>,
    /// (base, len) of every buffer of the rank, to check each copy stays inside one
    buffers: Vec<(u64, u64)>,
}

impl Rank {
    /// A rank of `side` with two zeroed slots and each step's copies for both.
    fn new(
        layout: RankLayout,
        tensors: TensorSet,
        (plan, buckets, program): (RankPlan, Vec<Vec<Bucket>>, Program),
        buffers: Vec<(u64, u64)>,
        side: Side,
    ) -> Rank {
        let words = program.slot_bytes.div_ceil(8) as usize;
        let slots = [vec![0u64; words.max(1)], vec![0u64; words.max(1)]];
        let mut r = Rank {
            layout,
            tensors,
            plan,
            buckets,
            program,
            slots,
            copies: Vec::new(),
            transposes: Vec::new(),
            buffers,
        };
        let (s0, s1) = (r.slot(0), r.slot(1));
        r.buffers.push((s0, r.program.slot_bytes));
        r.buffers.push((s1, r.program.slot_bytes));
        r.copies = r
            .program
            .steps
            .iter()
            .map(|st| [st.copies(side, s0), st.copies(side, s1)])
            .collect();
        r.transposes = r
            .program
            .steps
            .iter()
            .map(|st| [st.transpose_jobs(s0), st.transpose_jobs(s1)])
            .collect();
        r
    }

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

/// Runs element-wise jobs (transposes; the sender's conversions) on the rank's host memory,
/// element by element, as the kernel moves them (`awex_gpu::cuda::transpose::emulate` over
/// absolute addresses).
fn run_transposes(r: &Rank, jobs: &[TransposeJob]) {
    for j in jobs {
        let e = j.elem as u64;
        let de = j.conv.dst_elem(j.elem) as u64;
        for row in 0..j.rows as u64 {
            for col in 0..j.cols as u64 {
                let s = j.src + row * j.src_pitch as u64 + col * e;
                let d = if j.straight {
                    j.dst + row * j.dst_pitch as u64 + col * de
                } else {
                    j.dst + col * j.dst_pitch as u64 + row * de
                };
                let Some((from, to)) = j.conv.dtypes() else {
                    copy(r, s, r, d, e);
                    continue;
                };
                assert!(
                    r.inside(s, e) && r.inside(d, de),
                    "a conversion outside every buffer"
                );
                // SAFETY: both ranges were just checked to lie inside live buffers of the rank.
                let (src, dst) = unsafe {
                    (
                        std::slice::from_raw_parts(s as *const u8, e as usize),
                        std::slice::from_raw_parts_mut(d as *mut u8, de as usize),
                    )
                };
                awex_core::dtype::convert(src, from, dst, to).unwrap();
            }
        }
    }
}

/// Packs step `k` of a training rank into slot `s`: its copies and its conversions.
fn pack(r: &Rank, k: usize, s: usize) {
    run_copies(r, &r.copies[k][s]);
    run_transposes(r, &r.program.steps[k].convert_jobs(r.slot(s)));
}

/// Unpacks step `k` of an inference rank from slot `s`: its copies and its transposes.
fn unpack(r: &Rank, k: usize, s: usize) {
    run_copies(r, &r.copies[k][s]);
    run_transposes(r, &r.transposes[k][s]);
}

/// Builds every rank of a pair: its plan, tensors, program and slots.
fn build_ranks(
    cat: &awex_core::Catalogue,
    train: &dyn SideLayout,
    infer: &dyn SideLayout,
    budget: impl Fn(Who) -> u64,
) -> (BTreeMap<Who, Rank>, CommWorld) {
    let pair = Pair {
        catalogue: cat,
        training: train,
        inference: infer,
        encode_on_sender: false,
    };
    build_ranks_of(&pair, budget)
}

/// [`build_ranks`] for a pair planned as given (an FP8 pair's sender-encoded transfers).
fn build_ranks_of(pair: &Pair, budget: impl Fn(Who) -> u64) -> (BTreeMap<Who, Rank>, CommWorld) {
    let world = CommWorld::of(pair.training, pair.inference).unwrap();
    let mut plans: BTreeMap<Who, RankPlan> = BTreeMap::new();
    let mut layouts: HashMap<Who, RankLayout> = HashMap::new();
    for (side, l) in [
        (Side::Training, pair.training),
        (Side::Inference, pair.inference),
    ] {
        for r in l.ranks() {
            plans.insert((side, r), pair.plan_rank(side, r).unwrap());
            layouts.insert((side, r), l.rank_layout(r).unwrap());
        }
    }
    let npeers: HashMap<Who, usize> = plans.iter().map(|(w, p)| (*w, p.peers.len())).collect();
    let mut ranks: BTreeMap<Who, Rank> = BTreeMap::new();
    for (who, plan) in plans {
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
        let buckets = peer_buckets(&plan, |peer| {
            let them = (who.0.other(), peer);
            pair_bucket_bytes(budget(who), npeers[&who], budget(them), npeers[&them])
        });
        let steps = schedule(&plan, &buckets).unwrap();
        let program = Program::build(&plan, &buckets, &steps, &dev, &world).unwrap();
        let r = Rank::new(layout, tensors, (plan, buckets, program), buffers, who.0);
        ranks.insert(who, r);
    }
    (ranks, world)
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
    run_update_over(cat, train, infer, budget, version)
}

/// [`run_update`] over any two sides.
fn run_update_over(
    cat: &awex_core::Catalogue,
    train: &dyn SideLayout,
    infer: &dyn SideLayout,
    budget: impl Fn(Who) -> u64,
    version: u64,
) -> BTreeMap<Who, Rank> {
    let (ranks, world) = build_ranks(cat, train, infer, budget);
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
                pack(r, k, s);
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
                unpack(r, k, s);
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

/// The bytes of `len` at host address `addr`.
///
/// # Safety
/// `addr..addr + len` must lie in a live buffer that nothing else touches meanwhile.
unsafe fn host_bytes<'a>(addr: u64, len: u64) -> &'a mut [u8] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) }
}

/// A bucket's bytes cut into its runs (the segments of its delta frame).
fn runs<'a>(segs: &[OpSeg], bytes: &'a [u8]) -> Vec<&'a [u8]> {
    segs.iter()
        .map(|s| &bytes[s.at as usize..(s.at + s.n * s.elem as u64) as usize])
        .collect()
}

fn runs_mut<'a>(segs: &[OpSeg], mut bytes: &'a mut [u8]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::with_capacity(segs.len());
    let mut at = 0u64;
    for s in segs {
        assert_eq!(s.at, at, "a bucket's runs follow each other");
        let (head, rest) = bytes.split_at_mut((s.n * s.elem as u64) as usize);
        out.push(head);
        bytes = rest;
        at += s.n * s.elem as u64;
    }
    assert!(bytes.is_empty(), "a bucket's runs cover its bytes");
    out
}

/// What moved in one delta update.
#[derive(Debug, Default)]
struct DeltaRun {
    dense_bytes: u64,
    frame_bytes: u64,
    delta_buckets: usize,
    whole_buckets: usize,
}

/// One update of `version` with deltas, as the nccl transport runs it, the kernels replaced by
/// their host emulation: every training rank packs each step, encodes each bucket against its
/// copy of what it last sent (`copies`, by rank, step and operation; none: the bucket goes
/// whole) and applies the frame to that copy; every inference rank that `holds` gathers the
/// step's boxes into its slot, applies each frame where the bucket's bytes sit, and unpacks.
/// `gather = false` skips the gather (a planted error).
fn run_delta_update(
    ranks: &BTreeMap<Who, Rank>,
    copies: &mut HashMap<(RankId, usize, usize), Vec<u8>>,
    holds: impl Fn(RankId) -> bool,
    gather: bool,
) -> DeltaRun {
    let mut run = DeltaRun::default();
    let steps = ranks
        .values()
        .map(|r| r.program.steps.len())
        .max()
        .unwrap_or(0);
    for k in 0..steps {
        let s = k % 2;
        // frames (or whole buckets) per (receiver, sender) of this step
        let mut sent: HashMap<(RankId, RankId), (Vec<u8>, bool)> = HashMap::new();
        for ((side, who), r) in ranks {
            if *side != Side::Training || k >= r.program.steps.len() {
                continue;
            }
            pack(r, k, s);
            let st = &r.program.steps[k];
            for (i, o) in st.ops.iter().enumerate() {
                let segs = &st.segs[i];
                assert_eq!(
                    max_frame_len(segs),
                    wire_table(segs, 0, 0).unwrap().max_frame_len()
                );
                // SAFETY: the wire place is a slot or tensor range of the rank (checked by the
                // programs' own tests), read only here.
                let new = unsafe { host_bytes(o.wire.addr(r.slot(s)), o.op.bytes) }.to_vec();
                let table = wire_table(segs, 0, 0).unwrap();
                let key = (*who, k, i);
                let had = holds(o.op.peer) && copies.contains_key(&key);
                let base = copies.entry(key).or_insert_with(|| vec![0u8; new.len()]);
                let frame = host::encode(&table, &runs(segs, &new), &runs(segs, base));
                // a frame no shorter than the bucket goes whole, as the transport sends it
                let delta = had && (frame.len() as u64) < o.op.bytes;
                assert!(frame.len() as u64 <= max_frame_len(segs));
                // the copy takes the frame: it then holds what was sent
                host::decode(&table, &frame, &mut runs_mut(segs, base)).unwrap();
                assert!(
                    *base == new,
                    "the copy of bucket {i} of step {k} is the bytes sent"
                );
                run.dense_bytes += o.op.bytes;
                if delta {
                    run.frame_bytes += frame.len() as u64;
                    run.delta_buckets += 1;
                    sent.insert((o.op.peer, *who), (frame, true));
                } else {
                    run.whole_buckets += 1;
                    sent.insert((o.op.peer, *who), (new, false));
                }
            }
        }
        for ((side, who), r) in ranks {
            if *side != Side::Inference || k >= r.program.steps.len() {
                continue;
            }
            let st = &r.program.steps[k];
            if gather {
                run_copies(r, &st.gathers(r.slot(s)));
                run_transposes(r, &st.gather_transpose_jobs(r.slot(s)));
            }
            for (i, o) in st.ops.iter().enumerate() {
                let (bytes, is_delta) = sent.remove(&(*who, o.op.peer)).expect("a bucket came");
                // SAFETY: as above; the rank's own slot or tensor range.
                let place = unsafe { host_bytes(o.wire.addr(r.slot(s)), o.op.bytes) };
                if is_delta {
                    let segs = &st.segs[i];
                    let table = wire_table(segs, 0, 0).unwrap();
                    host::decode(&table, &bytes, &mut runs_mut(segs, place)).unwrap();
                } else {
                    place.copy_from_slice(&bytes);
                }
            }
            unpack(r, k, s);
        }
        assert!(sent.is_empty(), "every bucket was received");
    }
    run
}

#[test]
fn delta_programs_gather_apply_and_unpack_to_the_stepped_version_and_whole_buckets_repair_a_fresh_engine()
 {
    let (cat, train, infer) = mixed_pair(DType::Bf16);
    let weights = Weights::Stepped(Arc::new(Stepped::new(&cat, 1e-6, None)));
    let fill = |r: &Rank, v: u64| {
        fill_or_check_from(&weights, &r.layout, &cat, &r.tensors, v, false).unwrap()
    };
    let check =
        |r: &Rank, v: u64| fill_or_check_from(&weights, &r.layout, &cat, &r.tensors, v, true);
    for budget in [48u64, 256, 1 << 20] {
        let (ranks, _) = build_ranks(&cat, &train, &infer, |_| budget);
        let mut copies = HashMap::new();
        // version 1 whole (no copy yet), then deltas
        for v in 1..=3u64 {
            for ((side, _), r) in &ranks {
                if *side == Side::Training {
                    fill(r, v);
                }
            }
            let run = run_delta_update(&ranks, &mut copies, |_| true, true);
            if v == 1 {
                assert_eq!(run.delta_buckets, 0);
            } else if budget > 48 {
                // (48-byte buckets: a frame's header outweighs the few bytes it saves)
                assert!(
                    run.delta_buckets > 0 && 2 * run.frame_bytes < run.dense_bytes,
                    "budget {budget}, version {v}: {run:?}"
                );
            }
            for ((side, who), r) in &ranks {
                if *side == Side::Inference {
                    check(r, v)
                        .unwrap_or_else(|e| panic!("budget {budget}, version {v}, {who}: {e}"));
                }
            }
        }
        // engine 1 restarted (its tensors zeroed): its buckets go whole, the others' as deltas
        let fresh = |r: RankId| r.engine == 1;
        for ((side, who), r) in &ranks {
            if *side == Side::Inference && fresh(*who) {
                for t in r.tensors.iter() {
                    // SAFETY: the rank's own host tensor.
                    unsafe { host_bytes(t.ptr() as u64, t.len() as u64) }.fill(0);
                }
            }
            if *side == Side::Training {
                fill(r, 4);
            }
        }
        let run = run_delta_update(&ranks, &mut copies, |r| !fresh(r), true);
        assert!(run.delta_buckets > 0 && run.whole_buckets > 0, "{run:?}");
        for ((side, who), r) in &ranks {
            if *side == Side::Inference {
                check(r, 4).unwrap_or_else(|e| panic!("budget {budget}, version 4, {who}: {e}"));
            }
        }
    }
    // a planted error: frames applied without gathering the boxes they change first
    let (ranks, _) = build_ranks(&cat, &train, &infer, |_| 256);
    let mut copies = HashMap::new();
    for v in 1..=2u64 {
        for ((side, _), r) in &ranks {
            if *side == Side::Training {
                fill(r, v);
            }
        }
        run_delta_update(&ranks, &mut copies, |_| true, v == 1);
    }
    let torn = ranks
        .iter()
        .filter(|((side, _), _)| *side == Side::Inference)
        .filter(|(_, r)| check(r, 2).is_err())
        .count();
    assert!(torn > 0, "skipping the gather must leave some rank wrong");
}

/// gpt-oss's experts, which SGLang and vLLM store with their last two dims swapped: the
/// inference ranks unpack them with transpose jobs (and gather them back the same way for a
/// delta), whole updates and deltas alike, at bucket sizes that cut the experts into pieces.
#[test]
fn transposed_boxes_unpack_and_gather_through_transpose_jobs_whole_and_as_deltas() {
    use awex_core::model::presets;
    use awex_core::pair::PairSpec;
    use awex_core::{BackendSpec, Transport as TransportKind};
    const _: [&str; 3] = [awex_fsdp::CRATE, awex_sglang::CRATE, awex_vllm::CRATE];
    for infer in ["sglang:tp=2", "vllm:tp=2,ep=2"] {
        let p = PairSpec {
            model: presets::preset("gpt-oss-tiny").unwrap(),
            train: "fsdp:dp=2,fused_experts=1".parse::<BackendSpec>().unwrap(),
            infer: infer.parse::<BackendSpec>().unwrap(),
            transport: TransportKind::Nccl,
            infer_fp8: None,
        }
        .resolve()
        .unwrap();
        let weights = Weights::Stepped(Arc::new(Stepped::new(&p.catalogue, 1e-6, None)));
        for budget in [4096u64, 1 << 20] {
            let (ranks, _) = build_ranks(&p.catalogue, &*p.training, &*p.inference, |_| budget);
            let jobs: usize = ranks
                .values()
                .flat_map(|r| &r.transposes)
                .map(|t| t[0].len())
                .sum();
            assert!(jobs > 0, "{infer}: the plan has transposed pieces");
            let mut copies = HashMap::new();
            for v in 1..=2u64 {
                for ((side, _), r) in &ranks {
                    if *side == Side::Training {
                        fill_or_check_from(&weights, &r.layout, &p.catalogue, &r.tensors, v, false)
                            .unwrap();
                    }
                }
                let run = run_delta_update(&ranks, &mut copies, |_| true, true);
                assert_eq!(run.delta_buckets > 0, v > 1, "{run:?}");
                for ((side, who), r) in &ranks {
                    if *side == Side::Inference {
                        fill_or_check_from(&weights, &r.layout, &p.catalogue, &r.tensors, v, true)
                            .unwrap_or_else(|e| {
                                panic!("{infer}, budget {budget}, version {v}, {who}: {e}")
                            });
                    }
                }
            }
        }
        // whole updates, versions that change every byte
        run_update_over(&p.catalogue, &*p.training, &*p.inference, |_| 4096, 3);
    }
}

/// What the training ranks of `p` hold each canonical tensor in: a tensor kept narrower than
/// the checkpoint is sent rounded ([`Weights::held_as`]).
fn held_by_trainer(p: &awex_core::pair::ResolvedPair) -> Vec<(String, DType)> {
    p.training
        .ranks()
        .into_iter()
        .flat_map(|r| p.training.rank_layout(r).unwrap().tensors)
        .flat_map(|t| {
            t.placements
                .iter()
                .map(|pl| (pl.canonical.to_string(), t.dtype))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The real plans that convert over nccl: FSDP's bf16 `A_log` of Qwen3.5-MoE into SGLang's
/// and vLLM's fp32, FSDP on transformers 5.24 (fp32 routers) into SGLang's bf16 DeepSeek-V3
/// gate: the training ranks convert those pieces into their slots, every inference rank holds
/// the engine's bytes, whole and as deltas.
#[test]
fn real_pairs_that_convert_move_through_the_programs_whole_and_as_deltas() {
    use awex_core::model::presets;
    use awex_core::pair::PairSpec;
    use awex_core::{BackendSpec, Transport as TransportKind};
    const _: [&str; 3] = [awex_fsdp::CRATE, awex_sglang::CRATE, awex_vllm::CRATE];
    for (model, train, infer, conv) in [
        (
            "qwen3.5-moe-tiny",
            "fsdp:dp=2",
            "sglang:tp=2",
            Conversion::Bf16ToF32,
        ),
        (
            "qwen3.5-moe-tiny",
            "fsdp:dp=2",
            "vllm:tp=2,ep=2",
            Conversion::Bf16ToF32,
        ),
        (
            "deepseek-v3-tiny",
            "fsdp:dp=2,transformers=524",
            "sglang:tp=2,fused_shared_experts=1",
            Conversion::F32ToBf16,
        ),
    ] {
        let p = PairSpec {
            model: presets::preset(model).unwrap(),
            train: train.parse::<BackendSpec>().unwrap(),
            infer: infer.parse::<BackendSpec>().unwrap(),
            transport: TransportKind::Nccl,
            infer_fp8: None,
        }
        .resolve()
        .unwrap();
        let case = format!("{model} {train} -> {infer}");
        let held = held_by_trainer(&p);
        let stepped = Weights::Stepped(Arc::new(Stepped::new(&p.catalogue, 1e-6, None)));
        // versions that change every byte (whole buckets), then optimiser-like steps (deltas)
        for (weights, deltas) in [(Weights::Synthetic, false), (stepped, true)] {
            let weights = weights.held_as(&p.catalogue, held.clone());
            assert!(matches!(weights, Weights::HeldAs(..)) == (conv == Conversion::Bf16ToF32));
            for budget in [4096u64, 1 << 20] {
                let (ranks, _) = build_ranks(&p.catalogue, &*p.training, &*p.inference, |_| budget);
                let jobs: Vec<TransposeJob> = ranks
                    .values()
                    .flat_map(|r| r.program.steps.iter().map(|st| st.convert_jobs(r.slot(0))))
                    .flatten()
                    .collect();
                assert!(!jobs.is_empty(), "{case}: the plan converts");
                assert!(jobs.iter().all(|j| j.conv == conv), "{case}: {jobs:?}");
                let mut copies = HashMap::new();
                for v in 1..=2u64 {
                    for ((side, _), r) in &ranks {
                        if *side == Side::Training {
                            fill_or_check_from(
                                &weights,
                                &r.layout,
                                &p.catalogue,
                                &r.tensors,
                                v,
                                false,
                            )
                            .unwrap();
                        }
                    }
                    let run = run_delta_update(&ranks, &mut copies, |_| true, true);
                    if deltas {
                        assert_eq!(run.delta_buckets > 0, v > 1, "{case}: {run:?}");
                    }
                    for ((side, who), r) in &ranks {
                        if *side == Side::Inference {
                            fill_or_check_from(
                                &weights,
                                &r.layout,
                                &p.catalogue,
                                &r.tensors,
                                v,
                                true,
                            )
                            .unwrap_or_else(|e| {
                                panic!("{case}, budget {budget}, version {v}, {who}: {e}")
                            });
                        }
                    }
                }
            }
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

/// An f32 trainer into bf16 engines: every piece is converted by the sender as it packs it
/// (never sent straight from its tensor), the receiver unpacks the engine's bytes, whole and as
/// deltas against the converted bytes last sent.
#[test]
fn an_f32_trainer_s_pieces_are_converted_into_the_slot_and_arrive_as_bf16_whole_and_as_deltas() {
    let (cat, train, infer) = mixed_pair(DType::F32);
    for budget in [48u64, 256, 1 << 20] {
        let ranks = run_update(&cat, &train, &infer, |_| budget, 3);
        for ((side, _), r) in &ranks {
            if *side == Side::Training {
                let (direct, _) = r.program.direct_and_staged();
                assert_eq!(direct, 0, "a converting piece is staged");
                assert!(
                    r.program
                        .steps
                        .iter()
                        .all(|st| st.has_converts() && !st.has_copies())
                );
                for st in &r.program.steps {
                    assert!(
                        st.convert_jobs(r.slot(0))
                            .iter()
                            .all(|j| j.straight && j.conv == Conversion::F32ToBf16 && j.elem == 4)
                    );
                }
            }
        }
    }
    let weights = Weights::Stepped(Arc::new(Stepped::new(&cat, 1e-6, None)));
    let (ranks, _) = build_ranks(&cat, &train, &infer, |_| 256);
    let mut copies = HashMap::new();
    for v in 1..=3u64 {
        for ((side, _), r) in &ranks {
            if *side == Side::Training {
                fill_or_check_from(&weights, &r.layout, &cat, &r.tensors, v, false).unwrap();
            }
        }
        let run = run_delta_update(&ranks, &mut copies, |_| true, true);
        assert_eq!(run.delta_buckets > 0, v > 1, "version {v}: {run:?}");
        for ((side, who), r) in &ranks {
            if *side == Side::Inference {
                fill_or_check_from(&weights, &r.layout, &cat, &r.tensors, v, true)
                    .unwrap_or_else(|e| panic!("version {v}, {who}: {e}"));
            }
        }
    }
}

#[test]
fn conversions_the_gpu_does_not_make_and_unregistered_tensors_are_refused() {
    let (cat, train, infer) = mixed_pair(DType::F64);
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
            "`{}`: this transfer converts f64 to bf16, which the GPU transports do not (they convert bf16 and f16 to and from f32); keep both sides in the same dtype, or use a CPU transport (shm, tcp)",
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

// ---- FP8: the training rank quantises into its slots ----

mod fp8 {
    use super::*;
    use awex_core::encoding::{Fp8Config, Fp8Quantiser, InferFp8, Recipe, Shape2d};
    use awex_core::model::presets;
    use awex_core::pair::{PairSpec, ResolvedPair};
    use awex_core::weights::Weights;
    use awex_core::{BackendSpec, Transport as TransportKind};
    use awex_gpu::cuda::Fp8Job;
    use awex_runtime::bucket::pack;
    use awex_runtime::fill::{fill_or_check_from, fill_or_check_with};

    const _: [&str; 2] = [awex_megatron::CRATE, awex_sglang::CRATE];

    pub(super) fn fp8(block: u32) -> InferFp8 {
        let c = Fp8Config::from_hf(&serde_json::json!({
            "quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": [block, block]
        }))
        .unwrap();
        InferFp8::new(c, Recipe::Vllm).unwrap()
    }

    pub(super) fn resolve(
        model: awex_core::ModelSpec,
        train: &str,
        infer: &str,
        f: &InferFp8,
    ) -> ResolvedPair {
        PairSpec {
            model,
            train: train.parse::<BackendSpec>().unwrap(),
            infer: infer.parse::<BackendSpec>().unwrap(),
            transport: TransportKind::Nccl,
            infer_fp8: Some(f.clone()),
        }
        .resolve()
        .unwrap()
    }

    /// Runs `job` on host memory with the CPU reference quantiser: what the kernel writes.
    ///
    /// # Safety
    /// The job's source rows, destination rows and scale rows must lie in live host buffers.
    pub(super) unsafe fn quantise_on_host(q: &Fp8Quantiser, j: &Fp8Job) {
        let [bn, bk] = q.encoding.block.map(|b| b as usize);
        let (rows, cols) = (j.rows as usize, j.cols as usize);
        if rows == 0 || cols == 0 {
            return;
        }
        let sp = j.src_pitch as usize / 2;
        let (srows, scols) = (rows.div_ceil(bn), cols.div_ceil(bk));
        assert!(j.scale_pitch as usize >= scols);
        // SAFETY: the caller's contract; lengths are the job's last row's end.
        let (src, dst, scales) = unsafe {
            (
                std::slice::from_raw_parts(j.src as *const u16, (rows - 1) * sp + cols),
                std::slice::from_raw_parts_mut(
                    j.dst as *mut u8,
                    (rows - 1) * j.dst_pitch as usize + cols,
                ),
                std::slice::from_raw_parts_mut(
                    j.scales as *mut f32,
                    (srows - 1) * j.scale_pitch as usize + scols,
                ),
            )
        };
        let shape = Shape2d {
            rows,
            cols,
            pitch: sp,
        };
        q.quantise(
            src,
            shape,
            dst,
            j.dst_pitch as usize,
            scales,
            j.scale_pitch as usize,
        )
        .unwrap();
    }

    /// What one FP8 update through the programs did.
    struct Fp8Run {
        /// staged sends compared with tcp's bucket, and the kernel jobs that wrote into them
        compared: usize,
        jobs: usize,
        /// wire bytes of the update, and what bf16 would have moved into the FP8 tensors
        wire: u64,
    }

    /// Every rank of an FP8 pair laid out as the nccl transport lays it out; the training
    /// ranks pack every step with their copies and their FP8 jobs run by the CPU reference
    /// (the kernel's bytes), and each staged send must equal the tcp transport's packed
    /// bucket; then the inference ranks unpack, and every e4m3 byte and scale must be the CPU
    /// reference's of the canonical weights.
    fn run_fp8_update(p: &ResolvedPair, f: &InferFp8, budget: u64, version: u64) -> Fp8Run {
        let q = f.quantiser();
        let weights = Weights::Finite(Box::new(Weights::Synthetic));
        let pair = p.plan_pair();
        assert!(pair.encode_on_sender, "nccl plans FP8 on the sender");
        let (ranks, _) = build_ranks_of(&pair, |_| budget);
        for (who, r) in &ranks {
            assert_eq!(
                r.program.fp8.as_ref(),
                Some(f.encoding()),
                "{who:?} has FP8 pieces"
            );
        }
        for ((side, _), r) in &ranks {
            if *side == Side::Training {
                fill_or_check_from(
                    &weights,
                    &r.layout,
                    &p.catalogue,
                    &r.tensors,
                    version,
                    false,
                )
                .unwrap();
            }
        }
        let mut out = Fp8Run {
            compared: 0,
            jobs: 0,
            wire: 0,
        };
        let steps = ranks
            .values()
            .map(|r| r.program.steps.len())
            .max()
            .unwrap_or(0);
        for k in 0..steps {
            let s = k % 2;
            for (who, r) in &ranks {
                if who.0 != Side::Training || k >= r.copies.len() {
                    continue;
                }
                // a stale slot must not leak into the packed bytes
                let slot = r.slot(s);
                // SAFETY: the slot is this rank's buffer of `slot_bytes` bytes.
                unsafe {
                    std::ptr::write_bytes(slot as *mut u8, 0xa5, r.program.slot_bytes as usize)
                };
                run_copies(r, &r.copies[k][s]);
                let step = &r.program.steps[k];
                let jobs = step.fp8_jobs(slot);
                assert_eq!(jobs.len(), step.fp8_tensors().count());
                for j in &jobs {
                    // every job writes inside the slot and reads inside one tensor
                    let e4m3 = (j.rows as u64 - 1) * j.dst_pitch as u64 + j.cols as u64;
                    assert!(r.inside(j.dst, e4m3) && j.dst >= slot);
                    assert!(r.inside(
                        j.src,
                        (j.rows as u64 - 1) * j.src_pitch as u64 + 2 * j.cols as u64
                    ));
                    assert_eq!(j.scales % 4, 0);
                    // SAFETY: just checked to lie in this rank's buffers.
                    unsafe { quantise_on_host(&q, j) };
                }
                out.jobs += jobs.len();
                // each staged send holds exactly what the tcp transport packs for its bucket
                let plan = &r.plan;
                for o in &step.ops {
                    let Wire::Staged(off) = o.wire else { continue };
                    let bucket = &r.buckets[o.op.peer_index][o.op.bucket];
                    let mut want = vec![0u8; bucket.bytes as usize];
                    let n = pack(
                        bucket,
                        &plan.peers[o.op.peer_index].transfers,
                        &r.tensors,
                        &mut want,
                        Some(&q),
                    )
                    .unwrap();
                    assert_eq!(n as u64, o.op.bytes);
                    // SAFETY: the op's bytes lie in the slot (checked by `Program::build`).
                    let got = unsafe {
                        std::slice::from_raw_parts((slot + off) as *const u8, o.op.bytes as usize)
                    };
                    assert!(
                        got == &want[..],
                        "{who:?} step {k}: the slot differs from tcp's bucket"
                    );
                    out.compared += 1;
                }
            }
            for (&(side, who), r) in &ranks {
                if side != Side::Training {
                    continue;
                }
                let Some(step) = r.program.steps.get(k) else {
                    continue;
                };
                for o in &step.ops {
                    let peer = &ranks[&(Side::Inference, o.op.peer)];
                    let theirs = peer.program.steps[k]
                        .ops
                        .iter()
                        .find(|x| x.op.peer == who)
                        .expect("the receiver has the bucket in the same step");
                    assert_eq!(theirs.op.bytes, o.op.bytes, "sizes agree");
                    copy(
                        r,
                        o.wire.addr(r.slot(s)),
                        peer,
                        theirs.wire.addr(peer.slot(s)),
                        o.op.bytes,
                    );
                    out.wire += o.op.bytes;
                }
            }
            for ((side, _), r) in &ranks {
                if *side == Side::Inference && k < r.copies.len() {
                    assert!(!r.program.steps[k].has_fp8());
                    run_copies(r, &r.copies[k][s]);
                }
            }
        }
        for ((side, who), r) in &ranks {
            if *side == Side::Inference {
                fill_or_check_with(
                    &weights,
                    &r.layout,
                    &p.catalogue,
                    &r.tensors,
                    version,
                    true,
                    Some(f),
                )
                .unwrap_or_else(|e| panic!("inference rank {who}: {e}"));
            }
        }
        out
    }

    /// bf16 bytes of the whole update had the FP8 tensors been bf16, and the update's e4m3
    /// bytes: the sum over the plans' transfers.
    fn bytes_of(p: &ResolvedPair) -> (u64, u64) {
        let pair = p.plan_pair();
        let (mut bf16, mut e4m3) = (0, 0);
        for r in p.training.ranks() {
            for peer in pair.plan_rank(Side::Training, r).unwrap().peers {
                for t in &peer.transfers {
                    bf16 += t.numel() * 2;
                    if t.sender_encoded() {
                        e4m3 += t.numel();
                    }
                }
            }
        }
        (bf16, e4m3)
    }

    #[test]
    fn fp8_programs_put_on_the_wire_exactly_tcps_sender_encoded_buckets_and_deliver_the_reference()
    {
        let f = fp8(16);
        // every layer MoE, as SGLang's Qwen3-MoE builds it
        let mut moe = presets::preset("qwen3-moe-tiny").unwrap();
        moe.moe.as_mut().unwrap().mlp_only_layers.clear();
        for (model, train, infer) in [
            (
                presets::preset("qwen3-tiny").unwrap(),
                "megatron:tp=2",
                "sglang:tp=2",
            ),
            (moe, "megatron:tp=2,ep=2,etp=1", "sglang:tp=2"),
        ] {
            let p = resolve(model.clone(), train, infer, &f);
            let (bf16, e4m3) = bytes_of(&p);
            assert!(e4m3 > 0);
            // buckets of one MiB (a step or two) and of 4 KiB (many steps, pieces of a few
            // rows of blocks, plain and FP8 pieces sharing buckets)
            for budget in [1 << 20, 4096] {
                let r = run_fp8_update(&p, &f, budget, 7);
                assert!(r.compared > 0 && r.jobs > 0, "{}", model.name);
                // every block moves as e4m3 + its scale: about half of bf16's bytes for them
                assert!(
                    r.wire < bf16 - e4m3 / 2,
                    "{}: {} wire bytes of {bf16} bf16",
                    model.name,
                    r.wire
                );
            }
        }
    }

    #[test]
    fn a_plan_whose_fp8_blocks_are_cut_between_senders_is_refused_naming_the_tensor() {
        // Megatron tp 4 splits qwen3-tiny's k projection (32 rows) into 8-row shards, which
        // cut its 32 x 32 blocks between training ranks: the planner leaves those to the
        // receiver, which the nccl path does not quantise
        let f = fp8(32);
        let p = resolve(
            presets::preset("qwen3-tiny").unwrap(),
            "megatron:tp=4",
            "sglang:tp=1",
            &f,
        );
        let pair = p.plan_pair();
        let rank = p.inference.ranks()[0];
        let plan = pair.plan_rank(Side::Inference, rank).unwrap();
        let cut = plan
            .peers
            .iter()
            .flat_map(|p| &p.transfers)
            .find(|t| t.receiver_encoded())
            .expect("tp 4 cuts blocks");
        let e = awex_gpu::nccl::check_encoding(cut).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "`{}`: the plan has the receiver quantise this box to FP8 (a training shard boundary cuts its FP8 blocks, so no one sender holds them whole), but the nccl transport quantises on the training GPU only, whole blocks of bf16; use a training layout whose shards hold whole blocks in bf16 (Megatron tp or FSDP at dp 1), or --transport cuda-ipc, shm or tcp",
                cut.dst_tensor
            )
        );
        // the program refuses it too, before anything is allocated
        let layout = p.inference.rank_layout(rank).unwrap();
        let set = TensorSet::allocate_host(&layout).unwrap();
        let dev: Vec<DeviceTensor> = set
            .iter()
            .map(|v| DeviceTensor {
                name: v.name.clone(),
                ptr: v.ptr() as u64,
                dtype: v.dtype,
                shape: v.shape,
            })
            .collect();
        // SAFETY: host memory owned by `set`, never dereferenced by `build`.
        let dev = unsafe { DeviceTensors::new(dev) }.unwrap();
        let world = CommWorld::of(&*p.training, &*p.inference).unwrap();
        let buckets = peer_buckets(&plan, |_| 1 << 20);
        let steps = schedule(&plan, &buckets).unwrap();
        let e = Program::build(&plan, &buckets, &steps, &dev, &world)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a training shard boundary cuts its FP8 blocks"),
            "{e}"
        );
        // Megatron tp 2's 16-row shards hold the 16 x 16 blocks whole: nothing is refused
        let whole = resolve(
            presets::preset("qwen3-tiny").unwrap(),
            "megatron:tp=2",
            "sglang:tp=2",
            &fp8(16),
        );
        for r in whole.inference.ranks() {
            let plan = whole.plan_pair().plan_rank(Side::Inference, r).unwrap();
            for t in plan.peers.iter().flat_map(|p| &p.transfers) {
                awex_gpu::nccl::check_encoding(t).unwrap();
            }
        }
    }

    /// A Qwen3 whose dims are multiples of 128 (the kernel's blocks), Megatron tp 2 into
    /// SGLang tp 1 over nccl.
    fn gpu_pair(f: &InferFp8) -> ResolvedPair {
        let mut model = presets::preset("qwen3-tiny").unwrap();
        (model.hidden_size, model.num_heads, model.num_kv_heads) = (256, 2, 1);
        (model.head_dim, model.intermediate_size) = (128, 256);
        resolve(model, "megatron:tp=2", "sglang:tp=1", f)
    }

    /// A rank of a one-GPU test: its plan, program and slots, its tensors on the device and a
    /// host mirror.
    struct GpuRank {
        layout: RankLayout,
        host: TensorSet,
        device: TensorSet,
        plan: RankPlan,
        buckets: Vec<Vec<awex_core::plan::bucket::Bucket>>,
        program: Program,
        slots: [awex_gpu::cuda::DeviceBuffer; 2],
    }

    /// Writes version `v` of `weights` into every training rank's tensors on the device.
    fn gpu_fill_training(
        ranks: &BTreeMap<Who, GpuRank>,
        weights: &Weights,
        cat: &awex_core::Catalogue,
        v: u64,
    ) {
        for ((side, _), r) in ranks {
            if *side == Side::Training {
                fill_or_check_from(weights, &r.layout, cat, &r.host, v, false).unwrap();
                r.device.upload_from(&r.host).unwrap();
            }
        }
    }

    /// Packs a training rank's `step` into the slot at `slot` as the transport does: its copies
    /// on the copy engine, its FP8 jobs (with `q`) on `stream`, both waited for, every block
    /// finite; returns the FP8 jobs run.
    fn gpu_pack(
        engine: &awex_gpu::cuda::CopyEngine,
        kernel: &awex_gpu::cuda::Fp8Kernel,
        stream: &awex_gpu::cuda::Stream,
        q: Option<&Fp8Quantiser>,
        step: &awex_gpu::nccl::StepIo,
        slot: u64,
    ) -> usize {
        let mut jobs = 0;
        // SAFETY: the copies and jobs lie in the rank's tensors and slot, idle.
        unsafe {
            engine
                .launch(&step.copies(Side::Training, slot), None, None)
                .unwrap();
            if let Some(q) = q {
                let batch = kernel.batch(&step.fp8_jobs(slot), &q.encoding).unwrap();
                kernel
                    .launch_batch(stream, &batch, q.recipe, &q.encoding)
                    .unwrap();
                jobs = batch.jobs();
            }
        }
        engine.sync().unwrap();
        if q.is_some() {
            assert_eq!(kernel.take_batch_status(stream).unwrap().blocks, 0);
        }
        jobs
    }

    /// Every rank of `p` on `dev`, cut into buckets of `budget` bytes, tensors zeroed.
    fn gpu_ranks(
        p: &ResolvedPair,
        dev: &awex_gpu::cuda::Device,
        budget: u64,
    ) -> BTreeMap<Who, GpuRank> {
        let pair = p.plan_pair();
        let world = CommWorld::of(&*p.training, &*p.inference).unwrap();
        let mut ranks: BTreeMap<Who, GpuRank> = BTreeMap::new();
        for (side, l) in [
            (Side::Training, &p.training),
            (Side::Inference, &p.inference),
        ] {
            for r in l.ranks() {
                let plan = pair.plan_rank(side, r).unwrap();
                let layout = l.rank_layout(r).unwrap();
                let host = TensorSet::allocate_host(&layout).unwrap();
                let device = TensorSet::allocate_cuda(&layout, dev).unwrap();
                device.upload_from(&host).unwrap();
                let views: Vec<DeviceTensor> = device
                    .iter()
                    .map(|v| DeviceTensor {
                        name: v.name.clone(),
                        ptr: v.device_ptr().unwrap(),
                        dtype: v.dtype,
                        shape: v.shape,
                    })
                    .collect();
                // SAFETY: device memory owned by `device`, alive as long as the rank.
                let views = unsafe { DeviceTensors::new(views) }.unwrap();
                let buckets = peer_buckets(&plan, |_| budget);
                let steps = schedule(&plan, &buckets).unwrap();
                let program = Program::build(&plan, &buckets, &steps, &views, &world).unwrap();
                let n = program.slot_bytes.max(256);
                let slots = [dev.alloc(n).unwrap(), dev.alloc(n).unwrap()];
                ranks.insert(
                    (side, r),
                    GpuRank {
                        layout,
                        host,
                        device,
                        plan,
                        buckets,
                        program,
                        slots,
                    },
                );
            }
        }
        ranks
    }

    /// One GPU, one process, no NCCL (two ranks of a communicator cannot share a GPU): every
    /// rank's tensors and slots on the device, each training rank's steps packed by its copy
    /// engine and the FP8 kernel (the transport's batches), each staged send compared with
    /// tcp's bucket of the same plan, copied into its receiver's slot, unpacked by the
    /// receiver's copies; then every e4m3 byte and scale of the inference rank must be the CPU
    /// reference's of the canonical weights.
    #[test]
    #[ignore = "needs a GPU"]
    fn gpu_fp8_buckets_packed_by_the_kernel_unpack_into_the_reference_bytes() {
        use awex_gpu::cuda::{CopyEngine, Device, Fp8Kernel};
        let f = fp8(128);
        let q = f.quantiser();
        let p = gpu_pair(&f);
        let weights = Weights::Finite(Box::new(Weights::Synthetic));
        let dev = Device::open(0).unwrap();
        let engine = CopyEngine::new(&dev, 2).unwrap();
        let kernel = Fp8Kernel::load(&dev).unwrap();
        let stream = dev.stream().unwrap();
        for budget in [1u64 << 20, 64 << 10] {
            let ranks = gpu_ranks(&p, &dev, budget);
            gpu_fill_training(&ranks, &weights, &p.catalogue, 5);
            let steps = ranks.values().map(|r| r.program.steps.len()).max().unwrap();
            let (mut jobs, mut compared) = (0, 0);
            for k in 0..steps {
                let s = k % 2;
                for (&(side, who), r) in &ranks {
                    let Some(step) = r.program.steps.get(k) else {
                        continue;
                    };
                    if side != Side::Training {
                        continue;
                    }
                    let slot = r.slots[s].ptr();
                    jobs += gpu_pack(&engine, &kernel, &stream, Some(&q), step, slot);
                    for o in &step.ops {
                        let mut wire = vec![0u8; o.op.bytes as usize];
                        // SAFETY: the op's bytes lie in a tensor or the slot; all work synced.
                        unsafe { dev.copy_to_host(o.wire.addr(slot), &mut wire).unwrap() };
                        if matches!(o.wire, Wire::Staged(_)) {
                            let bucket = &r.buckets[o.op.peer_index][o.op.bucket];
                            let mut want = vec![0u8; wire.len()];
                            pack(
                                bucket,
                                &r.plan.peers[o.op.peer_index].transfers,
                                &r.host,
                                &mut want,
                                Some(&q),
                            )
                            .unwrap();
                            assert!(wire == want, "{who}: step {k}'s slot is not tcp's bucket");
                            compared += 1;
                        }
                        // the wire: into the receiver's slot (or tensor) for this step
                        let peer = &ranks[&(Side::Inference, o.op.peer)];
                        let theirs = peer.program.steps[k]
                            .ops
                            .iter()
                            .find(|x| x.op.peer == who)
                            .unwrap();
                        // SAFETY: as above, on the receiver.
                        unsafe {
                            dev.copy_from_host(theirs.wire.addr(peer.slots[s].ptr()), &wire)
                                .unwrap()
                        };
                    }
                }
                for (&(side, _), r) in &ranks {
                    if side == Side::Inference
                        && let Some(step) = r.program.steps.get(k)
                    {
                        // SAFETY: the copies lie in this rank's slot and tensors.
                        unsafe {
                            engine
                                .launch(&step.copies(side, r.slots[s].ptr()), None, None)
                                .unwrap()
                        };
                        engine.sync().unwrap();
                    }
                }
            }
            assert!(jobs > 0 && compared > 0, "{jobs} jobs, {compared} buckets");
            for ((side, who), r) in &ranks {
                if *side == Side::Inference {
                    r.device.download_to(&r.host).unwrap();
                    fill_or_check_with(
                        &weights,
                        &r.layout,
                        &p.catalogue,
                        &r.host,
                        5,
                        true,
                        Some(&f),
                    )
                    .unwrap_or_else(|e| panic!("inference rank {who}, budget {budget}: {e}"));
                }
            }
        }
    }

    /// Deltas of FP8 buckets on one GPU, with the transport's kernels and geometry (no NCCL):
    /// versions made by an optimiser-like step; each training rank packs and quantises a step
    /// into its slot, the wire kernels encode every bucket against the rank's device copy of
    /// what it last sent (each frame equal, byte for byte, to the host emulation's of the same
    /// bytes) and apply the frame to that copy; the frame goes to its receiver's frame buffer,
    /// which gathers the step's boxes from its tensors into its slot, applies the frame there
    /// (or in the tensor, for a contiguous bucket), and unpacks. The first version goes whole;
    /// after each, every e4m3 byte and scale of the inference rank is the CPU reference's.
    #[test]
    #[ignore = "needs a GPU"]
    fn gpu_fp8_delta_frames_encoded_and_applied_by_the_kernels_give_each_next_version() {
        let f = fp8(128);
        gpu_delta_versions(&gpu_pair(&f), Some(&f));
    }

    /// The same for gpt-oss into SGLang, whose experts land transposed: the receiver gathers
    /// them back with the transpose kernel before a frame applies, and unpacks them with it.
    #[test]
    #[ignore = "needs a GPU"]
    fn gpu_transposed_delta_frames_gather_apply_and_unpack_through_the_transpose_kernel() {
        let p = awex_core::pair::PairSpec {
            model: presets::preset("gpt-oss-tiny").unwrap(),
            train: "fsdp:dp=2,fused_experts=1".parse::<BackendSpec>().unwrap(),
            infer: "sglang:tp=2".parse::<BackendSpec>().unwrap(),
            transport: TransportKind::Nccl,
            infer_fp8: None,
        }
        .resolve()
        .unwrap();
        gpu_delta_versions(&p, None);
    }

    /// Versions 1 to 3 of `p` (FP8 inference side: `f`) through the programs on one GPU,
    /// version 1 whole, the others as deltas wherever the frame is shorter.
    /// The plans that convert (FSDP's bf16 `A_log` into SGLang's fp32; FSDP on transformers
    /// 5.24's fp32 router into SGLang's bf16 gate): each training rank's converting pieces are
    /// packed by the element-wise kernel, and every inference rank holds each next version.
    #[test]
    #[ignore = "needs a GPU"]
    fn gpu_converted_pieces_packed_by_the_kernel_arrive_in_the_engines_dtype_as_deltas() {
        for (model, train, infer) in [
            ("qwen3.5-moe-tiny", "fsdp:dp=2", "sglang:tp=2"),
            (
                "deepseek-v3-tiny",
                "fsdp:dp=2,transformers=524",
                "sglang:tp=2,fused_shared_experts=1",
            ),
        ] {
            let p = awex_core::pair::PairSpec {
                model: presets::preset(model).unwrap(),
                train: train.parse::<BackendSpec>().unwrap(),
                infer: infer.parse::<BackendSpec>().unwrap(),
                transport: TransportKind::Nccl,
                infer_fp8: None,
            }
            .resolve()
            .unwrap();
            eprintln!("{model} {train} -> {infer}");
            gpu_delta_versions(&p, None);
        }
    }

    fn gpu_delta_versions(p: &ResolvedPair, f: Option<&InferFp8>) {
        use awex_gpu::cuda::delta_wire::WireKernels;
        use awex_gpu::cuda::transpose::TransposeKernel;
        use awex_gpu::cuda::{CopyEngine, Device, Fp8Kernel};
        let q = f.map(|f| f.quantiser());
        let weights = Weights::Stepped(Arc::new(Stepped::new(&p.catalogue, 1e-6, None)))
            .held_as(&p.catalogue, held_by_trainer(p));
        let dev = Device::open(0).unwrap();
        let engine = CopyEngine::new(&dev, 2).unwrap();
        let kernel = Fp8Kernel::load(&dev).unwrap();
        let wire = WireKernels::load(&dev).unwrap();
        let tk = TransposeKernel::load(&dev).unwrap();
        let stream = dev.stream().unwrap();
        let transpose = |jobs: &[awex_gpu::cuda::transpose::TransposeJob]| {
            if let Some(b) = tk.batch(jobs).unwrap() {
                // SAFETY: the jobs lie in one rank's slot and tensors, idle.
                unsafe { tk.launch(&stream, &b).unwrap() };
                stream.sync().unwrap();
            }
        };
        for budget in [1u64 << 20, 64 << 10] {
            let ranks = gpu_ranks(p, &dev, budget);
            // per (training rank, step, op): the device copy of the bucket last sent
            let mut copies = HashMap::new();
            // bytes of the frames sent, and of the buckets they stand for
            let (mut frames_total, mut dense_total, mut delta_buckets) = (0u64, 0u64, 0);
            for v in 1..=3u64 {
                gpu_fill_training(&ranks, &weights, &p.catalogue, v);
                let steps = ranks.values().map(|r| r.program.steps.len()).max().unwrap();
                for k in 0..steps {
                    let s = k % 2;
                    // (receiver, sender) -> (frame or whole bucket, is a frame)
                    let mut sent: HashMap<(RankId, RankId), (Vec<u8>, bool)> = HashMap::new();
                    for (&(side, who), r) in &ranks {
                        let Some(step) = r.program.steps.get(k) else {
                            continue;
                        };
                        if side != Side::Training {
                            continue;
                        }
                        let slot = r.slots[s].ptr();
                        gpu_pack(&engine, &kernel, &stream, q.as_ref(), step, slot);
                        transpose(&step.convert_jobs(slot));
                        for (i, o) in step.ops.iter().enumerate() {
                            let segs = &step.segs[i];
                            let at = o.wire.addr(slot);
                            let key = (who, k, i);
                            let first = !copies.contains_key(&key);
                            let copy = copies
                                .entry(key)
                                .or_insert_with(|| dev.alloc(o.op.bytes.max(16)).unwrap());
                            let table = wire_table(segs, at, copy.ptr()).unwrap();
                            let work = wire.prepare(&dev, &table, true).unwrap();
                            let fbuf = dev.alloc(work.max_frame_len().max(16)).unwrap();
                            // SAFETY: new (slot or tensor), base (the copy) and the frame
                            // buffer are this rank's device memory, idle.
                            unsafe { wire.launch_encode(&stream, &work, fbuf.ptr()).unwrap() };
                            let (len, changed) =
                                wire.finish_encode_counted(&stream, &work).unwrap();
                            let mut frame = vec![0u8; len as usize];
                            fbuf.download(0, &mut frame).unwrap();
                            let (mut new, mut base) = (
                                vec![0u8; o.op.bytes as usize],
                                vec![0u8; o.op.bytes as usize],
                            );
                            // SAFETY: as above.
                            unsafe { dev.copy_to_host(at, &mut new).unwrap() };
                            copy.download(0, &mut base).unwrap();
                            let host_table = wire_table(segs, 0, 0).unwrap();
                            let (want, count) = host::encode_counted(
                                &host_table,
                                &runs(segs, &new),
                                &runs(segs, &base),
                            );
                            assert!(
                                frame == want,
                                "{who}: step {k} op {i}: the GPU's frame is not the host emulation's"
                            );
                            assert_eq!(changed, count, "{who}: step {k} op {i}: changed elements");
                            // the copy takes the frame
                            let into = wire
                                .prepare(&dev, &wire_table(segs, copy.ptr(), 0).unwrap(), false)
                                .unwrap();
                            // SAFETY: the copy and the frame buffer are idle device memory.
                            unsafe { wire.launch_decode(&stream, &into, fbuf.ptr(), len).unwrap() };
                            wire.finish_decode(&stream, &into).unwrap();
                            copy.download(0, &mut base).unwrap();
                            assert!(base == new, "{who}: the copy holds what was sent");
                            if first || len >= o.op.bytes {
                                sent.insert((o.op.peer, who), (new, false));
                            } else {
                                dense_total += o.op.bytes;
                                frames_total += len;
                                delta_buckets += 1;
                                sent.insert((o.op.peer, who), (frame, true));
                            }
                        }
                    }
                    for (&(side, who), r) in &ranks {
                        let Some(step) = r.program.steps.get(k) else {
                            continue;
                        };
                        if side != Side::Inference {
                            continue;
                        }
                        let slot = r.slots[s].ptr();
                        // SAFETY: the gathers lie in this rank's tensors and slot.
                        unsafe { engine.launch(&step.gathers(slot), None, None).unwrap() };
                        engine.sync().unwrap();
                        transpose(&step.gather_transpose_jobs(slot));
                        for (i, o) in step.ops.iter().enumerate() {
                            let (bytes, is_frame) = sent.remove(&(who, o.op.peer)).unwrap();
                            let at = o.wire.addr(slot);
                            if is_frame {
                                let fbuf = dev.alloc(bytes.len() as u64).unwrap();
                                fbuf.upload(0, &bytes).unwrap();
                                let work = wire
                                    .prepare(
                                        &dev,
                                        &wire_table(&step.segs[i], at, 0).unwrap(),
                                        false,
                                    )
                                    .unwrap();
                                // SAFETY: the bucket's place (slot or tensor) and the frame
                                // are this rank's idle device memory.
                                unsafe {
                                    wire.launch_decode(
                                        &stream,
                                        &work,
                                        fbuf.ptr(),
                                        bytes.len() as u64,
                                    )
                                    .unwrap()
                                };
                                wire.finish_decode(&stream, &work).unwrap();
                            } else {
                                // SAFETY: as above.
                                unsafe { dev.copy_from_host(at, &bytes).unwrap() };
                            }
                        }
                        // SAFETY: the copies lie in this rank's slot and tensors.
                        unsafe { engine.launch(&step.copies(side, slot), None, None).unwrap() };
                        engine.sync().unwrap();
                        transpose(&step.transpose_jobs(slot));
                    }
                    assert!(sent.is_empty());
                }
                for ((side, who), r) in &ranks {
                    if *side == Side::Inference {
                        r.device.download_to(&r.host).unwrap();
                        fill_or_check_with(&weights, &r.layout, &p.catalogue, &r.host, v, true, f)
                            .unwrap_or_else(|e| {
                                panic!("inference rank {who}, budget {budget}, version {v}: {e}")
                            });
                    }
                }
            }
            assert!(delta_buckets > 0, "versions 2 and 3 went as deltas");
            eprintln!(
                "budget {budget}: {delta_buckets} buckets went as deltas, {frames_total} frame bytes for {dense_total} bytes of buckets"
            );
        }
    }

    #[test]
    fn the_gpu_tests_pair_plans_every_fp8_block_on_its_sender() {
        // what the GPU test above runs, checked where there is no GPU: 128 x 128 blocks, each
        // held whole by one Megatron rank, so the nccl path takes the plan
        let f = fp8(128);
        let p = gpu_pair(&f);
        let pair = p.plan_pair();
        let mut encoded = 0;
        for r in p.training.ranks() {
            for t in pair
                .plan_rank(Side::Training, r)
                .unwrap()
                .peers
                .iter()
                .flat_map(|p| &p.transfers)
            {
                awex_gpu::nccl::check_encoding(t).unwrap();
                encoded += t.sender_encoded() as usize;
            }
        }
        assert!(encoded >= 8, "{encoded}");
    }

    /// A rank of an nccl pair as the rank runtime configures it.
    fn rank_config(
        side: Side,
        train: &str,
        infer: &str,
        f: &InferFp8,
    ) -> awex_runtime::rank::RankConfig {
        awex_runtime::rank::RankConfig {
            infer_fp8: Some(f.clone()),
            gateway: "http://127.0.0.1:9".into(),
            token: None,
            pair: "p".into(),
            side,
            rank: match side {
                Side::Training => RankId::train(0),
                Side::Inference => RankId::infer(0, 0),
            },
            model: presets::preset("qwen3-tiny").unwrap(),
            train: train.parse().unwrap(),
            infer: infer.parse().unwrap(),
            transport: TransportKind::Nccl,
            bucket_bytes: 1 << 20,
            host: "127.0.0.1".into(),
            uid: String::new(),
            apply: Default::default(),
            transports: Default::default(),
            gateway_lost: awex_runtime::rank::DEFAULT_GATEWAY_LOST,
            deltas: true,
        }
    }

    #[test]
    fn ranks_of_an_nccl_pair_refuse_cut_blocks_and_encodings_the_kernel_cannot_write() {
        use awex_runtime::rank::{make_transport, prepare};
        // blocks cut between Megatron tp 4's ranks: the receiving rank refuses when it
        // prepares, naming the tensor
        let c = rank_config(Side::Inference, "megatron:tp=4", "sglang:tp=1", &fp8(32));
        let e = prepare(&c).err().unwrap().to_string();
        assert!(
            e.contains("a training shard boundary cuts its FP8 blocks")
                && e.contains("or --transport cuda-ipc, shm or tcp"),
            "{e}"
        );
        // 16 x 16 blocks plan whole, but the GPU kernel writes 128 x 128 only: both sides
        // refuse when they build the transport, before touching a GPU
        for side in [Side::Training, Side::Inference] {
            let c = rank_config(side, "megatron:tp=2", "sglang:tp=2", &fp8(16));
            let prepared = prepare(&c).unwrap();
            let tensors = std::sync::Arc::new(TensorSet::allocate_host(&prepared.layout).unwrap());
            let e = make_transport(&c, &prepared, tensors)
                .err()
                .unwrap()
                .to_string();
            assert!(
                e.contains("the nccl transport quantises FP8 on the training GPU, and the GPU kernel cannot write this encoding")
                    && e.contains("it quantises 128x128 blocks only, not 16x16"),
                "{side:?}: {e}"
            );
        }
    }
}
