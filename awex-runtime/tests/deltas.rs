//! Delta updates over shm and tcp between threads standing in for ranks: every receiver ends
//! each version bit-identical to the canonical weights (what a dense update leaves), the deltas
//! move a few per cent of the bytes on optimiser-made versions, and a receiver that cannot prove
//! the base refuses a delta instead of applying it.

use awex_core::DType;
use awex_core::layout::{RankId, Side, SideLayout};
use awex_core::plan::Pair;
use awex_core::synthetic::{SyntheticSide, TensorSplit, catalogue};
use awex_core::weights::{Stepped, Weights};
use awex_runtime::TensorSet;
use awex_runtime::delta::PeerBases;
use awex_runtime::fill::fill_or_check_from;
use awex_runtime::transport::{
    ExecContext, ExecStats, PairSecret, ShmTransport, TcpTransport, Transport,
};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    Shm,
    Tcp,
}

type Rank = (
    awex_core::layout::RankLayout,
    Arc<TensorSet>,
    Box<dyn Transport>,
);

struct World {
    cat: awex_core::Catalogue,
    weights: Weights,
    senders: Vec<Rank>,
    receivers: Vec<Rank>,
    train_rdv: HashMap<RankId, serde_json::Value>,
    infer_rdv: HashMap<RankId, serde_json::Value>,
    kind: Kind,
    tag: String,
    secret: PairSecret,
    /// the attempt updates run as (a restarted tcp receiver is reached by a retry's fresh
    /// connections, as in a pair: its first attempt fails on the old stream)
    attempt: u32,
    pair_sides: (
        awex_core::layout::ExplicitSide,
        awex_core::layout::ExplicitSide,
    ),
    /// the weights' version each update carries (the identity unless a test makes versions
    /// go back to earlier contents)
    content: fn(u64) -> u64,
}

fn transport(
    kind: Kind,
    plan: Arc<awex_core::plan::RankPlan>,
    t: Arc<TensorSet>,
    ctl: &str,
) -> Box<dyn Transport> {
    match kind {
        Kind::Shm => Box::new(ShmTransport::new(plan, t, 4096, ctl).unwrap()),
        Kind::Tcp => {
            Box::new(TcpTransport::new(plan, t, 4096, "127.0.0.1:0", "127.0.0.1").unwrap())
        }
    }
}

fn split(dim: usize, cuts: Vec<u64>, pad: u64) -> TensorSplit {
    TensorSplit { dim, cuts, pad }
}

fn world(kind: Kind, train_dtype: DType) -> World {
    world_with(kind, train_dtype, 1e-6, |cat| {
        SyntheticSide {
            side: Side::Inference,
            engines: 2,
            replicas: 1,
            shards: 2,
            splits: vec![
                split(0, vec![50], 0),
                split(0, vec![24], 2),
                split(0, vec![32], 0),
                split(1, vec![17], 0),
            ],
            dtype: DType::Bf16,
            fuse: true,
        }
        .build(cat)
    })
}

/// Two engines of different layouts (two shards, fused; three shards split otherwise), so the
/// boxes a training rank sends to one overlap those it sends to the other only in part.
fn two_layouts(cat: &awex_core::Catalogue) -> awex_core::layout::ExplicitSide {
    let mut ranks = SyntheticSide {
        side: Side::Inference,
        engines: 1,
        replicas: 1,
        shards: 2,
        splits: vec![
            split(0, vec![50], 0),
            split(0, vec![24], 2),
            split(0, vec![32], 0),
            split(1, vec![17], 0),
        ],
        dtype: DType::Bf16,
        fuse: true,
    }
    .rank_layouts(cat);
    let other = SyntheticSide {
        side: Side::Inference,
        engines: 1,
        replicas: 1,
        shards: 3,
        splits: vec![
            split(1, vec![16, 40], 0),
            split(0, vec![7, 30], 1),
            split(0, vec![20, 41], 0),
            split(0, vec![11, 20], 0),
        ],
        dtype: DType::Bf16,
        fuse: false,
    }
    .rank_layouts(cat);
    for mut r in other {
        r.rank.engine = 1;
        ranks.push(r);
    }
    awex_core::layout::ExplicitSide::new(Side::Inference, ranks)
}

