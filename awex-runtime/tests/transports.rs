//! The shm and tcp transports move planned bytes exactly between threads standing in for ranks.

use awex_core::DType;
use awex_core::layout::{RankId, Side, SideLayout};
use awex_core::plan::Pair;
use awex_core::synthetic::{SyntheticSide, TensorSplit, catalogue};
use awex_runtime::fill::{Weights, fill_or_check_from};
use awex_runtime::transport::{ExecContext, PairSecret, ShmTransport, TcpTransport, Transport};
use awex_runtime::{PlacementError, RuntimeError, TensorSet};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

fn sides(
    train_dtype: DType,
) -> (
    awex_core::Catalogue,
    awex_core::layout::ExplicitSide,
    awex_core::layout::ExplicitSide,
) {
    let cat = catalogue(&[vec![40, 8], vec![24, 8], vec![16], vec![9, 5]]);
    let split = |dim: usize, cuts: Vec<u64>, pad: u64| TensorSplit { dim, cuts, pad };
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

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Shm,
    Tcp,
}

/// Runs `versions` updates between all ranks; returns each receiver's result of the last one.
fn run(kind: Kind, train_dtype: DType, checksums: bool, corrupt: bool, versions: u64) -> Results {
    let w = Weights::Synthetic;
    run_with(
        kind,
        train_dtype,
        checksums,
        corrupt,
        versions,
        &w,
        &|_, _, _| {},
    )
    .1
}

/// Each rank's result of an update.
type Results = Vec<Result<(), String>>;

/// What a test does to training rank `i`'s transport and tensors once they are filled for a
/// version.
type Tweak<'a> = &'a dyn Fn(usize, &mut dyn Transport, &TensorSet);

