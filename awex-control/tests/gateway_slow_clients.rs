//! Slow clients cannot hold the gateway: a request head must arrive whole within the header
//! timeout and a body within the body timeout however their bytes trickle in, and connections
//! without the token cannot take the slots the controller and the ranks need, so `/healthz`
//! and starting an update keep working during a flood of them.

mod gateway_common;

use awex_control::client::{Client, JoinOutcome};
use awex_control::server::GatewayConfig;
use awex_control::wire::JoinRequest;
use awex_core::{RankId, Side};
use gateway_common::{connect_request, start};
use serde_json::json;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `head` then trickles `trickle` one byte every 100 ms; returns how many trickled bytes
/// were written before the gateway closed the connection (or answered), `None` if it never did.
async fn trickle(addr: &str, head: &[u8], trickle: &[u8]) -> (Option<usize>, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head).await.unwrap();
    let mut buf = vec![0u8; 4096];
    for (i, b) in trickle.iter().enumerate() {
        if s.write_all(&[*b]).await.is_err() {
            return (Some(i), String::new());
        }
        match tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await {
            Ok(Ok(n)) => return (Some(i), String::from_utf8_lossy(&buf[..n]).into_owned()),
            Ok(Err(_)) => return (Some(i), String::new()),
            Err(_) => {}
        }
    }
    (None, String::new())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_request_head_is_closed_at_the_header_timeout() {
    let base = start(GatewayConfig {
        header_timeout: Duration::from_secs(1),
        ..GatewayConfig::default()
    })
    .await;
    let addr = base.trim_start_matches("http://");
    // 400 header bytes at 10 per second would take 40 s; each byte used to restart the timer
    let header = "x-slow: ".to_string() + &"a".repeat(390);
    let (closed_after, _) = trickle(
        addr,
        b"GET /healthz HTTP/1.1\r\nhost: x\r\n",
        header.as_bytes(),
    )
    .await;
    let n = closed_after.expect("the connection trickling its head was never closed");
    // 1 s at 10 bytes a second, with a generous margin for a loaded machine
    assert!(n < 390, "closed only after {n} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_request_body_is_refused_at_the_body_timeout() {
    let base = start(GatewayConfig {
        body_timeout: Duration::from_secs(1),
        ..GatewayConfig::default()
    })
    .await;
    let addr = base.trim_start_matches("http://");
    let body = format!("{{\"name\": \"{}\"}}", "a".repeat(380));
    let head = format!(
        "POST /v1/pairs HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let (answered_after, answer) = trickle(addr, head.as_bytes(), body.as_bytes()).await;
    let n = answered_after.expect("the connection trickling its body was never answered");
    assert!(n < body.len() - 10, "answered only after {n} bytes");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("the request body did not arrive within 1 s"),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_and_an_update_start_keep_working_during_a_flood_without_the_token() {
    let token = "fl00d-t0ken";
    let base = start(GatewayConfig {
        token: Some(token.into()),
        max_connections: 32,
        header_timeout: Duration::from_secs(600),
        idle_timeout: Duration::from_secs(600),
        ..GatewayConfig::default()
    })
    .await;
    let addr = base.trim_start_matches("http://").to_string();
    let c = Client::new(&base, Some(token.into()))
        .unwrap()
        .with_retries(0);
    c.connect(&connect_request("fl", 1, 1, 1)).await.unwrap();
    let jr = |side, rank| JoinRequest {
        side,
        rank,
        info: json!({}),
        capabilities: vec![],
    };
    assert!(matches!(
        c.join_once("fl", &jr(Side::Training, RankId::train(0)), Duration::ZERO)
            .await
            .unwrap(),
        JoinOutcome::Pending(_)
    ));
    c.join("fl", &jr(Side::Inference, RankId::infer(0, 0)))
        .await
        .unwrap();
    // 100 token-less connections trickling a header byte every 500 ms (the header timeout is
    // long: only the reserve keeps slots for the token holders)
    let mut flood = Vec::new();
    for _ in 0..100 {
        let a = addr.clone();
        flood.push(tokio::spawn(async move {
            let Ok(mut s) = TcpStream::connect(&a).await else {
                return;
            };
            if s.write_all(b"GET /healthz HTTP/1.1\r\nx-slow: ")
                .await
                .is_err()
            {
                return;
            }
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if s.write_all(b"a").await.is_err() {
                    return;
                }
            }
        }));
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // new connections: a fresh client each time
    let fresh = || {
        Client::new(&base, Some(token.into()))
            .unwrap()
            .with_retries(0)
    };
    fresh().healthz().await.expect("healthz during the flood");
    let st = fresh()
        .start_update("fl", 1)
        .await
        .expect("an update starts during the flood");
    assert_eq!(st.version, 1);
    fresh().status("fl").await.expect("status during the flood");
    for f in flood {
        f.abort();
    }
}
