//! Engines left out of a version, against a gateway in this process, over shm (the sender waits
//! for its receivers) and tcp:
//! - an engine removed right after an update started: the training rank may read the `update`
//!   event and the `left_out` event that follows it in one poll, and must not wait for the
//!   removed engine's ranks all the same; the version commits on the other engine at once;
//! - an engine whose rank is stopped (alive, silent) while a pair that may leave engines out
//!   updates: the training rank stops waiting for it shortly before the deadline and names it
//!   unreached, so the version commits on the other engine instead of failing.
//!
//! Every wait is bounded.

#[path = "shared/ranks.rs"]
mod ranks;

use awex_control::client::Client;
use awex_control::wire::{CommitPolicy, PairOptions, UpdateState};
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use awex_runtime::rank::Rank;
use ranks::{LIMIT, cfg, gateway, join, next};
use std::time::{Duration, Instant};

/// A pair of qwen3-tiny into two SGLang engines over `transport` committing with `commit`, its
/// training rank and the ranks of engines 0 and 1.
async fn two_engines(
    transport: Transport,
    name: &str,
    commit: CommitPolicy,
    deadline_ms: u64,
) -> (Client, String, Rank, Rank, Rank) {
    let gw = gateway().await;
    let client = Client::new(&gw, None).unwrap();
    let pair = format!("{name}-{}", transport.as_str());
    let infer = "sglang:tp=1,engines=2";
    let options = PairOptions {
        bucket_mib: 1,
        commit,
        update_deadline_ms: deadline_ms,
        ..PairOptions::default()
    };
    ranks::connect(&client, &pair, transport, infer, options).await;
    let uid = client.status(&pair).await.unwrap().uid;
    let rank = |side, id| {
        let mut c = cfg(&gw, &pair, side, id, transport, infer);
        c.uid = uid.clone();
        c
    };
    let (trainer, reader0, reader1) = tokio::join!(
        join(rank(Side::Training, RankId::train(0))),
        join(rank(Side::Inference, RankId::infer(0, 0))),
        join(rank(Side::Inference, RankId::infer(1, 0))),
    );
    (
        client,
        pair,
        trainer.unwrap(),
        reader0.unwrap(),
        reader1.unwrap(),
    )
}

