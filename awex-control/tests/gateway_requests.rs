//! Request-level tests of the gateway (tower `oneshot`, no sockets): auth, every class of bad
//! input, and the status code and message each one gets.

mod gateway_common;

use awex_control::server::{GatewayConfig, router};
use axum::Router;
use axum::body::Body;
use axum::http::{Request, header};
use gateway_common::{conforms, connect_request, tiny};
use serde_json::{Value, json};
use tower::ServiceExt;

const TOKEN: &str = "t0ken-for-tests";

fn app() -> Router {
    router(GatewayConfig {
        token: Some(TOKEN.into()),
        body_limit: 64 * 1024,
        ..GatewayConfig::default()
    })
}

async fn send(
    app: &Router,
    method: &str,
    uri: &str,
    token: Option<&str>,
    body: Option<Vec<u8>>,
) -> (u16, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let body = match body {
        Some(b) => {
            req = req.header(header::CONTENT_TYPE, "application/json");
            Body::from(b)
        }
        None => Body::empty(),
    };
    let resp = app.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, v)
}

async fn call(app: &Router, method: &str, uri: &str, body: Option<Value>) -> (u16, Value) {
    send(
        app,
        method,
        uri,
        Some(TOKEN),
        body.map(|b| serde_json::to_vec(&b).unwrap()),
    )
    .await
}

fn error(v: &Value) -> &str {
    v["error"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message in {v}"))
}

async fn connected(app: &Router, name: &str, train: u32, engines: u32, per: u32) {
    let (s, v) = call(
        app,
        "POST",
        "/v1/pairs",
        Some(serde_json::to_value(connect_request(name, train, engines, per)).unwrap()),
    )
    .await;
    assert_eq!(s, 201, "{v}");
}

#[tokio::test]
async fn health_and_openapi_are_public_everything_else_needs_the_token() {
    let app = app();
    assert_eq!(
        send(&app, "GET", "/healthz", None, None).await,
        (200, json!({"status": "ok"}))
    );
    let (s, doc) = send(&app, "GET", "/openapi.json", None, None).await;
    assert_eq!((s, doc["openapi"].as_str()), (200, Some("3.0.3")));
    let (s, v) = send(&app, "GET", "/metrics", None, None).await;
    assert_eq!(
        (s, error(&v)),
        (
            401,
            "missing bearer token: send `Authorization: Bearer <token>`"
        )
    );
    let (s, v) = send(&app, "GET", "/metrics", Some("wrong"), None).await;
    assert_eq!(
        (s, error(&v)),
        (403, "the bearer token is not valid for this gateway")
    );
    let (s, text) = send(&app, "GET", "/metrics", Some(TOKEN), None).await;
    assert_eq!(s, 200);
    assert!(
        text.as_str()
            .unwrap()
            .contains("awex_gateway_updates_total{outcome=\"committed\"} 0")
    );
    // No mutation without the token: the pair is not created.
    let body = serde_json::to_vec(&connect_request("p", 1, 1, 1)).unwrap();
    let (s, _) = send(&app, "POST", "/v1/pairs", None, Some(body.clone())).await;
    assert_eq!(s, 401);
    let (s, _) = send(&app, "POST", "/v1/pairs", Some("nope"), Some(body)).await;
    assert_eq!(s, 403);
    let (s, v) = call(&app, "GET", "/v1/pairs/p/status", None).await;
    assert_eq!(
        (s, error(&v)),
        (404, "no pair named `p`; create it with POST /v1/pairs")
    );
}

#[tokio::test]
async fn unknown_routes_and_methods_get_json_errors() {
    let app = app();
    let (s, v) = call(&app, "GET", "/v2/nothing", None).await;
    assert_eq!(
        (s, error(&v)),
        (
            404,
            "no route for GET /v2/nothing; the routes are listed in GET /openapi.json"
        )
    );
    let (s, v) = call(&app, "POST", "/healthz", None).await;
    assert_eq!(
        (s, error(&v)),
        (
            405,
            "method POST is not allowed on /healthz; the routes are listed in GET /openapi.json"
        )
    );
    let (s, _) = call(&app, "PATCH", "/v1/pairs/x", None).await;
    assert_eq!(s, 405);
}

#[tokio::test]
async fn connect_answers_201_then_409_for_the_same_name() {
    let app = app();
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs",
        Some(serde_json::to_value(connect_request("job-1", 2, 2, 2)).unwrap()),
    )
    .await;
    assert_eq!(s, 201);
    conforms("PairStatus", &v).unwrap();
    assert_eq!(v["state"], "joining");
    assert_eq!(v["world_size"], 6);
    assert_eq!(v["inference"]["engines"], 2);
    assert_eq!(v["serving_version"], Value::Null);
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs",
        Some(serde_json::to_value(connect_request("job-1", 1, 1, 1)).unwrap()),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (
            409,
            "a pair named `job-1` already exists (state joining); disconnect it first or pick another name"
        )
    );
}

