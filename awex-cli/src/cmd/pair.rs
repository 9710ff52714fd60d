//! `awex-cli pair`: operate pairs on a running gateway: connect, update, status, disconnect.

use super::plan::plural;
use super::serve::read_token;
use anyhow::{Context, bail};
use awex_control::client::Client;
use awex_control::wire::{
    ApplyMode, CommitPolicy, ConnectRequest, EngineState, EngineStatus, InferenceSpec, PairOptions,
    PairStatus, TrainingSpec, Transport, UpdateState, UpdateStatus,
};
use awex_core::backend::side_layout;
use awex_core::{BackendSpec, Catalogue, ModelSpec, Side};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Arguments of `awex-cli pair`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Gateway base URL.
    #[arg(
        long,
        env = "AWEX_GATEWAY",
        default_value = "http://127.0.0.1:7480",
        global = true
    )]
    pub gateway: String,
    /// File holding the gateway's bearer token (or set AWEX_TOKEN).
    #[arg(long, global = true)]
    pub token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: PairCommand,
}

#[derive(clap::Subcommand, Debug)]
enum PairCommand {
    /// Create a pair: validate both sides against each other and register it.
    Connect(Box<ConnectArgs>),
    /// Start an update to a version (and optionally wait for its commit).
    Update(UpdateArgs),
    /// Show a pair: state, serving version, latest update, ranks.
    Status(StatusArgs),
    /// Let a pair's engines serve again outside an update (after a failed version, only with
    /// --accept-torn: its weights may be partially written).
    Resume(ResumeArgs),
    /// Release a rank slot whose holder is gone though the gateway cannot see it (a stopped
    /// process, one lost while the gateway was down): the next process that joins the slot
    /// takes it over, and a version announced to the old holder fails.
    Release(ReleaseArgs),
    /// Add an engine to a running pair, in a free engine slot (a spare one, or one whose engine
    /// was removed); then start its ranks as inference ranks {engine, 0..}. It takes part in the
    /// first update that starts once they all joined, which moves every byte to it. Needs
    /// --commit quorum:K or available.
    AddEngine(AddEngineArgs),
    /// Remove an engine from a running pair: an update under way goes on without it, its ranks
    /// are told to stop and exit, their slots are freed. Needs --commit quorum:K or available.
    RemoveEngine(RemoveEngineArgs),
    /// Disconnect a pair; its ranks tear down their transports.
    Disconnect(NameArgs),
}

