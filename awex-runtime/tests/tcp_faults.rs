//! The tcp transport under faults and attack: a receiver that stops reading, a peer that goes
//! quiet, and an injector that knows everything public about a pair (fingerprint, bucket size,
//! port) but not its secret. Every wait in these tests is bounded.

use awex_core::DType;
use awex_core::layout::{RankId, Side, SideLayout};
use awex_core::plan::{Pair, RankPlan};
use awex_core::synthetic::{SyntheticSide, TensorSplit, catalogue};
use awex_runtime::fill::fill_or_check;
use awex_runtime::transport::{ExecContext, LostEngines, PairSecret, TcpTransport, Transport};
use awex_runtime::{RuntimeError, TensorSet};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BUCKET: u64 = 1 << 20;

struct Setup {
    cat: awex_core::Catalogue,
    train: awex_core::layout::ExplicitSide,
    infer: awex_core::layout::ExplicitSide,
}

/// One training and one inference rank sharing one tensor of `rows` x 4096 bf16 (8 KiB a row).
fn setup(rows: u64) -> Setup {
    let cat = catalogue(&[vec![rows, 4096]]);
    let side = |side| SyntheticSide {
        side,
        engines: 1,
        replicas: 1,
        shards: 1,
        splits: vec![TensorSplit {
            dim: 0,
            cuts: vec![],
            pad: 0,
        }],
        dtype: DType::Bf16,
        fuse: false,
    };
    let train = side(Side::Training).build(&cat);
    let infer = side(Side::Inference).build(&cat);
    Setup { cat, train, infer }
}

struct End {
    layout: awex_core::layout::RankLayout,
    tensors: Arc<TensorSet>,
    plan: Arc<RankPlan>,
    t: TcpTransport,
}

fn ends(s: &Setup, secret: Option<&PairSecret>) -> (End, End) {
    let pair = Pair {
        catalogue: &s.cat,
        training: &s.train,
        inference: &s.infer,
        encode_on_sender: false,
    };
    let mk = |side: Side, r: RankId, l: &dyn SideLayout| {
        let layout = l.rank_layout(r).unwrap();
        let plan = Arc::new(pair.plan_rank(side, r).unwrap());
        let tensors = Arc::new(TensorSet::allocate_host(&layout).unwrap());
        let mut t = TcpTransport::new(
            plan.clone(),
            tensors.clone(),
            BUCKET,
            "127.0.0.1:0",
            "127.0.0.1",
        )
        .unwrap();
        if let Some(k) = secret {
            t.authenticate(k);
        }
        End {
            layout,
            tensors,
            plan,
            t,
        }
    };
    (
        mk(Side::Training, RankId::train(0), &s.train),
        mk(Side::Inference, RankId::infer(0, 0), &s.infer),
    )
}

fn peers_of(e: &End) -> HashMap<RankId, serde_json::Value> {
    HashMap::from([(e.plan.rank, e.t.rendezvous())])
}

/// Runs `f` on a thread and waits at most `limit` for it: a hang fails the test instead of
/// hanging it.
fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("still blocked after {limit:?}: the transport hangs"))
}

fn ctx<'a>(
    version: u64,
    deadline: Duration,
    cancel: &'a AtomicBool,
    peers: &'a HashMap<RankId, serde_json::Value>,
) -> ExecContext<'a> {
    ExecContext {
        version,
        attempt: 1,
        deadline: Instant::now() + deadline,
        cancel,
        checksums: true,
        peers,
        corrupt: false,
        bases: None,
    }
}