#[tokio::test]
async fn connect_rejects_each_bad_body_with_its_own_message() {
    let app = app();
    let good = serde_json::to_value(connect_request("p", 2, 2, 2)).unwrap();
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = good.clone();
        f(&mut v);
        v
    };
    let cases: Vec<(Value, u16, &str)> = vec![
        (
            with(&|v| v["name"] = json!("bad/name")),
            400,
            "pair name `bad/name` is invalid: use 1 to 128 characters from A-Z a-z 0-9 . _ -",
        ),
        (with(&|v| v["name"] = json!("x".repeat(129))), 400, ""),
        (
            with(&|v| v["extra"] = json!(1)),
            422,
            "invalid request body: unknown field `extra`, expected one of `name`, `training`, `inference`, `transport`, `options`",
        ),
        (
            with(&|v| v["training"]["model"]["colour"] = json!("red")),
            422,
            "invalid request body: unknown field `training.model.colour`",
        ),
        (
            with(&|v| v["options"]["retries"] = json!(3)),
            422,
            "invalid request body: unknown field `retries`, expected one of `join_deadline_ms`, `update_deadline_ms`, `bucket_mib`, `buckets`, `checksums`, `apply`, `deltas`, `commit`, `check_finite`",
        ),
        (with(&|v| v["transport"] = json!("pigeon")), 422, ""),
        (
            with(&|v| v["training"]["world_size"] = json!(0)),
            422,
            "training.world_size=0, inference.engines=2 and inference.world_size=4 must all be at least 1",
        ),
        (
            with(&|v| v["inference"]["world_size"] = json!(5)),
            422,
            "inference.world_size=5 is not a multiple of inference.engines=2; it counts the ranks of all engines together",
        ),
        (
            with(&|v| {
                v["training"]["world_size"] = json!(65_000);
                v["inference"]["world_size"] = json!(1000);
            }),
            422,
            "the pair has 65000 training + 1000 inference ranks; at most 65536 ranks in all are accepted",
        ),
        (with(&|v| v["training"]["world_size"] = json!(-1)), 422, ""),
        (
            with(&|v| v["inference"]["urls"] = json!(["http://127.0.0.1:1"])),
            422,
            "inference.urls has 1 URLs for 2 engines; give one per engine or none",
        ),
        (
            with(&|v| v["inference"]["urls"] = json!(["http://127.0.0.1:1", "file:///etc/passwd"])),
            422,
            "inference.urls[1] `file:///etc/passwd` is not an engine base URL; expected e.g. http://10.0.0.5:30000",
        ),
        (
            with(&|v| v["options"]["update_deadline_ms"] = json!(0)),
            422,
            "options.update_deadline_ms=0 is out of range; it must be between 1 and 86400000",
        ),
        (
            with(&|v| v["options"]["buckets"] = json!(1000)),
            422,
            "options.buckets=1000 is out of range; it must be between 1 and 64",
        ),
        (
            with(&|v| v["options"]["commit"] = json!("most")),
            422,
            "invalid request body: `most` is not a commit policy: use `all`, `available` or `quorum:K` (K engines, at least 1)",
        ),
        (
            with(&|v| v["options"]["commit"] = json!("quorum:0")),
            422,
            "invalid request body: `quorum:0`: the quorum K in `quorum:K` must be a whole number of engines, at least 1",
        ),
        (
            with(&|v| v["options"]["commit"] = json!("quorum:3")),
            422,
            "options.commit = `quorum:3` needs 3 engines to apply each version, but the pair has inference.engines=2; use quorum:K with 1 <= K <= 2, or `available`",
        ),
        (
            with(&|v| {
                v["options"]["commit"] = json!("available");
                v["options"]["checksums"] = json!(true);
            }),
            422,
            "options.commit = `available` is refused: options.checksums is on, and it compares the two sides' checksum sums, which are not per engine: a version left out by an engine could never commit; connect with checksums off, or with commit = all",
        ),
        (
            with(&|v| {
                v["options"]["check_finite"] = json!(true);
                v["transport"] = json!("nccl");
            }),
            422,
            "options.check_finite reads the training ranks' sources on the host, and the nccl transport keeps them in GPU memory, where awex has no such check yet; use shm or tcp, or connect without check_finite",
        ),
        (
            with(&|v| v["training"]["backend"] = json!("mega tron")),
            422,
            "training.backend `mega tron` is not a backend name (1 to 64 characters from A-Z a-z 0-9 - _)",
        ),
        (
            with(&|v| v["inference"]["catalogue"]["tensors"] = json!(1)),
            422,
            "",
        ),
        (
            with(&|v| v["training"]["model"]["num_layers"] = json!(1_000_000)),
            422,
            "training model is too large: num_hidden_layers=1000000 is above awex's limit of 1024 (8x the most layers of a real model, 126)",
        ),
        (
            with(&|v| v["training"]["model"]["num_kv_heads"] = json!(3)),
            422,
            "training model is invalid: inconsistent model sizes: num_key_value_heads=3 must divide num_attention_heads=4",
        ),
        (
            with(&|v| {
                v.as_object_mut().unwrap().remove("transport");
            }),
            422,
            "invalid request body: missing field `transport`",
        ),
    ];
    for (body, status, message) in cases {
        let (s, v) = call(&app, "POST", "/v1/pairs", Some(body.clone())).await;
        assert_eq!(s, status, "{v} for {body}");
        if !message.is_empty() {
            assert_eq!(error(&v), message);
        }
    }
    // None of them registered a pair.
    let (s, _) = call(&app, "GET", "/v1/pairs/p/status", None).await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn connect_names_the_side_whose_summary_disagrees_with_its_model() {
    let app = app();
    let mut v = serde_json::to_value(connect_request("p", 1, 1, 1)).unwrap();
    v["inference"]["catalogue"]["digest"] = json!("0000000000000000");
    let (s, e) = call(&app, "POST", "/v1/pairs", Some(v)).await;
    assert_eq!(s, 422);
    assert_eq!(
        error(&e),
        "the inference catalogue summary does not match its model `qwen3-tiny`: the request says 47 tensors, 552320 bytes, digest 0000000000000000, which is not what this model yields; send the summary awex computes from the model itself (`Catalogue::of(model).summary()`, as `awex-cli pair connect` and the Python package do), and check that both were built from the same config"
    );
    // the summary that would pass is not handed out
    let right = awex_core::Catalogue::of(&gateway_common::tiny()).summary();
    assert!(!error(&e).contains(&right.digest), "{e}");
}

