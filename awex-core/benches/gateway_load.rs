//! Gateway load: N simulated ranks (tokio tasks, one HTTP client pool) join one pair on loopback
//! and complete U updates; prints the gateway's control overhead per update (start -> commit as
//! the controller sees it, and as the gateway records it), p50/p99/max, for each N.
//!
//! The ranks move no bytes: every millisecond measured is control plane (HTTP, JSON, long-poll
//! wake-ups, the commit). The floor printed first is one loopback HTTP round trip (`GET
//! /healthz`) measured in the same run.
//!
//! Everything runs on one single-threaded tokio runtime (the measured best on a 2-core machine:
//! no cross-thread wake-ups between the gateway and its simulated ranks).
//!
//! `cargo bench -p awex-core --bench gateway_load -- [--ranks 128,1024] [--updates 10]`

use awex_core::client::Client;
use awex_core::gateway::{
    ConnectRequest, EventKind, GatewayConfig, InferenceSpec, JoinRequest, PairOptions, Report,
    TrainingSpec, Transport, UpdateState,
};
use awex_core::model::presets::preset;
use awex_core::{Catalogue, ParallelConfig, RankId, Side};
use std::time::{Duration, Instant};

struct Options {
    ranks: Vec<u32>,
    updates: u64,
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        ranks: vec![128, 1024],
        updates: 10,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ranks" => {
                let v = args.next().ok_or("--ranks needs a list, e.g. 128,1024")?;
                o.ranks = v
                    .split(',')
                    .map(|x| x.trim().parse::<u32>().map_err(|_| format!("bad rank count `{x}`")))
                    .collect::<Result<_, _>>()?;
            }
            "--updates" => {
                let v = args.next().ok_or("--updates needs a number")?;
                o.updates = v.parse().map_err(|_| format!("bad update count `{v}`"))?;
            }
            // cargo bench passes --bench; ignore it and anything else unknown.
            _ => {}
        }
    }
    if o.ranks.iter().any(|&n| n < 4 || n % 4 != 0) {
        return Err("rank counts must be multiples of 4 (half training, half inference in 2 engines)".into());
    }
    Ok(o)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn request(name: &str, ranks: u32) -> ConnectRequest {
    let model = preset("qwen3-tiny").unwrap_or_else(|| unreachable!("qwen3-tiny is a preset"));
    let summary = Catalogue::of(&model).summary();
    let half = ranks / 2;
    ConnectRequest {
        name: name.into(),
        training: TrainingSpec {
            backend: "megatron".into(),
            parallel: ParallelConfig::from_pairs([("dp", u64::from(half))]),
            world_size: half,
            model: model.clone(),
            catalogue: summary.clone(),
        },
        inference: InferenceSpec {
            backend: "sglang".into(),
            parallel: ParallelConfig::from_pairs([("tp", u64::from(half / 2)), ("engines", 2)]),
            engines: 2,
            world_size: half,
            urls: Vec::new(),
            model,
            catalogue: summary,
        },
        transport: Transport::Shm,
        options: PairOptions::default(),
    }
}