#[derive(clap::Args, Debug)]
struct AddEngineArgs {
    /// Pair name.
    #[arg(long)]
    name: String,
    /// The engine slot to fill; default: the lowest free one.
    #[arg(long)]
    engine: Option<u32>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct RemoveEngineArgs {
    /// Pair name.
    #[arg(long)]
    name: String,
    /// The engine slot to free (as `pair status` lists them).
    #[arg(long)]
    engine: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct ReleaseArgs {
    /// Pair name.
    #[arg(long)]
    name: String,
    /// The slot: `training:R` or `inference:E/R` (engine E, rank R).
    #[arg(long, value_parser = parse_slot)]
    rank: (Side, awex_core::RankId),
}

/// Parses `training:R` or `inference:E/R`.
fn parse_slot(s: &str) -> Result<(Side, awex_core::RankId), String> {
    let bad = || {
        format!(
            "`{s}` is not a rank slot; expected training:R or inference:E/R, e.g. training:0 or inference:1/0"
        )
    };
    let (side, rank) = s.split_once(':').ok_or_else(bad)?;
    match side {
        "training" => rank
            .parse()
            .map(|r| (Side::Training, awex_core::RankId::train(r)))
            .map_err(|_| bad()),
        "inference" => {
            let (e, r) = rank.split_once('/').ok_or_else(bad)?;
            match (e.parse(), r.parse()) {
                (Ok(e), Ok(r)) => Ok((Side::Inference, awex_core::RankId::infer(e, r))),
                _ => Err(bad()),
            }
        }
        _ => Err(bad()),
    }
}

#[derive(clap::Args, Debug)]
struct ResumeArgs {
    /// Pair name.
    #[arg(long)]
    name: String,
    /// Resume even though the last failed version left the inference weights partially
    /// written (the status then reports `serving_torn_version`).
    #[arg(long)]
    accept_torn: bool,
}

#[derive(clap::Args, Debug)]
struct ConnectArgs {
    /// Pair name ([A-Za-z0-9._-], up to 128 characters).
    #[arg(long)]
    name: String,
    /// Model: a preset name, a config.json, or an HF model directory.
    #[arg(long)]
    model: String,
    /// The training side's model when it differs (e.g. f32 master weights); defaults to --model.
    #[arg(long)]
    train_model: Option<String>,
    /// Training backend and parallel config, e.g. megatron:tp=2,pp=2.
    #[arg(long, long_help = super::plan::spec_help(Side::Training))]
    train: BackendSpec,
    /// Training ranks; defaults to what the parallel config implies.
    #[arg(long)]
    train_world: Option<u32>,
    /// Inference backend and parallel config, e.g. sglang:tp=2,engines=2.
    #[arg(long, long_help = super::plan::spec_help(Side::Inference))]
    infer: BackendSpec,
    /// Inference ranks of all engines together; defaults to what the parallel config implies.
    #[arg(long)]
    infer_world: Option<u32>,
    /// Base URL of an inference engine (repeat once per engine) to pause around updates.
    #[arg(long = "url")]
    urls: Vec<String>,
    /// Transport: shm, tcp, cuda-ipc, nccl.
    #[arg(long, default_value = "shm")]
    transport: Transport,
    /// Compare sender and receiver checksums before committing.
    #[arg(long)]
    checksums: bool,
    /// Apply updates atomically: inference ranks receive into staging (one extra copy of their
    /// shard) and copy into their live tensors only once every rank received; a failure
    /// before that leaves the live weights at the last committed version.
    #[arg(long)]
    atomic: bool,
    /// Delta updates: each training rank keeps a host copy of what it last sent and moves only
    /// the changed elements to inference ranks that provably hold that version (shm, tcp;
    /// docs/deltas.md).
    #[arg(long)]
    deltas: bool,
    /// Training ranks read every tensor they send for infinity and NaN before an update moves
    /// anything, and fail it naming the tensor and element (one read of each rank's shard per
    /// update; shm, tcp). FP8 pairs check their quantised tensors without it.
    #[arg(long)]
    check_finite: bool,
    /// When a version commits across engines: `all` (every engine applied it; one failed
    /// engine fails it for all), `quorum:K` (at least K engines applied it) or `available`
    /// (at least one did); engines left out are reported behind and catch up in the next
    /// update (docs/gateway.md, "Engines and commit policies").
    #[arg(long, default_value = "all")]
    commit: CommitPolicy,
    /// How many of the last engines of --infer start out of the pair: their slots wait for
    /// engines added at run time (`pair add-engine`). Every rank plans against every slot of
    /// --infer (start all ranks with the same --infer), so no plan changes when an engine joins
    /// or leaves. Needs --commit quorum:K or available.
    #[arg(long, default_value_t = 0)]
    spare: u32,
    /// Time for every rank to join, in seconds (1 to 3600).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3_600))]
    join_deadline_s: u64,
    /// Time for every rank to report an update, in seconds (1 to 86400).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    update_deadline_s: u64,
    /// Staging bucket size in MiB (1 to 65536).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    bucket_mib: u64,
    /// Staging buckets per rank (1 to 64).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    buckets: u32,
    /// Print the pair's status as JSON.
    #[arg(long)]
    json: bool,
    /// The inference side's FP8 encoding (every rank must be started with the same).
    #[command(flatten)]
    quant: crate::cmd::quant::QuantArgs,
}

#[derive(clap::Args, Debug)]
struct UpdateArgs {
    /// Pair name.
    #[arg(long)]
    name: String,
    /// Version to install (greater than the last, or equal to a failed one to retry).
    #[arg(long)]
    version: u64,
    /// Wait until the version commits or fails; exit 1 if it failed.
    #[arg(long)]
    wait: bool,
    /// Longest wait with --wait, seconds.
    #[arg(long, default_value_t = 3600)]
    timeout_s: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct StatusArgs {
    /// Pair name.
    #[arg(long)]
    name: String,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct NameArgs {
    /// Pair name.
    #[arg(long)]
    name: String,
}

/// Builds the connect request: resolves the model(s), checks each backend spec against its
/// registered backend, and derives or checks the world sizes from the layouts.
fn connect_request(a: &ConnectArgs) -> anyhow::Result<ConnectRequest> {
    let infer_model = ModelSpec::resolve(&a.model)?;
    let train_model = match &a.train_model {
        Some(m) => ModelSpec::resolve(m)?,
        None => infer_model.clone(),
    };
    let train_layout = side_layout(Side::Training, &a.train, &train_model)?;
    let infer_layout = side_layout(Side::Inference, &a.infer, &infer_model)?;
    let world = |side: Side, given: Option<u32>, layout: usize| -> anyhow::Result<u32> {
        let layout = u32::try_from(layout).context("world size does not fit in 32 bits")?;
        match given {
            Some(w) if w != layout => bail!(
                "--{}-world {w} disagrees with the {side} parallel config, which has {layout} ranks",
                side.short()
            ),
            _ => Ok(layout),
        }
    };
    let train_world = world(Side::Training, a.train_world, train_layout.world_size())?;
    let infer_world = world(Side::Inference, a.infer_world, infer_layout.world_size())?;
    let engines = infer_layout.engines();
    Ok(ConnectRequest {
        name: a.name.clone(),
        training: TrainingSpec {
            backend: a.train.backend.clone(),
            parallel: a.train.parallel.clone(),
            world_size: train_world,
            catalogue: Catalogue::of(&train_model).summary(),
            model: train_model,
        },
        inference: InferenceSpec {
            spare: a.spare,
            fp8: a.quant.resolve_for(&a.model, &infer_model)?,
            backend: a.infer.backend.clone(),
            parallel: a.infer.parallel.clone(),
            engines,
            world_size: infer_world,
            urls: a.urls.clone(),
            catalogue: Catalogue::of(&infer_model).summary(),
            model: infer_model,
        },
        transport: a.transport,
        options: PairOptions {
            join_deadline_ms: a.join_deadline_s * 1000,
            update_deadline_ms: a.update_deadline_s * 1000,
            bucket_mib: a.bucket_mib,
            buckets: a.buckets,
            checksums: a.checksums,
            apply: if a.atomic {
                ApplyMode::Atomic
            } else {
                ApplyMode::InPlace
            },
            deltas: a.deltas,
            commit: a.commit,
            check_finite: a.check_finite,
        },
    })
}

fn token(args: &Args) -> anyhow::Result<Option<String>> {
    if let Some(f) = &args.token_file {
        return read_token(f).map(Some);
    }
    Ok(std::env::var("AWEX_TOKEN")
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty()))
}

/// Milliseconds as seconds, for people (`60 s`, `1.5 s`).
fn seconds(ms: u64) -> String {
    if ms % 1000 == 0 {
        format!("{} s", ms / 1000)
    } else {
        format!("{} s", ms as f64 / 1000.0)
    }
}

/// One line per fact of an update, for people.
pub fn describe_update(u: &UpdateStatus) -> String {
    let mut s = format!(
        "version {} attempt {}: {} after {:.3} s; bytes training {} / inference {}",
        u.version,
        u.attempt,
        u.state.as_str(),
        u.elapsed_ms as f64 / 1000.0,
        u.bytes.training,
        u.bytes.inference
    );
    if let Some(c) = &u.checksums {
        s.push_str(&format!(
            "; checksums {:#018x} / {:#018x}",
            c.training, c.inference
        ));
    }
    if let Some(e) = &u.error {
        s.push_str(&format!("\n  error: {e}"));
    }
    for r in u.ranks.iter().take(32) {
        s.push_str(&format!(
            "\n  {} rank {}/{}: {}{}",
            r.side,
            r.rank.engine,
            r.rank.rank,
            r.state.as_str(),
            r.error
                .as_ref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default()
        ));
    }
    for e in &u.engine_errors {
        s.push_str(&format!("\n  engine: {e}"));
    }
    s
}

/// One engine's standing, for people (`engine 1: torn, serving version 3, behind since ...`).
pub fn describe_engine(e: &EngineStatus) -> String {
    let serving = e
        .serving_version
        .map(|v| format!("serving version {v}"))
        .unwrap_or_else(|| "no committed version applied".into());
    let mut s = format!("engine {}: {}, {serving}", e.engine, e.state.as_str());
    if let Some(t) = e.torn_version {
        s.push_str(&format!(", weights partly written by version {t}"));
    }
    if let Some(t) = e.serving_torn_version {
        s.push_str(&format!(", serving torn version {t} (accepted)"));
    }
    if let Some(since) = e.behind_since_unix_ms {
        s.push_str(&format!(", behind since unix ms {since}"));
    }
    if let Some(err) = &e.last_error {
        s.push_str(&format!("; last error: {err}"));
    }
    s
}

/// A pair's status, for people.
pub fn describe_pair(p: &PairStatus) -> String {
    let serving = p
        .serving_version
        .map(|v| format!("serving version {v}"))
        .unwrap_or_else(|| "serving no committed version yet".into());
    let mut s = format!(
        "pair {} (id {}): {}, {serving}\n",
        p.name,
        p.id,
        p.state.as_str()
    );
    s.push_str(&format!(
        "  training:  {}:{}  {} ({} joined)  model {} [{}]\n",
        p.training.backend,
        p.training.parallel,
        plural(p.training.world_size, "rank"),
        p.training.joined,
        p.training.model,
        p.training.fingerprint
    ));
    s.push_str(&format!(
        "  inference: {}:{}  {} in {} ({} joined)  model {} [{}]\n",
        p.inference.backend,
        p.inference.parallel,
        plural(p.inference.world_size, "rank"),
        plural(p.inference.engines, "engine"),
        p.inference.joined,
        p.inference.model,
        p.inference.fingerprint
    ));
    s.push_str(&format!(
        "  transport {}, checksums {}, apply {}, deadlines: join {}, update {}, buckets {} x {} MiB",
        p.transport,
        if p.options.checksums { "on" } else { "off" },
        p.options.apply,
        seconds(p.options.join_deadline_ms),
        seconds(p.options.update_deadline_ms),
        p.options.buckets,
        p.options.bucket_mib
    ));
    if p.options.deltas {
        s.push_str(", deltas");
    }
    if p.options.check_finite {
        s.push_str(", check_finite");
    }
    if !p.options.commit.is_all() {
        s.push_str(&format!(", commit {}", p.options.commit));
    }
    // per engine, when engines may differ (a policy other than `all`, or one not serving)
    if !p.options.commit.is_all() || p.engines.iter().any(|e| e.state != EngineState::Serving) {
        for e in &p.engines {
            s.push_str(&format!(
                "
  {}",
                describe_engine(e)
            ));
        }
    }
    if let Some(e) = &p.join_error {
        s.push_str(&format!("\n  join failed: {e}"));
    }
    if let Some(u) = &p.current_update {
        s.push_str(&format!("\n  latest update: {}", describe_update(u)));
    }
    s
}

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let client = Client::new(&args.gateway, token(&args)?)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        match args.command {
            PairCommand::Connect(a) => {
                let req = connect_request(&a)?;
                for (flag, spec, side) in [
                    ("--train", &a.train, Side::Training),
                    ("--infer", &a.infer, Side::Inference),
                ] {
                    if spec.parallel.0.is_empty()
                        && let Some(note) = super::plan::defaults_note(flag, &spec.backend, side)
                    {
                        eprintln!("{note}");
                    }
                }
                let status = client.connect(&req).await?;
                if a.json {
                    println!("{}", serde_json::to_string_pretty(&status)?);
                } else {
                    println!("{}", describe_pair(&status));
                    println!(
                        "ranks may join now: {} training, {} inference; join deadline {}",
                        status.training.world_size,
                        status.inference.world_size,
                        seconds(status.options.join_deadline_ms)
                    );
                }
                Ok(ExitCode::SUCCESS)
            }
            PairCommand::Update(a) => {
                let mut u = match client.start_update(&a.name, a.version).await {
                    Ok(u) => u,
                    // started, though not yet on the gateway's disk: follow it, never retry it
                    Err(e) if e.queued() => {
                        eprintln!("version {} was started: {e}", a.version);
                        client
                            .update_status(&a.name, a.version)
                            .await
                            .context("reading the started version's status")?
                    }
                    Err(e) => return Err(e.into()),
                };
                if a.wait {
                    u = client
                        .wait_update(&a.name, a.version, Duration::from_secs(a.timeout_s))
                        .await?;
                }
                if a.json {
                    println!("{}", serde_json::to_string_pretty(&u)?);
                } else {
                    println!("pair {}: {}", a.name, describe_update(&u));
                }
                Ok(if u.state == UpdateState::Failed {
                    ExitCode::from(1)
                } else {
                    ExitCode::SUCCESS
                })
            }
            PairCommand::Status(a) => {
                let status = client.status(&a.name).await?;
                if a.json {
                    println!("{}", serde_json::to_string_pretty(&status)?);
                } else {
                    println!("{}", describe_pair(&status));
                }
                Ok(ExitCode::SUCCESS)
            }
            PairCommand::Resume(a) => {
                let status = client.resume(&a.name, a.accept_torn).await?;
                match status.serving_torn_version {
                    Some(v) => println!(
                        "pair {} resumed on the partially written version {v}; serving version {}",
                        status.name,
                        status
                            .serving_version
                            .map_or_else(|| "none".to_string(), |v| v.to_string())
                    ),
                    None => println!(
                        "pair {} resumed; serving version {}",
                        status.name,
                        status
                            .serving_version
                            .map_or_else(|| "none".to_string(), |v| v.to_string())
                    ),
                }
                Ok(ExitCode::SUCCESS)
            }
            PairCommand::Release(a) => {
                let (side, rank) = a.rank;
                let r = client
                    .release_slot(&a.name, &awex_control::wire::ReleaseSlot { side, rank })
                    .await?;
                let who = match side {
                    Side::Training => format!("training rank {}", rank.rank),
                    Side::Inference => format!("inference rank {}/{}", rank.engine, rank.rank),
                };
                println!(
                    "pair {}: {who} released (holder pid {}); the next process that joins it takes it over",
                    a.name,
                    r.holder_pid
                        .map_or_else(|| "unknown".to_string(), |p| p.to_string())
                );
                Ok(ExitCode::SUCCESS)
            }
            PairCommand::AddEngine(a) => {
                let r = client.add_engine(&a.name, a.engine).await?;
                if a.json {
                    println!("{}", serde_json::to_string_pretty(&r)?);
                } else {
                    println!(
                        "pair {}: engine {} added ({}); start its ranks as inference ranks {{engine: {}, rank: 0..{}}}: it takes part in the first update after they all joined",
                        r.pair,
                        r.engine,
                        r.status.state.as_str(),
                        r.engine,
                        r.ranks
                    );
                }
                Ok(ExitCode::SUCCESS)
            }
            PairCommand::RemoveEngine(a) => {
                let r = client.remove_engine(&a.name, a.engine).await?;
                if a.json {
                    println!("{}", serde_json::to_string_pretty(&r)?);
                } else {
                    println!(
                        "pair {}: engine {} removed; its ranks are told to stop, its slot is free",
                        r.pair, r.engine
                    );
                }
                Ok(ExitCode::SUCCESS)
            }
            PairCommand::Disconnect(a) => {
                let status = client.disconnect(&a.name).await?;
                println!(
                    "pair {} disconnected (id {}); last committed version: {}",
                    status.name,
                    status.id,
                    status
                        .serving_version
                        .map_or_else(|| "none".to_string(), |v| v.to_string())
                );
                Ok(ExitCode::SUCCESS)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(line: &str) -> Args {
        Cli::parse_from(std::iter::once("pair").chain(line.split_whitespace())).args
    }

    /// A gateway on its own thread and runtime; returns its URL.
    fn gateway() -> String {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(l.local_addr().unwrap()).unwrap();
                awex_control::server::serve(l, Default::default())
                    .await
                    .unwrap();
            });
        });
        format!("http://{}", rx.recv().unwrap())
    }