#[tokio::test]
async fn connect_bounds_free_form_fields_by_what_a_real_model_needs() {
    let app = app();
    let mut body = serde_json::to_value(connect_request("p", 1, 1, 1)).unwrap();
    body["training"]["model"]["name"] = json!("m".repeat(2000));
    let (s, v) = call(&app, "POST", "/v1/pairs", Some(body)).await;
    assert_eq!(
        (s, error(&v)),
        (
            422,
            "training model is too large: name (`_name_or_path`) bytes=2000 is above awex's limit of 1024 (an HF model id has at most 96 characters, a local path rarely 256)"
        )
    );
    let mut body = serde_json::to_value(connect_request("p", 1, 1, 1)).unwrap();
    body["inference"]["catalogue"]["digest"] = json!("f".repeat(40_000));
    let (s, v) = call(&app, "POST", "/v1/pairs", Some(body)).await;
    assert_eq!(s, 422, "{v}");
    assert!(error(&v).len() < 1000, "{} bytes", error(&v).len());
    let (s, _) = call(&app, "GET", "/v1/pairs/p/status", None).await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn connect_checks_an_fp8_config_as_the_cli_and_the_python_package_do() {
    let app = app();
    let base = serde_json::to_value(connect_request("p", 1, 1, 1)).unwrap();
    let fp8 = |config: Value| json!({"config": config, "recipe": "vllm"});
    let good = json!({"encoding": {"block": [128, 128], "scale_format": "f32"},
                      "activation_scheme": "dynamic", "ignored_layers": []});
    let with = |k: &str, v: Value| {
        let mut c = good.clone();
        c[k] = v;
        c
    };
    let cases: Vec<(Value, &str)> = vec![
        (
            fp8(with("activation_scheme", json!("static"))),
            "inference.fp8.config: quantization_config `activation_scheme` is \"static\"; block FP8 (weight_block_size set) needs \"dynamic\" (vLLM refuses the pair too)",
        ),
        (
            fp8(with("ignored_layers", json!([""]))),
            "inference.fp8.config: quantization_config `ignored_layers` is \"\"; every entry must be a module name of 1 to 512 bytes, e.g. \"lm_head\"",
        ),
        (fp8(with("colour", json!("blue"))), "colour"),
        (
            {
                let mut f = fp8(good.clone());
                f["extra"] = json!(1);
                f
            },
            "extra",
        ),
        (
            fp8(with("ignored_layers", json!([123, null]))),
            "invalid request body",
        ),
    ];
    for (f, want) in cases {
        let mut body = base.clone();
        body["inference"]["fp8"] = f.clone();
        let (s, v) = call(&app, "POST", "/v1/pairs", Some(body)).await;
        assert_eq!(s, 422, "{v} for {f}");
        assert!(error(&v).contains(want), "{} for {f}", error(&v));
    }
    // a huge activation_scheme: refused, and not echoed back whole
    let mut body = base.clone();
    body["inference"]["fp8"] = fp8(with("activation_scheme", json!("d".repeat(50_000))));
    let (s, v) = call(&app, "POST", "/v1/pairs", Some(body)).await;
    assert_eq!(s, 422, "{v}");
    assert!(error(&v).len() < 1000, "{} bytes", error(&v).len());
    let (s, _) = call(&app, "GET", "/v1/pairs/p/status", None).await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn connect_refuses_a_deepseek_model_with_an_empty_mla_size() {
    let app = app();
    let deepseek = awex_core::model::presets::preset("deepseek-v3-tiny").unwrap();
    for (field, want) in [
        (
            "kv_lora_rank",
            "training model is invalid: config.json field `kv_lora_rank`: must be at least 1 (DeepSeek-V3 has 512)",
        ),
        (
            "q_lora_rank",
            "training model is invalid: config.json field `q_lora_rank`: must be at least 1 (DeepSeek-V3 has 1536), or null for a plain q_proj (DeepSeek-V2-Lite)",
        ),
        (
            "v_head_dim",
            "training model is invalid: config.json field `v_head_dim`: must be at least 1 (DeepSeek-V3 has 128)",
        ),
    ] {
        let mut model = deepseek.clone();
        if let Some(m) = &mut model.mla {
            match field {
                "kv_lora_rank" => m.kv_lora_rank = 0,
                "q_lora_rank" => m.q_lora_rank = Some(0),
                _ => m.v_head_dim = 0,
            }
        }
        let mut req = connect_request("p", 1, 1, 1);
        // both sides the same hostile model, each with the summary it yields (built without
        // panicking: the catalogue lists the empty tensors; the layouts never see them)
        let summary = awex_core::Catalogue::of(&model).summary();
        req.training.model = model.clone();
        req.training.catalogue = summary.clone();
        req.inference.model = model;
        req.inference.catalogue = summary;
        let (s, v) = call(
            &app,
            "POST",
            "/v1/pairs",
            Some(serde_json::to_value(&req).unwrap()),
        )
        .await;
        assert_eq!((s, error(&v)), (422, want), "{field}");
    }
    let (s, _) = call(&app, "GET", "/v1/pairs/p/status", None).await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn connect_names_the_first_differing_tensor_before_any_rank_joins() {
    let app = app();
    let mut req = connect_request("p", 1, 1, 1);
    req.inference.model.intermediate_size = 96;
    req.inference.catalogue = awex_core::Catalogue::of(&req.inference.model).summary();
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs",
        Some(serde_json::to_value(&req).unwrap()),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (
            422,
            "the two sides do not describe the same canonical tensors: tensor `model.layers.0.mlp.gate_proj.weight` has shape [128, 64] (bf16) on the training side and [96, 64] (bf16) on the inference side"
        )
    );
    // A dtype difference the sender converts is fine: f32 training, bf16 inference.
    let mut req = connect_request("p", 1, 1, 1);
    req.training.model.dtype = awex_core::DType::F32;
    req.training.catalogue = awex_core::Catalogue::of(&req.training.model).summary();
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs",
        Some(serde_json::to_value(&req).unwrap()),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    assert_ne!(v["training"]["fingerprint"], v["inference"]["fingerprint"]);
}

#[tokio::test]
async fn malformed_oversized_and_non_json_bodies_are_400_413_415() {
    let app = app();
    let (s, v) = send(
        &app,
        "POST",
        "/v1/pairs",
        Some(TOKEN),
        Some(b"{\"name\": ".to_vec()),
    )
    .await;
    assert_eq!(s, 400);
    assert!(
        error(&v).starts_with("the request body is not valid JSON: EOF while parsing"),
        "{v}"
    );
    let (s, v) = send(
        &app,
        "POST",
        "/v1/pairs",
        Some(TOKEN),
        Some(vec![b' '; 70 * 1024]),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (
            413,
            "the request body exceeds the gateway's limit of 65536 bytes"
        )
    );
    let req = Request::builder()
        .method("POST")
        .uri("/v1/pairs")
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::from("{}"))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status().as_u16(), 415);
    let deep = "[".repeat(10_000);
    let (s, _) = send(
        &app,
        "POST",
        "/v1/pairs",
        Some(TOKEN),
        Some(deep.into_bytes()),
    )
    .await;
    assert_eq!(s, 400);
}