/// A rank that reports success for every update until the pair is disconnected.
async fn rank(
    client: Client,
    pair: String,
    side: Side,
    id: RankId,
    joined: tokio::sync::mpsc::UnboundedSender<()>,
) -> Result<(), String> {
    let info = serde_json::json!({ "host": "127.0.0.1", "port": 30000 + id.engine * 1000 + id.rank });
    let roster = client
        .join(&pair, &JoinRequest { side, rank: id, info })
        .await
        .map_err(|e| e.to_string())?;
    let _ = joined.send(());
    let mut after = roster.last_event_seq;
    loop {
        let batch = client
            .events(&pair, after, Duration::from_secs(30))
            .await
            .map_err(|e| e.to_string())?;
        for e in batch.events {
            after = e.seq;
            match e.kind {
                EventKind::Update => {
                    let r = Report {
                        side,
                        rank: id,
                        ok: true,
                        bytes: 0,
                        checksum: None,
                        error: None,
                        attempt: e.attempt,
                    };
                    client
                        .report(&pair, e.version.unwrap_or(0), &r)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                EventKind::Abort => {}
                EventKind::Disconnect => return Ok(()),
            }
        }
    }
}

async fn run(o: Options) -> Result<(), String> {
    let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let listener = awex_core::gateway::bind(loopback).map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(awex_core::gateway::serve(listener, GatewayConfig::default()));
    let client = Client::new(&format!("http://{addr}"), None).map_err(|e| e.to_string())?;

    // Floor: one loopback HTTP round trip through the same client.
    let mut floor = Vec::new();
    for i in 0..300 {
        let t = Instant::now();
        client.healthz().await.map_err(|e| e.to_string())?;
        if i >= 50 {
            floor.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    floor.sort_by(f64::total_cmp);
    println!(
        "floor: loopback HTTP round trip (GET /healthz) p50 {:.3} ms, p99 {:.3} ms",
        percentile(&floor, 50.0),
        percentile(&floor, 99.0)
    );
    for &n in &o.ranks {
        let mut bursts = Vec::new();
        for _ in 0..20 {
            let t = Instant::now();
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..n {
                let c = client.clone();
                set.spawn(async move { c.healthz().await });
            }
            while let Some(r) = set.join_next().await {
                r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
            }
            bursts.push(t.elapsed().as_secs_f64() * 1e3);
        }
        bursts.sort_by(f64::total_cmp);
        println!(
            "floor: {n} concurrent GET /healthz (one per rank) p50 {:.2} ms, p99 {:.2} ms",
            percentile(&bursts[5..], 50.0),
            percentile(&bursts[5..], 99.0)
        );
    }
    println!(
        "{:>6} {:>8} {:>10} {:>14} {:>14} {:>14} {:>14} {:>14}",
        "ranks", "updates", "join ms", "ctrl p50 ms", "ctrl p99 ms", "ctrl max ms", "gw p50 ms", "gw p99 ms"
    );
    for &n in &o.ranks {
        let name = format!("load-{n}");
        client.connect(&request(&name, n)).await.map_err(|e| e.to_string())?;
        let t_join = Instant::now();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for r in 0..n / 2 {
            tasks.push(tokio::spawn(rank(client.clone(), name.clone(), Side::Training, RankId::train(r), tx.clone())));
        }
        for e in 0..2 {
            for r in 0..n / 4 {
                tasks.push(tokio::spawn(rank(client.clone(), name.clone(), Side::Inference, RankId::infer(e, r), tx.clone())));
            }
        }
        for _ in 0..n {
            rx.recv().await.ok_or("a rank ended before joining")?;
        }
        let join_ms = t_join.elapsed().as_secs_f64() * 1e3;
        let (mut ctrl, mut gw) = (Vec::new(), Vec::new());
        for v in 1..=o.updates {
            let t = Instant::now();
            let started = loop {
                match client.start_update(&name, v).await {
                    Err(e) if e.status() == Some(409) && v == 1 => {
                        tokio::time::sleep(Duration::from_millis(1)).await
                    }
                    other => break other.map_err(|e| e.to_string())?,
                }
            };
            let done = client
                .wait_update(&name, started.version, Duration::from_secs(120))
                .await
                .map_err(|e| e.to_string())?;
            ctrl.push(t.elapsed().as_secs_f64() * 1e3);
            if done.state != UpdateState::Committed {
                return Err(format!("version {v} did not commit: {:?}", done.error));
            }
            gw.push(done.elapsed_ms as f64);
        }
        client.disconnect(&name).await.map_err(|e| e.to_string())?;
        for t in tasks {
            t.await.map_err(|e| e.to_string())??;
        }
        ctrl.sort_by(f64::total_cmp);
        gw.sort_by(f64::total_cmp);
        println!(
            "{:>6} {:>8} {:>10.1} {:>14.2} {:>14.2} {:>14.2} {:>14.0} {:>14.0}",
            n,
            o.updates,
            join_ms,
            percentile(&ctrl, 50.0),
            percentile(&ctrl, 99.0),
            ctrl.last().copied().unwrap_or(f64::NAN),
            percentile(&gw, 50.0),
            percentile(&gw, 99.0)
        );
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let o = match options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("gateway_load: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gateway_load: cannot start the runtime: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match rt.block_on(run(o)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gateway_load: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
