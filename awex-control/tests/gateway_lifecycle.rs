//! Lifecycle tests over a real loopback listener: the typed client, simulated ranks as tokio
//! tasks (succeeding, failing, silent), checksums, retries, SGLang engine stand-ins, disconnect.

mod endless_server;
mod gateway_common;

use awex_control::client::{Client, ClientError};
use awex_control::server::GatewayConfig;
use awex_control::wire::{
    CommitPolicy, EngineState, EventKind, RankReportState, Report, UpdateState,
};
use awex_core::{RankId, Side};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use gateway_common::{Act, Ranks, always_ok, conforms, connect_request, logs, spawn_ranks, start};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    // (revisions 1 and 2: the two sides' models, stored at connect)
    assert_eq!((kv.value, kv.revision), (json!("0a0b0c"), 3));
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
            .wait_update("lc", version, Duration::from_secs(120))
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
    let kv = join_raw["kv"].as_object().unwrap();
    let mut keys: Vec<&str> = kv.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["model.inference", "model.training", "nccl-unique-id"]
    );
    assert_eq!(kv["nccl-unique-id"], json!("0a0b0c"));
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
        .wait_update("f", 1, Duration::from_secs(120))
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
        .wait_update("f", 1, Duration::from_secs(120))
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
        .wait_update("s", 7, Duration::from_secs(120))
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
        incarnation: None,
        delta: None,
        unreached: Vec::new(),
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
        .wait_update("c", 1, Duration::from_secs(120))
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
                incarnation: None,
                delta: None,
                unreached: Vec::new(),
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
    /// `/continue_generation` answers only once this is false again.
    hold_resume: AtomicBool,
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
        while e.hold_resume.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        e.calls.lock().unwrap().push((i, "continue_generation"));
        StatusCode::OK
    }
    async fn info() -> axum::Json<serde_json::Value> {
        // SGLang's `/server_info` (resolved server arguments), a pre-0.5.21 server without
        // awex's loader: the gateway only pauses and resumes it
        axum::Json(
            serde_json::json!({"tp_size": 1, "dp_size": 1, "ep_size": 1, "version": "0.5.4"}),
        )
    }
    let app = Router::new()
        .route("/server_info", axum::routing::get(info))
        .route("/pause_generation", post(pause))
        .route("/continue_generation", post(resume))
        .with_state((engines, index));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// A controller's wait for an update answers once the engines were resumed after the commit,
