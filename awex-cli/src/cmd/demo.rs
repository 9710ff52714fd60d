//! `awex-cli demo`: the main job, end to end on one machine.
//!
//! Starts a gateway on loopback, spawns every training and inference rank as its own process
//! (this binary's hidden `worker` subcommand), connects the pair, runs N updates, has every
//! inference rank check every byte after every update, disconnects, checks that no shared
//! memory is left behind, and prints a table with the memcpy floor measured in the same run.
//!
//! With `--transport cuda-ipc` every rank keeps its tensors on GPU `--gpu` (training and
//! inference processes colocated on one GPU); the floor is then one device-to-device copy on
//! that GPU, measured in the same run.
//!
//! With `--transport nccl` the ranks form one NCCL communicator and each needs a GPU of its
//! own: training rank `i` uses the `i`-th entry of `--train-gpus` and inference rank `i`
//! (engine-major) the `i`-th of `--infer-gpus`, each list taken modulo its length; both
//! default to `--gpu`. A placement that puts two ranks on one GPU is refused at start, and
//! workers run with `NCCL_NVLS_ENABLE=0` unless the environment sets it.

use super::plan::{DEFAULT_INFER, DEFAULT_MODEL, DEFAULT_TRAIN, Resolved, human_bytes};
use anyhow::{Context, bail};
use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::{ConnectRequest, InferenceSpec, PairOptions, TrainingSpec, UpdateState};
use awex_core::layout::RankId;
use awex_runtime::shm::list_segments;
use awex_runtime::transport::TransportKind;
use serde::Serialize;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// Arguments of `awex-cli demo`.
#[derive(clap::Args, Debug, Clone)]
#[command(
    after_help = "Examples:\n  awex-cli demo\n  awex-cli demo --transport tcp --checksum --updates 5\n  awex-cli demo --transport cuda-ipc --gpu 0   (a build with --features cuda)\n  awex-cli demo --transport nccl --train megatron:tp=1 --infer sglang:tp=1 --train-gpus 0 --infer-gpus 1   (2 GPUs, --features cuda)\n  awex-cli demo --model qwen3-tiny --train megatron:tp=2,dp=2 --infer sglang:tp=4 --json"
)]
pub struct Args {
    /// Model: a preset name, a config.json, or an HF model directory.
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Training side (same syntax as `plan`).
    #[arg(long, default_value = DEFAULT_TRAIN)]
    pub train: String,
    /// Inference side (same syntax as `plan`).
    #[arg(long, default_value = DEFAULT_INFER)]
    pub infer: String,
    /// How bytes move: shm, tcp (CPU); cuda-ipc, nccl (GPU).
    #[arg(long, default_value = "shm")]
    pub transport: String,
    /// GPU of every rank with `--transport cuda-ipc`; the default of `--train-gpus` and
    /// `--infer-gpus` with `--transport nccl`.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    /// `--transport nccl`: GPUs of the training ranks, a comma list (rank i uses entry i modulo
    /// the list); default `--gpu`.
    #[arg(long)]
    pub train_gpus: Option<String>,
    /// `--transport nccl`: GPUs of the inference ranks, a comma list (rank i, engine-major,
    /// uses entry i modulo the list); default `--gpu`.
    #[arg(long)]
    pub infer_gpus: Option<String>,
    /// Number of updates (versions 1..=N).
    #[arg(long, default_value_t = 3)]
    pub updates: u64,
    /// Staging bucket size in MiB.
    #[arg(long, default_value_t = 64)]
    pub bucket_mib: u64,
    /// Per-bucket xxh3 checksums, verified by receivers and compared by the gateway.
    #[arg(long)]
    pub checksum: bool,
    /// After the last update, write canonical and per-rank safetensors here.
    #[arg(long)]
    pub dump_dir: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Deadline of one update in seconds.
    #[arg(long, default_value_t = 120)]
    pub deadline_s: u64,
    /// Fault drill: SIGKILL this training rank during update `--fault-version`, then restart it
    /// and retry that version.
    #[arg(long, hide = true)]
    pub fault_kill_train_rank: Option<u32>,
    /// Fault drill: corrupt one received byte on inference rank 0/0 in this version (use with --checksum).
    #[arg(long, hide = true)]
    pub fault_corrupt_version: Option<u64>,
    /// Fault drill: start inference rank 0/0 with this (wrong) inference layout; it must be refused at join.
    #[arg(long, hide = true)]
    pub fault_bad_infer: Option<String>,
    /// The version the fault drills act on.
    #[arg(long, hide = true, default_value_t = 2)]
    pub fault_version: u64,
}