#[tokio::test]
async fn joins_outside_the_pair_or_with_huge_info_are_refused() {
    let app = app();
    connected(&app, "p", 2, 2, 2).await;
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs/p/ranks?timeout_ms=0",
        Some(json!({"side": "inference", "rank": {"engine": 2, "rank": 0}})),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (
            422,
            "inference rank {engine: 2, rank: 0} is not in this pair: engines 0..2, ranks 0..2 per engine"
        )
    );
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs/p/ranks?timeout_ms=0",
        Some(json!({"side": "training", "rank": {"engine": 0, "rank": 2}})),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (
            422,
            "training rank {engine: 0, rank: 2} is not in this pair: training ranks are {engine: 0, rank: 0..2}"
        )
    );
    let big = "x".repeat(60 * 1024);
    let (s, v) = call(&app, "POST", "/v1/pairs/p/ranks?timeout_ms=0", Some(json!({"side": "training", "rank": {"engine": 0, "rank": 0}, "info": [big, "y".repeat(5000)]}))).await;
    assert_eq!(
        (s, error(&v)),
        (
            413,
            "the request body exceeds the gateway's limit of 65536 bytes"
        )
    );
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs/p/ranks?timeout_ms=0",
        Some(
            json!({"side": "training", "rank": {"engine": 0, "rank": 0}, "info": {}, "colour": 1}),
        ),
    )
    .await;
    assert_eq!(s, 422, "{v}");
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs/p/ranks?timeout_ms=70000",
        Some(json!({"side": "training", "rank": {"engine": 0, "rank": 0}})),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (400, "timeout_ms=70000 exceeds the maximum of 60000 ms")
    );
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs/p/ranks?timeout_ms=0",
        Some(json!({"side": "training", "rank": {"engine": 0, "rank": 0}})),
    )
    .await;
    assert_eq!(s, 202);
    conforms("JoinPending", &v).unwrap();
    assert_eq!(
        (v["joined"].as_u64(), v["world_size"].as_u64()),
        (Some(1), Some(6))
    );
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs/nope/ranks",
        Some(json!({"side": "training", "rank": {"engine": 0, "rank": 0}})),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (404, "no pair named `nope`; create it with POST /v1/pairs")
    );
}

