//! The gateway driving vLLM 0.33 servers (`awex-vllm`'s engine control) through a stand-in of
//! the five RL routes: order, failures and retries.

mod gateway_common;

use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::{CommitPolicy, EngineState, UpdateState};
use awex_core::{RankId, Side};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use gateway_common::{Ranks, always_ok, connect_request, logs, spawn_ranks, start};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A stand-in of one vLLM 0.33.0 server started with `VLLM_SERVER_DEV_MODE=1` and
/// `--weight-transfer-config '{"backend": "awex"}'`. Each behaviour follows vLLM's source:
/// `GET /server_info?config_format=json` answers `{"vllm_config": <VllmConfig JSON>, ...}`
/// (`vllm/entrypoints/serve/dev/server_info/api_router.py`); `/pause` (query `mode`) answers
/// `{"status": "paused"}`, `/resume` `{"status": "resumed"}`, `/init_weight_transfer_engine`,
/// `/start_weight_update`, `/update_weights`, `/finish_weight_update` `{"message": ...}`
/// (`vllm/entrypoints/rl/online/api_router.py`). `/update_weights` stands in for every worker's
/// `receive_weights`: it answers once the gateway shows the version running, or, on request,
/// fails as an exception escaping `receive_weights` does (500, `{"error": {"message"}}`).
#[derive(Default)]
struct Vllm {
    calls: Mutex<Vec<(usize, String, Value)>>,
    receive_fails: AtomicBool,
    /// Servers whose `/update_weights` fails (as `receive_fails` does for server 1).
    receive_fails_on: Mutex<Vec<usize>>,
    /// Servers whose `/pause` answers 500 (a server in trouble).
    pause_fails_on: Mutex<Vec<usize>>,
    /// Servers that are down: every call answers 503.
    down: Mutex<Vec<usize>>,
    /// Servers started again: their `/init_weight_transfer_engine` starts their two ranks
    /// (as every vLLM worker joins there) and answers once both joined.
    restarted: Mutex<Vec<usize>>,
    /// The ranks restarted servers started.
    respawned: Mutex<Ranks>,
}

