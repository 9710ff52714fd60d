//! Property test over requests: random methods, paths, query strings, headers and bodies
//! (random JSON, mutated valid bodies, raw bytes) never get a 5xx, never panic the server, and
//! every error answer is `{"error": "<message>"}` with a non-empty message.

mod gateway_common;

use awex_control::server::{GatewayConfig, router};
use axum::Router;
use axum::body::Body;
use axum::http::{Request, header};
use gateway_common::connect_request;
use proptest::prelude::*;
use serde_json::{Value, json};
use tower::ServiceExt;

const TOKEN: &str = "fuzz";

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "[ -~]{0,12}".prop_map(Value::String),
        prop_oneof![
            Just("training"),
            Just("inference"),
            Just("shm"),
            Just("nccl"),
            Just("p"),
            Just("bf16")
        ]
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    "[a-z_]{1,10}".boxed(),
                    prop_oneof![
                        Just("side"),
                        Just("rank"),
                        Just("engine"),
                        Just("ok"),
                        Just("version"),
                        Just("value"),
                        Just("info"),
                        Just("checksum"),
                        Just("bytes"),
                        Just("error")
                    ]
                    .prop_map(String::from)
                    .boxed(),
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Valid bodies of every route, with one field replaced by random JSON (or left intact).
fn mutated_body() -> impl Strategy<Value = Value> {
    let connect = serde_json::to_value(connect_request("p", 1, 1, 1)).unwrap_or(Value::Null);
    let bases = [
        connect,
        json!({"side": "training", "rank": {"engine": 0, "rank": 0}, "info": {"port": 1}}),
        json!({"side": "inference", "rank": {"engine": 0, "rank": 0}, "ok": true, "bytes": 1, "checksum": 2, "attempt": 1}),
        json!({"version": 1}),
        json!({"value": "uid"}),
    ];
    (
        0..bases.len(),
        json_value(),
        any::<prop::sample::Index>(),
        any::<bool>(),
    )
        .prop_map(move |(i, junk, at, replace)| {
            let mut v = bases[i].clone();
            if replace {
                let mut paths = Vec::new();
                collect_paths(&v, String::new(), &mut paths);
                if !paths.is_empty() {
                    let p = &paths[at.index(paths.len())];
                    if let Some(slot) = v.pointer_mut(p) {
                        *slot = junk;
                    }
                }
            }
            v
        })
}

fn collect_paths(v: &Value, here: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = format!("{here}/{k}");
                out.push(p.clone());
                collect_paths(x, p, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                let p = format!("{here}/{i}");
                out.push(p.clone());
                collect_paths(x, p, out);
            }
        }
        _ => {}
    }
}

fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("p".to_string()),
        Just("k".to_string()),
        Just("1".to_string()),
        Just("0".to_string()),
        Just("18446744073709551616".to_string()),
        Just("%FF%FE".to_string()),
        Just("..".to_string()),
        Just("%2F".to_string()),
        Just("x".repeat(300)),
        "[A-Za-z0-9._~%-]{0,16}",
        "\\PC{0,6}".prop_map(|s| s.bytes().map(|b| format!("%{b:02X}")).collect()),
    ]
}

fn query() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        Just("after"),
        Just("timeout_ms"),
        Just("ranks"),
        Just("wait"),
        Just("x")
    ];
    let value = prop_oneof![
        Just("0".to_string()),
        Just("1".to_string()),
        Just("-1".to_string()),
        Just("60000".to_string()),
        Just("60001".to_string()),
        Just("99999999999999999999".to_string()),
        Just("problems".to_string()),
        Just("none".to_string()),
        "[a-z0-9%]{0,6}",
    ];
    prop::collection::vec((key, value), 0..3).prop_map(|kv| {
        if kv.is_empty() {
            String::new()
        } else {
            let parts: Vec<String> = kv.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("?{}", parts.join("&"))
        }
    })
}

#[derive(Debug, Clone)]
enum BodyKind {
    None,
    Json(Value),
    Bytes(Vec<u8>),
    WrongType(Value),
}

fn body() -> impl Strategy<Value = BodyKind> {
    prop_oneof![
        Just(BodyKind::None),
        json_value().prop_map(BodyKind::Json),
        mutated_body().prop_map(BodyKind::Json),
        mutated_body().prop_map(BodyKind::Json),
        prop::collection::vec(any::<u8>(), 0..64).prop_map(BodyKind::Bytes),
        mutated_body().prop_map(BodyKind::WrongType),
    ]
}

fn path() -> impl Strategy<Value = String> {
    let templates = [
        "/healthz",
        "/metrics",
        "/openapi.json",
        "/v1/pairs",
        "/v1/pairs/{a}",
        "/v1/pairs/{a}/status",
        "/v1/pairs/{a}/ranks",
        "/v1/pairs/{a}/kv/{b}",
        "/v1/pairs/{a}/updates",
        "/v1/pairs/{a}/updates/{b}",
        "/v1/pairs/{a}/updates/{b}/report",
        "/v1/pairs/{a}/events",
        "/v1/{a}",
        "/{a}",
    ];
    (
        prop::sample::select(templates.to_vec()),
        segment(),
        segment(),
        query(),
    )
        .prop_map(|(t, a, b, q)| format!("{}{q}", t.replace("{a}", &a).replace("{b}", &b)))
}