/// One update's row of the report.
#[derive(Serialize, Debug, Clone)]
pub struct UpdateRow {
    /// Version.
    pub version: u64,
    /// Seconds from start to commit (or failure).
    pub seconds: f64,
    /// Bytes moved.
    pub bytes: u64,
    /// GB/s.
    pub gbps: f64,
    /// Committed and every inference rank verified every byte.
    pub verified: bool,
    /// Attempts it took.
    pub attempts: u32,
    /// Why it failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The `--json` report.
#[derive(Serialize, Debug)]
pub struct DemoReport {
    /// Every update committed and verified.
    pub verified: bool,
    /// Transport.
    pub transport: String,
    /// Model.
    pub model: String,
    /// Training spec.
    pub training: String,
    /// Inference spec.
    pub inference: String,
    /// Milliseconds from starting the rank processes to every rank joined (the pair ready).
    pub join_ms: f64,
    /// Milliseconds of the first update (start to commit), the rest of the cold path.
    pub first_update_ms: f64,
    /// Per update.
    pub updates: Vec<UpdateRow>,
    /// Single-thread memcpy bandwidth measured in this run, GB/s.
    pub memcpy_gbps: f64,
    /// One device-to-device copy on the demo's GPU, measured in this run, GB/s (cuda-ipc only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_copy_gbps: Option<f64>,
    /// Median update GB/s over the floor: the device copy for cuda-ipc, else memcpy.
    pub ratio: f64,
    /// One loopback TCP stream's bandwidth measured in this run, GB/s (tcp transport only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_loopback_gbps: Option<f64>,
    /// Shared-memory segments of this pair left behind after disconnect.
    pub leaked_segments: Vec<String>,
    /// Rank processes that did not exit cleanly.
    pub worker_errors: Vec<String>,
}

/// Best-of-5 bandwidth of one 1 GiB device-to-device copy on GPU `gpu` (bytes copied per second).
pub fn device_copy_gbps(gpu: u32) -> anyhow::Result<f64> {
    super::bench::floors::device_copy_gbps(gpu)
}

/// Refuses the GPU transports where they cannot run, saying why: a build without CUDA, no
/// driver, no GPU, one of `gpus` missing, or (nccl) no usable NCCL library.
pub fn check_gpu_transport(transport: TransportKind, gpus: &[u32]) -> anyhow::Result<()> {
    if matches!(transport, TransportKind::Shm | TransportKind::Tcp) {
        return Ok(());
    }
    if !awex_gpu::cuda::BUILT {
        bail!(
            "this awex-cli was built without CUDA, so the demo cannot use `{transport}`; rebuild with `cargo build --release -p awex-cli --features cuda`, or use --transport shm or tcp"
        );
    }
    let count = awex_gpu::cuda::device_count()?;
    if let Some(&gpu) = gpus.iter().find(|&&g| g >= count) {
        bail!(awex_gpu::cuda::CudaError::NoSuchDevice {
            ordinal: gpu,
            count
        });
    }
    if transport == TransportKind::Nccl {
        awex_gpu::nccl::Library::load()?;
    }
    Ok(())
}

/// Parses a comma list of GPU ordinals given to `flag`.
pub fn parse_gpus(flag: &str, list: &str) -> anyhow::Result<Vec<u32>> {
    let gpus: Vec<u32> = list
        .split(',')
        .map(|g| {
            g.trim().parse::<u32>().map_err(|_| {
                anyhow::anyhow!(
                    "{flag} takes a comma list of GPU ordinals such as `0,1`, but `{}` in `{list}` is not one",
                    g.trim()
                )
            })
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(gpus)
}

/// The GPU of every rank: training rank `i` uses `train[i % len]`, inference rank `i`
/// (engine-major) `infer[i % len]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpus {
    /// GPUs of the training ranks.
    pub train: Vec<u32>,
    /// GPUs of the inference ranks.
    pub infer: Vec<u32>,
}

impl Gpus {
    /// The placement the arguments ask for; `--train-gpus` / `--infer-gpus` only place the
    /// ranks of `--transport nccl` (cuda-ipc puts every rank on `--gpu`).
    pub fn of(a: &Args, transport: TransportKind) -> anyhow::Result<Gpus> {
        if transport != TransportKind::Nccl && (a.train_gpus.is_some() || a.infer_gpus.is_some()) {
            bail!(
                "--train-gpus and --infer-gpus place the ranks of --transport nccl; with `{transport}` use --gpu"
            );
        }
        let list = |flag: &str, v: &Option<String>| match v {
            Some(l) => parse_gpus(flag, l),
            None => Ok(vec![a.gpu]),
        };
        Ok(Gpus {
            train: list("--train-gpus", &a.train_gpus)?,
            infer: list("--infer-gpus", &a.infer_gpus)?,
        })
    }

    /// The GPU of the `i`-th rank of `side`.
    pub fn of_rank(&self, side: awex_core::layout::Side, i: usize) -> u32 {
        let l = match side {
            awex_core::layout::Side::Training => &self.train,
            awex_core::layout::Side::Inference => &self.infer,
        };
        l.get(i % l.len().max(1)).copied().unwrap_or(0)
    }

    /// Every GPU named.
    pub fn all(&self) -> Vec<u32> {
        let mut g: Vec<u32> = self.train.iter().chain(&self.infer).copied().collect();
        g.sort_unstable();
        g.dedup();
        g
    }

    /// Refuses a placement with two ranks of the communicator (`training` then `inference`
    /// ranks, in rank order) on one GPU: NCCL rejects it at communicator init.
    pub fn refuse_shared(&self, training: &[RankId], inference: &[RankId]) -> anyhow::Result<()> {
        use awex_core::layout::Side;
        let name = |side: Side, r: RankId| match side {
            Side::Training => format!("training rank {}", r.rank),
            Side::Inference => format!("inference rank {r}"),
        };
        let mut used: std::collections::HashMap<u32, String> = Default::default();
        let ranks = training
            .iter()
            .enumerate()
            .map(|(i, &r)| (Side::Training, i, r))
            .chain(
                inference
                    .iter()
                    .enumerate()
                    .map(|(i, &r)| (Side::Inference, i, r)),
            );
        for (side, i, r) in ranks {
            let gpu = self.of_rank(side, i);
            let me = name(side, r);
            if let Some(first) = used.get(&gpu) {
                bail!(
                    "NCCL cannot put two ranks of one communicator on the same GPU: {first} and {me} would both use GPU {gpu}; give every rank its own GPU with --train-gpus and --infer-gpus (e.g. --train-gpus 0 --infer-gpus 1 for one rank a side)"
                );
            }
            used.insert(gpu, me);
        }
        Ok(())
    }
}

/// The NCCL setting the workers get unless the environment sets it: NVLink SHARP (NVLS) off,
/// since point-to-point transfers do not use it and its multicast setup can fail where the
/// fabric does not offer it. `None` when the user set `NCCL_NVLS_ENABLE`.
pub fn nccl_nvls_default(user: Option<&std::ffi::OsStr>) -> Option<(&'static str, &'static str)> {
    match user {
        Some(_) => None,
        None => Some(("NCCL_NVLS_ENABLE", "0")),
    }
}

/// Best-of-5 single-thread memcpy bandwidth over 256 MiB buffers (bytes copied per second).
pub fn memcpy_gbps() -> f64 {
    let n = 256usize << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    n as f64 / best / 1e9
}

/// Best-of-3 bandwidth of one loopback TCP stream carrying 512 MiB in 64 MiB writes (bytes per second).
pub fn tcp_loopback_gbps() -> anyhow::Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let total = 512usize << 20;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 64 << 20];
        for _ in 0..3 {
            let mut got = 0;
            while got < total {
                let n = s.read(&mut buf)?;
                if n == 0 {
                    return Ok(());
                }
                got += n;
            }
            s.write_all(&[1])?;
        }
        Ok(())
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true).ok();
    let chunk = vec![7u8; 64 << 20];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..total / chunk.len() {
            s.write_all(&chunk)?;
        }
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    drop(s);
    reader
        .join()
        .map_err(|_| anyhow::anyhow!("loopback reader panicked"))??;
    Ok(total as f64 / best / 1e9)
}

