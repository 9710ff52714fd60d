//! A flood of idle connections cannot starve the gateway: connections beyond the limit get 503
//! at once, silent ones are closed after the header or idle timeout, and `/healthz` answers
//! again as soon as they are gone.

mod gateway_common;

use awex_control::server::GatewayConfig;
use gateway_common::start;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn get(addr: &str, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_beyond_the_limit_are_refused_and_silent_ones_closed() {
    let base = start(GatewayConfig {
        max_connections: 16,
        header_timeout: Duration::from_millis(400),
        idle_timeout: Duration::from_secs(300),
        ..GatewayConfig::default()
    })
    .await;
    let addr = base.trim_start_matches("http://").to_string();
    // 64 connections that never send a byte
    let mut idle = Vec::new();
    for _ in 0..64 {
        idle.push(TcpStream::connect(&addr).await.unwrap());
    }
    // the ones over the limit were answered 503 and closed at once
    let mut refused = 0;
    for s in idle.iter_mut() {
        let mut buf = vec![0u8; 512];
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await
        {
            let text = String::from_utf8_lossy(&buf[..n]);
            if text.starts_with("HTTP/1.1 503") {
                assert!(text.contains("maximum of 16 open connections"), "{text}");
                refused += 1;
            }
        }
    }
    assert_eq!(
        refused, 48,
        "every connection over the limit of 16 is refused"
    );
    // the 16 silent ones are closed by the header timeout (the idle timeout, 5 min, would
    // keep them); the API answers again
    let t0 = Instant::now();
    let health = loop {
        match get(&addr, "/healthz").await {
            Ok(r) if r.starts_with("HTTP/1.1 200") => break r,
            _ => {
                assert!(
                    t0.elapsed() < Duration::from_secs(120),
                    "healthz never came back"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert!(health.contains("ok"), "{health}");
    for s in idle.iter_mut() {
        let mut buf = [0u8; 16];
        let r = tokio::time::timeout(Duration::from_secs(120), s.read(&mut buf)).await;
        assert!(
            r.is_ok(),
            "a silent connection stays open past the header timeout"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_live_pairs_count_toward_the_limit_and_a_name_just_disconnected_connects_again() {
    use awex_control::client::Client;
    use gateway_common::connect_request;
    let base = start(GatewayConfig {
        max_pairs: 2,
        tombstone: Duration::from_secs(600),
        ..GatewayConfig::default()
    })
    .await;
    let client = Client::new(&base, None).unwrap();
    client
        .connect(&connect_request("a", 1, 1, 1))
        .await
        .unwrap();
    client
        .connect(&connect_request("b", 1, 1, 1))
        .await
        .unwrap();
    let full = client
        .connect(&connect_request("c", 1, 1, 1))
        .await
        .unwrap_err();
    assert_eq!(full.status(), Some(409));
    assert!(
        full.to_string()
            .contains("the gateway holds 2 live pairs, its limit"),
        "{full}"
    );
    // many connect/disconnect cycles within the tombstone time: a disconnected pair does not
    // count, and its name connects again at once
    client.disconnect("b").await.unwrap();
    for i in 0..10 {
        let name = format!("cycle{i}");
        client
            .connect(&connect_request(&name, 1, 1, 1))
            .await
            .unwrap();
        client.disconnect(&name).await.unwrap();
        client
            .connect(&connect_request(&name, 1, 1, 1))
            .await
            .unwrap();
        client.disconnect(&name).await.unwrap();
    }
    // the newest tombstones are remembered (their ranks still see `disconnect`): 410, not 404
    let gone = client.status("cycle9").await.unwrap();
    assert_eq!(gone.state, awex_control::wire::PairState::Disconnected);
    // at most `max_pairs` tombstones: the oldest were forgotten early
    let e = client.status("cycle0").await.unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");
    client
        .connect(&connect_request("b", 1, 1, 1))
        .await
        .unwrap();
}
