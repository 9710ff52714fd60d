//! Spawning the rank processes and waiting for them through the gateway.

use super::args::Args;
use super::gpus::nccl_nvls_default;
use crate::cmd::plan::Resolved;
use anyhow::{Context, bail};
use awex_control::client::Client;
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The rank processes of one demo, by name (`train 0`, `infer 1/0`); killed on drop.
pub struct Workers {
    /// Name and process of each rank.
    pub children: Vec<(String, Child)>,
    /// The pair's shared-memory prefix, swept after a kill.
    pub prefix: String,
}

impl Workers {
    /// Kills every rank process and sweeps their shared memory.
    pub fn kill_all(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.clear();
        awex_runtime::shm::sweep_dead(&self.prefix);
    }

    /// The first worker that exited, if any.
    pub fn exited(&mut self) -> Option<String> {
        for (name, c) in &mut self.children {
            if let Ok(Some(s)) = c.try_wait() {
                return Some(format!("worker `{name}` exited with {s}"));
            }
        }
        None
    }
}

/// Waits until a restarted rank joined again (after `since`, ms since the epoch).
pub async fn wait_rejoined(
    client: &Client,
    pair: &str,
    side: awex_core::layout::Side,
    rank: RankId,
    since: u64,
    workers: &mut Workers,
) -> anyhow::Result<()> {
    let stop_by = Instant::now() + Duration::from_secs(60);
    loop {
        let s = client.status(pair).await?;
        if s.roster
            .iter()
            .any(|e| e.side == side && e.rank == rank && e.joined_unix_ms >= since)
        {
            return Ok(());
        }
        if let Some(e) = workers.exited() {
            bail!("{e} before rejoining");
        }
        if Instant::now() > stop_by {
            bail!("{side} rank {rank} did not rejoin within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits for an inference rank's verdict on (version, attempt), published under `key`.
pub async fn wait_verdict(
    client: &Client,
    pair: &str,
    key: &str,
    version: u64,
    attempt: u32,
) -> anyhow::Result<awex_control::wire::KvEntry> {
    let stop_by = Instant::now() + Duration::from_secs(120);
    loop {
        match client.get_kv(pair, key, Duration::from_secs(5)).await {
            Ok(e)
                if e.value.get("version").and_then(|v| v.as_u64()) == Some(version)
                    && e.value.get("attempt").and_then(|v| v.as_u64()) == Some(attempt as u64) =>
            {
                return Ok(e);
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(e) if e.status() == Some(404) => {}
            Err(e) => return Err(anyhow::Error::new(e).context(format!("waiting for {key}"))),
        }
        if Instant::now() > stop_by {
            bail!("no verdict under `{key}` for version {version} attempt {attempt} within 120 s");
        }
    }
}

/// Waits until every training rank says its tensors hold `version` (kv `filled.{rank}`).
pub async fn wait_filled(
    client: &Client,
    pair: &str,
    r: &Resolved,
    version: u64,
    workers: &mut Workers,
) -> anyhow::Result<()> {
    let stop_by = Instant::now() + Duration::from_secs(600);
    for rank in r.training.ranks() {
        let key = crate::cmd::worker::filled_key(rank.rank);
        loop {
            match client.get_kv(pair, &key, Duration::from_secs(1)).await {
                Ok(e) if e.value.get("version").and_then(|v| v.as_u64()) >= Some(version) => {
                    break;
                }
                Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                Err(e) if e.status() == Some(404) => {}
                Err(e) => return Err(anyhow::Error::new(e).context(format!("waiting for {key}"))),
            }
            if let Some(e) = workers.exited() {
                bail!(
                    "{e} before training rank {} uploaded version {version}",
                    rank.rank
                );
            }
            if Instant::now() > stop_by {
                bail!(
                    "training rank {} did not upload version {version} within 600 s",
                    rank.rank
                );
            }
        }
    }
    Ok(())
}

/// Waits until every rank of a GPU transport says its transport is connected (kv
/// `connected.rdv.{side}.{engine}.{rank}`, put by the worker after its join): the handles
/// opened and the copies built belong to the join, not to the first update.
pub async fn wait_connected(
    client: &Client,
    pair: &str,
    r: &Resolved,
    workers: &mut Workers,
) -> anyhow::Result<()> {
    let stop_by = Instant::now() + Duration::from_secs(600);
    let ranks = r
        .training
        .ranks()
        .into_iter()
        .map(|k| (Side::Training, k))
        .chain(
            r.inference
                .ranks()
                .into_iter()
                .map(|k| (Side::Inference, k)),
        );
    for (side, rank) in ranks {
        let key = crate::cmd::worker::connected_key(side, rank);
        loop {
            match client.get_kv(pair, &key, Duration::from_secs(1)).await {
                Ok(_) => break,
                Err(e) if e.status() == Some(404) => {}
                Err(e) => return Err(anyhow::Error::new(e).context(format!("waiting for {key}"))),
            }
            if let Some(e) = workers.exited() {
                bail!("{e} before {side} rank {rank} connected its transport");
            }
            if Instant::now() > stop_by {
                bail!("{side} rank {rank} did not connect its transport within 600 s");
            }
        }
    }
    Ok(())
}

/// Waits until every rank joined the pair (a worker that dies first is an error).
pub async fn wait_ready(client: &Client, pair: &str, workers: &mut Workers) -> anyhow::Result<()> {
    loop {
        let s = client.status(pair).await?;
        match s.state {
            awex_control::wire::PairState::Ready => {
                // a restarted rank re-joins a ready pair: wait until the roster is full again
                // (but for engine slots that hold no engine yet)
                let per = s.inference.world_size / s.inference.engines.max(1);
                let free = s
                    .engines
                    .iter()
                    .filter(|e| {
                        matches!(
                            e.state,
                            awex_control::wire::EngineState::Absent
                                | awex_control::wire::EngineState::Joining
                        )
                    })
                    .count() as u32;
                if s.training.joined + s.inference.joined
                    >= s.training.world_size + s.inference.world_size - free * per
                {
                    return Ok(());
                }
            }
            awex_control::wire::PairState::Joining => {}
            other => bail!("pair `{pair}` is {} instead of ready", other.as_str()),
        }
        if let Some(e) = workers.exited() {
            bail!("{e} before every rank joined");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// The command line of one rank process (this binary's hidden `worker` subcommand); a training
/// rank starts out holding version `holds`.
#[allow(clippy::too_many_arguments)]
pub fn worker_command(
    a: &Args,
    gateway: &str,
    pair: &str,
    token: &str,
    side: &str,
    rank: RankId,
    gpu: u32,
    holds: u64,
) -> anyhow::Result<Command> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let mut c = Command::new(exe);
    c.arg("worker")
        .args(["--gateway", gateway, "--pair", pair, "--side", side])
        .args([
            "--engine",
            &rank.engine.to_string(),
            "--rank",
            &rank.rank.to_string(),
        ])
        .args([
            "--model", &a.model, "--train", &a.train, "--infer", &a.infer,
        ])
        .args([
            "--transport",
            &a.transport,
            "--bucket-mib",
            &a.bucket_mib.to_string(),
        ])
        .args(["--first-version", &holds.to_string()])
        .args(a.quant.to_args())
        .args(["--gpu", &gpu.to_string()])
        .env("AWEX_TOKEN", token)
        .stdin(Stdio::null());
    // the ranks log every update at `info`; the demo's own lines say what happened, so its
    // ranks print warnings and errors only unless RUST_LOG asks for more
    if std::env::var_os("RUST_LOG").is_none() {
        c.env("RUST_LOG", "warn");
    }
    if a.transport.parse::<Transport>().ok() == Some(Transport::Nccl)
        && let Some((k, v)) = nccl_nvls_default(std::env::var_os("NCCL_NVLS_ENABLE").as_deref())
    {
        c.env(k, v);
    }
    if let Some(d) = &a.dump_dir {
        c.arg("--dump-dir").arg(d);
    }
    if a.checksums {
        c.arg("--checksums");
    }
    if let Some(lr) = a.lr {
        c.args(["--lr", &lr.to_string()]);
    }
    Ok(c)
}