fn method() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS",
    ])
}

/// Mostly a routed method and path (so that handlers see the input), sometimes anything.
fn request_line() -> impl Strategy<Value = (&'static str, String)> {
    let routed = [
        ("GET", "/metrics"),
        ("POST", "/v1/pairs"),
        ("DELETE", "/v1/pairs/{a}"),
        ("GET", "/v1/pairs/{a}/status"),
        ("POST", "/v1/pairs/{a}/ranks"),
        ("PUT", "/v1/pairs/{a}/kv/{b}"),
        ("GET", "/v1/pairs/{a}/kv/{b}"),
        ("POST", "/v1/pairs/{a}/updates"),
        ("GET", "/v1/pairs/{a}/updates/{b}"),
        ("POST", "/v1/pairs/{a}/updates/{b}/report"),
        ("GET", "/v1/pairs/{a}/events"),
    ];
    let good = prop_oneof![Just("p".to_string()), Just("p".to_string()), segment()];
    let good_b = prop_oneof![Just("1".to_string()), Just("k".to_string()), segment()];
    prop_oneof![
        4 => (prop::sample::select(routed.to_vec()), good, good_b, query())
            .prop_map(|((m, t), a, b, q)| (m, format!("{}{q}", t.replace("{a}", &a).replace("{b}", &b)))),
        1 => (method(), path()),
    ]
}

/// A gateway holding pair `p` whose ranks have all joined, on a paused clock so that long-polls
/// end at once.
fn setup(rt: &tokio::runtime::Runtime) -> Router {
    let app = router(GatewayConfig {
        token: Some(TOKEN.into()),
        body_limit: 256 * 1024,
        ..GatewayConfig::default()
    });
    rt.block_on(async {
        let _ = send(
            &app,
            "POST",
            "/v1/pairs",
            Some(TOKEN),
            BodyKind::Json(
                serde_json::to_value(connect_request("p", 1, 1, 1)).unwrap_or(Value::Null),
            ),
        )
        .await;
        let _ = send(
            &app,
            "POST",
            "/v1/pairs/p/ranks?timeout_ms=0",
            Some(TOKEN),
            BodyKind::Json(json!({"side": "training", "rank": {"engine": 0, "rank": 0}})),
        )
        .await;
        let _ = send(
            &app,
            "POST",
            "/v1/pairs/p/ranks",
            Some(TOKEN),
            BodyKind::Json(json!({"side": "inference", "rank": {"engine": 0, "rank": 0}})),
        )
        .await;
    });
    app
}

async fn send(
    app: &Router,
    method: &str,
    uri: &str,
    token: Option<&str>,
    body: BodyKind,
) -> Option<(u16, Vec<u8>)> {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let body = match body {
        BodyKind::None => Body::empty(),
        BodyKind::Json(v) => {
            req = req.header(header::CONTENT_TYPE, "application/json");
            Body::from(serde_json::to_vec(&v).unwrap_or_default())
        }
        BodyKind::Bytes(b) => {
            req = req.header(header::CONTENT_TYPE, "application/json");
            Body::from(b)
        }
        BodyKind::WrongType(v) => {
            req = req.header(header::CONTENT_TYPE, "text/plain");
            Body::from(serde_json::to_vec(&v).unwrap_or_default())
        }
    };
    // A URI the http crate refuses never reaches the server.
    let req = req.body(body).ok()?;
    let resp = app.clone().oneshot(req).await.ok()?;
    let status = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .ok()?;
    Some((status, bytes.to_vec()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 768, ..ProptestConfig::default() })]

    #[test]
    fn no_request_gets_a_5xx_and_every_error_has_a_message(
        (m, p) in request_line(),
        b in body(),
        auth in prop_oneof![8 => Just(Some(TOKEN)), 1 => Just(None), 1 => Just(Some("wrong"))],
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        let app = setup(&rt);
        let answer = rt.block_on(send(&app, m, &p, auth, b.clone()));
        let Some((status, bytes)) = answer else { return Ok(()) };
        prop_assert!(status < 500, "{} {} -> {} {}", m, p, status, String::from_utf8_lossy(&bytes));
        if status >= 400 && m != "HEAD" {
            let v: Value = serde_json::from_slice(&bytes).map_err(|e| TestCaseError::fail(format!("{m} {p} -> {status}: body is not JSON ({e})")))?;
            let msg = v["error"].as_str().unwrap_or_default();
            prop_assert!(!msg.is_empty(), "{} {} -> {} without a message: {}", m, p, status, v);
            prop_assert_eq!(v.as_object().map(|o| o.len()), Some(1));
        }
        if auth != Some(TOKEN) && (p.starts_with("/v1/") || p.starts_with("/metrics")) && status < 400 {
            prop_assert!(false, "{} {} succeeded without the token", m, p);
        }
        // The server still answers afterwards.
        let health = rt.block_on(send(&app, "GET", "/healthz", None, BodyKind::None));
        prop_assert_eq!(health.map(|h| h.0), Some(200));
    }
}
