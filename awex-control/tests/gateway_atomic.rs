//! Atomic apply (`options.apply = atomic`) at the gateway: a version commits only after every
//! rank received and then every inference rank applied; a failure before the `apply` event is
//! not torn (the engines resume on the last committed version), a failure after it is; ranks
//! that do not support atomic apply are refused at join; engines whose receivers run inside the
//! trigger apply inside it (awex's SGLang loader keeps the trigger open across `apply`), and
//! those that cannot (vLLM's weight transfer) are refused at connect.

mod gateway_common;

use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::{
    ApplyMode, CAP_ATOMIC_APPLY, EventKind, JoinRequest, Report, UpdateState,
};
use awex_core::{RankId, Side};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use gateway_common::{connect_request, start};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const T: RankId = RankId::train(0);
const I0: RankId = RankId::infer(0, 0);
const I1: RankId = RankId::infer(1, 0);

fn report(side: Side, rank: RankId, ok: bool, attempt: u32) -> Report {
    Report {
        side,
        rank,
        ok,
        bytes: 8,
        checksum: Some(0),
        error: (!ok).then(|| "peer reset".to_string()),
        attempt: Some(attempt),
        incarnation: None,
        delta: None,
        unreached: Vec::new(),
    }
}

/// Joins every rank of a 1 + 2x1 pair (listing the atomic capability).
async fn join_all(client: &Client, pair: &str) {
    let join = |side, rank| {
        let c = client.clone();
        let pair = pair.to_string();
        async move {
            c.join(
                &pair,
                &JoinRequest {
                    side,
                    rank,
                    info: json!({}),
                    capabilities: vec![CAP_ATOMIC_APPLY.into()],
                },
            )
            .await
            .unwrap()
        }
    };
    tokio::join!(
        join(Side::Training, T),
        join(Side::Inference, I0),
        join(Side::Inference, I1)
    );
}

async fn kinds(client: &Client, pair: &str) -> Vec<String> {
    client
        .events(pair, 0, Duration::ZERO)
        .await
        .unwrap()
        .events
        .iter()
        .map(|e| {
            format!(
                "{:?} {}/{}",
                e.kind,
                e.version.unwrap_or(0),
                e.attempt.unwrap_or(0)
            )
        })
        .collect()
}

/// Every rank reports receiving attempt `a` of version `v`.
async fn receive_all(client: &Client, pair: &str, v: u64, a: u32) {
    for (side, rank) in [
        (Side::Training, T),
        (Side::Inference, I0),
        (Side::Inference, I1),
    ] {
        client
            .report(pair, v, &report(side, rank, true, a))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_atomic_version_commits_only_after_every_inference_rank_applied() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("a", 1, 2, 1);
    req.options.apply = ApplyMode::Atomic;
    let st = client.connect(&req).await.unwrap();
    assert_eq!(st.options.apply, ApplyMode::Atomic);
    join_all(&client, "a").await;
    client.start_update("a", 1).await.unwrap();
    receive_all(&client, "a", 1, 1).await;
    // every rank received: the gateway announces `apply`, and nothing is committed yet
    let u = client.update_status("a", 1).await.unwrap();
    assert_eq!(u.state, UpdateState::Running);
    assert!(u.applying);
    assert_eq!((u.succeeded, u.applied), (3, 0));
    assert_eq!(kinds(&client, "a").await, vec!["Update 1/1", "Apply 1/1"]);
    assert_eq!(client.status("a").await.unwrap().serving_version, None);
    // the training rank has nothing to apply; a second apply report is refused
    let e = client
        .report("a", 1, &report(Side::Training, T, true, 1))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(409));
    assert!(e.to_string().contains("only they report"), "{e}");
    client
        .report("a", 1, &report(Side::Inference, I0, true, 1))
        .await
        .unwrap();
    let e = client
        .report("a", 1, &report(Side::Inference, I0, true, 1))
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(409));
    assert!(
        e.to_string()
            .contains("already reported applying version 1"),
        "{e}"
    );
    let u = client.update_status("a", 1).await.unwrap();
    assert_eq!((u.state, u.applied), (UpdateState::Running, 1));
    client
        .report("a", 1, &report(Side::Inference, I1, true, 1))
        .await
        .unwrap();
    let u = client.update_status("a", 1).await.unwrap();
    assert_eq!((u.state, u.applied), (UpdateState::Committed, 2));
    let applied: Vec<Option<bool>> = u.ranks.iter().map(|r| r.applied).collect();
    assert_eq!(applied, vec![None, Some(true), Some(true)]);
    assert_eq!(client.status("a").await.unwrap().serving_version, Some(1));
}