/// so that the version is served when `update` returns; a status read in between says the
/// version committed and the engines are `resuming`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_an_update_answers_only_after_the_engines_were_resumed() {
    let engines = Arc::new(Engines::default());
    engines.hold_resume.store(true, Ordering::SeqCst);
    let urls = vec![
        engine_server(engines.clone(), 0).await,
        engine_server(engines.clone(), 1).await,
    ];
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("w", 1, 2, 1);
    req.inference.urls = urls;
    client.connect(&req).await.unwrap();
    let ranks = spawn_ranks(&client, "w", 1, 2, 1, |_, _| always_ok(1, 0));
    loop {
        match client.start_update("w", 1).await {
            Err(e) if e.status() == Some(409) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => {
                other.unwrap();
                break;
            }
        }
    }
    let waiter = {
        let (client, engines) = (client.clone(), engines.clone());
        tokio::spawn(async move {
            let st = client
                .wait_update("w", 1, Duration::from_secs(60))
                .await
                .unwrap();
            // what the engines had been told when the wait answered
            (st, engines.calls.lock().unwrap().clone())
        })
    };
    // the version commits while the engines' resume is held
    let held = loop {
        match client.wait_update("w", 1, Duration::ZERO).await {
            Ok(st) if st.state == UpdateState::Committed => break st,
            Ok(st) => panic!("version 1 ended {:?}: {:?}", st.state, st.error),
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    assert!(held.resuming, "{held:?}");
    assert!(!waiter.is_finished());
    engines.hold_resume.store(false, Ordering::SeqCst);
    let (st, calls) = waiter.await.unwrap();
    assert_eq!((st.state, st.resuming), (UpdateState::Committed, false));
    let resumed = calls
        .iter()
        .filter(|(_, e)| *e == "continue_generation")
        .count();
    assert_eq!(resumed, 2, "{calls:?}");
    client.disconnect("w").await.unwrap();
    logs(ranks).await;
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
        .wait_update("e", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed);
    assert!(done.pause_ms.is_some());
    // the wait answers once the engines were resumed after the commit
    assert!(!done.resuming);
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
        .wait_update("e", 2, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(failed.state, UpdateState::Failed);
    let error = failed.error.unwrap();
    assert!(error.starts_with("version 2 attempt 1 failed: pausing the inference engines failed: engine 1 POST http://127.0.0.1:"), "{error}");
    assert!(
        error.ends_with("/pause_generation answered 500 Internal Server Error"),
        "{error}"
    );
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
            vec!["joined 3", "update 1/1", "abort 2/1", "disconnect"],
            "ranks never run a version whose pause failed, and hear at once that it failed"
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

/// A stand-in of one SGLang 0.5.23 server for the gateway's side of the update session. Each
/// behaviour copies SGLang's `python/sglang/srt/entrypoints/http_server.py`:
/// `/server_info` returns the resolved server arguments (`tp_size`, `custom_weight_loader`,
/// `version`); `/pause_generation` and `/continue_generation` answer 200; `/begin_weight_update`
/// and `/end_weight_update` (0.5.21 and later, 404 before) and `/update_weights_from_tensor`
/// answer `{"success", "message"}`, 200 or 400, and keep one update session per server as
/// `managers/scheduler_components/weight_updater.py` does (`begin_weight_update` refuses while one
/// is open, `end_weight_update` and every `update_weights_from_*` while none is). The trigger
/// stands in for the loader: it answers once the gateway shows the version running (the loader
/// receives it), or fails / hangs on request. The version `/model_info` reports is the last
/// successful trigger's `weight_version` (`tokenizer_control_mixin.py`,
/// `update_weights_from_tensor`) or `/update_weight_version`'s `new_version`, "default" before.
#[derive(Default)]
struct Session {
    calls: Mutex<Vec<(usize, String, Value)>>,
    /// Which servers have an update session open.
    open: Mutex<[bool; 2]>,
    /// The architecture `/model_info` reports (`Qwen3ForCausalLM`, the pair's, when unset).
    serves: Mutex<Option<&'static str>>,
    loader_fails: AtomicBool,
    trigger_hangs: AtomicBool,
    /// The `weight_version` each server reports (`None`: "default", the launch value).
    reported: Mutex<[Option<String>; 2]>,
}

impl Session {
    /// The `weight_version` server `i` reports.
    fn reported(&self, i: usize) -> String {
        self.reported.lock().unwrap()[i]
            .clone()
            .unwrap_or_else(|| "default".into())
    }
}

async fn sglang_server(
    s: Arc<Session>,
    index: usize,
    version: &'static str,
    gateway: String,
    pair: &'static str,
) -> String {
    type St = (Arc<Session>, usize, &'static str, String, &'static str);
    async fn info(State((_, _, version, _, _)): State<St>) -> axum::Json<Value> {
        axum::Json(json!({
            "tp_size": 2, "dp_size": 1, "ep_size": 1, "version": version, "model_path": "/models/tiny",
            "custom_weight_loader": ["awex.sglang.receive"],
        }))
    }
    // `http_server.py` `model_info`: `architectures` is the served model's
    // `hf_config.architectures`
    async fn model_info(State((s, i, _, _, _)): State<St>) -> axum::Json<Value> {
        let arch = s.serves.lock().unwrap().unwrap_or("Qwen3ForCausalLM");
        axum::Json(json!({
            "model_path": "/models/tiny", "model_type": "qwen3", "architectures": [arch],
            "weight_version": s.reported(i), "is_generation": true,
        }))
    }
    async fn route(
        State((s, i, version, gateway, pair)): State<St>,
        uri: axum::http::Uri,
        body: axum::Json<Value>,
    ) -> (StatusCode, axum::Json<Value>) {
        let path = uri.path().to_string();
        s.calls
            .lock()
            .unwrap()
            .push((i, path.clone(), body.0.clone()));
        let ok = (
            StatusCode::OK,
            axum::Json(json!({"success": true, "message": "ok"})),
        );
        let refuse = |message: &str| {
            (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"success": false, "message": message})),
            )
        };
        let session = version >= "0.5.21";
        match path.as_str() {
            "/begin_weight_update" | "/end_weight_update" if !session => (
                StatusCode::NOT_FOUND,
                axum::Json(json!({"detail": "Not Found"})),
            ),
            "/begin_weight_update" => {
                let mut open = s.open.lock().unwrap();
                if open[i] {
                    return refuse(
                        "a weight-update session is already open; call end_weight_update() first",
                    );
                }
                open[i] = true;
                ok
            }
            "/end_weight_update" => {
                let mut open = s.open.lock().unwrap();
                if !open[i] {
                    return refuse(
                        "no weight-update session is open; call begin_weight_update() first",
                    );
                }
                open[i] = false;
                ok
            }
            "/update_weights_from_tensor" if session && !s.open.lock().unwrap()[i] => refuse(
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            ),
            "/update_weights_from_tensor" if body.0.get("weight_version").is_some() => {
                if s.trigger_hangs.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                // the loader receives the running version
                let client = Client::new(&gateway, None).unwrap();
                let st = client.status(pair).await.unwrap();
                let running = st.current_update.map(|u| u.state);
                assert_eq!(
                    running,
                    Some(UpdateState::Running),
                    "triggered before the update ran"
                );
                if s.loader_fails.load(Ordering::SeqCst) && i == 1 {
                    return (
                        StatusCode::BAD_REQUEST,
                        axum::Json(
                            json!({"success": false, "message": "awex.sglang.receive: engine 1 rank 0: transport: peer reset"}),
                        ),
                    );
                }
                // recorded once the loader returned, as SGLang does (awex's loader returns
                // also when the version failed elsewhere)
                s.reported.lock().unwrap()[i] = body.0["weight_version"].as_str().map(String::from);
                ok
            }
            // `UpdateWeightVersionReqInput`: `new_version`, `abort_all_requests` (default true)
            "/update_weight_version" => match body.0.get("new_version").and_then(Value::as_str) {
                Some(v) => {
                    s.reported.lock().unwrap()[i] = Some(v.to_string());
                    (
                        StatusCode::OK,
                        axum::Json(
                            json!({"success": true, "message": format!("Weight version updated to {v}"), "new_version": v}),
                        ),
                    )
                }
                None => (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    axum::Json(json!({"detail": "new_version: Field required"})),
                ),
            },
            _ => ok,
        }
    }
    let app = Router::new()
        .route("/server_info", get(info))
        .route("/model_info", get(model_info))
        .route("/pause_generation", post(route))
        .route("/continue_generation", post(route))
        .route("/begin_weight_update", post(route))
        .route("/end_weight_update", post(route))
        .route("/update_weights_from_tensor", post(route))
        .route("/update_weight_version", post(route))
        .with_state((s, index, version, gateway, pair));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// The calls engine `i` received, as `(path, body)`, and then forgets them.
fn take(s: &Session, i: usize) -> Vec<(String, Value)> {
    let mut calls = s.calls.lock().unwrap();
    let mine = calls
        .iter()
        .filter(|(e, _, _)| *e == i)
        .map(|(_, p, b)| (p.clone(), b.clone()))
        .collect();
    calls.retain(|(e, _, _)| *e != i);
    mine
}

fn paths(calls: &[(String, Value)]) -> Vec<&str> {
    calls.iter().map(|(p, _)| p.as_str()).collect()
}

async fn start_retrying(client: &Client, pair: &str, v: u64) {
    loop {
        match client.start_update(pair, v).await {
            Err(e) if e.status() == Some(409) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => break drop(other.unwrap()),
        }
    }
}

/// Waits (up to 5 s) until the engines have answered `n` calls in all: calls that follow
/// the commit (continue_generation) may land after `wait_update` returns.
async fn wait_calls(s: &Session, n: usize) {
    for _ in 0..500 {
        if s.calls.lock().unwrap().len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (up to 5 s) until engine `i` has been called at `path`.
async fn wait_path(s: &Session, i: usize, path: &str) {
    for _ in 0..500 {
        if s.calls
            .lock()
            .unwrap()
            .iter()
            .any(|(e, p, _)| *e == i && p == path)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn session_pair(version: &'static str, pair: &'static str) -> (Client, Arc<Session>, Ranks) {
    session_pair_with(version, pair, CommitPolicy::All).await
}

/// [`session_pair`] with commit policy `commit`.
async fn session_pair_with(
    version: &'static str,
    pair: &'static str,
    commit: CommitPolicy,
) -> (Client, Arc<Session>, Ranks) {
    let s = Arc::new(Session::default());
    let base = start(GatewayConfig::default()).await;
    let urls = vec![
        sglang_server(s.clone(), 0, version, base.clone(), pair).await,
        sglang_server(s.clone(), 1, version, base.clone(), pair).await,
    ];
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request(pair, 1, 2, 2);
    req.inference.urls = urls;
    req.options.update_deadline_ms = 3_000;
    req.options.commit = commit;
    client.connect(&req).await.unwrap();
    let ranks = spawn_ranks(&client, pair, 1, 2, 2, |_, _| always_ok(1, 0));
    (client, s, ranks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_session_runs_pause_begin_trigger_end_continue_and_commits_after_all() {
    let (client, s, ranks) = session_pair("0.5.23", "sess").await;
    start_retrying(&client, "sess", 1).await;
    let done = client
        .wait_update("sess", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    // continue_generation follows the commit: wait for all 8 calls of each engine
    wait_calls(&s, 16).await;
    for i in 0..2 {
        let calls = take(&s, i);
        assert_eq!(
            paths(&calls),
            vec![
                // the warm-up after connect starts the loaders (no version, no cache flush)
                "/begin_weight_update",
                "/update_weights_from_tensor",
                "/end_weight_update",
                // version 1
                "/pause_generation",
                "/begin_weight_update",
                "/update_weights_from_tensor",
                "/end_weight_update",
                "/continue_generation",
            ],
            "engine {i}"
        );
        assert_eq!(
            calls[1].1,
            json!({"serialized_named_tensors": ["gARdlC4=", "gARdlC4="], "load_format": "awex.sglang.receive", "flush_cache": false, "selector": "target"})
        );
        assert_eq!(calls[3].1, json!({"mode": "retract"}));
        assert_eq!(calls[4].1, json!({"selector": "target"}));
        assert_eq!(
            calls[5].1,
            // each TP rank's payload names the work: the pickle of
            // [("awex.work/1/1/receive", torch.LongTensor([]))], written out by hand
            json!({"serialized_named_tensors": ["gAJdWBUAAABhd2V4LndvcmsvMS8xL3JlY2VpdmVjdG9yY2gKTG9uZ1RlbnNvcgpdhVKGYS4=", "gAJdWBUAAABhd2V4LndvcmsvMS8xL3JlY2VpdmVjdG9yY2gKTG9uZ1RlbnNvcgpdhVKGYS4="], "load_format": "awex.sglang.receive", "weight_version": "1", "flush_cache": true, "selector": "target"})
        );
    }
    client.disconnect("sess").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_0_5_21_server_gets_no_update_session() {
    let (client, s, ranks) = session_pair("0.5.20", "old").await;
    start_retrying(&client, "old", 1).await;
    let done = client
        .wait_update("old", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    wait_calls(&s, 8).await;
    assert_eq!(
        paths(&take(&s, 0)),
        vec![
            "/update_weights_from_tensor",
            "/pause_generation",
            "/update_weights_from_tensor",
            "/continue_generation"
        ]
    );
    client.disconnect("old").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_loader_fails_the_version_keeps_engines_paused_until_a_retry_or_accept_torn() {
    let (client, s, ranks) = session_pair("0.5.23", "torn").await;
    s.loader_fails.store(true, Ordering::SeqCst);
    start_retrying(&client, "torn", 1).await;
    let failed = client
        .wait_update("torn", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(failed.state, UpdateState::Failed);
    let error = failed.error.unwrap();
    assert!(
        error.contains("the inference engines' weight loaders failed: engine 1 POST http://127.0.0.1:")
            && error.ends_with("/update_weights_from_tensor awex.sglang.receive: engine 1 rank 0: transport: peer reset"),
        "{error}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let st = client.status("torn").await.unwrap();
    assert_eq!((st.serving_version, st.torn_version), (None, Some(1)));
    // torn weights are never served silently: no continue_generation, resume needs accept_torn
    assert!(!paths(&take(&s, 1)).contains(&"/continue_generation"));
    let refused = client.resume("torn", false).await.unwrap_err();
    assert_eq!(refused.status(), Some(409));
    assert!(
        refused.to_string().contains("partially written"),
        "{refused}"
    );
    // a retry of the same version closes the failed attempt's session first (SGLang refuses a
    // second begin_weight_update while one is open), then commits and resumes
    s.loader_fails.store(false, Ordering::SeqCst);
    take(&s, 0);
    start_retrying(&client, "torn", 1).await;
    let done = client
        .wait_update("torn", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let st = client.status("torn").await.unwrap();
    assert_eq!((st.serving_version, st.torn_version), (Some(1), None));
    for i in 0..2 {
        let calls = take(&s, i);
        // nothing committed yet: the version reported at connect is restored
        assert_eq!(
            calls[1].1,
            json!({"new_version": "default", "abort_all_requests": false}),
            "engine {i}"
        );
        assert_eq!(
            paths(&calls),
            vec![
                "/end_weight_update",
                "/update_weight_version",
                "/pause_generation",
                "/begin_weight_update",
                "/update_weights_from_tensor",
                "/end_weight_update",
                "/continue_generation",
            ],
            "engine {i}"
        );
    }
    // version 2 fails again; the controller accepts the torn weights explicitly
    s.loader_fails.store(true, Ordering::SeqCst);
    start_retrying(&client, "torn", 2).await;
    client
        .wait_update("torn", 2, Duration::from_secs(120))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    take(&s, 0);
    let st = client.resume("torn", true).await.unwrap();
    assert_eq!(
        (st.serving_version, st.torn_version, st.serving_torn_version),
        (Some(1), None, Some(2))
    );
    wait_path(&s, 0, "/continue_generation").await;
    // the failed attempt's session is closed, and the committed version reported again,
    // before the engines serve again
    let calls = take(&s, 0);
    assert_eq!(
        paths(&calls),
        vec![
            "/end_weight_update",
            "/update_weight_version",
            "/continue_generation"
        ]
    );
    assert_eq!(
        calls[1].1,
        json!({"new_version": "1", "abort_all_requests": false})
    );
    client.disconnect("torn").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_under_available_leaves_a_failed_loader_out_and_it_reports_the_version_it_serves() {
    let (client, s, ranks) = session_pair_with("0.5.23", "sav", CommitPolicy::Available).await;
    start_retrying(&client, "sav", 1).await;
    let done = client
        .wait_update("sav", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    for i in 0..2 {
        wait_path(&s, i, "/continue_generation").await;
        take(&s, i);
    }
    // version 2: engine 1's loader fails; the version commits on engine 0
    s.loader_fails.store(true, Ordering::SeqCst);
    start_retrying(&client, "sav", 2).await;
    let done = client
        .wait_update("sav", 2, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    assert_eq!(
        done.left_out.iter().map(|l| l.engine).collect::<Vec<_>>(),
        vec![1]
    );
    wait_path(&s, 0, "/continue_generation").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        paths(&take(&s, 0)),
        vec![
            "/pause_generation",
            "/begin_weight_update",
            "/update_weights_from_tensor",
            "/end_weight_update",
            "/continue_generation",
        ]
    );
    // engine 1 keeps its session open and stays paused: torn, serving version 1 no more
    assert_eq!(
        paths(&take(&s, 1)),
        vec![
            "/pause_generation",
            "/begin_weight_update",
            "/update_weights_from_tensor",
        ]
    );
    let st = client.status("sav").await.unwrap();
    assert_eq!(st.engines[1].state, EngineState::Torn, "{:?}", st.engines);
    assert_eq!(st.engines[1].serving_version, Some(1), "{:?}", st.engines);
    // version 3: engine 1's session is closed first and it reports the version it serves
    // whole (1), not the pair's last committed one (2); then it catches up
    s.loader_fails.store(false, Ordering::SeqCst);
    start_retrying(&client, "sav", 3).await;
    let done = client
        .wait_update("sav", 3, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    assert!(done.left_out.is_empty(), "{:?}", done.left_out);
    wait_path(&s, 1, "/continue_generation").await;
    let calls = take(&s, 1);
    assert_eq!(
        paths(&calls),
        vec![
            "/end_weight_update",
            "/update_weight_version",
            "/pause_generation",
            "/begin_weight_update",
            "/update_weights_from_tensor",
            "/end_weight_update",
            "/continue_generation",
        ]
    );
    assert_eq!(
        calls[1].1,
        json!({"new_version": "1", "abort_all_requests": false})
    );
    let st = client.status("sav").await.unwrap();
    for e in &st.engines {
        assert_eq!(
            (e.state, e.serving_version),
            (EngineState::Serving, Some(3)),
            "{e:?}"
        );
    }
    client.disconnect("sav").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failed_attempt_sglang_reports_the_last_committed_version_again() {
    let (client, s, ranks) = session_pair("0.5.23", "ver").await;
    start_retrying(&client, "ver", 1).await;
    let done = client
        .wait_update("ver", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    wait_calls(&s, 16).await;
    assert_eq!((s.reported(0), s.reported(1)), ("1".into(), "1".into()));
    // version 2: engine 0's loader returns (SGLang records "2"), engine 1's fails
    s.loader_fails.store(true, Ordering::SeqCst);
    start_retrying(&client, "ver", 2).await;
    let failed = client
        .wait_update("ver", 2, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(failed.state, UpdateState::Failed);
    assert_eq!(s.reported(0), "2");
    take(&s, 0);
    take(&s, 1);
    client.resume("ver", true).await.unwrap();
    wait_path(&s, 0, "/continue_generation").await;
    wait_path(&s, 1, "/continue_generation").await;
    for i in 0..2 {
        let calls = take(&s, i);
        let restore: Vec<&Value> = calls
            .iter()
            .filter(|(p, _)| p == "/update_weight_version")
            .map(|(_, b)| b)
            .collect();
        assert_eq!(
            restore,
            vec![&json!({"new_version": "1", "abort_all_requests": false})],
            "engine {i}: {calls:?}"
        );
        assert_eq!(paths(&calls).last(), Some(&"/continue_generation"));
        assert_eq!(s.reported(i), "1", "engine {i}");
    }
    client.disconnect("ver").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_that_hangs_past_the_deadline_fails_the_version() {
    let (client, s, ranks) = session_pair("0.5.23", "hang").await;
    s.trigger_hangs.store(true, Ordering::SeqCst);
    start_retrying(&client, "hang", 1).await;
    // the update deadline is 3 s; the message below says the deadline is what failed it
    let failed = client
        .wait_update("hang", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(failed.state, UpdateState::Failed);
    let error = failed.error.unwrap();
    assert!(
        error.contains("the deadline of 3000 ms passed while the inference engines were receiving")
            || error.contains("/update_weights_from_tensor timed out after 3000 ms"),
        "{error}"
    );
    client.disconnect("hang").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_checks_every_server_against_the_declared_layout() {
    let s = Arc::new(Session::default());
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let good = sglang_server(s.clone(), 0, "0.5.23", base.clone(), "chk").await;
    // the servers run tp=2; the pair declares tp=4
    let mut req = connect_request("chk", 1, 1, 4);
    req.inference.urls = vec![good.clone()];
    let e = client.connect(&req).await.unwrap_err();
    assert_eq!(e.status(), Some(422));
    assert!(
        e.to_string().contains(&format!(
            "engine 0 at {good}: the pair declares sglang tp=4 but the server reports tp_size=2"
        )),
        "{e}"
    );
    // a server that serves another architecture than the pair's model
    *s.serves.lock().unwrap() = Some("LlamaForCausalLM");
    let mut req = connect_request("chk", 1, 1, 2);
    req.inference.urls = vec![good.clone()];
    let e = client.connect(&req).await.unwrap_err();
    assert_eq!(e.status(), Some(422));
    assert!(
        e.to_string().contains(&format!(
            "engine 0 at {good}: the pair's model is Qwen3ForCausalLM but the server reports architectures=[\"LlamaForCausalLM\"] (model_path /models/tiny)"
        )),
        "{e}"
    );
    *s.serves.lock().unwrap() = None;
    // an engine nobody answers for fails the connect too
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let mut req = connect_request("chk", 1, 2, 2);
    req.inference.urls = vec![good, dead.clone()];
    let e = client.connect(&req).await.unwrap_err();
    assert_eq!(e.status(), Some(422));
    assert!(
        e.to_string()
            .contains(&format!("engine 1 at {dead} did not answer")),
        "{e}"
    );
    assert_eq!(client.status("chk").await.unwrap_err().status(), Some(404));
}

/// Ranks not given the model read it from `model.{side}`: the gateway stores both sides' models
/// from the connect request before the connect answers, so a rank asking at once (SGLang's
/// loader, which the connect's warm-up starts) finds them without any controller writing them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_stores_both_models_before_it_answers() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let req = connect_request("models", 1, 1, 1);
    client.connect(&req).await.unwrap();
    for (side, model) in [
        (Side::Training, &req.training.model),
        (Side::Inference, &req.inference.model),
    ] {
        let got = client
            .get_kv(
                "models",
                &awex_control::wire::model_key(side),
                Duration::ZERO,
            )
            .await
            .unwrap_or_else(|e| panic!("{side} model not stored at connect: {e}"));
        assert_eq!(got.value, serde_json::to_value(model).unwrap(), "{side}");
        let back: awex_core::model::ModelSpec = serde_json::from_value(got.value).unwrap();
        assert_eq!(back.fingerprint(), model.fingerprint());
    }
}

/// An engine URL whose server answers without end (a wrong port, a broken engine) fails the
/// connect naming the bound, and the gateway reads at most the bound of each answer, not all the
/// server can send before the engine timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_answers_without_end_fails_the_connect_at_the_answer_bound() {
    let server = endless_server::endless(512 << 20, None).await;
    let base = start(GatewayConfig {
        engine_timeout: Duration::from_secs(300),
        ..GatewayConfig::default()
    })
    .await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("endless", 1, 1, 1);
    req.inference.urls = vec![server.url.clone()];
    let e = client.connect(&req).await.unwrap_err().to_string();
    assert!(e.starts_with("gateway answered 422: engine 0 at "), "{e}");
    assert!(
        e.contains(
            "/server_info: answered 200 OK, but its answer runs past the 16 MiB awex reads from it"
        ),
        "{e}"
    );
    // SGLang's two info routes, each read to the bound at most
    let sent = server.sent.load(Ordering::SeqCst);
    let bound = 2 * (awex_control::body::MAX_ENGINE_ANSWER_BYTES + (32 << 20));
    assert!(sent <= bound, "the gateway took {sent} bytes");
}