struct Workers {
    children: Vec<(String, Child)>,
    prefix: String,
}

impl Workers {
    fn kill_all(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.clear();
        awex_runtime::shm::sweep_dead(&self.prefix);
    }

    /// The first worker that exited, if any.
    fn exited(&mut self) -> Option<String> {
        for (name, c) in &mut self.children {
            if let Ok(Some(s)) = c.try_wait() {
                return Some(format!("worker `{name}` exited with {s}"));
            }
        }
        None
    }
}

/// Waits until a restarted training rank joined again (after `since`, ms since the epoch).
async fn wait_rejoined(
    client: &Client,
    pair: &str,
    rank: RankId,
    since: u64,
    workers: &mut Workers,
) -> anyhow::Result<()> {
    let stop_by = Instant::now() + Duration::from_secs(60);
    loop {
        let s = client.status(pair).await?;
        if s.roster.iter().any(|e| {
            e.side == awex_core::layout::Side::Training
                && e.rank == rank
                && e.joined_unix_ms >= since
        }) {
            return Ok(());
        }
        if let Some(e) = workers.exited() {
            bail!("{e} before rejoining");
        }
        if Instant::now() > stop_by {
            bail!("training rank {rank} did not rejoin within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits for an inference rank's verdict on (version, attempt), published under `key`.
async fn wait_verdict(
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
async fn wait_filled(
    client: &Client,
    pair: &str,
    r: &Resolved,
    version: u64,
    workers: &mut Workers,
) -> anyhow::Result<()> {
    let stop_by = Instant::now() + Duration::from_secs(600);
    for rank in r.training.ranks() {
        let key = super::worker::filled_key(rank.rank);
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

/// Waits until every rank joined the pair (a worker that dies first is an error).
async fn wait_ready(client: &Client, pair: &str, workers: &mut Workers) -> anyhow::Result<()> {
    loop {
        let s = client.status(pair).await?;
        match s.state {
            awex_control::wire::PairState::Ready => {
                // a restarted rank re-joins a ready pair: wait until the roster is full again
                if s.training.joined + s.inference.joined
                    >= s.training.world_size + s.inference.world_size
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

#[allow(clippy::too_many_arguments)]
fn worker_command(
    a: &Args,
    gateway: &str,
    pair: &str,
    token: &str,
    side: &str,
    rank: RankId,
    gpu: u32,
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
        .args(["--first-version", &first_version(a).to_string()])
        .args(["--gpu", &gpu.to_string()])
        .env("AWEX_TOKEN", token)
        .stdin(Stdio::null());
    if a.transport.parse::<TransportKind>().ok() == Some(TransportKind::Nccl)
        && let Some((k, v)) = nccl_nvls_default(std::env::var_os("NCCL_NVLS_ENABLE").as_deref())
    {
        c.env(k, v);
    }
    if let Some(d) = &a.dump_dir {
        c.arg("--dump-dir").arg(d);
    }
    if a.checksum {
        c.arg("--checksum");
    }
    Ok(c)
}

/// The first version: 0 when the model is an HF directory with weights (they are version 0), else 1.
fn first_version(a: &Args) -> u64 {
    let dir = std::path::Path::new(&a.model);
    if dir.is_dir() && awex_core::model::Checkpoint::present(dir) {
        0
    } else {
        1
    }
}

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let transport: TransportKind = args.transport.parse().map_err(anyhow::Error::msg)?;
    if args.updates == 0 {
        bail!("--updates must be at least 1");
    }
    let r = Resolved::new(&args.model, &args.train, &args.infer)?;
    let gpus = Gpus::of(&args, transport)?;
    if transport == TransportKind::Nccl {
        gpus.refuse_shared(&r.training.ranks(), &r.inference.ranks())?;
    }
    check_gpu_transport(transport, &gpus.all())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = rt.block_on(demo(&args, &r, transport, &gpus))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "awex demo: {} | {} -> {} | transport {}",
            report.model, report.training, report.inference, report.transport
        );
        println!("version    seconds       moved      GB/s  verified");
        for u in &report.updates {
            println!(
                "{:>7}  {:>9.3}  {:>10}  {:>8.2}  {}{}",
                u.version,
                u.seconds,
                human_bytes(u.bytes as f64),
                u.gbps,
                if u.verified { "yes" } else { "NO" },
                u.error
                    .as_ref()
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default()
            );
        }
        match report.device_copy_gbps {
            Some(g) => println!(
                "device copy floor (one 1 GiB cuMemcpyDtoD on GPU {}, same run): {:.2} GB/s; median update / floor = {:.4}",
                args.gpu, g, report.ratio
            ),
            None => println!(
                "memcpy floor (1 thread, same run): {:.2} GB/s; median update / floor = {:.2}",
                report.memcpy_gbps, report.ratio
            ),
        }
        if let Some(t) = report.tcp_loopback_gbps {
            println!("one loopback TCP stream (same run): {t:.2} GB/s");
        }
        for e in &report.worker_errors {
            println!("{e}");
        }
        if !report.leaked_segments.is_empty() {
            println!(
                "LEAKED shared memory: {}",
                report.leaked_segments.join(", ")
            );
        }
    }
    Ok(if report.verified && report.leaked_segments.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn demo(
    a: &Args,
    r: &Resolved,
    transport: TransportKind,
    gpus: &Gpus,
) -> anyhow::Result<DemoReport> {
    let floor = memcpy_gbps();
    let device_floor = match transport {
        TransportKind::CudaIpc => Some(
            device_copy_gbps(a.gpu)
                .with_context(|| format!("measuring the copy floor on GPU {}", a.gpu))?,
        ),
        _ => None,
    };
    let tcp_floor = if transport == TransportKind::Tcp {
        Some(tcp_loopback_gbps()?)
    } else {
        None
    };
    let token = format!(
        "{:032x}",
        xxhash_rust::xxh3::xxh3_128(
            format!("{:?}{}", Instant::now(), std::process::id()).as_bytes()
        )
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let gateway = format!("http://{}", listener.local_addr()?);
    let config = GatewayConfig {
        token: Some(token.clone()),
        ..GatewayConfig::default()
    };
    let server = tokio::spawn(awex_control::server::serve(listener, config));
    let client = Client::new(&gateway, Some(token.clone()))?;
    let pair = format!("demo-{}", std::process::id());
    let summary = r.catalogue.summary();
    let deadline_ms = a.deadline_s.max(1) * 1000;
    let engines = r.inference.engines();
    client
        .connect(&ConnectRequest {
            name: pair.clone(),
            training: TrainingSpec {
                backend: r.train_spec.backend.clone(),
                parallel: r.train_spec.parallel.clone(),
                world_size: r.training.world_size() as u32,
                model: r.model.clone(),
                catalogue: summary.clone(),
            },
            inference: InferenceSpec {
                backend: r.infer_spec.backend.clone(),
                parallel: r.infer_spec.parallel.clone(),
                engines,
                world_size: r.inference.world_size() as u32,
                urls: vec![],
                model: r.model.clone(),
                catalogue: summary,
            },
            transport: serde_json::from_value(serde_json::json!(transport.as_str()))?,
            options: PairOptions {
                join_deadline_ms: 120_000,
                update_deadline_ms: deadline_ms,
                bucket_mib: a.bucket_mib,
                checksums: a.checksum,
                ..PairOptions::default()
            },
        })
        .await
        .context("connecting the demo pair")?;

    let t_spawn = Instant::now();
    let mut workers = Workers {
        children: Vec::new(),
        prefix: format!("awex-{pair}-"),
    };
    let quiet = !std::io::stderr().is_terminal();
    use awex_core::layout::Side;
    let train_gpu = |rank: RankId| gpus.of_rank(Side::Training, rank.rank as usize);
    for rank in r.training.ranks() {
        let mut c = worker_command(a, &gateway, &pair, &token, "train", rank, train_gpu(rank))?;
        if a.fault_kill_train_rank == Some(rank.rank) {
            c.args(["--die-at-version", &a.fault_version.to_string()]);
        }
        workers.children.push((
            format!("train {}", rank.rank),
            c.spawn().context("spawning a training rank")?,
        ));
    }
    for (i, rank) in r.inference.ranks().into_iter().enumerate() {
        let mut own = a.clone();
        if let (Some(bad), true) = (&a.fault_bad_infer, rank == RankId::infer(0, 0)) {
            own.infer = bad.clone();
        }
        let gpu = gpus.of_rank(Side::Inference, i);
        let mut c = worker_command(&own, &gateway, &pair, &token, "infer", rank, gpu)?;
        if rank == RankId::infer(0, 0)
            && let Some(v) = a.fault_corrupt_version
        {
            c.args(["--corrupt-version", &v.to_string()]);
        }
        workers.children.push((
            format!("infer {rank}"),
            c.spawn().context("spawning an inference rank")?,
        ));
    }
    let bar = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        let b = indicatif::ProgressBar::new(a.updates);
        b.set_style(
            indicatif::ProgressStyle::with_template("{spinner} update {pos}/{len} {wide_msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    };

    wait_ready(&client, &pair, &mut workers).await?;
    let join_ms = t_spawn.elapsed().as_secs_f64() * 1e3;
    let mut rows = Vec::new();
    let first = first_version(a);
    let mut version = first;
    let mut attempts = 0u32;
    while version < first + a.updates {
        attempts += 1;
        bar.set_message(format!("version {version}, attempt {attempts}"));
        if matches!(transport, TransportKind::CudaIpc | TransportKind::Nccl) {
            // the trainers upload each version before it is timed, as the shm trainers fill it
            wait_filled(&client, &pair, r, version, &mut workers).await?;
        }
        let t0 = Instant::now();
        client
            .start_update(&pair, version)
            .await
            .with_context(|| format!("starting version {version}"))?;
        let status = client
            .wait_update(
                &pair,
                version,
                Duration::from_millis(deadline_ms * 2 + 10_000),
            )
            .await?;
        let seconds = t0.elapsed().as_secs_f64();
        if status.state != UpdateState::Committed {
            let error = status.error.clone().unwrap_or_else(|| "failed".into());
            // fault drill: restart the killed training rank and retry the same version once
            if let Some(k) = a.fault_kill_train_rank
                && version == a.fault_version
                && attempts == 1
            {
                let name = format!("train {k}");
                if let Some(pos) = workers.children.iter().position(|(n, _)| *n == name) {
                    let (_, mut old) = workers.children.remove(pos);
                    let _ = old.wait();
                }
                let restarted = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0);
                let c = worker_command(
                    a,
                    &gateway,
                    &pair,
                    &token,
                    "train",
                    RankId::train(k),
                    train_gpu(RankId::train(k)),
                )?
                .spawn()?;
                workers.children.push((name, c));
                wait_rejoined(&client, &pair, RankId::train(k), restarted, &mut workers).await?;
                rows.push(UpdateRow {
                    version,
                    seconds,
                    bytes: 0,
                    gbps: 0.0,
                    verified: false,
                    attempts,
                    error: Some(error),
                });
                continue;
            }
            rows.push(UpdateRow {
                version,
                seconds,
                bytes: 0,
                gbps: 0.0,
                verified: false,
                attempts,
                error: Some(error),
            });
            break;
        }
        let bytes = status.bytes.inference;
        // every inference rank checks every byte, after its report
        let mut verified = true;
        let mut error = None;
        for rank in r.inference.ranks() {
            let key = format!("verify.{}.{}", rank.engine, rank.rank);
            let e = wait_verdict(&client, &pair, &key, version, status.attempt).await?;
            if e.value.get("ok") != Some(&serde_json::Value::Bool(true)) {
                verified = false;
                error = Some(format!(
                    "inference rank {rank}: {}",
                    e.value.get("error").and_then(|v| v.as_str()).unwrap_or("?")
                ));
            }
        }
        rows.push(UpdateRow {
            version,
            seconds,
            bytes,
            gbps: bytes as f64 / seconds / 1e9,
            verified,
            attempts,
            error,
        });
        bar.inc(1);
        version += 1;
        attempts = 0;
    }
    bar.finish_and_clear();

    if let Some(dir) = &a.dump_dir {
        let last = rows
            .iter()
            .filter(|u| u.verified)
            .map(|u| u.version)
            .max()
            .unwrap_or(first);
        let weights = super::worker::weights_of(&a.model, &r.catalogue)?;
        let tensors: Vec<(String, awex_core::DType, Vec<u64>, Vec<u8>)> = r
            .catalogue
            .tensors()
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    c.dtype,
                    c.shape.as_slice().to_vec(),
                    weights
                        .tensor(&r.catalogue, &c.name, last)
                        .unwrap_or_default(),
                )
            })
            .collect();
        let items: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), *d, s.clone(), b.as_slice()))
            .collect();
        crate::safetensors::write(&dir.join("canonical.safetensors"), &items)?;
    }

    client.disconnect(&pair).await.context("disconnecting")?;
    // workers see the disconnect, tear down and exit
    let stop_by = Instant::now() + Duration::from_secs(30);
    let mut worker_errors = Vec::new();
    for (name, c) in &mut workers.children {
        loop {
            match c.try_wait()? {
                Some(s) if s.success() => break,
                Some(s) => {
                    worker_errors.push(format!("worker `{name}` exited with {s}"));
                    break;
                }
                None if Instant::now() > stop_by => {
                    worker_errors.push(format!("worker `{name}` did not exit after disconnect"));
                    break;
                }
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }
    workers.kill_all();
    server.abort();
    let leaked = list_segments(&format!("awex-{pair}-"));
    let median = {
        let mut g: Vec<f64> = rows.iter().filter(|u| u.verified).map(|u| u.gbps).collect();
        g.sort_by(f64::total_cmp);
        g.get(g.len() / 2).copied().unwrap_or(0.0)
    };
    let verified =
        rows.iter().filter(|u| u.verified).count() as u64 == a.updates && worker_errors.is_empty();
    Ok(DemoReport {
        verified,
        transport: transport.to_string(),
        model: r.model.name.clone(),
        training: r.train_spec.to_string(),
        inference: r.infer_spec.to_string(),
        first_update_ms: rows.first().map_or(0.0, |u| u.seconds * 1e3),
        join_ms,
        updates: rows,
        memcpy_gbps: floor,
        device_copy_gbps: device_floor,
        ratio: match device_floor.unwrap_or(floor) {
            f if f > 0.0 => median / f,
            _ => 0.0,
        },
        tcp_loopback_gbps: tcp_floor,
        leaked_segments: leaked,
        worker_errors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_transports_need_no_gpu() {
        for t in [TransportKind::Shm, TransportKind::Tcp] {
            assert!(check_gpu_transport(t, &[7]).is_ok());
        }
    }

    fn args(transport: &str, extra: &[&str]) -> Args {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: Args,
        }
        let mut argv = vec!["demo", "--transport", transport];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).unwrap().a
    }

    #[test]
    fn gpu_lists_parse_and_rank_i_takes_entry_i_modulo_the_list() {
        assert_eq!(parse_gpus("--train-gpus", "0").unwrap(), vec![0]);
        assert_eq!(
            parse_gpus("--infer-gpus", "4, 5,6,7").unwrap(),
            vec![4, 5, 6, 7]
        );
        for bad in ["", "0,", "a", "0,-1", "1.5"] {
            let e = parse_gpus("--infer-gpus", bad).unwrap_err().to_string();
            assert!(
                e.starts_with(
                    "--infer-gpus takes a comma list of GPU ordinals such as `0,1`, but `"
                ) && e.ends_with(&format!("in `{bad}` is not one")),
                "{e}"
            );
        }
        assert_eq!(
            parse_gpus("--train-gpus", "0,x").unwrap_err().to_string(),
            "--train-gpus takes a comma list of GPU ordinals such as `0,1`, but `x` in `0,x` is not one"
        );
        let g = Gpus::of(
            &args("nccl", &["--train-gpus", "0,1", "--infer-gpus", "2,3,4"]),
            TransportKind::Nccl,
        )
        .unwrap();
        use awex_core::layout::Side;
        let train: Vec<u32> = (0..4).map(|i| g.of_rank(Side::Training, i)).collect();
        let infer: Vec<u32> = (0..4).map(|i| g.of_rank(Side::Inference, i)).collect();
        assert_eq!((train, infer), (vec![0, 1, 0, 1], vec![2, 3, 4, 2]));
        assert_eq!(g.all(), vec![0, 1, 2, 3, 4]);
        // both default to --gpu
        let d = Gpus::of(&args("nccl", &["--gpu", "3"]), TransportKind::Nccl).unwrap();
        assert_eq!(
            d,
            Gpus {
                train: vec![3],
                infer: vec![3]
            }
        );
    }

    #[test]
    fn placement_flags_are_refused_outside_nccl() {
        let e = Gpus::of(
            &args("cuda-ipc", &["--infer-gpus", "1"]),
            TransportKind::CudaIpc,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "--train-gpus and --infer-gpus place the ranks of --transport nccl; with `cuda-ipc` use --gpu"
        );
    }

    #[test]
    fn two_ranks_on_one_gpu_are_refused_naming_both() {
        let t = |n: u32| (0..n).map(RankId::train).collect::<Vec<_>>();
        let i = |e: u32, n: u32| {
            (0..e)
                .flat_map(|e| (0..n).map(move |r| RankId::infer(e, r)))
                .collect::<Vec<_>>()
        };
        let g = |train: &[u32], infer: &[u32]| Gpus {
            train: train.to_vec(),
            infer: infer.to_vec(),
        };
        assert_eq!(
            g(&[0], &[0])
                .refuse_shared(&t(1), &i(1, 1))
                .unwrap_err()
                .to_string(),
            "NCCL cannot put two ranks of one communicator on the same GPU: training rank 0 and inference rank 0/0 would both use GPU 0; give every rank its own GPU with --train-gpus and --infer-gpus (e.g. --train-gpus 0 --infer-gpus 1 for one rank a side)"
        );
        // two training ranks wrapping onto one GPU
        let e = g(&[0], &[1]).refuse_shared(&t(2), &i(1, 1)).unwrap_err();
        assert!(
            e.to_string()
                .contains("training rank 0 and training rank 1 would both use GPU 0"),
            "{e}"
        );
        // the second engine's first rank wraps onto the first engine's GPU
        let e = g(&[0, 1], &[2, 3])
            .refuse_shared(&t(2), &i(2, 2))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("inference rank 0/0 and inference rank 1/0 would both use GPU 2"),
            "{e}"
        );
        g(&[0], &[1]).refuse_shared(&t(1), &i(1, 1)).unwrap();
        g(&[0, 1, 2, 3], &[4, 5, 6, 7])
            .refuse_shared(&t(4), &i(2, 2))
            .unwrap();
    }

    #[test]
    fn workers_get_nvls_off_unless_the_user_set_it() {
        assert_eq!(nccl_nvls_default(None), Some(("NCCL_NVLS_ENABLE", "0")));
        assert_eq!(nccl_nvls_default(Some(std::ffi::OsStr::new("1"))), None);
        assert_eq!(nccl_nvls_default(Some(std::ffi::OsStr::new(""))), None);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn nccl_without_the_cuda_feature_says_the_binary_lacks_cuda() {
        assert_eq!(
            check_gpu_transport(TransportKind::Nccl, &[0, 1])
                .unwrap_err()
                .to_string(),
            "this awex-cli was built without CUDA, so the demo cannot use `nccl`; rebuild with `cargo build --release -p awex-cli --features cuda`, or use --transport shm or tcp"
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_ipc_without_the_cuda_feature_says_the_binary_lacks_cuda() {
        assert_eq!(
            check_gpu_transport(TransportKind::CudaIpc, &[0])
                .unwrap_err()
                .to_string(),
            "this awex-cli was built without CUDA, so the demo cannot use `cuda-ipc`; rebuild with `cargo build --release -p awex-cli --features cuda`, or use --transport shm or tcp"
        );
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_ipc_without_a_driver_says_no_cuda_driver_found() {
        if awex_gpu::cuda::driver_present() {
            eprintln!("libcuda is present here; the GPU demo covers this machine");
            return;
        }
        assert_eq!(
            check_gpu_transport(TransportKind::CudaIpc, &[0])
                .unwrap_err()
                .to_string(),
            "no CUDA driver found: libcuda could not be loaded (tried libcuda.so and libcuda.so.1 on the library search path); install the NVIDIA driver or run on a machine with a GPU"
        );
    }
}
