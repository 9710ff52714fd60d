//! `awex-cli bench apply`: what atomic apply costs. The same pair (ranks as tasks of this
//! process, a gateway on loopback, the `shm` or `tcp` transport) runs `--updates` versions in
//! place, then atomically; the table prints each mode's update time (controller: start to
//! commit), the difference, the apply copy alone (staging to live tensors, timed on a copy of
//! the inference shard), the extra memory (one copy of every inference rank's shard) and the
//! single-thread memcpy floor, all measured in the same run.

use super::median;
use crate::cmd::demo::memcpy_gbps;
use anyhow::{Context, bail};
use awex_control::wire::{ApplyMode, PairOptions, UpdateState};
use awex_core::Transport;
use awex_core::layout::Side;
use awex_runtime::TensorSet;
use awex_runtime::fill::Weights;
use awex_runtime::host::Memory;
use awex_runtime::rank::{Rank, RankConfig, make_transport, prepare};
use serde::Serialize;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Arguments of `awex-cli bench apply`.
#[derive(clap::Args, Debug)]
pub struct ApplyArgs {
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
    #[arg(long, default_value = "shm")]
    transport: String,
    /// Updates per mode (the first of each is a warm-up, not counted).
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(2..=1000))]
    updates: u64,
    /// Bucket size in MiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    bucket_mib: u64,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

/// One mode's measured updates.
#[derive(Debug, Serialize)]
struct ModeRun {
    apply: &'static str,
    /// Update times (start to commit), ms, warm-up excluded.
    update_ms: Vec<f64>,
    median_ms: f64,
}

#[derive(Debug, Serialize)]
struct ApplyReport {
    model: String,
    train: String,
    infer: String,
    transport: String,
    /// Bytes the inference side receives per update (every rank's shard).
    inference_bytes: u64,
    /// Extra memory of atomic apply: one staging copy of every inference rank's shard.
    staging_bytes: u64,
    modes: Vec<ModeRun>,
    /// Atomic minus in-place median update time, ms.
    atomic_extra_ms: f64,
    /// The apply copy alone (staging to live, every inference rank's shard, one after the
    /// other), best of 5, ms.
    apply_copy_ms: f64,
    /// Single-thread memcpy, best of 5 over 256 MiB, GB/s.
    memcpy_gbps: f64,
    /// `staging_bytes` at the memcpy floor, ms.
    floor_ms: f64,
}

