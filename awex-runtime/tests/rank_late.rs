//! A rank that takes an attempt late (its process was stopped, then resumed) against a gateway
//! in process, over tcp: the attempt it missed is over (failed at its deadline, retried), so
//! running it fails at once, touches no stream of the retry, and the rank takes the retry,
//! which commits. Every wait is bounded.

#[path = "shared/ranks.rs"]
mod ranks;

use awex_control::client::Client;
use awex_control::wire::{PairOptions, RankReportState, UpdateState};
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use awex_runtime::rank::{Rank, RankConfig};
use ranks::{LIMIT, gateway, next};
use std::time::Duration;

const PAIR: &str = "late";

fn cfg(gw: &str, side: Side, rank: RankId) -> RankConfig {
    let mut c = ranks::cfg(gw, PAIR, side, rank, Transport::Tcp, "sglang:tp=1");
    c.deltas = false;
    c
}

async fn join(c: RankConfig) -> Rank {
    ranks::join(c).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rank_that_takes_a_failed_attempt_late_abandons_it_and_takes_the_retry() {
    let gw = gateway().await;
    let client = Client::new(&gw, None).unwrap();
    // short enough for attempt 1 to fail soon; a loaded machine moves qwen3-tiny far faster
    let options = PairOptions {
        bucket_mib: 1,
        update_deadline_ms: 3_000,
        ..PairOptions::default()
    };
    ranks::connect(&client, PAIR, Transport::Tcp, "sglang:tp=1", options).await;
    let (mut trainer, mut reader) = tokio::join!(
        join(cfg(&gw, Side::Training, RankId::train(0))),
        join(cfg(&gw, Side::Inference, RankId::infer(0, 0))),
    );

    // attempt 1: the reader takes the work, then stops (as a SIGSTOPped process would) until
    // the gateway failed that attempt at its deadline
    client.start_update(PAIR, 1).await.unwrap();
    let w1 = next(&mut reader).await;
    assert_eq!((w1.version, w1.attempt), (1, 1));
    let t1 = next(&mut trainer).await;
    assert_eq!(t1, w1);
    // the trainer's part: its bytes go into the silent reader's socket, or it waits for it
    // until the deadline; either way the attempt fails for want of the reader's report
    let _ = tokio::time::timeout(LIMIT, trainer.execute(t1, true))
        .await
        .unwrap();
    let st = client.wait_update(PAIR, 1, LIMIT).await.unwrap();
    assert_eq!((st.attempt, st.state), (1, UpdateState::Failed), "{st:?}");

    // the retry starts; the trainer runs it and connects for it first
    client.start_update(PAIR, 1).await.unwrap();
    let t2 = next(&mut trainer).await;
    assert_eq!((t2.version, t2.attempt), (1, 2));
    let sender = tokio::spawn(async move {
        let r = trainer.execute(t2, true).await;
        (trainer, r)
    });
    // (until the trainer reported its part, a few seconds at most: its connection for the
    // retry is then in the reader's hands, which the stale attempt must leave alone)
    for _ in 0..100 {
        let st = client.update_status(PAIR, 1).await.unwrap();
        let reported = st
            .ranks
            .iter()
            .any(|r| r.side == Side::Training && r.state != RankReportState::Waiting);
        if reported || st.state.is_final() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // resumed, the reader runs the attempt it had taken: that attempt is over (past the
    // deadline the gateway set for it, and retried), so it fails at once
    let stale = tokio::time::timeout(LIMIT, reader.execute(w1, true))
        .await
        .expect("the stale attempt ran on");
    let e = stale.expect_err("a part of an attempt that was over succeeded");
    let e = e.to_string();
    assert!(
        ["missed its deadline", "already over", "was aborted"]
            .iter()
            .any(|m| e.contains(m)),
        "{e}"
    );
    // and it takes the retry, which commits with every byte
    let w2 = next(&mut reader).await;
    assert_eq!(w2, t2);
    let got = tokio::time::timeout(LIMIT, reader.execute(w2, true))
        .await
        .unwrap()
        .unwrap();
    let (_trainer, sent) = tokio::time::timeout(LIMIT, sender).await.unwrap().unwrap();
    let sent = sent.unwrap();
    assert_eq!(got.bytes, sent.bytes);
    assert!(got.bytes > 0);
    let st = client.wait_update(PAIR, 1, LIMIT).await.unwrap();
    assert_eq!(
        (st.attempt, st.state),
        (2, UpdateState::Committed),
        "{st:?}"
    );
}
