//! The gateway driving vLLM 0.33 servers (`awex-vllm`'s engine control) through a stand-in of
//! the five RL routes: order, failures and retries.

mod gateway_common;

use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::UpdateState;
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
        match uri.path() {
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
                if s.receive_fails.load(Ordering::SeqCst) && i == 1 {
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
    std::hint::black_box(awex_vllm::CRATE);
    let s = Arc::new(Vllm::default());
    let base = start(GatewayConfig::default()).await;
    let urls = vec![
        vllm_server(s.clone(), 0, base.clone(), pair).await,
        vllm_server(s.clone(), 1, base.clone(), pair).await,
    ];
    let client = Client::new(&base, None).unwrap();
    let mut req = connect_request(pair, 1, 2, 2);
    req.inference.backend = "vllm".into();
    req.inference.urls = urls;
    req.options.update_deadline_ms = 3_000;
    client.connect(&req).await.unwrap();
    let ranks = spawn_ranks(&client, pair, 1, 2, 2, |_, _| always_ok(1, 0));
    (client, s, ranks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_runs_init_then_pause_start_update_finish_resume_and_commits() {
    let (client, s, ranks) = vllm_pair("vl").await;
    start_retrying(&client, "vl", 1).await;
    let done = client
        .wait_update("vl", 1, Duration::from_secs(10))
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
        .wait_update("vt", 1, Duration::from_secs(10))
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
        .wait_update("vt", 1, Duration::from_secs(10))
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
