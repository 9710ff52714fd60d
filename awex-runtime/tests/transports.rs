//! The shm and tcp transports move planned bytes exactly between threads standing in for ranks.

use awex_core::DType;
use awex_core::layout::{RankId, Side, SideLayout};
use awex_core::plan::Pair;
use awex_core::synthetic::{SyntheticSide, TensorSplit, catalogue};
use awex_runtime::fill::fill_or_check;
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
fn run(
    kind: Kind,
    train_dtype: DType,
    checksums: bool,
    corrupt: bool,
    versions: u64,
) -> Vec<Result<(), String>> {
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
    for version in 1..=versions {
        for (l, t, _) in &senders {
            fill_or_check(l, &cat, t, version, false).unwrap();
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
                Ok(_) => fill_or_check(l, &cat, t, version, true),
                Err(e) => Err(e.to_string()),
            });
        }
    }
    last
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