#[tokio::test]
async fn kv_values_are_bounded_and_missing_keys_are_404() {
    let app = router(GatewayConfig::default());
    connected(&app, "p", 1, 1, 1).await;
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/pairs/p/kv/nccl.uid",
        Some(json!({"value": [1, 2, 3]})),
    )
    .await;
    assert_eq!(s, 201);
    conforms("KvEntry", &v).unwrap();
    // revisions 1 and 2 are the two sides' models, stored at connect
    assert_eq!(
        v,
        json!({"key": "nccl.uid", "value": [1, 2, 3], "revision": 3})
    );
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/pairs/p/kv/nccl.uid",
        Some(json!({"value": "abc"})),
    )
    .await;
    assert_eq!((s, v["revision"].as_u64()), (200, Some(4)));
    let (s, v) = call(&app, "GET", "/v1/pairs/p/kv/nccl.uid", None).await;
    assert_eq!(
        (s, v),
        (
            200,
            json!({"key": "nccl.uid", "value": "abc", "revision": 4})
        )
    );
    let (s, v) = call(&app, "GET", "/v1/pairs/p/kv/absent", None).await;
    assert_eq!(
        (s, error(&v)),
        (404, "key `absent` is not set in pair `p` (waited 0 ms)")
    );
    let (s, v) = call(&app, "GET", "/v1/pairs/p/kv/absent?timeout_ms=30", None).await;
    assert_eq!(
        (s, error(&v)),
        (404, "key `absent` is not set in pair `p` (waited 30 ms)")
    );
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/pairs/p/kv/bad%20key",
        Some(json!({"value": 1})),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (
            400,
            "key `bad key` is invalid: use 1 to 128 characters from A-Z a-z 0-9 . _ -"
        )
    );
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/pairs/p/kv/big",
        Some(json!({"value": "z".repeat(70_000)})),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (
            413,
            "the value of key `big` is 70002 bytes of JSON; at most 65536 are accepted"
        )
    );
    let (s, v) = call(&app, "PUT", "/v1/pairs/p/kv/k", Some(json!({"val": 1}))).await;
    assert_eq!(s, 422, "{v}");
    // 1,024 keys: nccl.uid, the two models and 1,021 more
    for i in 3..1024 {
        let (s, _) = call(
            &app,
            "PUT",
            &format!("/v1/pairs/p/kv/k{i}"),
            Some(json!({"value": i})),
        )
        .await;
        assert_eq!(s, 201);
    }
    let (s, v) = call(
        &app,
        "PUT",
        "/v1/pairs/p/kv/one-too-many",
        Some(json!({"value": 0})),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (
            409,
            "pair `p` already holds 1024 keys, the limit; reuse a key"
        )
    );
}

