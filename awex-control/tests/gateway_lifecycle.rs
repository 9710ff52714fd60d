//! Lifecycle tests over a real loopback listener: the typed client, simulated ranks as tokio
//! tasks (succeeding, failing, silent), checksums, retries, SGLang engine stand-ins, disconnect.

mod gateway_common;

use awex_control::client::{Client, ClientError};
use awex_control::server::GatewayConfig;
use awex_control::wire::{EventKind, JoinRequest, RankReportState, Report, UpdateState};
use awex_core::{RankId, Side};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use gateway_common::{conforms, connect_request, start};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a simulated rank does when told to run an update.
#[derive(Clone, Debug)]
enum Act {
    Ok { bytes: u64, checksum: u64 },
    Fail(&'static str),
    Silent,
}

type Behaviour = Arc<dyn Fn(u64, u32) -> Act + Send + Sync>;

fn always_ok(bytes: u64, checksum: u64) -> Behaviour {
    Arc::new(move |_, _| Act::Ok { bytes, checksum })
}

/// A rank: joins, then follows the event stream until `disconnect`; returns what it saw.
async fn rank(
    client: Client,
    pair: String,
    side: Side,
    rank: RankId,
    act: Behaviour,
) -> Result<Vec<String>, ClientError> {
    let info =
        json!({ "host": "127.0.0.1", "port": 20000 + rank.engine * 100 + rank.rank, "side": side });
    let roster = client
        .join(&pair, &JoinRequest { side, rank, info })
        .await?;
    let mut log = vec![format!("joined {}", roster.roster.len())];
    let mut after = roster.last_event_seq;
    loop {
        let batch = client.events(&pair, after, Duration::from_secs(5)).await?;
        for e in batch.events {
            after = e.seq;
            let (v, a) = (e.version.unwrap_or(0), e.attempt.unwrap_or(0));
            match e.kind {
                EventKind::Update => {
                    log.push(format!("update {v}/{a}"));
                    let report = match act(v, a) {
                        Act::Ok { bytes, checksum } => Some(Report {
                            side,
                            rank,
                            ok: true,
                            bytes,
                            checksum: Some(checksum),
                            error: None,
                            attempt: Some(a),
                        }),
                        Act::Fail(why) => Some(Report {
                            side,
                            rank,
                            ok: false,
                            bytes: 0,
                            checksum: None,
                            error: Some(why.into()),
                            attempt: Some(a),
                        }),
                        Act::Silent => None,
                    };
                    if let Some(r) = report {
                        match client.report(&pair, v, &r).await {
                            // The attempt already failed (another rank was faster): its abort follows.
                            Err(e) if e.status() == Some(409) => {}
                            other => {
                                other?;
                            }
                        }
                    }
                }
                EventKind::Abort => log.push(format!("abort {v}/{a}")),
                EventKind::Disconnect => {
                    log.push("disconnect".into());
                    return Ok(log);
                }
            }
        }
    }
}

type Ranks = Vec<tokio::task::JoinHandle<Result<Vec<String>, ClientError>>>;

/// Spawns every rank of a pair with `train` training ranks and `engines` x `per` inference ranks.
fn spawn_ranks(
    client: &Client,
    pair: &str,
    train: u32,
    engines: u32,
    per: u32,
    act: impl Fn(Side, RankId) -> Behaviour,
) -> Ranks {
    let mut handles = Vec::new();
    for r in 0..train {
        let id = RankId::train(r);
        handles.push(tokio::spawn(rank(
            client.clone(),
            pair.into(),
            Side::Training,
            id,
            act(Side::Training, id),
        )));
    }
    for e in 0..engines {
        for r in 0..per {
            let id = RankId::infer(e, r);
            handles.push(tokio::spawn(rank(
                client.clone(),
                pair.into(),
                Side::Inference,
                id,
                act(Side::Inference, id),
            )));
        }
    }
    handles
}

async fn logs(handles: Ranks) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("rank task").expect("rank ran"));
    }
    out
}