/// [`run`] with `weights`, and `tweak` applied to every training rank before each version;
/// returns the senders' and the receivers' results of the last version.
fn run_with(
    kind: Kind,
    train_dtype: DType,
    checksums: bool,
    corrupt: bool,
    versions: u64,
    weights: &Weights,
    tweak: Tweak<'_>,
) -> (Results, Results) {
    let (cat, train, infer) = sides(train_dtype);
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    static RUN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let tag = format!(
        "awex-test-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let secret = PairSecret::random(&tag);
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    let mut train_rdv: HashMap<RankId, serde_json::Value> = HashMap::new();
    let mut infer_rdv: HashMap<RankId, serde_json::Value> = HashMap::new();
    for r in train.ranks() {
        let layout = train.rank_layout(r).unwrap();
        let plan = Arc::new(pair.plan_rank(Side::Training, r).unwrap());
        let tensors = Arc::new(match kind {
            Kind::Shm => {
                TensorSet::allocate_shm(&layout, &format!("{tag}-t{}-data", r.rank)).unwrap()
            }
            Kind::Tcp => TensorSet::allocate_host(&layout).unwrap(),
        });
        let t: Box<dyn Transport> = match kind {
            Kind::Shm => Box::new(
                ShmTransport::new(
                    plan,
                    tensors.clone(),
                    256,
                    &format!("{tag}-t{}-ctl", r.rank),
                )
                .unwrap(),
            ),
            Kind::Tcp => Box::new(
                TcpTransport::new(plan, tensors.clone(), 256, "127.0.0.1:0", "127.0.0.1").unwrap(),
            ),
        };
        let mut t = t;
        t.authenticate(&secret);
        train_rdv.insert(r, t.rendezvous());
        senders.push((layout, tensors, t));
    }
    for r in infer.ranks() {
        let layout = infer.rank_layout(r).unwrap();
        let plan = Arc::new(pair.plan_rank(Side::Inference, r).unwrap());
        let tensors = Arc::new(TensorSet::allocate_host(&layout).unwrap());
        let t: Box<dyn Transport> = match kind {
            Kind::Shm => Box::new(ShmTransport::new(plan, tensors.clone(), 256, "unused").unwrap()),
            Kind::Tcp => Box::new(
                TcpTransport::new(plan, tensors.clone(), 256, "127.0.0.1:0", "127.0.0.1").unwrap(),
            ),
        };
        let mut t = t;
        t.authenticate(&secret);
        infer_rdv.insert(r, t.rendezvous());
        receivers.push((layout, tensors, t));
    }
    let cancel = AtomicBool::new(false);
    let mut last = Vec::new();
    let mut last_sent = Vec::new();
    for version in 1..=versions {
        for (i, (l, t, tr)) in senders.iter_mut().enumerate() {
            fill_or_check_from(weights, l, &cat, t, version, false).unwrap();
            tweak(i, tr.as_mut(), t);
        }
        let ctx = ExecContext {
            version,
            attempt: 1,
            deadline: Instant::now() + Duration::from_secs(if corrupt { 4 } else { 30 }),
            cancel: &cancel,
            checksums,
            peers: &infer_rdv,
            corrupt: false,
            bases: None,
        };
        let rctx = ExecContext {
            peers: &train_rdv,
            ..ExecContext { ..ctx }
        };
        let bad = ExecContext {
            corrupt,
            ..ExecContext { ..rctx }
        };
        let (sent, got): (Vec<_>, Vec<_>) = std::thread::scope(|s| {
            let hs: Vec<_> = senders
                .iter_mut()
                .map(|(_, _, t)| s.spawn(|| t.execute(&ctx)))
                .collect();
            let hr: Vec<_> = receivers
                .iter_mut()
                .enumerate()
                .map(|(i, (_, _, t))| {
                    let c = if i == 0 { &bad } else { &rctx };
                    s.spawn(move || t.execute(c))
                })
                .collect();
            (
                hs.into_iter().map(|h| h.join().unwrap()).collect(),
                hr.into_iter().map(|h| h.join().unwrap()).collect(),
            )
        });
        last.clear();
        last_sent = sent
            .iter()
            .map(|r| r.as_ref().map(|_| ()).map_err(|e| e.to_string()))
            .collect();
        let sent_sum = sent
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .fold(0u64, |a, s| a.wrapping_add(s.checksum));
        let got_sum = got
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .fold(0u64, |a, s| a.wrapping_add(s.checksum));
        let all_ok = got.iter().all(|r| r.is_ok());
        if checksums && all_ok {
            assert_eq!(sent_sum, got_sum, "checksums of both sides agree");
        }
        for ((l, t, _), r) in receivers.iter().zip(got) {
            last.push(match r {
                Ok(_) => fill_or_check_from(weights, l, &cat, t, version, true),
                Err(e) => Err(e.to_string()),
            });
        }
    }
    (last_sent, last)
}

#[test]
fn shm_moves_every_byte_for_three_versions() {
    let r = run(Kind::Shm, DType::Bf16, false, false, 3);
    assert_eq!(r.len(), 6);
    assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
}

#[test]
fn shm_converts_fp32_training_weights_and_checksums_agree() {
    let r = run(Kind::Shm, DType::F32, true, false, 2);
    assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
}

#[test]
fn tcp_moves_every_byte_with_checksums() {
    let r = run(Kind::Tcp, DType::F32, true, false, 3);
    assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
}

#[test]
fn corrupted_bucket_fails_with_checksums_on() {
    for kind in [Kind::Shm, Kind::Tcp] {
        let r = run(kind, DType::Bf16, true, true, 1);
        let e = r[0].as_ref().unwrap_err();
        assert!(e.contains("failed its checksum"), "{e}");
        assert!(r[1..].iter().all(|x| x.is_ok()));
    }
}

#[test]
fn shm_sender_needs_shared_memory_tensors() {
    let (cat, train, infer) = sides(DType::Bf16);
    let pair = Pair {
        catalogue: &cat,
        training: &train,
        inference: &infer,
        encode_on_sender: false,
    };
    let r = RankId::train(0);
    let plan = Arc::new(pair.plan_rank(Side::Training, r).unwrap());
    let tensors = Arc::new(TensorSet::allocate_host(&train.rank_layout(r).unwrap()).unwrap());
    let e = ShmTransport::new(plan, tensors, 256, "awex-test-x-ctl")
        .err()
        .unwrap();
    assert!(
        matches!(e, RuntimeError::Placement(PlacementError::NotShared))
            && e.to_string().contains("use tcp"),
        "{e}"
    );
}

/// With `check_finite`, a training rank whose source holds a NaN or an infinity fails the
/// update naming the tensor and element before it sends anything; the others' updates with
/// finite sources move every byte as without the check; without the check, the NaN is sent.
#[test]
fn check_finite_fails_a_sender_whose_source_holds_nan_and_passes_finite_sources() {
    for kind in [Kind::Shm, Kind::Tcp] {
        // the check on every sender, finite sources: every receiver gets every byte
        let finite = Weights::Finite(Box::new(Weights::Synthetic));
        let (sent, got) = run_with(kind, DType::Bf16, true, false, 2, &finite, &|_, t, _| {
            t.check_finite_sources().unwrap();
        });
        assert!(sent.iter().all(Result::is_ok), "{sent:?}");
        assert!(got.iter().all(Result::is_ok), "{got:?}");
        // a NaN at element 5 of training rank 1's first tensor (bf16 0x7fc0), -inf in rank 0's
        let poison = |i: usize, t: &mut dyn Transport, set: &TensorSet, check: bool| {
            if check {
                t.check_finite_sources().unwrap();
            }
            let v = set.iter().next().unwrap();
            // SAFETY: the test owns the tensors; nothing moves them between versions.
            let b = unsafe { v.try_bytes_mut().unwrap() };
            let bits: u16 = if i == 1 { 0x7fc0 } else { 0xff80 };
            b[10..12].copy_from_slice(&bits.to_le_bytes());
        };
        let (sent, _) = run_with(kind, DType::Bf16, false, true, 1, &finite, &|i, t, set| {
            poison(i, t, set, true)
        });
        for (i, r) in sent.iter().enumerate() {
            let e = r.as_ref().unwrap_err();
            let what = if i == 1 {
                "NaN (bf16 bits 0x7fc0)"
            } else {
                "-inf (bf16 bits 0xff80)"
            };
            assert!(
                e.contains(&format!("holds {what} at element 5 of this rank's shard"))
                    && e.contains("check_finite is on"),
                "sender {i}: {e}"
            );
        }
        // without the check the same sources are sent (what the check is for)
        let (sent, got) = run_with(kind, DType::Bf16, false, false, 1, &finite, &|i, t, set| {
            poison(i, t, set, false)
        });
        assert!(sent.iter().all(Result::is_ok), "{sent:?}");
        // the receivers holding element 5 of the first tensor got the NaN or -inf
        assert!(
            got.iter()
                .any(|r| r.as_ref().is_err_and(|e| !e.contains("check_finite"))),
            "{got:?}"
        );
    }
}