async fn removed_after_start_commits_on_the_other_engine(transport: Transport) {
    // a deadline a loaded machine never needs for qwen3-tiny: the version fails at it only if
    // the trainer waits for the removed engine
    let (client, pair, mut trainer, mut reader0, mut reader1) =
        two_engines(transport, "removed", CommitPolicy::Quorum(1), 30_000).await;

    // the update starts and engine 1 is removed before any rank polls: the trainer reads the
    // `update`, `left_out` and `engine_removed` events together
    client.start_update(&pair, 1).await.unwrap();
    client.remove_engine(&pair, 1).await.unwrap();
    let work = next(&mut trainer).await;
    assert_eq!((work.version, work.attempt), (1, 1));
    let sender = tokio::spawn(async move { trainer.execute(work, true).await });
    let got = next(&mut reader0).await;
    assert_eq!(got, work);
    let received = tokio::time::timeout(LIMIT, reader0.execute(got, true))
        .await
        .unwrap()
        .unwrap();
    // the removed engine's rank is told it is out, and takes nothing
    let none = tokio::time::timeout(LIMIT, reader1.next_live_work())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(none, None);
    assert!(reader1.engine_removed());

    let sent = tokio::time::timeout(LIMIT, sender)
        .await
        .expect("the trainer waited for the removed engine")
        .unwrap()
        .unwrap();
    // (the receiver checked every bucket's digest; the sender's figures count both engines)
    assert!(received.bytes > 0 && sent.bytes >= received.bytes);
    let st = client.wait_update(&pair, 1, LIMIT).await.unwrap();
    assert_eq!(
        (st.attempt, st.state),
        (1, UpdateState::Committed),
        "{st:?}"
    );
    assert_eq!(
        st.left_out.iter().map(|l| l.engine).collect::<Vec<_>>(),
        vec![1],
        "{st:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_engine_removed_right_after_the_start_is_not_waited_for_over_shm() {
    removed_after_start_commits_on_the_other_engine(Transport::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_engine_removed_right_after_the_start_is_not_waited_for_over_tcp() {
    removed_after_start_commits_on_the_other_engine(Transport::Tcp).await;
}

async fn a_stopped_engine_is_left_out_near_the_deadline(transport: Transport) {
    // long enough for a loaded machine to move qwen3-tiny many times over
    let deadline = Duration::from_secs(10);
    let (client, pair, mut trainer, mut reader0, mut stopped) = two_engines(
        transport,
        "stopped",
        CommitPolicy::Available,
        deadline.as_millis() as u64,
    )
    .await;
    let t0 = Instant::now();
    client.start_update(&pair, 1).await.unwrap();
    let work = next(&mut trainer).await;
    let sender = tokio::spawn(async move {
        let r = trainer.execute(work, true).await;
        (trainer, r)
    });
    let got = next(&mut reader0).await;
    let received = tokio::time::timeout(LIMIT, reader0.execute(got, true))
        .await
        .unwrap()
        .unwrap();
    // engine 1's rank does not take the work (as a stopped process would not); the trainer's
    // part succeeds all the same, before the deadline
    let (mut trainer, sent) = tokio::time::timeout(LIMIT, sender).await.unwrap().unwrap();
    let sent = sent.expect("the trainer waited for the stopped engine until the deadline");
    assert!(received.bytes > 0 && sent.bytes >= received.bytes);
    let st = client.wait_update(&pair, 1, LIMIT).await.unwrap();
    assert_eq!(
        (st.attempt, st.state),
        (1, UpdateState::Committed),
        "{st:?}"
    );
    assert_eq!(
        st.left_out.iter().map(|l| l.engine).collect::<Vec<_>>(),
        vec![1],
        "{st:?}"
    );
    // (at the cut-off or, where its bytes fit in the socket's buffers, at the deadline)
    assert!(t0.elapsed() >= deadline / 2, "{:?}", t0.elapsed());

    // resumed, engine 1's rank skips the version it missed and takes the next one with the
    // other engine: every byte reaches both, the one behind getting them all
    client.start_update(&pair, 2).await.unwrap();
    let work = next(&mut trainer).await;
    assert_eq!(work.version, 2);
    let sender = tokio::spawn(async move { trainer.execute(work, true).await });
    for reader in [&mut reader0, &mut stopped] {
        let got = next(reader).await;
        assert_eq!(got, work);
    }
    let (a, b) = tokio::time::timeout(LIMIT, async {
        tokio::join!(reader0.execute(work, true), stopped.execute(work, true))
    })
    .await
    .unwrap();
    assert!(a.unwrap().bytes > 0 && b.unwrap().bytes > 0);
    tokio::time::timeout(LIMIT, sender)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let st = client.wait_update(&pair, 2, LIMIT).await.unwrap();
    assert_eq!(
        (st.attempt, st.state),
        (1, UpdateState::Committed),
        "{st:?}"
    );
    assert!(st.left_out.is_empty(), "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_engine_is_left_out_near_the_deadline_over_shm() {
    a_stopped_engine_is_left_out_near_the_deadline(Transport::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_engine_is_left_out_near_the_deadline_over_tcp() {
    a_stopped_engine_is_left_out_near_the_deadline(Transport::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_removed_engines_rank_stops_waiting_for_the_outcome_of_the_version_it_took_part_in() {
    let (client, pair, mut trainer, mut reader0, mut reader1) =
        two_engines(Transport::Tcp, "outcome", CommitPolicy::Quorum(1), 60_000).await;
    client.start_update(&pair, 1).await.unwrap();
    let work = next(&mut trainer).await;
    let sender = tokio::spawn(async move { trainer.execute(work, true).await });
    // engine 1's rank does its part and waits for the outcome; engine 0's rank holds the
    // version in flight (it has not taken its part yet); engine 1 is removed meanwhile
    assert_eq!(next(&mut reader1).await, work);
    let part = tokio::time::timeout(LIMIT, reader1.execute(work, true))
        .await
        .unwrap()
        .unwrap();
    client.remove_engine(&pair, 1).await.unwrap();
    let outcome = tokio::time::timeout(LIMIT, reader1.outcome(work, part, LIMIT))
        .await
        .unwrap();
    match &outcome {
        awex_runtime::rank::Outcome::Failed { reason, .. } => {
            let r = reason.to_string();
            assert!(
                r.contains("engine 1 was left out of it") && r.contains("removed"),
                "{r}"
            );
        }
        other => panic!("{other:?}"),
    }
    // it did not wait for the version to end: that is still running, held by engine 0
    let st = client.update_status(&pair, 1).await.unwrap();
    assert_eq!(st.state, UpdateState::Running, "{st:?}");
    assert_eq!(next(&mut reader0).await, work);
    tokio::time::timeout(LIMIT, reader0.execute(work, true))
        .await
        .unwrap()
        .unwrap();
    tokio::time::timeout(LIMIT, sender)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let st = client.wait_update(&pair, 1, LIMIT).await.unwrap();
    assert_eq!(st.state, UpdateState::Committed, "{st:?}");
    // and the removed engine's rank is told it is out
    let none = tokio::time::timeout(LIMIT, reader1.next_live_work())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(none, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_atomic_engine_left_out_after_its_rank_received_leaves_its_live_tensors_alone() {
    use awex_control::wire::{ApplyMode, RankReportState, Report};
    let gw = gateway().await;
    let client = Client::new(&gw, None).unwrap();
    let (pair, transport) = ("atomic-out".to_string(), Transport::Shm);
    let infer = "sglang:tp=2,engines=2";
    let options = PairOptions {
        bucket_mib: 1,
        commit: CommitPolicy::Available,
        apply: ApplyMode::Atomic,
        update_deadline_ms: 60_000,
        ..PairOptions::default()
    };
    ranks::connect(&client, &pair, transport, infer, options).await;
    let uid = client.status(&pair).await.unwrap().uid;
    let rank = |side, id| {
        let mut c = cfg(&gw, &pair, side, id, transport, infer);
        c.uid = uid.clone();
        c.apply = ApplyMode::Atomic;
        c
    };
    let (trainer, r00, r01, r10, r11) = tokio::join!(
        join(rank(Side::Training, RankId::train(0))),
        join(rank(Side::Inference, RankId::infer(0, 0))),
        join(rank(Side::Inference, RankId::infer(0, 1))),
        join(rank(Side::Inference, RankId::infer(1, 0))),
        join(rank(Side::Inference, RankId::infer(1, 1))),
    );
    let (mut trainer, r00, r01, mut r10, r11) = (
        trainer.unwrap(),
        r00.unwrap(),
        r01.unwrap(),
        r10.unwrap(),
        r11.unwrap(),
    );
    client.start_update(&pair, 1).await.unwrap();
    let work = next(&mut trainer).await;
    let sender = tokio::spawn(async move { trainer.execute(work, true).await });
    let mut receivers = Vec::new();
    for mut r in [r00, r01] {
        let w = next(&mut r).await;
        receivers.push(tokio::spawn(async move { r.execute(w, true).await }));
    }
    let w = next(&mut r10).await;
    let left = tokio::spawn(async move { r10.execute(w, true).await });
    // rank 1/0 received its part into staging; then its engine's other rank fails: engine 1 is
    // left out before `apply` went out to the engines still in
    let end = Instant::now() + LIMIT;
    loop {
        let st = client.update_status(&pair, 1).await.unwrap();
        let reported = st.ranks.iter().any(|r| {
            r.side == Side::Inference
                && r.rank == RankId::infer(1, 0)
                && r.state != RankReportState::Waiting
        });
        if reported {
            break;
        }
        assert!(
            Instant::now() < end,
            "rank 1/0 did not report receiving: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client
        .report(
            &pair,
            1,
            &Report {
                side: Side::Inference,
                rank: RankId::infer(1, 1),
                ok: false,
                bytes: 0,
                checksum: None,
                error: Some("planted: this rank lost its part".into()),
                attempt: Some(1),
                incarnation: Some(r11.incarnation().to_string()),
                delta: None,
                unreached: Vec::new(),
            },
        )
        .await
        .unwrap();
    // the left-out engine's rank does not apply: it stops with an error instead of copying
    // staging into its live tensors and reporting them applied
    let skipped = tokio::time::timeout(LIMIT, left).await.unwrap().unwrap();
    // (a rank that applied would have reported it, or failed reporting it once the version
    // committed on engine 0: only the wait for `apply` ends with the version aborted)
    assert!(
        matches!(skipped, Err(awex_runtime::RuntimeError::Aborted(1))),
        "rank 1/0 did not stop at its engine's left-out notice: {skipped:?}"
    );
    for r in receivers {
        tokio::time::timeout(LIMIT, r)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    tokio::time::timeout(LIMIT, sender)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let st = client.wait_update(&pair, 1, LIMIT).await.unwrap();
    assert_eq!(
        (st.attempt, st.state),
        (1, UpdateState::Committed),
        "{st:?}"
    );
    assert_eq!(
        st.left_out.iter().map(|l| l.engine).collect::<Vec<_>>(),
        vec![1],
        "{st:?}"
    );
    let engines = client.status(&pair).await.unwrap().engines;
    // left out before anything reached its live tensors: behind, not torn
    assert_eq!(engines[1].torn_version, None, "{engines:?}");
    assert_eq!(engines[1].serving_version, None, "{engines:?}");
}