    #[test]
    fn connect_derives_world_sizes_and_engines_from_the_backend_specs() {
        crate::link::link_backends();
        let Args {
            command: PairCommand::Connect(a),
            ..
        } = parse(
            "connect --name p --model qwen3-tiny --train megatron:tp=2,pp=2 --infer sglang:tp=2,engines=3 --transport nccl --checksums",
        )
        else {
            unreachable!()
        };
        let req = connect_request(&a).unwrap();
        assert_eq!(req.training.world_size, 4);
        assert_eq!((req.inference.engines, req.inference.world_size), (3, 6));
        assert_eq!(req.transport, Transport::Nccl);
        assert!(req.options.checksums);
        assert_eq!(
            req.training.catalogue,
            Catalogue::of(&req.training.model).summary()
        );
        let Args {
            command: PairCommand::Connect(a),
            ..
        } = parse(
            "connect --name p --model qwen3-tiny --train megatron:tp=2 --infer sglang:tp=2 --infer-world 4",
        )
        else {
            unreachable!()
        };
        assert_eq!(
            connect_request(&a).unwrap_err().to_string(),
            "--infer-world 4 disagrees with the inference parallel config, which has 2 ranks"
        );
    }

    #[test]
    fn operator_commands_drive_a_pair_on_a_live_gateway() {
        crate::link::link_backends();
        let url = gateway();
        let run_line = |l: &str| run(parse(&format!("--gateway {url} {l}")));
        let ok = run_line(
            "connect --name op --model qwen3-tiny --train megatron:tp=1 --infer sglang:tp=1",
        )
        .unwrap();
        assert_eq!(ok, ExitCode::SUCCESS);
        let dup = run_line(
            "connect --name op --model qwen3-tiny --train megatron:tp=1 --infer sglang:tp=1",
        )
        .unwrap_err();
        assert_eq!(
            dup.to_string(),
            "gateway answered 409: a pair named `op` already exists (state joining); disconnect it first or pick another name"
        );
        assert_eq!(
            run_line("status --name op --json").unwrap(),
            ExitCode::SUCCESS
        );
        let early = run_line("update --name op --version 1").unwrap_err();
        assert_eq!(
            early.to_string(),
            "gateway answered 409: pair `op` is still joining: 0 of 2 ranks joined; start updates once every rank joined"
        );
        assert_eq!(run_line("disconnect --name op").unwrap(), ExitCode::SUCCESS);
        let gone = run_line("status --name nope").unwrap_err();
        assert_eq!(
            gone.to_string(),
            "gateway answered 404: no pair named `nope`; create it with POST /v1/pairs"
        );
    }
}
