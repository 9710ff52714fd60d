//! SGLang detection through a gathered probe, against recorded server-info responses served
//! from 127.0.0.1.

use awex_core::backend::Backend;
use awex_core::backend::{ParallelConfig, Probe};
use awex_sglang::SglangBackend;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const V05: &str = include_str!("../../awex-sglang/tests/fixtures/server_info_v0.5.json");
const V040: &str = include_str!("../../awex-sglang/tests/fixtures/get_server_info_v0.4.0.json");

/// A minimal HTTP/1.1 server answering `GET path` from a fixed table, recording each path asked.
struct FakeServer {
    url: String,
    asked: Arc<Mutex<Vec<String>>>,
}

async fn serve(routes: Vec<(&'static str, u16, String)>) -> FakeServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let asked = Arc::new(Mutex::new(Vec::new()));
    let log = asked.clone();
    let routes = Arc::new(routes);
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let routes = routes.clone();
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf);
                let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                log.lock().expect("log").push(path.clone());
                let (status, body) = routes
                    .iter()
                    .find(|(p, _, _)| *p == path)
                    .map(|(_, s, b)| (*s, b.clone()))
                    .unwrap_or((404, r#"{"detail":"Not Found"}"#.to_string()));
                let reason = if status == 200 { "OK" } else { "Not Found" };
                let resp = format!(
                    "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    FakeServer { url, asked }
}

async fn probe(url: Option<&str>, sglang_installed: bool) -> Probe {
    let mut p = awex_control::probe::gather(
        &[],
        SglangBackend.server_info_paths(),
        None,
        url.map(str::to_string),
        Duration::from_millis(500),
    )
    .await;
    let mut packages = BTreeMap::new();
    if sglang_installed {
        packages.insert("sglang".to_string(), true);
    }
    p.python_packages = packages;
    p
}
fn parallel(tp: u64, ep: u64) -> Option<ParallelConfig> {
    Some(ParallelConfig::from_pairs([
        ("tp", tp),
        ("ep", ep),
        ("engines", 1),
    ]))
}

#[tokio::test]
async fn live_server_reports_tp_ep_and_dp() {
    let server = serve(vec![("/server_info", 200, V05.to_string())]).await;
    let url = server.url.clone();
    let d = SglangBackend.detect(&probe(Some(&url), true).await);
    assert_eq!(d.parallel, parallel(4, 2));
    assert!((d.score - 1.0).abs() < 1e-9, "score {}", d.score);
    assert_eq!(
        d.evidence,
        vec![
            "python package `sglang` is importable".to_string(),
            format!(
                "SGLang 0.5.2 server at {url} (GET /server_info): model_path=Qwen/Qwen3-30B-A3B, tp_size=4, ep_size=2"
            ),
            "dp_size=2: the server runs 2 data-parallel replicas of tp_size=4; awex lays out one engine of tp=4 ranks (engines=1)".to_string(),
            "custom weight loader: unknown (the server's info has no `custom_weight_loader`; awex needs `--custom-weight-loader awex.sglang.receive`)".to_string(),
        ]
    );
    assert_eq!(
        *server.asked.lock().expect("log"),
        vec!["/server_info".to_string()]
    );
}

#[tokio::test]
async fn older_server_answers_on_the_legacy_path() {
    let server = serve(vec![("/get_server_info", 200, V040.to_string())]).await;
    let url = server.url.clone();
    let d = SglangBackend.detect(&probe(Some(&url), false).await);
    assert_eq!(d.parallel, parallel(2, 1));
    assert!((d.score - 0.7).abs() < 1e-9, "score {}", d.score);
    assert_eq!(
        d.evidence,
        vec![
            format!(
                "SGLang 0.4.0 server at {url} (GET /get_server_info): model_path=meta-llama/Llama-3.1-8B-Instruct, tp_size=2, ep_size=1"
            ),
            "dp_size=1: the server runs 1 data-parallel replica of tp_size=2; awex lays out one engine of tp=2 ranks (engines=1)".to_string(),
            "custom weight loader: unknown (the server's info has no `custom_weight_loader`; awex needs `--custom-weight-loader awex.sglang.receive`)".to_string(),
        ]
    );
    assert_eq!(
        *server.asked.lock().expect("log"),
        vec!["/server_info".to_string(), "/get_server_info".to_string()]
    );
}

#[tokio::test]
async fn whether_awexs_loader_is_allowed_is_reported() {
    // SGLang 0.5.23 resolves an unset `--custom-weight-loader` to [] (model_path_hook.py)
    for (loaders, said) in [
        (
            serde_json::json!(["awex.sglang.receive"]),
            "custom weight loader: awex.sglang.receive is allowed (custom_weight_loader=[\"awex.sglang.receive\"])",
        ),
        (
            serde_json::json!([]),
            "custom weight loader: awex.sglang.receive is not allowed (custom_weight_loader=[]); launch the server with `--custom-weight-loader awex.sglang.receive`",
        ),
        (
            serde_json::json!(["my.loader"]),
            "custom weight loader: awex.sglang.receive is not allowed (custom_weight_loader=[\"my.loader\"]); launch the server with `--custom-weight-loader awex.sglang.receive`",
        ),
    ] {
        let info = serde_json::json!({
            "model_path": "/models/Qwen3-8B", "tp_size": 8, "dp_size": 1, "ep_size": 1,
            "custom_weight_loader": loaders, "version": "0.5.23",
        });
        let server = serve(vec![("/server_info", 200, info.to_string())]).await;
        let url = server.url.clone();
        let d = SglangBackend.detect(&probe(Some(&url), false).await);
        assert_eq!(d.parallel, parallel(8, 1));
        assert_eq!(
            d.evidence,
            vec![
                format!(
                    "SGLang 0.5.23 server at {url} (GET /server_info): model_path=/models/Qwen3-8B, tp_size=8, ep_size=1"
                ),
                "dp_size=1: the server runs 1 data-parallel replica of tp_size=8; awex lays out one engine of tp=8 ranks (engines=1)".to_string(),
                said.to_string(),
            ]
        );
    }
}

#[tokio::test]
async fn dp_attention_is_mentioned_in_evidence() {
    let mut info: Value = serde_json::from_str(V05).expect("fixture");
    info["enable_dp_attention"] = Value::Bool(true);
    let server = serve(vec![("/server_info", 200, info.to_string())]).await;
    let d = SglangBackend.detect(&probe(Some(&server.url), false).await);
    assert_eq!(d.parallel, parallel(4, 2));
    assert_eq!(
        d.evidence.last().map(String::as_str),
        Some(
            "enable_dp_attention=true: attention is split over attn_tp = tp/dp, which awex does not lay out yet; the layout assumes attention split over tp"
        )
    );
}

#[tokio::test]
async fn foreign_server_is_not_taken_for_sglang() {
    let server = serve(vec![(
        "/server_info",
        200,
        r#"{"status":"ok"}"#.to_string(),
    )])
    .await;
    let url = server.url.clone();
    let d = SglangBackend.detect(&probe(Some(&url), false).await);
    assert_eq!(d.parallel, None);
    assert!((d.score - 0.05).abs() < 1e-9, "score {}", d.score);
    assert_eq!(
        d.evidence,
        vec![format!(
            "a server at {url} answered GET /server_info, but not in SGLang's server-info format: the response has no `tp_size`"
        )]
    );
}

#[tokio::test]
async fn no_server_scores_zero_without_hanging() {
    // a port that was just free: nothing listens there
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    drop(listener);
    // (a generous bound: it only says detect does not hang)
    let d = tokio::time::timeout(Duration::from_secs(60), probe(Some(&url), false))
        .await
        .map(|p| SglangBackend.detect(&p))
        .expect("detect returns before the probe timeouts add up");
    assert_eq!(d.score, 0.0);
    assert_eq!(d.parallel, None);
    assert_eq!(d.evidence.len(), 1);
    let e = &d.evidence[0];
    assert!(
        e.starts_with(&format!(
            "no SGLang server answered at {url}: GET {url}/server_info: "
        )),
        "{e}"
    );
    assert!(e.contains(&format!("; GET {url}/get_server_info: ")), "{e}");
}

#[tokio::test]
async fn silent_server_times_out() {
    // accepts connections but never answers
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let hold = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            open.push(sock);
        }
    });
    // two paths, 500 ms each; the server never answers, so only the probe's own timeout ends
    // it (the bound here is generous: it only says detect does not hang)
    let d = tokio::time::timeout(Duration::from_secs(60), probe(Some(&url), false))
        .await
        .map(|p| SglangBackend.detect(&p))
        .expect("detect gives up after the probe timeout");
    assert_eq!(d.score, 0.0);
    assert!(
        d.evidence[0].starts_with(&format!("no SGLang server answered at {url}")),
        "{}",
        d.evidence[0]
    );
    hold.abort();
}

#[tokio::test]
async fn package_alone_without_url_is_partial_evidence() {
    let d = SglangBackend.detect(&probe(None, true).await);
    assert!((d.score - 0.3).abs() < 1e-9, "score {}", d.score);
    assert_eq!(d.parallel, None);
    assert_eq!(
        d.evidence,
        vec![
            "python package `sglang` is importable".to_string(),
            "no server URL given: pass the SGLang server's URL to read its tp/ep/dp sizes"
                .to_string(),
        ]
    );
}