#[tokio::test]
async fn out_of_order_update_requests_are_409_404_or_400() {
    let app = app();
    connected(&app, "p", 1, 1, 1).await;
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs/p/updates",
        Some(json!({"version": 1})),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (
            409,
            "pair `p` is still joining: 0 of 2 ranks joined; start updates once every rank joined"
        )
    );
    let report =
        json!({"side": "training", "rank": {"engine": 0, "rank": 0}, "ok": true, "bytes": 10});
    let (s, v) = call(&app, "POST", "/v1/pairs/p/updates/1/report", Some(report)).await;
    assert_eq!(
        (s, error(&v)),
        (
            409,
            "pair `p` has no update of version 1; report only versions announced by an `update` event"
        )
    );
    let (s, v) = call(&app, "GET", "/v1/pairs/p/updates/1", None).await;
    assert_eq!(
        (s, error(&v)),
        (
            404,
            "pair `p` has no update of version 1 (none was started)"
        )
    );
    let (s, v) = call(&app, "GET", "/v1/pairs/p/updates/one", None).await;
    assert_eq!(s, 400, "{v}");
    assert!(error(&v).starts_with("bad path: "), "{v}");
    let (s, v) = call(&app, "GET", "/v1/pairs/p/updates/1?wait=1", None).await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = call(&app, "GET", "/v1/pairs/p/events?after=5&timeout_ms=0", None).await;
    assert_eq!(
        (s, error(&v)),
        (
            409,
            "after=5 is beyond the last event of pair `p` (0); the pair was probably connected again: join it anew"
        )
    );
    let (s, v) = call(&app, "GET", "/v1/pairs/p/events?after=0&timeout_ms=0", None).await;
    assert_eq!((s, v), (200, json!({"events": [], "last_seq": 0})));
    let (s, v) = call(&app, "GET", "/v1/pairs/p/events?after=-1", None).await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs/p/updates",
        Some(json!({"version": "1"})),
    )
    .await;
    assert_eq!(s, 422, "{v}");
}