/// A sender of 32 buckets (32 MiB, more than loopback socket buffers hold) to a receiver that
/// accepted the connection but never reads: the sender must stop at its deadline (before the
/// fix the packer waited for a free buffer and the writer for the packer, for ever).
#[test]
fn sender_to_a_receiver_that_stops_reading_stops_at_the_deadline() {
    let s = setup(4096);
    let k = PairSecret::random("p");
    let (mut tx, rx) = ends(&s, Some(&k));
    fill_or_check(&tx.layout, &s.cat, &tx.tensors, 1, false).unwrap();
    let peers = peers_of(&rx);
    let r = bounded(Duration::from_secs(30), move || {
        let cancel = AtomicBool::new(false);
        let r =
            tx.t.execute(&ctx(1, Duration::from_secs(2), &cancel, &peers));
        drop(rx); // keeps the receiver (and its unread stream) alive until the sender stopped
        r.map(|_| ())
    });
    let e = r.unwrap_err().to_string();
    assert!(e.contains("timed out after"), "{e}");
    assert!(e.contains("inference rank"), "{e}");
    // (the deadline, 2 s, is what stopped it: the message says so; `bounded` says it did not hang)
}

/// In a pair that may leave engines out, the same stuck sender gives the receiver up at the
/// cut-off (its engine reported unreached, the part a success); resumed, the receiver takes the
/// next version whole over the fresh connection the sender opens for it, whichever comes first.
fn given_up_then_the_next_version_whole(sender_first: bool) {
    let s = setup(4096);
    let k = PairSecret::random("p");
    let (mut tx, mut rx) = ends(&s, Some(&k));
    let (to_rx, to_tx) = (peers_of(&rx), peers_of(&tx));
    let lost = Arc::new(LostEngines::default());
    assert!(tx.t.tolerate_lost_engines(Some(lost.clone())));
    let cancel = AtomicBool::new(false);
    fill_or_check(&tx.layout, &s.cat, &tx.tensors, 1, false).unwrap();
    lost.set_cutoff(Instant::now() + Duration::from_secs(1));
    // version 1: the receiver does not read (stopped)
    let sent =
        tx.t.execute(&ctx(1, Duration::from_secs(60), &cancel, &to_rx));
    sent.expect("given up at the cut-off, not failed at the deadline");
    assert_eq!(tx.t.unreached(), vec![0]);
    // version 2: both run, one half a second after the other (the order is what the test is
    // about; a loaded machine that blurs it makes the test weaker, never wrong)
    fill_or_check(&tx.layout, &s.cat, &tx.tensors, 2, false).unwrap();
    lost.clear();
    lost.set_cutoff(Instant::now() + Duration::from_secs(50));
    let send = || {
        tx.t.execute(&ctx(2, Duration::from_secs(60), &cancel, &to_rx))
    };
    let receive = || {
        rx.t.execute(&ctx(2, Duration::from_secs(60), &cancel, &to_tx))
    };
    std::thread::scope(|sc| {
        let (a, b) = if sender_first {
            let a = sc.spawn(send);
            std::thread::sleep(Duration::from_millis(500));
            (a, sc.spawn(receive))
        } else {
            let b = sc.spawn(receive);
            std::thread::sleep(Duration::from_millis(500));
            (sc.spawn(send), b)
        };
        a.join().unwrap().unwrap();
        b.join().unwrap().unwrap();
    });
    assert_eq!(tx.t.unreached(), Vec::<u32>::new());
    assert_eq!(rx.t.refused(), 0);
    fill_or_check(&rx.layout, &s.cat, &rx.tensors, 2, true).unwrap();
}

/// The sender first: its fresh connection arrives while the old stream still holds the unread
/// half of the version given up, and replaces it (before the fix the receiver refused it as a
/// second connection for a live stream, and its engine was left out again).
#[test]
fn a_stopped_receiver_given_up_at_the_cutoff_takes_the_next_version_on_a_fresh_stream() {
    given_up_then_the_next_version_whole(true);
}

/// The receiver first: it reads the old stream's stale frames to its end, then waits for the
/// fresh stream (before the fix the end of the old one failed its part).
#[test]
fn a_stopped_receiver_that_reads_the_given_up_stream_first_waits_for_the_fresh_one() {
    given_up_then_the_next_version_whole(false);
}