/// A stand-in for engines the gateway pauses and resumes (SGLang's `/pause_generation`,
/// `/continue_generation`, `/server_info` without awex's loader, as in `gateway_lifecycle.rs`).
async fn engine(calls: Arc<Mutex<Vec<&'static str>>>, loader: bool) -> String {
    type St = (Arc<Mutex<Vec<&'static str>>>, bool);
    async fn info(State((_, loader)): State<St>) -> axum::Json<serde_json::Value> {
        let mut v = json!({"tp_size": 1, "dp_size": 1, "ep_size": 1, "version": "0.5.23"});
        if loader {
            v["custom_weight_loader"] = json!(["awex.sglang.receive"]);
        }
        axum::Json(v)
    }
    async fn pause(State((c, _)): State<St>) -> StatusCode {
        c.lock().unwrap().push("pause");
        StatusCode::OK
    }
    async fn resume(State((c, _)): State<St>) -> StatusCode {
        c.lock().unwrap().push("continue");
        StatusCode::OK
    }
    let app = Router::new()
        .route("/server_info", get(info))
        .route("/pause_generation", post(pause))
        .route("/continue_generation", post(resume))
        .with_state((calls, loader));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

async fn settled(calls: &Mutex<Vec<&'static str>>, n: usize) -> Vec<&'static str> {
    for _ in 0..300 {
        if calls.lock().unwrap().len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    calls.lock().unwrap().clone()
}

async fn running(client: &Client, pair: &str, v: u64) -> u32 {
    for _ in 0..300 {
        let u = client.update_status(pair, v).await.unwrap();
        if u.state == UpdateState::Running {
            return u.attempt;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("version {v} never ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_before_apply_is_not_torn_and_resumes_a_failure_while_applying_is_torn() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let mut req = connect_request("f", 1, 2, 1);
    req.options.apply = ApplyMode::Atomic;
    req.inference.urls = vec![
        engine(calls.clone(), false).await,
        engine(calls.clone(), false).await,
    ];
    client.connect(&req).await.unwrap();
    join_all(&client, "f").await;
    // version 1 commits
    client.start_update("f", 1).await.unwrap();
    let a = running(&client, "f", 1).await;
    receive_all(&client, "f", 1, a).await;
    for r in [I0, I1] {
        client
            .report("f", 1, &report(Side::Inference, r, true, a))
            .await
            .unwrap();
    }
    assert_eq!(
        client.update_status("f", 1).await.unwrap().state,
        UpdateState::Committed
    );
    assert_eq!(settled(&calls, 4).await.len(), 4);
    calls.lock().unwrap().clear();

    // version 2, attempt 1: the sender fails mid-update, before `apply`
    client.start_update("f", 2).await.unwrap();
    let a = running(&client, "f", 2).await;
    client
        .report("f", 2, &report(Side::Inference, I0, true, a))
        .await
        .unwrap();
    client
        .report("f", 2, &report(Side::Training, T, false, a))
        .await
        .unwrap();
    let u = client.update_status("f", 2).await.unwrap();
    assert_eq!(u.state, UpdateState::Failed);
    assert!(!u.applying);
    let st = client.status("f").await.unwrap();
    assert_eq!(st.torn_version, None, "nothing live was written");
    assert_eq!(st.serving_version, Some(1));
    assert_eq!(
        settled(&calls, 4).await,
        vec!["pause", "pause", "continue", "continue"],
        "the engines serve version 1 again"
    );
    calls.lock().unwrap().clear();

    // attempt 2: every rank received, then engine 1's rank fails while applying: torn
    client.start_update("f", 2).await.unwrap();
    let a = running(&client, "f", 2).await;
    assert_eq!(a, 2);
    receive_all(&client, "f", 2, a).await;
    client
        .report("f", 2, &report(Side::Inference, I0, true, a))
        .await
        .unwrap();
    client
        .report("f", 2, &report(Side::Inference, I1, false, a))
        .await
        .unwrap();
    let u = client.update_status("f", 2).await.unwrap();
    assert_eq!(u.state, UpdateState::Failed);
    let error = u.error.unwrap();
    assert!(
        error.contains(
            "inference rank 1/0 failed applying the staged version to its live tensors: peer reset"
        ),
        "{error}"
    );
    let st = client.status("f").await.unwrap();
    assert_eq!(st.torn_version, Some(2));
    assert_eq!(
        settled(&calls, 2).await,
        vec!["pause", "pause"],
        "the engines stay paused on torn weights"
    );
    calls.lock().unwrap().clear();

    // attempt 3 fails before apply: still torn (the live tensors are attempt 2's), still paused
    client.start_update("f", 2).await.unwrap();
    let a = running(&client, "f", 2).await;
    client
        .report("f", 2, &report(Side::Training, T, false, a))
        .await
        .unwrap();
    assert_eq!(client.status("f").await.unwrap().torn_version, Some(2));
    assert_eq!(settled(&calls, 2).await, vec!["pause", "pause"]);
    calls.lock().unwrap().clear();

    // attempt 4 commits: not torn any more, the engines serve version 2
    client.start_update("f", 2).await.unwrap();
    let a = running(&client, "f", 2).await;
    receive_all(&client, "f", 2, a).await;
    for r in [I0, I1] {
        client
            .report("f", 2, &report(Side::Inference, r, true, a))
            .await
            .unwrap();
    }
    let st = client.status("f").await.unwrap();
    assert_eq!((st.serving_version, st.torn_version), (Some(2), None));
    assert_eq!(settled(&calls, 4).await.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_without_the_capability_are_refused_and_in_place_pairs_read_as_before() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("old", 1, 1, 1);
    req.options.apply = ApplyMode::Atomic;
    client.connect(&req).await.unwrap();
    let e = client
        .join(
            "old",
            &JoinRequest {
                side: Side::Inference,
                rank: RankId::infer(0, 0),
                info: json!({}),
                capabilities: vec![],
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(422));
    assert_eq!(
        e.to_string()
            .split_once(": ")
            .map(|x| x.1)
            .unwrap_or_default(),
        "pair `old` applies updates atomically (options.apply = atomic), but inference rank 0/0 did not list the capability `apply.atomic` when joining; run an awex that supports atomic apply on every rank, or connect the pair with apply = in_place",
        "{e}"
    );
    // a status of an atomic pair names the mode; an in-place pair's JSON is what older ranks
    // and gateways read (no `apply` key), and a join without capabilities sends none
    let raw: serde_json::Value = reqwest::get(format!("{base}/v1/pairs/old/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(raw["options"]["apply"], "atomic");
    client
        .connect(&connect_request("new", 1, 1, 1))
        .await
        .unwrap();
    let raw: serde_json::Value = reqwest::get(format!("{base}/v1/pairs/new/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(raw["options"].get("apply").is_none(), "{}", raw["options"]);
    let body = serde_json::to_value(JoinRequest {
        side: Side::Training,
        rank: T,
        info: json!({}),
        capabilities: vec![],
    })
    .unwrap();
    assert!(body.get("capabilities").is_none());
}

/// An SGLang server with awex's loader (`/server_info` lists it; SGLang 0.5.23's session
/// routes): an update's trigger stays open until the test releases it, as awex's loader in an
/// atomic pair answers only after it applied; the warm-up's trigger (no `weight_version`)
/// answers at once.
async fn loader_engine(
    calls: Arc<Mutex<Vec<&'static str>>>,
    release: Arc<tokio::sync::Notify>,
) -> String {
    type St = (Arc<Mutex<Vec<&'static str>>>, Arc<tokio::sync::Notify>);
    async fn info() -> axum::Json<serde_json::Value> {
        axum::Json(
            json!({"tp_size": 1, "dp_size": 1, "ep_size": 1, "version": "0.5.23",
            "custom_weight_loader": ["awex.sglang.receive"]}),
        )
    }
    fn route(
        name: &'static str,
    ) -> impl Fn(State<St>) -> std::future::Ready<axum::Json<serde_json::Value>> + Clone {
        move |State((c, _)): State<St>| {
            c.lock().unwrap().push(name);
            std::future::ready(axum::Json(json!({"success": true, "message": "ok"})))
        }
    }
    async fn trigger(
        State((c, release)): State<St>,
        axum::Json(body): axum::Json<serde_json::Value>,
    ) -> axum::Json<serde_json::Value> {
        if body.get("weight_version").is_some() {
            c.lock().unwrap().push("trigger");
            release.notified().await;
            c.lock().unwrap().push("trigger answered");
        }
        axum::Json(json!({"success": true, "message": "Success"}))
    }
    let app = Router::new()
        .route("/server_info", get(info))
        .route("/pause_generation", post(route("pause")))
        .route("/begin_weight_update", post(route("begin")))
        .route("/update_weights_from_tensor", post(trigger))
        .route("/end_weight_update", post(route("end")))
        .route("/continue_generation", post(route("continue")))
        .with_state((calls, release));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loader_engines_apply_inside_the_open_trigger_and_commit_after_it_answered() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let release = Arc::new(tokio::sync::Notify::new());
    let mut req = connect_request("l", 1, 2, 1);
    req.options.apply = ApplyMode::Atomic;
    req.inference.urls = vec![
        loader_engine(calls.clone(), release.clone()).await,
        loader_engine(calls.clone(), release.clone()).await,
    ];
    client.connect(&req).await.unwrap();
    join_all(&client, "l").await;
    settled(&calls, 4).await; // the warm-up's begin and end on both engines
    calls.lock().unwrap().clear();

    // version 1: every rank received (staged) while both triggers are open: `apply` goes out
    client.start_update("l", 1).await.unwrap();
    assert_eq!(running(&client, "l", 1).await, 1);
    settled(&calls, 6).await;
    receive_all(&client, "l", 1, 1).await;
    let u = client.update_status("l", 1).await.unwrap();
    assert!(u.applying, "apply must not wait for the open trigger");
    assert!(kinds(&client, "l").await.contains(&"Apply 1/1".to_string()));
    for rank in [I0, I1] {
        client
            .report("l", 1, &report(Side::Inference, rank, true, 1))
            .await
            .unwrap();
    }
    // applied everywhere, but the engines have not answered: no commit yet
    let u = client.update_status("l", 1).await.unwrap();
    assert_eq!((u.state, u.applied), (UpdateState::Running, 2));
    release.notify_waiters();
    let mut state = UpdateState::Running;
    for _ in 0..300 {
        state = client.update_status("l", 1).await.unwrap().state;
        if state != UpdateState::Running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(state, UpdateState::Committed);
    let seen = settled(&calls, 12).await;
    let count = |name: &str| seen.iter().filter(|c| **c == name).count();
    for name in [
        "pause",
        "begin",
        "trigger",
        "trigger answered",
        "end",
        "continue",
    ] {
        assert_eq!(count(name), 2, "{name} in {seen:?}");
    }
    let pos = |name: &str| seen.iter().rposition(|c| *c == name).unwrap();
    assert!(
        pos("trigger answered") < seen.iter().position(|c| *c == "end").unwrap(),
        "{seen:?}"
    );
    assert!(
        pos("end") < seen.iter().position(|c| *c == "continue").unwrap(),
        "{seen:?}"
    );
    assert_eq!(client.status("l").await.unwrap().serving_version, Some(1));

    // version 2: a training rank fails before `apply`: nothing live was written, not torn, and
    // the engines serve again once their triggers answered
    calls.lock().unwrap().clear();
    client.start_update("l", 2).await.unwrap();
    running(&client, "l", 2).await;
    settled(&calls, 6).await;
    client
        .report("l", 2, &report(Side::Training, T, false, 1))
        .await
        .unwrap();
    let u = client.update_status("l", 2).await.unwrap();
    assert_eq!(u.state, UpdateState::Failed);
    assert!(!u.applying);
    release.notify_waiters();
    let seen = settled(&calls, 10).await;
    assert_eq!(
        seen.iter().filter(|c| **c == "continue").count(),
        2,
        "{seen:?}"
    );
    let st = client.status("l").await.unwrap();
    assert_eq!((st.serving_version, st.torn_version), (Some(1), None));
}

#[test]
fn apply_events_are_part_of_the_wire() {
    let e: awex_control::wire::Event =
        serde_json::from_value(json!({"seq": 3, "kind": "apply", "version": 2, "attempt": 1}))
            .unwrap();
    assert_eq!(e.kind, EventKind::Apply);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_never_applies_fails_the_version_at_the_deadline_torn() {
    let base = start(GatewayConfig::default()).await;
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request("d", 1, 2, 1);
    req.options.apply = ApplyMode::Atomic;
    req.options.update_deadline_ms = 400;
    client.connect(&req).await.unwrap();
    join_all(&client, "d").await;
    client.start_update("d", 1).await.unwrap();
    receive_all(&client, "d", 1, 1).await;
    client
        .report("d", 1, &report(Side::Inference, I0, true, 1))
        .await
        .unwrap();
    let u = client
        .wait_update("d", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(u.state, UpdateState::Failed);
    assert_eq!(
        u.error.as_deref(),
        Some(
            "version 1 attempt 1 failed: the deadline of 400 ms passed while the inference ranks applied the version; 1 did not report applying: inference rank 1/0"
        )
    );
    assert_eq!(client.status("d").await.unwrap().torn_version, Some(1));
}