#[tokio::test]
async fn disconnected_pairs_answer_410_and_their_name_is_free_again() {
    let app = app();
    connected(&app, "p", 1, 1, 1).await;
    let (s, v) = call(&app, "DELETE", "/v1/pairs/p", None).await;
    assert_eq!((s, v["state"].as_str()), (200, Some("disconnected")));
    let (s, v) = call(&app, "DELETE", "/v1/pairs/p", None).await;
    assert_eq!(
        (s, error(&v)),
        (
            410,
            "pair `p` was disconnected; connect it again with POST /v1/pairs"
        )
    );
    let (s, v) = call(&app, "GET", "/v1/pairs/p/events?after=0", None).await;
    assert_eq!(s, 200);
    assert_eq!(v["events"], json!([{"seq": 1, "kind": "disconnect"}]));
    let (s, _) = call(
        &app,
        "POST",
        "/v1/pairs/p/ranks",
        Some(json!({"side": "training", "rank": {"engine": 0, "rank": 0}})),
    )
    .await;
    assert_eq!(s, 410);
    connected(&app, "p", 1, 1, 1).await;
}

#[tokio::test]
async fn join_after_the_deadline_is_409_naming_the_missing_ranks() {
    let app = app();
    let mut req = connect_request("late", 2, 1, 1);
    req.options.join_deadline_ms = 50;
    let (s, _) = call(
        &app,
        "POST",
        "/v1/pairs",
        Some(serde_json::to_value(&req).unwrap()),
    )
    .await;
    assert_eq!(s, 201);
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs/late/ranks",
        Some(json!({"side": "training", "rank": {"engine": 0, "rank": 0}})),
    )
    .await;
    assert_eq!(
        (s, error(&v)),
        (
            408,
            "pair `late` failed to join: join deadline of 50 ms passed with 1 of 3 ranks joined; missing: training rank 1, inference rank 0/0; disconnect it and connect again"
        )
    );
    let (s, v) = call(
        &app,
        "POST",
        "/v1/pairs/late/ranks",
        Some(json!({"side": "training", "rank": {"engine": 0, "rank": 1}})),
    )
    .await;
    assert_eq!(s, 409);
    assert!(error(&v).contains("missing: training rank 1, inference rank 0/0"));
    let (_, v) = call(&app, "GET", "/v1/pairs/late/status", None).await;
    assert_eq!(v["state"], "join_failed");
    let (s, _) = call(&app, "DELETE", "/v1/pairs/late", None).await;
    assert_eq!(s, 200);
}

#[test]
fn tiny_model_is_the_one_the_tests_use() {
    assert_eq!(tiny().num_layers, 4);
}

/// A model's Gated DeltaNet sizes (`ModelSpec::linear`) as a connect request spells them.
fn linear(key_head_dim: u64, full_attention_layers: Vec<u64>) -> Value {
    json!({
        "num_key_heads": 4, "num_value_heads": 8, "key_head_dim": key_head_dim,
        "value_head_dim": 16, "conv_kernel": 4,
        "full_attention_layers": full_attention_layers, "attn_output_gate": true
    })
}

