//! A pair's long-polls are bounded (4 per rank + 16 by default): requests that would wait beyond
//! the bound get 503 at once with a body that says so, requests that do not wait need no
//! permit, permits come back when their clients go away, and the pair's ranks still commit.

mod gateway_common;

use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::{PairState, UpdateState};
use gateway_common::{always_ok, connect_request, logs, spawn_ranks, start};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn send(addr: &str, path: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    s
}

/// What has arrived on `s` within `wait` (empty when nothing did).
async fn answer(s: &mut TcpStream, wait: Duration) -> String {
    let mut buf = vec![0u8; 4096];
    match tokio::time::timeout(wait, s.read(&mut buf)).await {
        Ok(Ok(n)) => String::from_utf8_lossy(&buf[..n]).into_owned(),
        _ => String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_polls_beyond_the_pairs_bound_get_503_and_its_ranks_still_commit() {
    let base = start(GatewayConfig::default()).await;
    let addr = base.trim_start_matches("http://").to_string();
    let client = Client::new(&base, None).unwrap();
    client
        .connect(&connect_request("lp", 1, 1, 1))
        .await
        .unwrap();
    let ranks = spawn_ranks(&client, "lp", 1, 1, 1, |_, _| always_ok(100, 7));
    let t0 = Instant::now();
    let last = loop {
        let st = client.status("lp").await.unwrap();
        if st.state == PairState::Ready {
            break st.last_event_seq;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{st:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // the bound of a pair of 2 ranks: 4 x 2 + 16 = 24, of which the ranks' event polls hold up
    // to 2; 40 more long-polls that wait for events that never come
    let poll = format!("/v1/pairs/lp/events?after={last}&timeout_ms=30000");
    let mut flood = Vec::new();
    for _ in 0..40 {
        flood.push(send(&addr, &poll).await);
    }
    let mut refused = 0;
    for s in flood.iter_mut() {
        let a = answer(s, Duration::from_millis(20)).await;
        if a.is_empty() {
            continue; // waiting: it holds a permit
        }
        assert!(a.starts_with("HTTP/1.1 503"), "{a}");
        assert!(a.to_lowercase().contains("retry-after: 1"), "{a}");
        assert!(
            a.contains("pair `lp` has 24 long-polls open, its bound (24); retry shortly"),
            "{a}"
        );
        refused += 1;
    }
    assert!((16..=18).contains(&refused), "{refused} of 40 refused");
    // every kind of long-poll is bounded: a kv read and an update status that would wait
    for path in [
        "/v1/pairs/lp/kv/nothing?timeout_ms=5000",
        "/v1/pairs/lp/updates/1?timeout_ms=5000",
    ] {
        let mut s = send(&addr, path).await;
        let a = answer(&mut s, Duration::from_secs(2)).await;
        assert!(a.starts_with("HTTP/1.1 503"), "{path}: {a}");
    }
    // a request that does not wait needs no permit
    let mut s = send(&addr, "/v1/pairs/lp/kv/nothing").await;
    let a = answer(&mut s, Duration::from_secs(2)).await;
    assert!(a.starts_with("HTTP/1.1 404"), "{a}");
    // the flood goes away: its permits come back at once
    drop(flood);
    let t0 = Instant::now();
    loop {
        let mut s = send(&addr, "/v1/pairs/lp/kv/nothing?timeout_ms=50").await;
        let a = answer(&mut s, Duration::from_secs(2)).await;
        if a.starts_with("HTTP/1.1 404") {
            break;
        }
        assert!(a.starts_with("HTTP/1.1 503"), "{a}");
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "the flood's permits were not released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // and the ranks, which kept their polls, commit an update
    client.start_update("lp", 1).await.unwrap();
    let st = client
        .wait_update("lp", 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(st.state, UpdateState::Committed, "{st:?}");
    client.disconnect("lp").await.unwrap();
    for log in logs(ranks).await {
        assert!(log.contains(&"update 1/1".to_string()), "{log:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bound_is_configurable() {
    let base = start(GatewayConfig {
        max_long_polls_per_pair: Some(2),
        ..GatewayConfig::default()
    })
    .await;
    let addr = base.trim_start_matches("http://").to_string();
    let client = Client::new(&base, None).unwrap();
    client
        .connect(&connect_request("lp2", 1, 1, 1))
        .await
        .unwrap();
    let path = "/v1/pairs/lp2/kv/nothing?timeout_ms=5000";
    let mut held = [send(&addr, path).await, send(&addr, path).await];
    for s in held.iter_mut() {
        assert_eq!(answer(s, Duration::from_millis(100)).await, "");
    }
    let mut third = send(&addr, path).await;
    let a = answer(&mut third, Duration::from_secs(2)).await;
    assert!(
        a.contains("pair `lp2` has 2 long-polls open, its bound (2)"),
        "{a}"
    );
    // another pair has its own bound
    client
        .connect(&connect_request("lp3", 1, 1, 1))
        .await
        .unwrap();
    let mut other = send(&addr, "/v1/pairs/lp3/kv/nothing?timeout_ms=50").await;
    let a = answer(&mut other, Duration::from_secs(2)).await;
    assert!(a.starts_with("HTTP/1.1 404"), "{a}");
}
