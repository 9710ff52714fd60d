//! `/healthz` and `/metrics` keep answering while the gateway validates 24 connects of a
//! 1T-parameter model at once: validation (catalogues and layouts, CPU-heavy) runs on the
//! blocking pool, a core fewer at once than the machine has, never on the async workers that
//! answer requests; `/metrics` counts the validations running
//! (`awex_gateway_connect_validations`).

mod gateway_common;

use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::{ConnectRequest, InferenceSpec, PairOptions, TrainingSpec, Transport};
use awex_core::model::presets::preset;
use awex_core::{Catalogue, ParallelConfig};
use gateway_common::start;
use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

fn moe_1t(name: &str) -> ConnectRequest {
    let model = preset("moe-1t").expect("moe-1t preset");
    let summary = Catalogue::of(&model).summary();
    ConnectRequest {
        name: name.to_string(),
        training: TrainingSpec {
            backend: "megatron".into(),
            parallel: ParallelConfig::from_pairs([("tp", 8), ("pp", 8), ("ep", 32)]),
            world_size: 1024,
            model: model.clone(),
            catalogue: summary.clone(),
        },
        inference: InferenceSpec {
            spare: 0,
            fp8: None,
            backend: "sglang".into(),
            parallel: ParallelConfig::from_pairs([("tp", 8)]),
            engines: 16,
            world_size: 128,
            urls: Vec::new(),
            model,
            catalogue: summary,
        },
        transport: Transport::Nccl,
        options: PairOptions::default(),
    }
}

/// One `GET` of `path` on a fresh connection: the answer's body (the status must be 200).
fn get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    assert!(out.starts_with("HTTP/1.1 200"), "{path}: {out}");
    out.split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string())
}

/// The connect validations `/metrics` counts as running when it answers.
fn validations_running(addr: &str) -> u64 {
    let body = get(addr, "/metrics");
    body.lines()
        .find_map(|l| l.strip_prefix("awex_gateway_connect_validations "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no awex_gateway_connect_validations gauge in\n{body}"))
}

// One async worker: a validation run on it would hold every request until it ended, so no
// answer could report one running. Counted, not timed: answers given while a validation ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn healthz_and_metrics_answer_while_24_moe_1t_connects_are_validated() {
    let base = start(GatewayConfig::default()).await;
    let addr = base.trim_start_matches("http://").to_string();
    let client = Client::new(&base, None).unwrap();
    let busy = Arc::new(AtomicBool::new(true));
    let prober = {
        let (addr, busy) = (addr.clone(), busy.clone());
        std::thread::spawn(move || {
            // (answers, answers while a validation was running)
            let (mut answers, mut during) = (0u32, 0u32);
            while busy.load(Ordering::Acquire) {
                get(&addr, "/healthz");
                answers += 1;
                if validations_running(&addr) > 0 {
                    during += 1;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            (answers, during)
        })
    };
    // built before (the catalogue of 74,000 tensors is CPU work this test must not put on the
    // runtime it shares with the gateway)
    let requests: Vec<_> = (0..24).map(|i| moe_1t(&format!("moe-{i}"))).collect();
    let connects: Vec<_> = requests
        .into_iter()
        .map(|req| {
            let client = client.clone();
            tokio::spawn(async move { client.connect(&req).await })
        })
        .collect();
    for c in connects {
        c.await.expect("connect task").expect("moe-1t connect");
    }
    busy.store(false, Ordering::Release);
    let (answers, during) = prober.join().expect("prober");
    println!(
        "/healthz and /metrics during 24 moe-1t connects: {answers} answers, {during} while a validation ran"
    );
    // 24 validations of seconds each against a probe every 10 ms: many answers land inside one
    assert!(
        during >= 3,
        "{during} of {answers} answers came while a connect was being validated: validation holds the async workers"
    );
    assert_eq!(
        validations_running(&addr),
        0,
        "validations still counted after every connect returned"
    );
}