#[tokio::test]
async fn connect_applies_the_same_bounds_as_every_other_entry_point() {
    let app = app();
    let good = serde_json::to_value(connect_request("p", 2, 2, 2)).unwrap();
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = good.clone();
        f(&mut v);
        v
    };
    let cases: Vec<(Value, &str)> = vec![
        (
            with(&|v| v["training"]["parallel"]["dp"] = json!(1_000_000_000u64)),
            "training.parallel: megatron dp=1000000000 is above awex's limit of 65536 (one side of a pair has at most 65536 ranks)",
        ),
        (
            with(&|v| v["inference"]["parallel"]["engines"] = json!(100_000)),
            "inference.parallel: sglang engines=100000 is above awex's limit of 65536 (one side of a pair has at most 65536 ranks)",
        ),
        (
            with(&|v| v["inference"]["parallel"]["tp"] = json!(100_000)),
            "inference.parallel: sglang tp=100000 is above awex's limit of 1024 (tensor parallelism splits attention heads, of which a model has at most 1024)",
        ),
        (
            with(&|v| v["inference"]["model"]["vocab_size"] = json!(1u64 << 62)),
            "inference model is too large: vocab_size=4611686018427387904 is above awex's limit of 4194304 (16x the largest real vocabulary, 262144)",
        ),
        (
            with(&|v| v["training"]["model"]["head_dim"] = json!(u64::MAX)),
            "training model is too large: head_dim=18446744073709551615 is above awex's limit of 1024 (4x the largest real head_dim, 256)",
        ),
        (
            with(&|v| v["training"]["model"]["num_layers"] = json!(1_000_000_000u64)),
            "training model is too large: num_hidden_layers=1000000000 is above awex's limit of 1024 (8x the most layers of a real model, 126)",
        ),
        (
            with(&|v| v["training"]["model"]["linear"] = linear(u64::MAX, vec![3])),
            "training model is too large: linear_key_head_dim=18446744073709551615 is above awex's limit of 1024 (4x the largest real head_dim, 256)",
        ),
        (
            // a list the family check would search once per layer
            with(&|v| v["inference"]["model"]["linear"] = linear(16, vec![3; 2000])),
            "inference model is too large: full-attention layers (`layer_types`)=2000 is above awex's limit of 1024 (it lists at most one entry per layer)",
        ),
    ];
    // (each is refused by the limit check that runs before any catalogue or layout is built:
    // awex-core/tests/limits.rs counts what such a refusal allocates)
    for (body, message) in cases {
        let (s, v) = call(&app, "POST", "/v1/pairs", Some(body.clone())).await;
        assert_eq!((s, error(&v)), (422, message), "{body}");
    }
    let (s, _) = call(&app, "GET", "/v1/pairs/p/status", None).await;
    assert_eq!(s, 404);
}

/// An engine that holds boxes transposed (gpt-oss's experts on SGLang) is moved over cuda-ipc
/// (the receiver's GPU transposes, deltas or not) and over shm and tcp without deltas: connect
/// refuses nccl, and deltas on shm or tcp, naming the tensor.
#[tokio::test]
async fn connect_refuses_transposed_boxes_where_the_pair_could_not_move_them() {
    use awex_core::Transport;
    use awex_core::backend::ParallelConfig;
    let app = app();
    let gpt_oss = |name: &str, transport: Transport, deltas: bool| {
        let mut req = connect_request(name, 1, 1, 1);
        let model = awex_core::model::presets::preset("gpt-oss-tiny").expect("preset");
        let summary = awex_core::Catalogue::of(&model).summary();
        req.training.backend = "fsdp".into();
        req.training.parallel = ParallelConfig::from_pairs([("dp", 1), ("fused_experts", 1)]);
        req.training.model = model.clone();
        req.training.catalogue = summary.clone();
        req.inference.model = model;
        req.inference.catalogue = summary;
        req.transport = transport;
        req.options.deltas = deltas;
        serde_json::to_value(&req).unwrap()
    };
    for (transport, deltas, why) in [
        (Transport::Shm, true, "options.deltas"),
        (Transport::Tcp, true, "options.deltas"),
    ] {
        let (s, v) = call(
            &app,
            "POST",
            "/v1/pairs",
            Some(gpt_oss("g", transport, deltas)),
        )
        .await;
        assert_eq!(
            (s, error(&v)),
            (
                422,
                format!(
                    "inference.parallel `sglang:tp=1` holds `model.layers.0.mlp.experts.gate_up_proj` transposed (as `model.layers.0.mlp.experts.w13_weight`: the engine stores it with its last two dims swapped), which {why} does not move yet; use the cuda-ipc or nccl transport, or shm or tcp without delta updates"
                )
                .as_str()
            )
        );
    }
    // shm without deltas connects, and cuda-ipc and nccl (the receiver's GPU transposes) with
    // or without
    for (name, transport, deltas) in [
        ("g", Transport::Shm, false),
        ("g2", Transport::CudaIpc, false),
        ("g3", Transport::CudaIpc, true),
        ("g4", Transport::Nccl, false),
        ("g5", Transport::Nccl, true),
    ] {
        let (s, v) = call(
            &app,
            "POST",
            "/v1/pairs",
            Some(gpt_oss(name, transport, deltas)),
        )
        .await;
        assert_eq!(s, 201, "{transport} deltas={deltas}: {v}");
    }
}