/// Runs the subcommand.
pub fn run(a: ApplyArgs) -> anyhow::Result<ExitCode> {
    let transport: Transport = a.transport.parse().map_err(anyhow::Error::msg)?;
    if transport.on_gpu() {
        bail!("bench apply runs on the CPU transports, shm or tcp, not {transport}");
    }
    let r = crate::cmd::plan::resolve(&a.model, &a.train, &a.infer)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let floor = memcpy_gbps();
    let mut modes = Vec::new();
    for apply in [ApplyMode::InPlace, ApplyMode::Atomic] {
        let ms = rt.block_on(run_mode(&a, &r, transport, apply))?;
        let median = median(&ms);
        modes.push(ModeRun {
            apply: apply.as_str(),
            update_ms: ms,
            median_ms: median,
        });
    }
    let inference_bytes: u64 = r
        .inference
        .ranks()
        .into_iter()
        .filter_map(|k| r.inference.rank_layout(k))
        .map(|l| l.tensors.iter().map(|t| t.nbytes()).sum::<u64>())
        .sum();
    let apply_copy_ms = apply_copy_ms(&r)?;
    let report = ApplyReport {
        model: r.spec.model.name.clone(),
        train: r.spec.train.to_string(),
        infer: r.spec.infer.to_string(),
        transport: transport.to_string(),
        inference_bytes,
        staging_bytes: inference_bytes,
        atomic_extra_ms: modes[1].median_ms - modes[0].median_ms,
        modes,
        apply_copy_ms,
        memcpy_gbps: floor,
        floor_ms: inference_bytes as f64 / (floor * 1e9) * 1e3,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(r: &ApplyReport) {
    let gb = |b: u64| b as f64 / 1e9;
    println!(
        "{} | {} -> {} | transport {} | inference receives {:.3} GB per update",
        r.model,
        r.train,
        r.infer,
        r.transport,
        gb(r.inference_bytes)
    );
    println!("{:<10} {:>12} {:>12}", "apply", "median ms", "GB/s");
    for m in &r.modes {
        println!(
            "{:<10} {:>12.1} {:>12.2}",
            m.apply,
            m.median_ms,
            gb(r.inference_bytes) / (m.median_ms / 1e3)
        );
    }
    println!(
        "atomic costs {:+.1} ms per update ({:+.0}%) and {:.3} GB more memory (one staging copy of every inference shard)",
        r.atomic_extra_ms,
        100.0 * r.atomic_extra_ms / r.modes[0].median_ms.max(1e-9),
        gb(r.staging_bytes)
    );
    println!(
        "the apply copy alone: {:.1} ms; memcpy floor {:.2} GB/s (single thread) = {:.1} ms for {:.3} GB",
        r.apply_copy_ms,
        r.memcpy_gbps,
        r.floor_ms,
        gb(r.staging_bytes)
    );
}

/// The staging-to-live copy of every inference rank's shard, timed alone (best of 5).
fn apply_copy_ms(r: &crate::cmd::plan::Resolved) -> anyhow::Result<f64> {
    let mut best = f64::MAX;
    let sets: Vec<(TensorSet, TensorSet)> = r
        .inference
        .ranks()
        .into_iter()
        .filter_map(|k| r.inference.rank_layout(k))
        .map(|l| {
            let live = TensorSet::allocate_host(&l)?;
            let staging = live.staging_like()?;
            Ok((live, staging))
        })
        .collect::<Result<_, awex_runtime::RuntimeError>>()?;
    for _ in 0..5 {
        let t = Instant::now();
        for (live, staging) in &sets {
            live.copy_from(staging)?;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best * 1e3)
}

/// One pair in mode `apply`: every rank a task of this process; the update times.
async fn run_mode(
    a: &ApplyArgs,
    r: &crate::cmd::plan::Resolved,
    transport: Transport,
    apply: ApplyMode,
) -> anyhow::Result<Vec<f64>> {
    let options = PairOptions {
        bucket_mib: a.bucket_mib,
        update_deadline_ms: 600_000,
        apply,
        ..PairOptions::default()
    };
    let name = format!("bench-apply-{}-{}", apply.as_str(), std::process::id());
    let lp = super::local::LocalPair::connect(r, name, transport, options).await?;
    let (client, pair) = (&lp.client, &lp.name);
    let tasks: Vec<_> = lp
        .ranks
        .iter()
        .map(|cfg| tokio::spawn(rank_task(cfg.clone())))
        .collect();
    let n_ranks = lp.ranks.len() as u32;
    for _ in 0..600 {
        if client.status(pair).await?.joined == n_ranks {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut times = Vec::new();
    for v in 1..=a.updates {
        let t = Instant::now();
        client.start_update(pair, v).await?;
        let u = client
            .wait_update(pair, v, Duration::from_secs(600))
            .await?;
        if u.state != UpdateState::Committed {
            bail!(
                "version {v} did not commit ({}): {}",
                u.state.as_str(),
                u.error.unwrap_or_default()
            );
        }
        if v > 1 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    client.disconnect(pair).await?;
    for t in tasks {
        t.await.context("a rank task")??;
    }
    Ok(times)
}

/// One rank: allocates its tensors (the training side fills version 1 once: the bench times
/// moving bytes, not generating them), joins and executes every update until disconnect.
async fn rank_task(cfg: RankConfig) -> anyhow::Result<()> {
    let prepared = prepare(&cfg)?;
    let mem = Memory::allocate(
        &prepared.layout,
        &cfg.shm_scope(),
        cfg.side,
        cfg.transport,
        0,
    )?;
    if cfg.side == Side::Training {
        mem.fill(
            &Weights::Synthetic,
            &prepared.layout,
            &prepared.catalogue,
            1,
        )?;
    }
    let tensors = mem.tensors.clone();
    let t = make_transport(&cfg, &prepared, tensors.clone())?;
    let mut me = Rank::join(cfg, &prepared, &tensors, t).await?;
    while let Some(w) = me.next_live_work().await? {
        me.execute(w, false).await?;
    }
    me.close();
    Ok(())
}
