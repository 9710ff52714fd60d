//! A pair's long-polls are bounded (4 per rank + 16 by default): requests that would wait beyond
//! the bound get 503 at once with a body that says so, requests that do not wait need no
//! permit, permits come back when their clients go away, and the pair's ranks still commit.
//! Event polls of a rank's live holder (naming its claim id) have a pool of their own: a flood
//! of other requests does not cut the ranks off their work.

mod gateway_common;

use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::{EventKind, JoinRequest, PairState, Report, UpdateState};
use awex_core::{RankId, Side};
use gateway_common::{always_ok, connect_request, logs, spawn_ranks, start};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn send(addr: &str, path: &str) -> TcpStream {
    send_as(addr, path, None).await
}

/// [`send`] by a rank naming its claim id (the `awex-claim` header).
async fn send_as(addr: &str, path: &str, claim: Option<&str>) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let claim = claim.map_or(String::new(), |c| format!("awex-claim: {c}\r\n"));
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n{claim}\r\n").as_bytes())
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

/// What has arrived on each of `streams` once at least `at_least` of them answered (waiting up
/// to a minute for them: a loaded machine may answer late), plus whatever else arrived by one
/// more look at each; empty for those still waiting. Counts answers instead of timing them.
async fn answers(streams: &mut [TcpStream], at_least: usize) -> Vec<String> {
    let mut got = vec![String::new(); streams.len()];
    let t0 = Instant::now();
    loop {
        for (s, g) in streams.iter_mut().zip(got.iter_mut()) {
            if g.is_empty() {
                *g = answer(s, Duration::from_millis(10)).await;
            }
        }
        let n = got.iter().filter(|g| !g.is_empty()).count();
        if n >= at_least {
            return got;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{n} of {} answered, {at_least} expected",
            streams.len()
        );
    }
}

/// A gateway on a free port with pair `name` (1 x 1) connected: its address and a client.
async fn gateway_with_pair(name: &str) -> (String, Client) {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    client
        .connect(&connect_request(name, 1, 1, 1))
        .await
        .unwrap();
    (base.trim_start_matches("http://").to_string(), client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_polls_beyond_the_pairs_bound_get_503_and_its_ranks_still_commit() {
    let (addr, client) = gateway_with_pair("lp").await;
    let ranks = spawn_ranks(&client, "lp", 1, 1, 1, |_, _| always_ok(100, 7));
    let t0 = Instant::now();
    let last = loop {
        let st = client.status("lp").await.unwrap();
        if st.state == PairState::Ready {
            break st.last_event_seq;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "{st:?}");
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
    // at least 16 are refused (24 permits, at most 2 held by the ranks' own polls, which
    // take them from the rank's own pool once they hold their slot)
    for a in answers(&mut flood, 16).await {
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
            t0.elapsed() < Duration::from_secs(60),
            "the flood's permits were not released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // and the ranks, which kept their polls, commit an update
    client.start_update("lp", 1).await.unwrap();
    let st = client
        .wait_update("lp", 1, Duration::from_secs(120))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_other_long_polls_does_not_take_the_ranks_event_polls() {
    let (addr, client) = gateway_with_pair("fl").await;
    // both ranks claim their slots with a claim id, as awex's ranks do
    let (t, i) = (RankId::train(0), RankId::infer(0, 0));
    let join = |side, rank, claim: &'static str| {
        let c = client.clone();
        async move {
            c.join(
                "fl",
                &JoinRequest {
                    side,
                    rank,
                    info: json!({"incarnation": claim, "pid": std::process::id()}),
                    capabilities: vec![],
                },
            )
            .await
            .unwrap()
        }
    };
    let (joined, _) = tokio::join!(
        join(Side::Training, t, "c1aim0000000000t"),
        join(Side::Inference, i, "c1aim0000000000i")
    );
    let last = joined.last_event_seq;
    // 40 anonymous polls for events that never come fill the shared pool (bound 24)
    let poll = format!("/v1/pairs/fl/events?after={last}&timeout_ms=30000");
    let mut flood = Vec::new();
    for _ in 0..40 {
        flood.push(send(&addr, &poll).await);
    }
    let mut refused = 0;
    for a in answers(&mut flood, 16).await {
        if !a.is_empty() {
            assert!(
                a.contains("pair `fl` has 24 long-polls open, its bound (24)"),
                "{a}"
            );
            refused += 1;
        }
    }
    assert_eq!(refused, 16);
    // an anonymous poll is refused now, the ranks' own polls are not: they get their update
    let mut s = send(&addr, &poll).await;
    assert!(
        answer(&mut s, Duration::from_secs(2))
            .await
            .starts_with("HTTP/1.1 503")
    );
    let rank_poll = |claim: &'static str| {
        let c = client.clone();
        tokio::spawn(async move {
            c.events_as("fl", last, Duration::from_secs(10), Some(claim))
                .await
        })
    };
    let polls = [rank_poll("c1aim0000000000t"), rank_poll("c1aim0000000000i")];
    tokio::time::sleep(Duration::from_millis(100)).await;
    client.start_update("fl", 1).await.unwrap();
    for p in polls {
        let got = p
            .await
            .unwrap()
            .expect("a rank's event poll during the flood");
        assert!(
            got.events
                .iter()
                .any(|e| e.kind == EventKind::Update && e.version == Some(1)),
            "{got:?}"
        );
    }
    for (side, rank, claim) in [
        (Side::Training, t, "c1aim0000000000t"),
        (Side::Inference, i, "c1aim0000000000i"),
    ] {
        let r = Report {
            side,
            rank,
            ok: true,
            bytes: 100,
            checksum: Some(7),
            error: None,
            attempt: Some(1),
            incarnation: Some(claim.to_string()),
            delta: None,
            unreached: Vec::new(),
        };
        client.report("fl", 1, &r).await.unwrap();
    }
    let st = client.update_status("fl", 1).await.unwrap();
    assert_eq!(st.state, UpdateState::Committed, "{st:?}");
    // a rank's own pool is bounded too: 4 polls of one holder wait, the fifth is refused
    let after = client.status("fl").await.unwrap().last_event_seq;
    let own = format!("/v1/pairs/fl/events?after={after}&timeout_ms=30000");
    let mut mine = Vec::new();
    for _ in 0..5 {
        mine.push(send_as(&addr, &own, Some("c1aim0000000000i")).await);
    }
    let answers = answers(&mut mine, 1).await;
    let refused: Vec<&String> = answers.iter().filter(|a| !a.is_empty()).collect();
    assert_eq!(refused.len(), 1, "{answers:?}");
    assert!(
        refused[0]
            .contains("a rank of pair `fl` (slot 1) has 4 event polls open, its own bound (4)"),
        "{}",
        refused[0]
    );
    drop(flood);
    drop(mine);
}