type St = (Arc<Vllm>, usize, String, &'static str);

async fn vllm_server(s: Arc<Vllm>, index: usize, gateway: String, pair: &'static str) -> String {
    async fn info() -> axum::Json<Value> {
        axum::Json(json!({"vllm_config": {
            "model_config": {"model": "Qwen/Qwen3-0.6B"},
            "parallel_config": {"tensor_parallel_size": 2, "data_parallel_size": 1,
                                "pipeline_parallel_size": 1, "enable_expert_parallel": false},
            "weight_transfer_config": {"backend": "awex"},
        }, "vllm_env": {"VLLM_SERVER_DEV_MODE": true}, "system_env": {}}))
    }
    async fn route(
        State((s, i, gateway, pair)): State<St>,
        uri: axum::http::Uri,
        body: axum::Json<Value>,
    ) -> (StatusCode, axum::Json<Value>) {
        let path = uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default();
        s.calls
            .lock()
            .unwrap()
            .push((i, path.clone(), body.0.clone()));
        let msg = |m: &str| (StatusCode::OK, axum::Json(json!({"message": m})));
        if s.down.lock().unwrap().contains(&i) {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(json!({"detail": "server down"})),
            );
        }
        if uri.path() == "/init_weight_transfer_engine" && s.restarted.lock().unwrap().contains(&i)
        {
            let client = Client::new(&gateway, None).unwrap();
            let since = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64;
            for r in 0..2 {
                let h = tokio::spawn(gateway_common::present_rank(
                    client.clone(),
                    pair.to_string(),
                    Side::Inference,
                    RankId::infer(i as u32, r),
                    always_ok(1, 0),
                    format!("{pair}-engine{i}-rank{r}-restarted"),
                ));
                s.respawned.lock().unwrap().push(h);
            }
            for _ in 0..500 {
                let st = client.status(pair).await.unwrap();
                let joined = st
                    .roster
                    .iter()
                    .filter(|x| x.rank.engine == i as u32 && x.side == Side::Inference)
                    .filter(|x| x.joined_unix_ms >= since)
                    .count();
                if joined == 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            return msg("Weight transfer initialized");
        }
        match uri.path() {
            "/pause" if s.pause_fails_on.lock().unwrap().contains(&i) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(json!({"error": {"message": "engine core is dead", "code": 500}})),
            ),
            "/pause" => (StatusCode::OK, axum::Json(json!({"status": "paused"}))),
            "/resume" => (StatusCode::OK, axum::Json(json!({"status": "resumed"}))),
            "/init_weight_transfer_engine" => msg("Weight transfer initialized"),
            "/start_weight_update" => msg("Weight update started"),
            "/finish_weight_update" => msg("Weight update finished"),
            "/update_weights" => {
                let client = Client::new(&gateway, None).unwrap();
                let st = client.status(pair).await.unwrap();
                assert_eq!(
                    st.current_update.map(|u| u.state),
                    Some(UpdateState::Running),
                    "triggered before the update ran"
                );
                if (s.receive_fails.load(Ordering::SeqCst) && i == 1)
                    || s.receive_fails_on.lock().unwrap().contains(&i)
                {
                    return (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        axum::Json(
                            json!({"error": {"message": "awex.UpdateFailed: engine 1 rank 0: transport: peer reset", "type": "InternalServerError", "param": null, "code": 500}}),
                        ),
                    );
                }
                msg("Weights updated")
            }
            _ => (
                StatusCode::NOT_FOUND,
                axum::Json(json!({"detail": "Not Found"})),
            ),
        }
    }
    let app = Router::new()
        .route("/server_info", get(info))
        .route("/pause", post(route))
        .route("/resume", post(route))
        .route("/init_weight_transfer_engine", post(route))
        .route("/start_weight_update", post(route))
        .route("/update_weights", post(route))
        .route("/finish_weight_update", post(route))
        .with_state((s, index, gateway, pair));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

fn take(s: &Vllm, i: usize) -> Vec<(String, Value)> {
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

async fn vllm_pair(pair: &'static str) -> (Client, Arc<Vllm>, Ranks) {
    vllm_fleet(pair, 2, CommitPolicy::All).await
}

/// A pair of one training rank and `engines` vLLM servers (tp 2 each) with commit policy
/// `commit`.
async fn vllm_fleet(
    pair: &'static str,
    engines: u32,
    commit: CommitPolicy,
) -> (Client, Arc<Vllm>, Ranks) {
    std::hint::black_box(awex_vllm::CRATE);
    let s = Arc::new(Vllm::default());
    let base = start(GatewayConfig::default()).await;
    let mut urls = Vec::new();
    for i in 0..engines as usize {
        urls.push(vllm_server(s.clone(), i, base.clone(), pair).await);
    }
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request(pair, 1, engines, 2);
    req.inference.backend = "vllm".into();
    req.inference.urls = urls;
    req.options.update_deadline_ms = 3_000;
    req.options.commit = commit;
    client.connect(&req).await.unwrap();
    let ranks = if commit == CommitPolicy::All {
        spawn_ranks(&client, pair, 1, engines, 2, |_, _| always_ok(1, 0))
    } else {
        // per-engine commits: ranks that the gateway can tell gone (claims and presence polls)
        let mut ranks = spawn_ranks(&client, pair, 1, 0, 2, |_, _| always_ok(1, 0));
        for e in 0..engines {
            for r in 0..2 {
                ranks.push(tokio::spawn(gateway_common::present_rank(
                    client.clone(),
                    pair.to_string(),
                    Side::Inference,
                    RankId::infer(e, r),
                    always_ok(1, 0),
                    format!("{pair}-engine{e}-rank{r}-first"),
                )));
            }
        }
        ranks
    };
    (client, s, ranks)
}

/// Every engine of `pair` serves `version` (the pair's status).
async fn every_engine_serves(client: &Client, pair: &str, version: u64) {
    let st = client.status(pair).await.unwrap();
    for e in &st.engines {
        assert_eq!(
            (e.state, e.serving_version),
            (EngineState::Serving, Some(version)),
            "{e:?}"
        );
    }
}

/// Waits until server `i` was called at `path` (at most about 5 s).
async fn wait_call(s: &Vllm, i: usize, path: &str) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_runs_init_then_pause_start_update_finish_resume_and_commits() {
    let (client, s, ranks) = vllm_pair("vl").await;
    start_retrying(&client, "vl", 1).await;
    let done = client
        .wait_update("vl", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    for _ in 0..200 {
        if s.calls.lock().unwrap().len() >= 12 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for i in 0..2 {
        let calls = take(&s, i);
        assert_eq!(
            paths(&calls),
            vec![
                "/init_weight_transfer_engine",
                "/pause?mode=keep",
                "/start_weight_update",
                "/update_weights",
                "/finish_weight_update",
                "/resume",
            ],
            "engine {i}"
        );
        assert_eq!(calls[0].1, json!({"init_info": {}}));
        assert_eq!(calls[3].1, json!({"update_info": {"version": 1}}));
        assert_eq!(calls[4].1, json!({"weight_version": "1"}));
    }
    client.disconnect("vl").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_receive_fails_the_version_with_vllms_message_and_a_retry_commits() {
    let (client, s, ranks) = vllm_pair("vt").await;
    s.receive_fails.store(true, Ordering::SeqCst);
    start_retrying(&client, "vt", 1).await;
    let failed = client
        .wait_update("vt", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(failed.state, UpdateState::Failed);
    let error = failed.error.unwrap();
    // the gateway quotes a non-2xx answer without a top-level `message` whole
    // (`awex-control/src/server/engine.rs`): vLLM's `{"error": {"message"}}` is in it
    assert!(
        error.contains("engine 1 POST http://127.0.0.1:")
            && error.contains("/update_weights answered 500 Internal Server Error: ")
            && error.contains("awex.UpdateFailed: engine 1 rank 0: transport: peer reset"),
        "{error}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    // torn weights are not served: engine 1 is not resumed
    let calls = take(&s, 1);
    assert!(!paths(&calls).contains(&"/resume"), "{calls:?}");
    assert!(
        !paths(&calls).contains(&"/finish_weight_update"),
        "{calls:?}"
    );
    s.receive_fails.store(false, Ordering::SeqCst);
    take(&s, 0);
    start_retrying(&client, "vt", 1).await;
    let done = client
        .wait_update("vt", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    // the resume follows the commit
    for _ in 0..500 {
        if s.calls
            .lock()
            .unwrap()
            .iter()
            .any(|(e, p, _)| *e == 0 && p == "/resume")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let calls = take(&s, 0);
    assert_eq!(paths(&calls).last(), Some(&"/resume"));
    assert!(paths(&calls).contains(&"/finish_weight_update"));
    client.disconnect("vt").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn available_leaves_a_failed_engine_out_resumes_only_the_others_and_it_catches_up_next() {
    let (client, s, ranks) = vllm_fleet("va", 3, CommitPolicy::Available).await;
    s.receive_fails_on.lock().unwrap().push(1);
    start_retrying(&client, "va", 1).await;
    let done = client
        .wait_update("va", 1, Duration::from_secs(120))
        .await
        .unwrap();
    // engine 1's loader failed: the version commits on engines 0 and 2 in its first attempt
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    assert_eq!(done.attempt, 1);
    assert_eq!(done.left_out.len(), 1, "{:?}", done.left_out);
    assert_eq!(done.left_out[0].engine, 1);
    assert!(
        done.left_out[0]
            .error
            .contains("awex.UpdateFailed: engine 1 rank 0: transport: peer reset"),
        "{:?}",
        done.left_out
    );
    for i in [0, 2] {
        wait_call(&s, i, "/resume").await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for i in [0, 2] {
        let calls = take(&s, i);
        assert_eq!(
            paths(&calls),
            vec![
                "/init_weight_transfer_engine",
                "/pause?mode=keep",
                "/start_weight_update",
                "/update_weights",
                "/finish_weight_update",
                "/resume",
            ],
            "engine {i}"
        );
    }
    // its ranks may have written part of the version: it is neither closed as if it had
    // applied it nor resumed, and it is reported torn, serving nothing new
    let calls = take(&s, 1);
    assert_eq!(
        paths(&calls),
        vec![
            "/init_weight_transfer_engine",
            "/pause?mode=keep",
            "/start_weight_update",
            "/update_weights",
        ],
        "engine 1"
    );
    let st = client.status("va").await.unwrap();
    let states: Vec<_> = st.engines.iter().map(|e| e.state).collect();
    assert_eq!(
        states,
        vec![
            EngineState::Serving,
            EngineState::Torn,
            EngineState::Serving
        ]
    );
    assert_eq!(st.engines[1].serving_version, None);
    assert_eq!(st.engines[1].torn_version, Some(1));
    // the controller cannot resume it on torn weights by accident
    let refused = client.resume("va", false).await.unwrap_err();
    assert_eq!(refused.status(), Some(409), "{refused}");

    // engine 1 works again: it takes part in version 2 (its open session closed first) and
    // every engine serves version 2
    s.receive_fails_on.lock().unwrap().clear();
    start_retrying(&client, "va", 2).await;
    let done = client
        .wait_update("va", 2, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    assert!(done.left_out.is_empty(), "{:?}", done.left_out);
    wait_call(&s, 1, "/resume").await;
    let calls = take(&s, 1);
    assert_eq!(
        paths(&calls),
        vec![
            "/finish_weight_update",
            "/pause?mode=keep",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
        ],
        "engine 1"
    );
    every_engine_serves(&client, "va", 2).await;
    client.disconnect("va").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_pause_fails_takes_no_part_keeps_its_weights_whole_and_catches_up_next() {
    let (client, s, ranks) = vllm_fleet("vp", 3, CommitPolicy::Quorum(2)).await;
    s.pause_fails_on.lock().unwrap().push(2);
    start_retrying(&client, "vp", 1).await;
    let done = client
        .wait_update("vp", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    assert_eq!(done.left_out.len(), 1, "{:?}", done.left_out);
    assert_eq!(done.left_out[0].engine, 2);
    assert!(
        done.left_out[0]
            .error
            .starts_with("pausing the engine failed: engine 2 POST http://127.0.0.1:")
            && done.left_out[0].error.contains("engine core is dead"),
        "{:?}",
        done.left_out
    );
    wait_call(&s, 2, "/resume").await;
    // never triggered nor closed; resumed on the version it holds whole (a pause that failed
    // may have paused it)
    let calls = take(&s, 2);
    assert_eq!(
        paths(&calls),
        vec![
            "/init_weight_transfer_engine",
            "/pause?mode=keep",
            "/resume"
        ],
        "engine 2"
    );
    let st = client.status("vp").await.unwrap();
    let e2 = &st.engines[2];
    assert_eq!(e2.state, EngineState::Behind, "{e2:?}");
    assert_eq!(
        (e2.serving_version, e2.torn_version),
        (None, None),
        "{e2:?}"
    );

    s.pause_fails_on.lock().unwrap().clear();
    start_retrying(&client, "vp", 2).await;
    let done = client
        .wait_update("vp", 2, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    assert!(done.left_out.is_empty(), "{:?}", done.left_out);
    every_engine_serves(&client, "vp", 2).await;
    client.disconnect("vp").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_that_engine_failures_make_unreachable_fails_the_version_and_resumes_no_torn_engine()
 {
    let (client, s, ranks) = vllm_fleet("vq", 3, CommitPolicy::Quorum(3)).await;
    s.receive_fails_on.lock().unwrap().push(0);
    start_retrying(&client, "vq", 1).await;
    let done = client
        .wait_update("vq", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Failed);
    let error = done.error.unwrap();
    assert!(
        error.contains(
            "only 2 of 3 engines can still apply it and the commit policy `quorum:3` needs 3"
        ),
        "{error}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..3 {
        let calls = take(&s, i);
        assert!(!paths(&calls).contains(&"/resume"), "engine {i}: {calls:?}");
        assert!(
            !paths(&calls).contains(&"/finish_weight_update"),
            "engine {i}: {calls:?}"
        );
    }
    client.disconnect("vq").await.unwrap();
    logs(ranks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_is_left_out_and_once_restarted_is_warmed_up_again_and_catches_up() {
    let (client, s, mut ranks) = vllm_fleet("vd", 3, CommitPolicy::Available).await;
    start_retrying(&client, "vd", 1).await;
    let done = client
        .wait_update("vd", 1, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    // server 1 dies with its ranks (ranks are spawned training first, then by engine)
    s.down.lock().unwrap().push(1);
    for h in ranks.drain(3..5) {
        h.abort();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    for i in 0..3 {
        take(&s, i);
    }
    start_retrying(&client, "vd", 2).await;
    let done = client
        .wait_update("vd", 2, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    assert_eq!(done.left_out.len(), 1, "{:?}", done.left_out);
    assert_eq!(done.left_out[0].engine, 1);
    // (its ranks' polls closed a second ago: it is asked to start its receivers again, which
    // fails; were the gateway slower to see them gone, its pause would fail instead)
    let why = &done.left_out[0].error;
    assert!(
        why.starts_with("warming the engine up again (its ranks were gone) failed: engine 1 POST")
            || why.starts_with("pausing the engine failed: engine 1 POST"),
        "{why}"
    );
    // it took no part
    let calls = take(&s, 1);
    assert!(!paths(&calls).contains(&"/update_weights"), "{calls:?}");
    let st = client.status("vd").await.unwrap();
    assert_eq!(
        st.engines[1].state,
        EngineState::Behind,
        "{:?}",
        st.engines[1]
    );
    assert_eq!(st.engines[1].serving_version, Some(1));

    // the server starts again: the next version warms it up (its ranks join), and it catches up
    s.restarted.lock().unwrap().push(1);
    s.down.lock().unwrap().clear();
    start_retrying(&client, "vd", 3).await;
    let done = client
        .wait_update("vd", 3, Duration::from_secs(120))
        .await
        .unwrap();
    assert_eq!(done.state, UpdateState::Committed, "{:?}", done.error);
    assert!(done.left_out.is_empty(), "{:?}", done.left_out);
    wait_call(&s, 1, "/resume").await;
    let calls = take(&s, 1);
    assert_eq!(
        paths(&calls),
        vec![
            "/init_weight_transfer_engine",
            "/pause?mode=keep",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
        ],
        "engine 1"
    );
    every_engine_serves(&client, "vd", 3).await;
    client.disconnect("vd").await.unwrap();
    logs(ranks).await;
    let respawned: Ranks = std::mem::take(&mut *s.respawned.lock().unwrap());
    logs(respawned).await;
}