/// The same stuck sender stops promptly when the update is aborted elsewhere.
#[test]
fn sender_to_a_receiver_that_stops_reading_stops_on_abort() {
    let s = setup(4096);
    let k = PairSecret::random("p");
    let (mut tx, rx) = ends(&s, Some(&k));
    let peers = peers_of(&rx);
    let cancel = Arc::new(AtomicBool::new(false));
    let c = cancel.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        c.store(true, Ordering::Release);
    });
    let r = bounded(Duration::from_secs(30), move || {
        let r =
            tx.t.execute(&ctx(1, Duration::from_secs(600), &cancel, &peers));
        drop(rx);
        r.map(|_| ())
    });
    assert!(matches!(r, Err(RuntimeError::Aborted(1))), "{r:?}");
}

/// A receiver whose sender went quiet says how long it waited and for whom, not EAGAIN.
#[test]
fn read_timeout_names_the_peer_and_the_wait() {
    let s = setup(64);
    let k = PairSecret::random("p");
    let (mut tx, mut rx) = ends(&s, Some(&k));
    let (to_rx, to_tx) = (peers_of(&rx), peers_of(&tx));
    let cancel = AtomicBool::new(false);
    fill_or_check(&tx.layout, &s.cat, &tx.tensors, 1, false).unwrap();
    std::thread::scope(|sc| {
        let a = sc.spawn(|| {
            tx.t.execute(&ctx(1, Duration::from_secs(20), &cancel, &to_rx))
        });
        let b = sc.spawn(|| {
            rx.t.execute(&ctx(1, Duration::from_secs(20), &cancel, &to_tx))
        });
        a.join().unwrap().unwrap();
        b.join().unwrap().unwrap();
    });
    // version 2: the connection is up, the training rank never sends
    let e =
        rx.t.execute(&ctx(2, Duration::from_millis(1500), &cancel, &to_tx))
            .unwrap_err()
            .to_string();
    assert!(
        e.contains("timed out after 1.") && e.contains("s waiting for training rank 0"),
        "{e}"
    );
    assert!(!e.contains("os error 11"), "{e}");
}

fn hello(plan: &RankPlan, tag: u64) -> Vec<u8> {
    let key = |r: RankId| ((r.engine as u64) << 32) | r.rank as u64;
    let p = &plan.peers[0];
    let mut h = Vec::new();
    for w in [
        u64::from_le_bytes(*b"AWEXTCP2"),
        key(plan.rank),
        key(p.peer),
        p.fingerprint,
        tag,
        BUCKET,
    ] {
        h.extend_from_slice(&w.to_le_bytes());
    }
    h.extend_from_slice(&[7u8; 32]);
    h
}

