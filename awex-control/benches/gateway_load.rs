//! Gateway load: N simulated ranks (tokio tasks, one HTTP client pool) join one pair on loopback
//! and complete U updates; prints the gateway's control overhead per update (start -> commit as
//! the controller sees it, and as the gateway records it), p50/p99/max, for each N.
//!
//! The ranks move no bytes: every millisecond measured is control plane (HTTP, JSON, long-poll
//! wake-ups, the commit). The floor printed first is one loopback HTTP round trip (`GET
//! /healthz`) measured in the same run.
//!
//! Columns: `ctrl` is start-update request to the controller seeing `committed`; `gw` is the
//! gateway's own start-to-commit time (whole ms); `gw cpu` (with `--split`) is the CPU time the
//! gateway's thread spent per update.
//!
//! By default everything runs on one single-threaded tokio runtime (the measured best latency on
//! a 2-core machine: no cross-thread wake-ups between the gateway and its simulated ranks).
//! `--split` runs the gateway on its own thread and runtime and measures its CPU per update.
//!
//! `--state-dir DIR` keeps the gateway's state in DIR (written through before each answer, as
//! `awex-cli serve` does by default) instead of in memory.
//!
//! `cargo bench -p awex-control --features server --bench gateway_load -- [--ranks 128,1024]
//! [--updates 10] [--split] [--state-dir DIR]`

use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::{
    ConnectRequest, EventKind, InferenceSpec, JoinRequest, PairOptions, Report, TrainingSpec,
    Transport, UpdateState,
};
use awex_core::model::presets::preset;
use awex_core::{Catalogue, ParallelConfig, RankId, Side};
use std::time::{Duration, Instant};

struct Options {
    ranks: Vec<u32>,
    updates: u64,
    split: bool,
    /// Keep the gateway's state in this directory (write-through) instead of in memory.
    state_dir: Option<std::path::PathBuf>,
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        ranks: vec![128, 1024],
        updates: 10,
        split: false,
        state_dir: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ranks" => {
                let v = args.next().ok_or("--ranks needs a list, e.g. 128,1024")?;
                o.ranks = v
                    .split(',')
                    .map(|x| {
                        x.trim()
                            .parse::<u32>()
                            .map_err(|_| format!("bad rank count `{x}`"))
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--updates" => {
                let v = args.next().ok_or("--updates needs a number")?;
                o.updates = v.parse().map_err(|_| format!("bad update count `{v}`"))?;
            }
            "--split" => o.split = true,
            "--state-dir" => {
                o.state_dir = Some(args.next().ok_or("--state-dir needs a directory")?.into());
            }
            // cargo bench passes --bench; ignore it and anything else unknown.
            _ => {}
        }
    }
    if o.ranks.iter().any(|&n| n < 4 || n % 4 != 0) {
        return Err(
            "rank counts must be multiples of 4 (half training, half inference in 2 engines)"
                .into(),
        );
    }
    Ok(o)
}

/// A figure for the table, `n/a` when not measured.
fn cell(v: f64) -> String {
    if v.is_nan() {
        "n/a".to_string()
    } else {
        format!("{v:.2}")
    }
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
            spare: 0,
            fp8: None,
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
    let info =
        serde_json::json!({ "host": "127.0.0.1", "port": 30000 + id.engine * 1000 + id.rank });
    let roster = client
        .join(
            &pair,
            &JoinRequest {
                side,
                rank: id,
                info,
                capabilities: Vec::new(),
            },
        )
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
                        incarnation: None,
                        delta: None,
                        unreached: Vec::new(),
                    };
                    client
                        .report(&pair, e.version.unwrap_or(0), &r)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                EventKind::Abort
                | EventKind::Apply
                | EventKind::LeftOut
                | EventKind::EngineRemoved => {}
                EventKind::Disconnect => return Ok(()),
            }
        }
    }
}