async fn raw(base: &str, path: &str) -> Value {
    reqwest::get(format!("{base}{path}"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_commit_when_every_rank_succeeds_and_disconnect_reaches_every_rank() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("lc", 2, 2, 2);
    req.options.checksums = true;
    let status = client.connect(&req).await.unwrap();
    assert_eq!((status.world_size, status.joined), (6, 0));
    // Training rank 0 posts the rendezvous value; every rank can read it.
    client
        .put_kv("lc", "nccl-unique-id", json!("0a0b0c"))
        .await
        .unwrap();
    // Each training rank sends 300 bytes (checksum 7), each inference rank receives 150 (checksum 3.5 -> 3 and 4).
    let ranks = spawn_ranks(&client, "lc", 2, 2, 2, |side, r| match side {
        Side::Training => always_ok(300, 7),
        Side::Inference => always_ok(150, if r.rank == 0 { 3 } else { 4 }),
    });
    let kv = client
        .get_kv("lc", "nccl-unique-id", Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!((kv.value, kv.revision), (json!("0a0b0c"), 1));
    for version in [1, 2] {
        // The first start may race the last joins: wait until ready.
        let started = loop {
            match client.start_update("lc", version).await {
                Err(e) if e.status() == Some(409) && e.to_string().contains("still joining") => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                other => break other.unwrap(),
            }
        };
        assert_eq!(
            (started.version, started.attempt, started.state),
            (version, 1, UpdateState::Running)
        );
        let done = client
            .wait_update("lc", version, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(done.state, UpdateState::Committed, "{done:?}");
        assert_eq!((done.bytes.training, done.bytes.inference), (600, 600));
        let sums = done.checksums.unwrap();
        assert_eq!((sums.training, sums.inference), (14, 14));
        assert_eq!(done.succeeded, 6);
        assert!(
            done.ranks.is_empty(),
            "wait_update lists only problem ranks"
        );
    }
    let full = client.update_status("lc", 2).await.unwrap();
    assert_eq!(full.ranks.len(), 6);
    assert!(full.ranks.iter().all(|r| r.state == RankReportState::Ok));
    let status = client.status("lc").await.unwrap();
    assert_eq!(status.serving_version, Some(2));
    assert_eq!(status.joined, 6);
    assert_eq!(status.roster.len(), 6);
    // Every answer conforms to its schema in the OpenAPI document.
    conforms("PairStatus", &raw(&base, "/v1/pairs/lc/status").await).unwrap();
    conforms("UpdateStatus", &raw(&base, "/v1/pairs/lc/updates/2").await).unwrap();
    conforms(
        "EventsResponse",
        &raw(&base, "/v1/pairs/lc/events?after=0&timeout_ms=0").await,
    )
    .unwrap();
    let join_raw: Value = reqwest::Client::new()
        .post(format!("{base}/v1/pairs/lc/ranks"))
        .json(&json!({"side": "training", "rank": {"engine": 0, "rank": 0}, "info": {"restarted": true}}))
        .send().await.unwrap().json().await.unwrap();
    conforms("JoinResponse", &join_raw).unwrap();
    assert_eq!(
        join_raw["roster"][0]["info"],
        json!({"restarted": true}),
        "a re-join replaces the rank's entry"
    );
    assert_eq!(join_raw["roster"].as_array().unwrap().len(), 6);
    assert_eq!(join_raw["kv"], json!({"nccl-unique-id": "0a0b0c"}));
    assert_eq!(
        join_raw["last_event_seq"], 2,
        "a restarted rank starts after the events it missed"
    );
    client.disconnect("lc").await.unwrap();
    for log in logs(ranks).await {
        assert_eq!(
            log,
            vec!["joined 6", "update 1/1", "update 2/1", "disconnect"]
        );
    }
    let metrics = client.metrics().await.unwrap();
    for line in [
        "awex_gateway_updates_total{outcome=\"committed\"} 2",
        "awex_gateway_update_bytes_total{side=\"training\"} 1200",
        "awex_gateway_pairs{state=\"disconnected\"} 1",
        "awex_gateway_rank_joins_total 7",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "missing {line} in {metrics}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_rank_fails_the_version_which_can_then_be_retried() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    client
        .connect(&connect_request("f", 1, 1, 2))
        .await
        .unwrap();
    let ranks = spawn_ranks(&client, "f", 1, 1, 2, |side, r| {
        if side == Side::Inference && r.rank == 1 {
            Arc::new(|_, attempt| {
                if attempt == 1 {
                    Act::Fail("CUDA error: out of memory")
                } else {
                    Act::Ok {
                        bytes: 5,
                        checksum: 0,
                    }
                }
            })
        } else {
            always_ok(5, 0)
        }
    });
    let started = loop {
        match client.start_update("f", 1).await {
            Err(e) if e.status() == Some(409) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => break other.unwrap(),
        }
    };
    assert_eq!(started.attempt, 1);
    let failed = client
        .wait_update("f", 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(failed.state, UpdateState::Failed);
    assert_eq!(
        failed.error.as_deref(),
        Some(
            "version 1 attempt 1 failed: inference rank 0/1 reported failure: CUDA error: out of memory"
        )
    );
    let bad: Vec<_> = failed
        .ranks
        .iter()
        .filter(|r| r.state == RankReportState::Failed)
        .collect();
    assert_eq!(bad.len(), 1);
    assert_eq!(
        (bad[0].side, bad[0].rank),
        (Side::Inference, RankId::infer(0, 1))
    );
    assert_eq!(client.status("f").await.unwrap().serving_version, None);
    // Same version again: a new attempt.
    let retry = client.start_update("f", 1).await.unwrap();
    assert_eq!((retry.version, retry.attempt), (1, 2));
    let ok = client
        .wait_update("f", 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(ok.state, UpdateState::Committed);
    let again = client.start_update("f", 1).await.unwrap_err();
    assert_eq!(
        again.to_string(),
        "gateway answered 409: version 1 is stale: pair `f` already ran version 1 (committed); versions must increase, and only a failed version may be retried"
    );
    let stale = client.start_update("f", 0).await.unwrap_err();
    assert_eq!(stale.status(), Some(409));
    client.disconnect("f").await.unwrap();
    let logs = logs(ranks).await;
    assert_eq!(
        logs[0],
        vec![
            "joined 3",
            "update 1/1",
            "abort 1/1",
            "update 1/2",
            "disconnect"
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_never_reports_fails_the_version_at_the_deadline() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("s", 2, 1, 2);
    req.options.update_deadline_ms = 300;
    client.connect(&req).await.unwrap();
    let ranks = spawn_ranks(&client, "s", 2, 1, 2, |side, r| {
        if side == Side::Training && r.rank == 1 {
            Arc::new(|_, _| Act::Silent)
        } else {
            always_ok(1, 0)
        }
    });
    loop {
        match client.start_update("s", 7).await {
            Err(e) if e.status() == Some(409) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => break assert_eq!(other.unwrap().state, UpdateState::Running),
        }
    }
    // A second update while one runs is refused.
    let busy = client.start_update("s", 8).await.unwrap_err();
    assert_eq!(
        busy.to_string(),
        "gateway answered 409: version 7 of pair `s` is running; wait for it to commit or fail before starting version 8"
    );
    let failed = client
        .wait_update("s", 7, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(failed.state, UpdateState::Failed);
    assert_eq!(
        failed.error.as_deref(),
        Some(
            "version 7 attempt 1 failed: the deadline of 300 ms passed; 1 of 4 ranks did not report: training rank 1"
        )
    );
    assert!(failed.elapsed_ms >= 300, "{}", failed.elapsed_ms);
    assert_eq!(failed.ranks.len(), 1);
    assert_eq!(
        (failed.ranks[0].rank, failed.ranks[0].state),
        (RankId::train(1), RankReportState::Missing)
    );
    let late = Report {
        side: Side::Training,
        rank: RankId::train(1),
        ok: true,
        bytes: 1,
        checksum: None,
        error: None,
        attempt: Some(1),
    };
    let e = client.report("s", 7, &late).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "gateway answered 409: version 7 attempt 1 already failed; the report of training rank 1 came too late"
    );
    client.disconnect("s").await.unwrap();
    for log in logs(ranks).await {
        assert_eq!(
            log,
            vec!["joined 4", "update 7/1", "abort 7/1", "disconnect"]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disagreeing_checksums_fail_the_version_naming_both_sums() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("c", 1, 1, 1);
    req.options.checksums = true;
    client.connect(&req).await.unwrap();
    let ranks = spawn_ranks(&client, "c", 1, 1, 1, |side, _| match side {
        Side::Training => always_ok(8, 0xdead),
        Side::Inference => always_ok(8, 0xbeef),
    });
    loop {
        match client.start_update("c", 1).await {
            Err(e) if e.status() == Some(409) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => break drop(other.unwrap()),
        }
    }
    let failed = client
        .wait_update("c", 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        failed.error.as_deref(),
        Some(
            "version 1 attempt 1 failed: checksum mismatch: the training ranks' checksums sum to 0x000000000000dead, the inference ranks' to 0x000000000000beef"
        )
    );
    // A successful report without a checksum is refused while checksums are on.
    let e = client
        .report(
            "c",
            1,
            &Report {
                side: Side::Training,
                rank: RankId::train(0),
                ok: true,
                bytes: 0,
                checksum: None,
                error: None,
                attempt: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "gateway answered 422: pair `c` has checksums on: the successful report of training rank 0 needs `checksum`"
    );
    client.disconnect("c").await.unwrap();
    logs(ranks).await;
}

/// A stand-in for SGLang engines: records `(engine, endpoint)` for every call.
#[derive(Default)]
struct Engines {
    calls: Mutex<Vec<(usize, &'static str)>>,
    fail_pause: AtomicBool,
}

async fn engine_server(engines: Arc<Engines>, index: usize) -> String {
    async fn pause(State((e, i)): State<(Arc<Engines>, usize)>) -> StatusCode {
        e.calls.lock().unwrap().push((i, "pause_generation"));
        if e.fail_pause.load(Ordering::SeqCst) && i == 1 {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::OK
        }
    }
    async fn resume(State((e, i)): State<(Arc<Engines>, usize)>) -> StatusCode {
        e.calls.lock().unwrap().push((i, "continue_generation"));
        StatusCode::OK
    }
    let app = Router::new()
        .route("/pause_generation", post(pause))
        .route("/continue_generation", post(resume))
        .with_state((engines, index));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_are_paused_before_and_resumed_after_every_update_even_a_failed_one() {
    let engines = Arc::new(Engines::default());
    let urls = vec![
        engine_server(engines.clone(), 0).await,
        engine_server(engines.clone(), 1).await,
    ];
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("e", 1, 2, 1);
    req.inference.urls = urls;
    client.connect(&req).await.unwrap();
    let ranks = spawn_ranks(&client, "e", 1, 2, 1, |_, _| always_ok(1, 0));
    let first = loop {
        match client.start_update("e", 1).await {
            Err(e) if e.status() == Some(409) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => break other.unwrap(),
        }
    };
    assert_eq!(first.state, UpdateState::Pending);
    let done = client
        .wait_update("e", 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed);
    assert!(done.pause_ms.is_some());
    // Resume runs after the commit; wait for it to be recorded.
    for _ in 0..200 {
        if engines.calls.lock().unwrap().len() == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut calls = engines.calls.lock().unwrap().clone();
    calls.sort_by_key(|(i, e)| (*e == "continue_generation", *i));
    assert_eq!(
        calls,
        vec![
            (0, "pause_generation"),
            (1, "pause_generation"),
            (0, "continue_generation"),
            (1, "continue_generation")
        ]
    );
    // Engine 1 refuses to pause: the update fails without running and both engines are resumed.
    engines.calls.lock().unwrap().clear();
    engines.fail_pause.store(true, Ordering::SeqCst);
    client.start_update("e", 2).await.unwrap();
    let failed = client
        .wait_update("e", 2, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(failed.state, UpdateState::Failed);
    let error = failed.error.unwrap();
    assert!(error.starts_with("version 2 attempt 1 failed: pausing the inference engines failed: engine 1 POST http://127.0.0.1:"), "{error}");
    assert!(
        error.ends_with("/pause_generation answered 500 Internal Server Error"),
        "{error}"
    );
    for _ in 0..200 {
        if engines.calls.lock().unwrap().len() == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut calls = engines.calls.lock().unwrap().clone();
    calls.sort_by_key(|(i, e)| (*e == "continue_generation", *i));
    assert_eq!(
        calls,
        vec![
            (0, "pause_generation"),
            (1, "pause_generation"),
            (0, "continue_generation"),
            (1, "continue_generation")
        ]
    );
    assert_eq!(client.status("e").await.unwrap().serving_version, Some(1));
    client.disconnect("e").await.unwrap();
    for log in logs(ranks).await {
        assert_eq!(
            log,
            vec!["joined 3", "update 1/1", "disconnect"],
            "ranks never hear of a version whose pause failed"
        );
    }
}

/// A stand-in gateway that answers 503 to everything and counts requests.
async fn unavailable(counter: Arc<AtomicUsize>) -> String {
    async fn count(State(c): State<Arc<AtomicUsize>>) -> (StatusCode, &'static str) {
        c.fetch_add(1, Ordering::SeqCst);
        (StatusCode::SERVICE_UNAVAILABLE, "{\"error\": \"busy\"}")
    }
    let app = Router::new()
        .route("/v1/pairs/x/updates", post(count))
        .route("/v1/pairs/x/updates/{v}", get(count))
        .with_state(counter);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::test]
async fn client_retries_idempotent_reads_but_never_resends_a_started_update() {
    let counter = Arc::new(AtomicUsize::new(0));
    let client = Client::new(&unavailable(counter.clone()).await, None)
        .unwrap()
        .with_retries(2);
    let e = client.start_update("x", 1).await.unwrap_err();
    assert_eq!(e.to_string(), "gateway answered 503: busy");
    assert_eq!(counter.swap(0, Ordering::SeqCst), 1);
    let e = client.update_status("x", 1).await.unwrap_err();
    assert_eq!(e.status(), Some(503));
    assert_eq!(counter.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn client_reports_an_unreachable_gateway_as_a_connect_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let client = Client::new(&format!("http://{addr}"), None)
        .unwrap()
        .with_retries(1);
    let e = client.start_update("x", 1).await.unwrap_err();
    assert!(matches!(e, ClientError::Connect { .. }), "{e}");
    assert_eq!(e.status(), None);
}

#[tokio::test]
async fn client_carries_the_token_and_surfaces_401_and_403() {
    let base = start(GatewayConfig {
        token: Some("abc".into()),
        ..GatewayConfig::default()
    })
    .await;
    let e = Client::new(&base, None)
        .unwrap()
        .status("p")
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "gateway answered 401: missing bearer token: send `Authorization: Bearer <token>`"
    );
    let e = Client::new(&base, Some("abd".into()))
        .unwrap()
        .status("p")
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(403));
    let e = Client::new(&base, Some("abc".into()))
        .unwrap()
        .status("p")
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(404));
}

#[tokio::test]
async fn event_long_poll_returns_an_empty_list_when_nothing_happens() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    client
        .connect(&connect_request("q", 1, 1, 1))
        .await
        .unwrap();
    let t = std::time::Instant::now();
    let r = client
        .events("q", 0, Duration::from_millis(100))
        .await
        .unwrap();
    assert!(r.events.is_empty());
    assert_eq!(r.last_seq, 0);
    assert!(t.elapsed() >= Duration::from_millis(100));
    // A disconnect wakes a waiting poll at once.
    let waiter = {
        let c = client.clone();
        tokio::spawn(async move { c.events("q", 0, Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    client.disconnect("q").await.unwrap();
    let r = waiter.await.unwrap().unwrap();
    assert_eq!(r.events.len(), 1);
    assert_eq!(r.events[0].kind, EventKind::Disconnect);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_during_an_update_fails_it_and_resumes_the_engines() {
    let engines = Arc::new(Engines::default());
    let urls = vec![engine_server(engines.clone(), 0).await];
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("d", 1, 1, 1);
    req.inference.urls = urls;
    client.connect(&req).await.unwrap();
    let ranks = spawn_ranks(&client, "d", 1, 1, 1, |_, _| Arc::new(|_, _| Act::Silent));
    loop {
        match client.start_update("d", 3).await {
            Err(e) if e.status() == Some(409) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => break drop(other.unwrap()),
        }
    }
    // Wait until the engines are paused and the ranks were told.
    for _ in 0..200 {
        if client.update_status("d", 3).await.unwrap().state == UpdateState::Running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let gone = client.disconnect("d").await.unwrap();
    let u = gone.current_update.unwrap();
    assert_eq!(u.state, UpdateState::Failed);
    assert_eq!(
        u.error.as_deref(),
        Some("version 3 attempt 1 failed: the pair was disconnected")
    );
    for log in logs(ranks).await {
        assert_eq!(
            log,
            vec!["joined 2", "update 3/1", "abort 3/1", "disconnect"]
        );
    }
    for _ in 0..200 {
        if engines.calls.lock().unwrap().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        *engines.calls.lock().unwrap(),
        vec![(0, "pause_generation"), (0, "continue_generation")]
    );
    // The name is free again at once, for a new pair with a new id.
    let again = client
        .connect(&connect_request("d", 1, 1, 1))
        .await
        .unwrap();
    assert_ne!(again.id, gone.id);
}