/// An injector that knows the fingerprint, bucket size and port: it stalls one connection,
/// forges a hello, sends frames, replays a hello; every connection is refused, the legitimate
/// stream kept, every byte committed is the training rank's, and the update succeeds.
#[test]
fn injector_with_everything_public_cannot_change_a_byte_or_fail_an_update() {
    let s = setup(64);
    let k = PairSecret::random("p");
    let (mut tx, mut rx) = ends(&s, Some(&k));
    let addr = rx.t.addr().unwrap().to_string();
    let (to_rx, to_tx) = (peers_of(&rx), peers_of(&tx));
    let cancel = AtomicBool::new(false);
    let forged = hello(&tx.plan, 0);
    let inject = |attempt_frames: bool| {
        let mut c = TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(&forged).unwrap();
        let mut nonce = [0u8; 32];
        let _ = c.read_exact(&mut nonce);
        let _ = c.write_all(&[0u8; 32]); // a proof it cannot compute
        if attempt_frames {
            // frames of version 1, as if accepted: zeros for every byte
            let mut f = vec![0u8; 40];
            f[0..4].copy_from_slice(b"AWXB");
            f[8..16].copy_from_slice(&1u64.to_le_bytes());
            let _ = c.write_all(&f);
            let _ = c.write_all(&vec![0u8; 1 << 20]);
        }
        let mut b = [0u8; 1];
        // refused: the receiver closes the connection without a proof of its own
        matches!(c.read(&mut b), Ok(0) | Err(_))
    };
    // a stalled connection (a hello never sent) must not hold up anyone
    let _stalled = TcpStream::connect(&addr).unwrap();
    assert!(inject(false), "a forged hello is refused");
    for version in 1..=2u64 {
        fill_or_check(&tx.layout, &s.cat, &tx.tensors, version, false).unwrap();
        std::thread::scope(|sc| {
            let a = sc.spawn(|| {
                tx.t.execute(&ctx(version, Duration::from_secs(20), &cancel, &to_rx))
            });
            let i = sc.spawn(|| inject(true));
            let b = sc.spawn(|| {
                rx.t.execute(&ctx(version, Duration::from_secs(20), &cancel, &to_tx))
            });
            a.join().unwrap().unwrap();
            b.join().unwrap().unwrap();
            assert!(i.join().unwrap(), "the injector was refused");
        });
        fill_or_check(&rx.layout, &s.cat, &rx.tensors, version, true)
            .unwrap_or_else(|e| panic!("version {version}: {e}"));
    }
    // a connection with another pair's secret is refused too, the live stream kept
    let other = PairSecret::random("p");
    let (mut tx2, _rx2) = ends(&s, Some(&other));
    let e = tx2
        .t
        .execute(&ctx(3, Duration::from_secs(5), &cancel, &to_rx))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("closed the connection") || e.contains("failed"),
        "{e}"
    );
    fill_or_check(&tx.layout, &s.cat, &tx.tensors, 3, false).unwrap();
    std::thread::scope(|sc| {
        let a = sc.spawn(|| {
            tx.t.execute(&ctx(3, Duration::from_secs(20), &cancel, &to_rx))
        });
        let b = sc.spawn(|| {
            rx.t.execute(&ctx(3, Duration::from_secs(20), &cancel, &to_tx))
        });
        a.join().unwrap().unwrap();
        b.join().unwrap().unwrap();
    });
    fill_or_check(&rx.layout, &s.cat, &rx.tensors, 3, true).unwrap();
    assert!(rx.t.refused() >= 4, "refused {}", rx.t.refused());
}

/// An inference rank whose training rank never connected says the connections it refused
/// meanwhile, so that a job that keeps no rank logs still learns why from the failure (here a
/// training rank holding another pair's secret).
#[test]
fn an_inference_rank_that_waited_in_vain_says_the_connection_it_refused() {
    let s = setup(64);
    let (_, mut rx) = ends(&s, Some(&PairSecret::random("p")));
    let (mut tx, _) = ends(&s, Some(&PairSecret::random("p")));
    let (to_rx, to_tx) = (peers_of(&rx), peers_of(&tx));
    let (cancel_tx, cancel_rx) = (AtomicBool::new(false), AtomicBool::new(false));
    let (sent, received) = std::thread::scope(|sc| {
        let b = sc.spawn(|| {
            rx.t.execute(&ctx(1, Duration::from_secs(600), &cancel_rx, &to_tx))
        });
        let sent =
            tx.t.execute(&ctx(1, Duration::from_secs(600), &cancel_tx, &to_rx));
        // the training rank was refused: the inference rank's wait ends now (an abort)
        cancel_rx.store(true, Ordering::SeqCst);
        (sent, b.join().unwrap())
    });
    let sent = sent.unwrap_err().to_string();
    assert!(sent.contains("closed the connection"), "{sent}");
    let received = received.unwrap_err().to_string();
    assert!(
        received.starts_with("transport: training rank 0/0 never connected (update 1 was aborted)"),
        "{received}"
    );
    assert!(
        received.contains("; this rank has refused 1 connection, from 127.0.0.1:")
            && received
                .ends_with("it claims to be training rank 0/0 but does not hold pair `p`'s secret"),
        "{received}"
    );
    assert_eq!(rx.t.refused(), 1);
}

/// Without the pair secret a training rank does not even try.
#[test]
fn no_secret_no_connection() {
    let s = setup(64);
    let (mut tx, rx) = ends(&s, None);
    let peers = peers_of(&rx);
    let cancel = AtomicBool::new(false);
    let e =
        tx.t.execute(&ctx(1, Duration::from_secs(5), &cancel, &peers))
            .unwrap_err()
            .to_string();
    assert!(e.contains("no pair secret"), "{e}");
}
