//! `awex-cli bench delta`: what delta updates save on the data plane. The same pair (ranks as
//! tasks of this process, a gateway on loopback, the `shm` or `tcp` transport) runs `--updates`
//! versions made by an optimiser-like step (`--lr`) with every byte moving, then with deltas;
//! each update is timed by the controller from its start to its commit, with the training ranks'
//! next version already written and every inference rank's bytes checked against it *outside*
//! the timed window (`demo` times them inside its updates' wall time on a busy host). The table
//! prints each mode's median update time, the bytes the inference side received, the density
//! of changed elements, the delta over the dense time, and the single-thread memcpy floor of the
//! dense bytes, all measured in the same run.

use super::median;
use crate::cmd::demo::memcpy_gbps;
use anyhow::{Context, bail};
use awex_control::wire::{PairOptions, UpdateState};
use awex_core::Transport;
use awex_core::layout::Side;
use awex_runtime::fill::Weights;
use awex_runtime::host::Memory;
use awex_runtime::rank::{Outcome, Rank, RankConfig, make_transport, prepare};
use serde::Serialize;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Arguments of `awex-cli bench delta`.
#[derive(clap::Args, Debug)]
pub struct DeltaArgs {
    /// Model: a preset, a config.json or an HF directory.
    #[arg(long, default_value = "qwen3-0.6b")]
    model: String,
    /// Training layout.
    #[arg(long, default_value = "megatron:tp=1")]
    train: String,
    /// Inference layout.
    #[arg(long, default_value = "sglang:tp=1")]
    infer: String,
    /// Transport: shm or tcp.
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// Learning rate of the optimiser-like step that makes each version (a seeded fp32 master
    /// moved by at most this much per element and version, cast to the model's dtype).
    #[arg(long, default_value_t = 1e-6)]
    lr: f64,
    /// Updates per mode (the first of each is not counted: dense, it is a warm-up; with deltas,
    /// no rank holds a base yet and it moves every byte).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(2..=1000))]
    updates: u64,
    /// Bucket size in MiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    bucket_mib: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

/// One mode's measured updates (the first excluded).
#[derive(Debug, Serialize)]
struct ModeRun {
    deltas: bool,
    /// Update times (start to commit), ms.
    update_ms: Vec<f64>,
    median_ms: f64,
    /// Bytes the inference side received per update.
    received_bytes: Vec<u64>,
    /// Changed over compared elements per update (deltas only).
    density: Vec<f64>,
    /// The slowest training rank's part per update (its `execute`: encoding and sending), ms.
    training_part_ms: Vec<f64>,
    /// The slowest inference rank's part per update (receiving and applying), ms.
    inference_part_ms: Vec<f64>,
    /// Bytes the training ranks wrote into their copies of what they sent, per update (deltas:
    /// the changed elements when every peer took a delta, else the whole copy).
    refreshed_bytes: Vec<u64>,
}

#[derive(Debug, Serialize)]
struct DeltaReport {
    model: String,
    train: String,
    infer: String,
    transport: String,
    lr: f64,
    /// Bytes a dense update gives the inference side (every rank's planned bytes).
    dense_bytes: u64,
    modes: Vec<ModeRun>,
    /// Delta over dense median update time.
    time_ratio: f64,
    /// Median bytes received with deltas over the dense bytes.
    bytes_ratio: f64,
    /// Single-thread memcpy, best of 5 over 256 MiB, GB/s.
    memcpy_gbps: f64,
    /// `dense_bytes` at the memcpy floor, ms.
    floor_ms: f64,
    /// Every inference rank's bytes equal the version after every update (both modes).
    verified: bool,
}

/// Runs the subcommand.
pub fn run(a: DeltaArgs) -> anyhow::Result<ExitCode> {
    let transport: Transport = a.transport.parse().map_err(anyhow::Error::msg)?;
    if transport.on_gpu() {
        bail!(
            "bench delta runs on the CPU transports, shm or tcp, not {transport} (which move every byte)"
        );
    }
    if !(a.lr.is_finite() && a.lr > 0.0 && a.lr <= 1.0) {
        bail!(
            "--lr {} is not a learning rate in (0, 1]: RL runs use 1e-7 to 1e-5",
            a.lr
        );
    }
    let r = crate::cmd::plan::resolve(&a.model, &a.train, &a.infer)?;
    let weights = crate::cmd::worker::demo_weights(&a.model, &r.catalogue, false, Some(a.lr))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let floor = memcpy_gbps();
    let mut modes = Vec::new();
    for deltas in [false, true] {
        modes.push(rt.block_on(run_mode(&a, &r, transport, &weights, deltas))?);
    }
    // what a dense update gives the inference side (the planned bytes: padding no placement
    // covers does not move)
    let dense_bytes = modes[0].received_bytes.iter().copied().max().unwrap_or(0);
    let moved: Vec<f64> = modes[1].received_bytes.iter().map(|&b| b as f64).collect();
    let report = DeltaReport {
        model: r.spec.model.name.clone(),
        train: r.spec.train.to_string(),
        infer: r.spec.infer.to_string(),
        transport: transport.to_string(),
        lr: a.lr,
        dense_bytes,
        time_ratio: modes[1].median_ms / modes[0].median_ms.max(1e-9),
        bytes_ratio: median(&moved) / (dense_bytes.max(1) as f64),
        modes,
        memcpy_gbps: floor,
        floor_ms: dense_bytes as f64 / (floor * 1e9) * 1e3,
        verified: true,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(r: &DeltaReport) {
    let gb = |b: u64| b as f64 / 1e9;
    println!(
        "{} | {} -> {} | transport {} | versions by an optimiser-like step at lr {:e} | a dense update gives the inference side {:.3} GB",
        r.model,
        r.train,
        r.infer,
        r.transport,
        r.lr,
        gb(r.dense_bytes)
    );
    println!(
        "{:<8} {:>12} {:>14} {:>10} {:>14} {:>14} {:>14}  updates (ms)",
        "mode", "median ms", "received", "changed", "sender ms", "receiver ms", "copy refresh"
    );
    for m in &r.modes {
        let received = median(
            &m.received_bytes
                .iter()
                .map(|&b| b as f64)
                .collect::<Vec<_>>(),
        );
        let changed = if m.deltas {
            format!("{:.2} %", 100.0 * median(&m.density))
        } else {
            "-".into()
        };
        let each: Vec<String> = m.update_ms.iter().map(|t| format!("{t:.1}")).collect();
        let refreshed = if m.deltas {
            let b: Vec<f64> = m.refreshed_bytes.iter().map(|&b| b as f64).collect();
            format!("{:.1} MB", median(&b) / 1e6)
        } else {
            "-".into()
        };
        println!(
            "{:<8} {:>12.1} {:>11.3} GB {:>10} {:>14.1} {:>14.1} {:>14}  {}",
            if m.deltas { "deltas" } else { "dense" },
            m.median_ms,
            received / 1e9,
            changed,
            median(&m.training_part_ms),
            median(&m.inference_part_ms),
            refreshed,
            each.join(" ")
        );
    }
    println!(
        "deltas: {:.3} x the dense update's time, {:.2} % of its bytes; every inference rank's bytes verified after each update",
        r.time_ratio,
        100.0 * r.bytes_ratio
    );
    println!(
        "memcpy floor {:.2} GB/s (single thread) = {:.1} ms for the dense bytes",
        r.memcpy_gbps, r.floor_ms
    );
}

/// What the rank tasks tell the controller: how many ranks are ready for the next version (the
/// training ranks wrote it, the inference ranks checked the last one), and the first failure.
#[derive(Default)]
struct Progress {
    ready: AtomicU64,
    failed: std::sync::Mutex<Option<String>>,
    /// Each rank's part (`execute`, from taking the work to its report): side, version, ms,
    /// bytes written into its copy of what it sent.
    parts: std::sync::Mutex<Vec<(Side, u64, f64, u64)>>,
}

/// One pair, dense or with deltas: every rank a task of this process.
async fn run_mode(
    a: &DeltaArgs,
    r: &crate::cmd::plan::Resolved,
    transport: Transport,
    weights: &Weights,
    deltas: bool,
) -> anyhow::Result<ModeRun> {
    let options = PairOptions {
        bucket_mib: a.bucket_mib,
        update_deadline_ms: 600_000,
        deltas,
        ..PairOptions::default()
    };
    let name = format!("bench-delta-{deltas}-{}", std::process::id());
    let lp = super::local::LocalPair::connect(r, name, transport, options).await?;
    let (client, pair) = (&lp.client, &lp.name);
    let progress = Arc::new(Progress::default());
    let tasks: Vec<_> = lp
        .ranks
        .iter()
        .map(|cfg| tokio::spawn(rank_task(cfg.clone(), weights.clone(), progress.clone())))
        .collect();
    let n_ranks = lp.ranks.len() as u64;
    let mut run = ModeRun {
        deltas,
        update_ms: Vec::new(),
        median_ms: 0.0,
        received_bytes: Vec::new(),
        density: Vec::new(),
        training_part_ms: Vec::new(),
        inference_part_ms: Vec::new(),
        refreshed_bytes: Vec::new(),
    };
    for v in 1..=a.updates {
        // every training rank holds version v, every inference rank checked version v - 1
        let want = n_ranks * v;
        let waited = Instant::now();
        while progress.ready.load(Ordering::Acquire) < want {
            if let Some(e) = progress.failed.lock().ok().and_then(|f| f.clone()) {
                bail!("{e}");
            }
            if waited.elapsed() > Duration::from_secs(600) {
                bail!("the ranks were not ready for version {v} within 600 s");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let t = Instant::now();
        client.start_update(pair, v).await?;
        let u = client
            .wait_update(pair, v, Duration::from_secs(600))
            .await?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if u.state != UpdateState::Committed {
            bail!(
                "version {v} did not commit ({}): {}",
                u.state.as_str(),
                u.error.unwrap_or_default()
            );
        }
        if v > 1 {
            run.update_ms.push(ms);
            run.received_bytes.push(u.bytes.inference);
            if let Some(d) = u.delta {
                run.density
                    .push(d.changed.inference as f64 / d.elements.inference.max(1) as f64);
            }
        }
    }
    // the last version's check
    let want = n_ranks * (a.updates + 1);
    let waited = Instant::now();
    while progress.ready.load(Ordering::Acquire) < want {
        if let Some(e) = progress.failed.lock().ok().and_then(|f| f.clone()) {
            bail!("{e}");
        }
        if waited.elapsed() > Duration::from_secs(600) {
            bail!("the last version was not checked within 600 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    client.disconnect(pair).await?;
    for t in tasks {
        t.await.context("a rank task")??;
    }
    run.median_ms = median(&run.update_ms);
    let parts = progress.parts.lock().map(|p| p.clone()).unwrap_or_default();
    for v in 2..=a.updates {
        let slowest = |side: Side| {
            parts
                .iter()
                .filter(|(s, pv, ..)| *s == side && *pv == v)
                .map(|p| p.2)
                .fold(0.0, f64::max)
        };
        run.training_part_ms.push(slowest(Side::Training));
        run.inference_part_ms.push(slowest(Side::Inference));
        run.refreshed_bytes.push(
            parts
                .iter()
                .filter(|(s, pv, ..)| *s == Side::Training && *pv == v)
                .map(|p| p.3)
                .sum(),
        );
    }
    Ok(run)
}

/// One rank: allocates its tensors, writes version 1 (training), joins, and after each committed
/// version writes the next one (training) or checks every byte of it (inference), then says it
/// is ready; a mismatch fails the bench.
async fn rank_task(
    cfg: RankConfig,
    weights: Weights,
    progress: Arc<Progress>,
) -> anyhow::Result<()> {
    let r = rank_loop(cfg, &weights, &progress).await;
    if let Err(e) = &r
        && let Ok(mut f) = progress.failed.lock()
    {
        f.get_or_insert_with(|| crate::report::chain(e));
    }
    r
}

async fn rank_loop(cfg: RankConfig, weights: &Weights, progress: &Progress) -> anyhow::Result<()> {
    let prepared = prepare(&cfg)?;
    let side = cfg.side;
    let (layout, cat) = (&prepared.layout, &prepared.catalogue);
    let mem = Memory::allocate(layout, &cfg.shm_scope(), side, cfg.transport, 0)?;
    if side == Side::Training {
        mem.fill(weights, layout, cat, 1)?;
    }
    let tensors = mem.tensors.clone();
    let t = make_transport(&cfg, &prepared, tensors.clone())?;
    let rank = cfg.rank;
    let mut me = Rank::join(cfg, &prepared, &tensors, t).await?;
    progress.ready.fetch_add(1, Ordering::AcqRel);
    while let Some(w) = me.next_live_work().await? {
        let t = Instant::now();
        let stats = me.execute(w, false).await?;
        if let Ok(mut p) = progress.parts.lock() {
            p.push((
                side,
                w.version,
                t.elapsed().as_secs_f64() * 1e3,
                stats.refreshed,
            ));
        }
        match me.outcome(w, stats, Duration::from_secs(600)).await {
            Outcome::Committed { .. } => {}
            other => bail!("version {} did not commit: {other:?}", w.version),
        }
        match side {
            Side::Training => mem.fill(weights, layout, cat, w.version + 1)?,
            Side::Inference => mem.check(weights, layout, cat, w.version).map_err(|e| {
                anyhow::anyhow!("inference rank {rank}: version {}: {e}", w.version)
            })?,
        }
        progress.ready.fetch_add(1, Ordering::AcqRel);
    }
    me.close();
    Ok(())
}