/// Runs the gateway on its own thread and single-threaded runtime; returns its address and the
/// CPU-time clock of that thread, so that the gateway's own CPU per update can be measured apart
/// from the simulated ranks'.
fn gateway_thread(
    config: GatewayConfig,
) -> Result<(std::net::SocketAddr, libc::clockid_t), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut clock: libc::clockid_t = 0;
        // SAFETY: pthread_self is always valid for the calling thread; `clock` is a valid out pointer.
        let rc = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build();
        let (Ok(rt), 0) = (rt, rc) else {
            let _ = tx.send(Err("cannot start the gateway thread".to_string()));
            return;
        };
        rt.block_on(async move {
            let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
            let listener = match awex_control::server::bind(loopback) {
                Ok(l) => l,
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = tx.send(
                listener
                    .local_addr()
                    .map(|a| (a, clock))
                    .map_err(|e| e.to_string()),
            );
            let _ = awex_control::server::serve(listener, config).await;
        });
    });
    rx.recv().map_err(|e| e.to_string())?
}

/// CPU time consumed so far by the thread whose clock this is, in ms.
fn cpu_ms(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out pointer; the clock belongs to a thread that lives as long as the process.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6
}

fn config_of(o: &Options) -> GatewayConfig {
    GatewayConfig {
        state_dir: o.state_dir.clone(),
        ..GatewayConfig::default()
    }
}

async fn run(o: Options) -> Result<(), String> {
    let (addr, gateway_clock) = if o.split {
        let (a, c) = gateway_thread(config_of(&o))?;
        (a, Some(c))
    } else {
        let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let listener = awex_control::server::bind(loopback).map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        tokio::spawn(awex_control::server::serve(listener, config_of(&o)));
        (addr, None)
    };
    println!(
        "mode: {}",
        if o.split {
            "split: gateway on its own thread and runtime (gateway CPU per update measured)"
        } else {
            "shared: gateway and simulated ranks on one single-threaded runtime"
        }
    );
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
        "{:>6} {:>8} {:>10} {:>12} {:>12} {:>12} {:>10} {:>10} {:>12} {:>12}",
        "ranks",
        "updates",
        "join ms",
        "ctrl p50 ms",
        "ctrl p99 ms",
        "ctrl max ms",
        "gw p50 ms",
        "gw p99 ms",
        "gw cpu p50",
        "gw cpu p99"
    );
    for &n in &o.ranks {
        let name = format!("load-{n}");
        client
            .connect(&request(&name, n))
            .await
            .map_err(|e| e.to_string())?;
        let t_join = Instant::now();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for r in 0..n / 2 {
            tasks.push(tokio::spawn(rank(
                client.clone(),
                name.clone(),
                Side::Training,
                RankId::train(r),
                tx.clone(),
            )));
        }
        for e in 0..2 {
            for r in 0..n / 4 {
                tasks.push(tokio::spawn(rank(
                    client.clone(),
                    name.clone(),
                    Side::Inference,
                    RankId::infer(e, r),
                    tx.clone(),
                )));
            }
        }
        for _ in 0..n {
            rx.recv().await.ok_or("a rank ended before joining")?;
        }
        let join_ms = t_join.elapsed().as_secs_f64() * 1e3;
        let (mut ctrl, mut gw, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
        for v in 1..=o.updates {
            let cpu0 = gateway_clock.map(cpu_ms);
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
            if let (Some(c), Some(c0)) = (gateway_clock, cpu0) {
                cpu.push(cpu_ms(c) - c0);
            }
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
        cpu.sort_by(f64::total_cmp);
        println!(
            "{:>6} {:>8} {:>10.1} {:>12.2} {:>12.2} {:>12.2} {:>10.0} {:>10.0} {:>12} {:>12}",
            n,
            o.updates,
            join_ms,
            percentile(&ctrl, 50.0),
            percentile(&ctrl, 99.0),
            ctrl.last().copied().unwrap_or(f64::NAN),
            percentile(&gw, 50.0),
            percentile(&gw, 99.0),
            cell(percentile(&cpu, 50.0)),
            cell(percentile(&cpu, 99.0))
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
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
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