fn world_with(
    kind: Kind,
    train_dtype: DType,
    lr: f64,
    infer: impl FnOnce(&awex_core::Catalogue) -> awex_core::layout::ExplicitSide,
) -> World {
    let cat = catalogue(&[vec![96, 64], vec![48, 64], vec![64], vec![33, 40]]);
    let train = SyntheticSide {
        side: Side::Training,
        engines: 1,
        replicas: 1,
        shards: 2,
        splits: vec![
            split(0, vec![40], 0),
            split(1, vec![20], 1),
            split(0, vec![30], 0),
            split(0, vec![10], 2),
        ],
        dtype: train_dtype,
        fuse: false,
    }
    .build(&cat);
    let infer = infer(&cat);
    static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let tag = format!(
        "awex-test-delta-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let weights = Weights::Stepped(Arc::new(Stepped::new(&cat, lr, None)));
    let mut w = World {
        cat,
        weights,
        senders: vec![],
        receivers: vec![],
        train_rdv: HashMap::new(),
        infer_rdv: HashMap::new(),
        kind,
        secret: PairSecret::random(&tag),
        attempt: 1,
        tag,
        pair_sides: (train, infer),
        content: |v| v,
    };
    let pair = Pair {
        catalogue: &w.cat,
        training: &w.pair_sides.0,
        inference: &w.pair_sides.1,
        encode_on_sender: false,
    };
    for r in w.pair_sides.0.ranks() {
        let layout = w.pair_sides.0.rank_layout(r).unwrap();
        let plan = Arc::new(pair.plan_rank(Side::Training, r).unwrap());
        let tensors = Arc::new(match kind {
            Kind::Shm => {
                TensorSet::allocate_shm(&layout, &format!("{}-t{}-data", w.tag, r.rank)).unwrap()
            }
            Kind::Tcp => TensorSet::allocate_host(&layout).unwrap(),
        });
        let ctl = format!("{}-t{}-ctl", w.tag, r.rank);
        let mut t = transport(kind, plan, tensors.clone(), &ctl);
        t.authenticate(&w.secret);
        assert!(t.enable_deltas().unwrap());
        w.train_rdv.insert(r, t.rendezvous());
        w.senders.push((layout, tensors, t));
    }
    let receivers: Vec<RankId> = w.pair_sides.1.ranks();
    for r in receivers {
        let rank = new_receiver(&w, r);
        w.infer_rdv.insert(r, rank.2.rendezvous());
        w.receivers.push(rank);
    }
    w
}

fn new_receiver(w: &World, r: RankId) -> Rank {
    let pair = Pair {
        catalogue: &w.cat,
        training: &w.pair_sides.0,
        inference: &w.pair_sides.1,
        encode_on_sender: false,
    };
    let layout = w.pair_sides.1.rank_layout(r).unwrap();
    let plan = Arc::new(pair.plan_rank(Side::Inference, r).unwrap());
    let tensors = Arc::new(TensorSet::allocate_host(&layout).unwrap());
    let mut t = transport(w.kind, plan, tensors.clone(), "unused");
    t.authenticate(&w.secret);
    assert!(t.enable_deltas().unwrap());
    assert!(t.holds_base());
    (layout, tensors, t)
}

/// Runs `version` with `bases` within `limit`; returns the senders' and the receivers' results.
fn run(
    w: &mut World,
    version: u64,
    bases: Option<&PeerBases>,
    checksums: bool,
    limit: Duration,
) -> (Vec<ExecStats>, Vec<Result<ExecStats, String>>) {
    for (l, t, _) in &w.senders {
        fill_or_check_from(&w.weights, l, &w.cat, t, (w.content)(version), false).unwrap();
    }
    let cancel = AtomicBool::new(false);
    let ctx = ExecContext {
        version,
        attempt: w.attempt,
        deadline: Instant::now() + limit,
        cancel: &cancel,
        checksums,
        peers: &w.infer_rdv,
        corrupt: false,
        bases,
    };
    let rctx = ExecContext {
        peers: &w.train_rdv,
        bases: None,
        ..ExecContext { ..ctx }
    };
    let (sent, got): (Vec<_>, Vec<_>) = std::thread::scope(|s| {
        let hs: Vec<_> = w
            .senders
            .iter_mut()
            .map(|(_, _, t)| s.spawn(|| t.execute(&ctx)))
            .collect();
        let hr: Vec<_> = w
            .receivers
            .iter_mut()
            .map(|(_, _, t)| s.spawn(|| t.execute(&rctx)))
            .collect();
        (
            hs.into_iter().map(|h| h.join().unwrap()).collect(),
            hr.into_iter().map(|h| h.join().unwrap()).collect(),
        )
    });
    (
        sent.into_iter().map(|r| r.unwrap_or_default()).collect(),
        got.into_iter()
            .map(|r| r.map_err(|e| e.to_string()))
            .collect(),
    )
}

/// Runs `version` with `bases`; returns the senders' and the receivers' results, each receiver's
/// result checked against the canonical weights of the version.
fn update(
    w: &mut World,
    version: u64,
    bases: Option<&PeerBases>,
    checksums: bool,
) -> (Vec<ExecStats>, Vec<Result<ExecStats, String>>) {
    let (sent, got) = run(w, version, bases, checksums, Duration::from_secs(60));
    let got = got
        .into_iter()
        .zip(&w.receivers)
        .map(|(r, (l, t, _))| {
            let st = r?;
            fill_or_check_from(&w.weights, l, &w.cat, t, (w.content)(version), true)?;
            Ok(st)
        })
        .collect();
    (sent, got)
}

fn every_rank_holds(version: u64) -> PeerBases {
    PeerBases {
        version,
        except: HashSet::new(),
    }
}

#[test]
fn delta_updates_equal_dense_ones_and_move_a_few_per_cent_over_shm_and_tcp() {
    for kind in [Kind::Shm, Kind::Tcp] {
        for (dtype, checksums) in [(DType::Bf16, false), (DType::F32, true)] {
            let mut w = world(kind, dtype);
            let (_, first) = update(&mut w, 1, None, checksums);
            assert!(first.iter().all(|r| r.is_ok()), "{kind:?} v1: {first:?}");
            for v in 2..=4 {
                let bases = every_rank_holds(v - 1);
                let (sent, got) = update(&mut w, v, Some(&bases), checksums);
                let mut total = ExecStats::default();
                for r in &got {
                    total.add(r.as_ref().unwrap_or_else(|e| panic!("{kind:?} v{v}: {e}")));
                }
                let moved = total.bytes as f64 / total.dense_bytes() as f64;
                let density = total.delta.density();
                // optimiser-made versions at lr 1e-6: about 1 % changes, and the wire carries
                // the changes (values and their gaps)
                assert!((0.003..0.08).contains(&density), "{kind:?} v{v}: {density}");
                assert!(
                    moved < 0.10,
                    "{kind:?} {dtype} v{v}: moved {moved} of dense"
                );
                let sent_bytes: u64 = sent.iter().map(|s| s.bytes).sum();
                assert_eq!(
                    sent_bytes, total.bytes,
                    "{kind:?} both ends count the same bytes"
                );
                // the two engines replicate one layout: a sender compares each byte it sends as
                // a delta once per update, not once per engine
                let compared: u64 = sent.iter().map(|s| s.compared).sum();
                let dense: u64 = sent.iter().map(|s| s.delta.dense_bytes).sum();
                assert_eq!(
                    2 * compared,
                    dense,
                    "{kind:?} v{v}: compared once per update"
                );
                if checksums {
                    let a = sent.iter().fold(0u64, |a, s| a.wrapping_add(s.checksum));
                    let b = total.checksum;
                    assert_eq!(a, b, "checksums cover the resulting bytes on both ends");
                }
            }
        }
    }
}

#[test]
fn a_rank_outside_the_base_gets_every_byte_and_one_that_cannot_prove_it_refuses_a_delta() {
    for kind in [Kind::Shm, Kind::Tcp] {
        let mut w = world(kind, DType::Bf16);
        let (_, r) = update(&mut w, 1, None, false);
        assert!(r.iter().all(|r| r.is_ok()));
        // inference rank 0/1 restarts: a new process holds none of version 1
        let restarted = RankId::infer(0, 1);
        let at = w
            .pair_sides
            .1
            .ranks()
            .iter()
            .position(|r| *r == restarted)
            .unwrap();
        let fresh = new_receiver(&w, restarted);
        w.infer_rdv.insert(restarted, fresh.2.rendezvous());
        w.receivers[at] = fresh;
        w.attempt = 2;
        // the gateway names it: it gets every byte, the others deltas, all end equal to v2
        let bases = PeerBases {
            version: 1,
            except: [restarted].into_iter().collect(),
        };
        let (_, got) = update(&mut w, 2, Some(&bases), false);
        for (i, r) in got.iter().enumerate() {
            let st = r
                .as_ref()
                .unwrap_or_else(|e| panic!("{kind:?} rank {i}: {e}"));
            if i == at {
                assert_eq!(
                    st.delta.elements, 0,
                    "{kind:?}: the restarted rank got dense bytes"
                );
            } else {
                assert!(st.delta.elements > 0, "{kind:?}: rank {i} got deltas");
            }
        }
        // a base the receiver cannot prove (told wrongly that everyone holds v2, after a fresh
        // restart): it refuses the delta, naming the version, and applies nothing
        let fresh = new_receiver(&w, restarted);
        w.infer_rdv.insert(restarted, fresh.2.rendezvous());
        w.receivers[at] = fresh;
        w.attempt = 3;
        let bases = every_rank_holds(2);
        let cancel_short = update_expecting_refusal(&mut w, 3, &bases, at);
        assert!(
            cancel_short.contains("sent a delta against version 2"),
            "{kind:?}: {cancel_short}"
        );
    }
}

/// Runs `version` with `bases` where receiver `bad` cannot prove its base; returns its error
/// (the others' results are not checked: the version fails as a whole).
fn update_expecting_refusal(w: &mut World, version: u64, bases: &PeerBases, bad: usize) -> String {
    let (_, got) = run(w, version, Some(bases), false, Duration::from_secs(5));
    match &got[bad] {
        Ok(_) => panic!("receiver {bad} applied a delta it cannot prove the base of"),
        Err(e) => e.clone(),
    }
}

/// What the weights of update `v` are in [`the_copy_refreshed_from_the_changes_keeps_every_later_delta_exact`]:
/// versions 4 and 7 go back to the contents of the version before the last, so every element the
/// last update changed changes back; a sender whose copy missed any of them sends no change
/// there and the receivers keep the wrong value.
fn back_and_forth(v: u64) -> u64 {
    [0, 1, 2, 3, 2, 4, 5, 4, 6, 7][v as usize]
}

#[test]
fn the_copy_refreshed_from_the_changes_keeps_every_later_delta_exact() {
    for kind in [Kind::Shm, Kind::Tcp] {
        for dtype in [DType::Bf16, DType::F32] {
            // lr 2e-6: a bf16 element changes about one time in sixteen, few enough that the
            // senders write only the changed elements into their copies
            let mut w = world_with(kind, dtype, 2e-6, two_layouts);
            w.content = back_and_forth;
            let copy_bytes: Vec<u64> = w
                .senders
                .iter()
                .map(|(_, t, _)| t.iter().map(|v| v.len() as u64).sum())
                .collect();
            let (sent, got) = update(&mut w, 1, None, false);
            assert!(
                got.iter().all(|r| r.is_ok()),
                "{kind:?} {dtype} v1: {got:?}"
            );
            let refreshed: Vec<u64> = sent.iter().map(|s| s.refreshed).collect();
            assert_eq!(
                refreshed, copy_bytes,
                "{kind:?}: a dense update refreshes the whole copy"
            );
            // inference rank 1/2 is named as holding no base at version 5: it gets every byte,
            // the others deltas, and the senders refresh their copies whole
            let without = RankId::infer(1, 2);
            for v in 2..=9 {
                let bases = PeerBases {
                    version: v - 1,
                    except: if v == 5 {
                        [without].into_iter().collect()
                    } else {
                        HashSet::new()
                    },
                };
                let (sent, got) = update(&mut w, v, Some(&bases), v % 2 == 0);
                for (i, r) in got.iter().enumerate() {
                    let st = r
                        .as_ref()
                        .unwrap_or_else(|e| panic!("{kind:?} {dtype} v{v} receiver {i}: {e}"));
                    let dense = v == 5 && w.pair_sides.1.ranks()[i] == without;
                    assert_eq!(
                        st.delta.elements == 0,
                        dense,
                        "{kind:?} {dtype} v{v} receiver {i}: a delta unless it holds no base"
                    );
                }
                for (s, &all) in sent.iter().zip(&copy_bytes) {
                    assert!(
                        s.delta.changed > 0,
                        "{kind:?} {dtype} v{v}: something changed"
                    );
                    if v == 5 {
                        assert_eq!(s.refreshed, all, "{kind:?} {dtype} v5: refreshed whole");
                    } else if dtype == DType::Bf16 {
                        // bf16 pieces are compared in place: only the changed elements are
                        // written (some twice, where the two engines' boxes overlap)
                        assert!(
                            s.refreshed > 0 && s.refreshed < all,
                            "{kind:?} v{v}: refreshed {} of {all} bytes",
                            s.refreshed
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_receiver_maps_the_delta_segment_without_committing_pages_nobody_wrote() {
    // The delta segment is sized for the worst case (every bucket dense) and tmpfs commits a
    // page only once it is written; a receiver that populated its mapping would commit all of
    // it (a model's worth of shared memory, and seconds of page clearing on a large one).
    let mut w = world(Kind::Shm, DType::Bf16);
    let (_, first) = update(&mut w, 1, None, false);
    assert!(first.iter().all(|r| r.is_ok()), "v1: {first:?}");
    let (_, got) = update(&mut w, 2, Some(&every_rank_holds(1)), false);
    let mut total = ExecStats::default();
    for r in &got {
        total.add(r.as_ref().expect("v2"));
    }
    assert!(total.delta.changed > 0, "v2 went as deltas");
    for r in 0..w.senders.len() {
        let path = format!("/dev/shm/{}-t{r}-delta", w.tag);
        let c = std::ffi::CString::new(path.clone()).unwrap();
        // SAFETY: a valid path and a zeroed stat buffer.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::stat(c.as_ptr(), &mut st) }, 0, "{path}");
        let committed = st.st_blocks as u64 * 512;
        let size = st.st_size as u64;
        assert!(
            committed * 2 < size,
            "{path}: {committed} of its {size} bytes committed after a delta of a few per cent"
        );
    }
}
