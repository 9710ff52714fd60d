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
//!
//! One module per job: [`args`] (the flags), [`gpus`] (GPU checks and rank placement),
//! [`floors`] (memcpy, device copy, loopback TCP, measured in the run), [`ranks`] (spawning the
//! rank processes and waiting on them through the gateway), [`progress`] (stderr lines or a
//! bar), [`checks`] (what the run proved), [`dump`] (`--dump-dir`), [`report`] (the table and
//! the JSON); this file runs them in order.

mod args;
mod checks;
mod dump;
mod floors;
mod gpus;
mod progress;
mod ranks;
mod report;

pub use args::{Args, parse_lr};
pub use floors::{device_copy_gbps, memcpy_gbps, tcp_loopback_gbps};
pub use gpus::{Gpus, check_gpu_transport};
pub use report::{Checks, DemoReport, UpdateRow};

use crate::cmd::plan::Resolved;
use anyhow::{Context, bail};
use args::first_version;
use awex_control::client::Client;
use awex_control::server::GatewayConfig;
use awex_control::wire::{ApplyMode, PairOptions, UpdateState};
use awex_core::Transport;
use awex_core::layout::RankId;
use progress::Progress;
use ranks::{
    Workers, wait_connected, wait_filled, wait_ready, wait_rejoined, wait_verdict, worker_command,
};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let transport: Transport = args.transport.parse().map_err(anyhow::Error::msg)?;
    if args.updates == 0 {
        bail!("--updates must be at least 1");
    }
    let gpus = Gpus::of(&args, transport)?;
    let r = crate::cmd::plan::resolve_over(
        &args.model,
        &args.train,
        &args.infer,
        &args.quant,
        transport,
    )?;
    if let Some(fp8) = &r.spec.infer_fp8
        && transport.on_gpu()
    {
        awex_runtime::transport::refuse_on_gpu_over(transport, fp8)?;
        if transport == Transport::Nccl {
            // the training GPUs quantise: every FP8 block must be whole on one of them (the
            // ranks refuse the pair otherwise; said here before any process starts)
            let pair = r.plan_pair();
            for rank in r.inference.ranks() {
                let plan = pair.plan_rank(awex_core::layout::Side::Inference, rank)?;
                for t in plan.peers.iter().flat_map(|p| &p.transfers) {
                    awex_gpu::nccl::check_encoding(t)?;
                }
            }
        }
    }
    if transport == Transport::Nccl {
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
        report::print_table(&report, args.gpu());
    }
    Ok(if report.verified && report.checks.all_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn demo(
    a: &Args,
    r: &Resolved,
    transport: Transport,
    gpus: &Gpus,
) -> anyhow::Result<DemoReport> {
    let mut progress = Progress::default();
    progress.say(&format!(
        "{} | {} -> {} | transport {}; measuring the floor",
        r.spec.model.name, r.spec.train, r.spec.infer, transport
    ));
    for rule in r.catalogue.not_moved() {
        progress.say(&format!("not moved: {}", rule.describe()));
    }
    let floor = memcpy_gbps();
    let device_floor = match transport {
        Transport::CudaIpc => Some(
            device_copy_gbps(a.gpu())
                .with_context(|| format!("measuring the copy floor on GPU {}", a.gpu()))?,
        ),
        _ => None,
    };
    let tcp_floor = if transport == Transport::Tcp {
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
    let _summary = r.catalogue.summary();
    let deadline_ms = a.deadline_s * 1000;
    let _engines = r.inference.engines();
    let connected = client
        .connect(&{
            let mut req = awex_control::connect::connect_request(
                &pair,
                r,
                vec![],
                PairOptions {
                    join_deadline_ms: 120_000,
                    update_deadline_ms: deadline_ms,
                    bucket_mib: a.bucket_mib,
                    checksums: a.checksums,
                    deltas: a.deltas,
                    check_finite: a.check_finite,
                    commit: a.commit,
                    apply: if a.atomic {
                        ApplyMode::Atomic
                    } else {
                        ApplyMode::InPlace
                    },
                    ..PairOptions::default()
                },
            );
            req.transport = transport;
            if a.fault_add_engine {
                // the last engine's slot starts empty: the drill adds that engine mid-run
                req.inference.spare = 1;
            }
            req
        })
        .await
        .context("connecting the demo pair")?;
    // this connect's segments, and no one else's: the pair's name holds this process's id,
    // which another demo's can equal (another PID namespace sharing /dev/shm, or a pid reused
    // while a killed demo's ranks still hold theirs), the connect's uid is this run's own
    let segments = segment_prefix(&pair, &connected.uid);

    let mut workers = Workers {
        children: Vec::new(),
        prefix: segments.clone(),
    };
    use awex_core::layout::Side;
    progress.say(&format!(
        "gateway on {gateway}; spawning {} and {}",
        crate::cmd::plan::plural(r.training.world_size() as u64, "training rank"),
        crate::cmd::plan::plural(r.inference.world_size() as u64, "inference rank")
    ));
    let t_spawn = Instant::now();
    let train_gpu = |rank: RankId| gpus.of_rank(Side::Training, rank.rank as usize);
    for rank in r.training.ranks() {
        let mut c = worker_command(
            a,
            &gateway,
            &pair,
            &token,
            "train",
            rank,
            train_gpu(rank),
            first_version(a),
        )?;
        if a.fault_kill_train_rank == Some(rank.rank) {
            c.args(["--die-at-version", &a.fault_version.to_string()]);
        }
        workers.children.push((
            format!("train {}", rank.rank),
            c.spawn().context("spawning a training rank")?,
        ));
    }
    // `--fault-add-engine`: the engine that joins mid-run (its ranks start later)
    let added = a
        .fault_add_engine
        .then(|| r.inference.engines().saturating_sub(1));
    for (i, rank) in r.inference.ranks().into_iter().enumerate() {
        if added == Some(rank.engine) {
            continue;
        }
        let mut own = a.clone();
        if let (Some(bad), true) = (&a.fault_bad_infer, rank == RankId::infer(0, 0)) {
            own.infer = bad.clone();
        }
        let gpu = gpus.of_rank(Side::Inference, i);
        let mut c = worker_command(
            &own,
            &gateway,
            &pair,
            &token,
            "infer",
            rank,
            gpu,
            first_version(a),
        )?;
        if rank == RankId::infer(0, 0)
            && let Some(v) = a.fault_corrupt_version
        {
            c.args(["--corrupt-version", &v.to_string()]);
        }
        if a.fault_kill_infer_engine == Some(rank.engine) && rank.rank == 0 {
            c.args(["--die-at-version", &a.fault_version.to_string()]);
        }
        workers.children.push((
            format!("infer {rank}"),
            c.spawn().context("spawning an inference rank")?,
        ));
    }
    let joining = Instant::now();
    wait_ready(&client, &pair, &mut workers).await?;
    if transport.on_gpu() {
        wait_connected(&client, &pair, r, &mut workers).await?;
    }
    let join_ms = t_spawn.elapsed().as_secs_f64() * 1e3;
    progress.say(&format!(
        "every rank joined in {:.1} s; {}",
        joining.elapsed().as_secs_f64(),
        crate::cmd::plan::plural(a.updates, "update")
    ));
    progress.start_updates(a.updates);
    let mut rows = Vec::new();
    let first = first_version(a);
    let mut version = first;
    let mut attempts = 0u32;
    let mut checksums_compared = 0u64;
    let (mut added_serving, mut removed_absent, mut removed_exited) = (false, false, false);
    while version < first + a.updates {
        attempts += 1;
        progress.message(format!("version {version}, attempt {attempts}"));
        if transport.on_gpu() || a.lr.is_some() {
            // the trainers upload (or compute: optimiser-like versions) each version before it
            // is timed, as a trainer holds its new weights before the update starts
            wait_filled(&client, &pair, r, version, &mut workers).await?;
        }
        if let Some(e) = added
            && version == a.fault_version
            && attempts == 1
        {
            // fleet drill: the engine is added to the running pair and its ranks started; this
            // version is its first
            let since = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            let changed = client
                .add_engine(&pair, Some(e))
                .await
                .with_context(|| format!("adding engine {e}"))?;
            for (i, rank) in r.inference.ranks().into_iter().enumerate() {
                if rank.engine != changed.engine {
                    continue;
                }
                let c = worker_command(
                    a,
                    &gateway,
                    &pair,
                    &token,
                    "infer",
                    rank,
                    gpus.of_rank(Side::Inference, i),
                    first_version(a),
                )?
                .spawn()
                .context("spawning an added engine's rank")?;
                workers.children.push((format!("infer {rank}"), c));
            }
            for rank in r.inference.ranks() {
                if rank.engine == changed.engine {
                    wait_rejoined(&client, &pair, Side::Inference, rank, since, &mut workers)
                        .await?;
                }
            }
            progress.say(&format!(
                "engine {e} added to the running pair; its ranks joined"
            ));
        }
        let t0 = Instant::now();
        client
            .start_update(&pair, version)
            .await
            .with_context(|| format!("starting version {version}"))?;
        if let Some(e) = a.fault_remove_engine
            && version == a.fault_version
            && attempts == 1
        {
            // fleet drill: the engine leaves while this version runs
            client
                .remove_engine(&pair, e)
                .await
                .with_context(|| format!("removing engine {e}"))?;
            progress.say(&format!("engine {e} removed while version {version} runs"));
        }
        // fault drill: the engines' ranks stop as the update starts (silent, not gone)
        let stopped = if version == a.fault_version && attempts == 1 {
            signal_infer_ranks(&workers, &a.fault_stop_infer_engines, libc::SIGSTOP)
        } else {
            Vec::new()
        };
        let status = client
            .wait_update(
                &pair,
                version,
                Duration::from_millis(deadline_ms * 2 + 10_000),
            )
            .await?;
        let seconds = t0.elapsed().as_secs_f64();
        if !stopped.is_empty() {
            signal_infer_ranks(&workers, &a.fault_stop_infer_engines, libc::SIGCONT);
        }
        if !stopped.is_empty() && status.state != UpdateState::Committed {
            // nothing is reported serving the version that did not commit; then retry it
            let st = client.status(&pair).await?;
            let none_serving = st.engines.iter().all(|e| {
                e.serving_version != Some(version)
                    && (e.state != awex_control::wire::EngineState::Serving
                        || e.serving_version == st.serving_version)
            });
            let error = status.error.clone().unwrap_or_else(|| "failed".into());
            progress.say(&format!(
                "version {version} attempt {attempts} failed after {seconds:.2} s with engines {stopped:?} stopped: {error}"
            ));
            rows.push(UpdateRow {
                version,
                seconds,
                transfer_ms: None,
                bytes: 0,
                dense_bytes: None,
                density: None,
                base: None,
                gbps: 0.0,
                verified: false,
                attempts,
                error: Some(error),
                torn: Some(st.torn_version == Some(version)),
                live_intact: None,
                left_out: status.left_out.iter().map(|l| l.engine).collect(),
                behind: None,
                caught_up: None,
                none_serving: Some(none_serving),
            });
            continue;
        }
        if status.state != UpdateState::Committed {
            let error = status.error.clone().unwrap_or_else(|| "failed".into());
            progress.say(&format!(
                "version {version} attempt {attempts} failed after {seconds:.2} s: {error}"
            ));
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
                    // it holds the version being retried, and says so (`filled`) on GPU
                    // transports, where the retry waits for that before it starts
                    version,
                )?
                .spawn()?;
                workers.children.push((name, c));
                wait_rejoined(
                    &client,
                    &pair,
                    Side::Training,
                    RankId::train(k),
                    restarted,
                    &mut workers,
                )
                .await?;
                // what the failed attempt left behind: the pair's torn mark, and whether every
                // inference rank's live tensors still hold the last committed version
                let torn = client.status(&pair).await?.torn_version == Some(version);
                let mut live_intact = true;
                for rank in r.inference.ranks() {
                    // a rank that never reported this attempt never ran it (the attempt was
                    // over before it started: the gateway fails a version as soon as a rank's
                    // process is gone), so it has no verdict and its tensors were not touched
                    let never_ran = status.ranks.iter().any(|u| {
                        u.side == Side::Inference
                            && u.rank == rank
                            && matches!(
                                u.state,
                                awex_control::wire::RankReportState::Waiting
                                    | awex_control::wire::RankReportState::Missing
                            )
                    });
                    if never_ran {
                        continue;
                    }
                    let key = format!("verify.{}.{}", rank.engine, rank.rank);
                    let e = wait_verdict(&client, &pair, &key, version, status.attempt).await?;
                    live_intact &=
                        e.value.get("live_holds_committed") == Some(&serde_json::Value::Bool(true));
                }
                rows.push(UpdateRow {
                    version,
                    seconds,
                    transfer_ms: None,
                    bytes: 0,
                    gbps: 0.0,
                    verified: false,
                    attempts,
                    error: Some(error),
                    torn: Some(torn),
                    live_intact: Some(live_intact),
                    dense_bytes: None,
                    density: None,
                    base: None,
                    left_out: Vec::new(),
                    behind: None,
                    caught_up: None,
                    none_serving: None,
                });
                continue;
            }
            rows.push(UpdateRow {
                version,
                seconds,
                transfer_ms: None,
                bytes: 0,
                dense_bytes: None,
                density: None,
                base: None,
                gbps: 0.0,
                verified: false,
                attempts,
                error: Some(error),
                torn: None,
                live_intact: None,
                left_out: Vec::new(),
                behind: None,
                caught_up: None,
                none_serving: None,
            });
            break;
        }
        let bytes = status.bytes.inference;
        if status
            .checksums
            .as_ref()
            .is_some_and(|c| c.training == c.inference)
        {
            checksums_compared += 1;
        }
        // every inference rank checks every byte, after its report (but those of engines left
        // out of the version: they do not serve it)
        let left_out: Vec<u32> = status.left_out.iter().map(|l| l.engine).collect();
        let mut verified = true;
        let mut error = None;
        // the slowest inference rank's data plane, when every rank timed its own
        let mut transfer_ms = Some(0.0f64);
        for rank in r.inference.ranks() {
            if left_out.contains(&rank.engine) {
                continue;
            }
            let key = format!("verify.{}.{}", rank.engine, rank.rank);
            let e = wait_verdict(&client, &pair, &key, version, status.attempt).await?;
            let t = e.value.get("transfer_ms").and_then(|v| v.as_f64());
            transfer_ms = transfer_ms.zip(t).map(|(a, b)| a.max(b));
            if e.value.get("ok") != Some(&serde_json::Value::Bool(true)) {
                verified = false;
                error = Some(format!(
                    "inference rank {rank}: {}",
                    e.value.get("error").and_then(|v| v.as_str()).unwrap_or("?")
                ));
            }
        }
        let dense_bytes = status.delta.map(|d| d.dense_bytes.inference);
        // fault drill: the killed engine is reported behind, then restarted to catch up
        let mut behind = None;
        let mut caught_up = None;
        if let Some(e) = a.fault_kill_infer_engine {
            let st = client.status(&pair).await?;
            if version == a.fault_version {
                behind = Some(st.engines.get(e as usize).is_some_and(|x| {
                    x.state != awex_control::wire::EngineState::Serving
                        && x.serving_version != Some(version)
                }));
                let rank = RankId::infer(e, 0);
                let name = format!("infer {rank}");
                if let Some(pos) = workers.children.iter().position(|(n, _)| *n == name) {
                    let (_, mut old) = workers.children.remove(pos);
                    let _ = old.wait();
                }
                let restarted = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0);
                let i = r
                    .inference
                    .ranks()
                    .iter()
                    .position(|x| *x == rank)
                    .unwrap_or(0);
                let c = worker_command(
                    a,
                    &gateway,
                    &pair,
                    &token,
                    "infer",
                    rank,
                    gpus.of_rank(Side::Inference, i),
                    first_version(a),
                )?
                .spawn()?;
                workers.children.push((name, c));
                wait_rejoined(
                    &client,
                    &pair,
                    Side::Inference,
                    rank,
                    restarted,
                    &mut workers,
                )
                .await?;
                progress.say(&format!(
                    "version {version}: engine {e} left out and reported behind; its rank restarted"
                ));
            } else if version == a.fault_version + 1 {
                caught_up = Some(st.engines.iter().all(|x| {
                    x.state == awex_control::wire::EngineState::Serving
                        && x.serving_version == Some(version)
                }));
            }
        }
        if added.is_some() && version == a.fault_version {
            let st = client.status(&pair).await?;
            added_serving = added
                .and_then(|e| st.engines.get(e as usize))
                .is_some_and(|x| {
                    x.state == awex_control::wire::EngineState::Serving
                        && x.serving_version == Some(version)
                });
        }
        if let Some(e) = a.fault_remove_engine
            && version == a.fault_version + 1
        {
            let st = client.status(&pair).await?;
            removed_absent = st
                .engines
                .get(e as usize)
                .is_some_and(|x| x.state == awex_control::wire::EngineState::Absent);
            // its ranks saw `engine_removed` and exit on their own
            removed_exited = true;
            let mine = |name: &str| {
                r.inference
                    .ranks()
                    .iter()
                    .any(|k| k.engine == e && name == format!("infer {k}"))
            };
            for (name, c) in &mut workers.children {
                if mine(name) {
                    let by = Instant::now() + Duration::from_secs(60);
                    loop {
                        match c.try_wait()? {
                            Some(s) => {
                                removed_exited &= s.success();
                                break;
                            }
                            None if Instant::now() > by => {
                                removed_exited = false;
                                break;
                            }
                            None => tokio::time::sleep(Duration::from_millis(20)).await,
                        }
                    }
                }
            }
            // reaped: no later wait takes their exit for a failure
            if removed_exited {
                workers.children.retain(|(name, _)| !mine(name));
            }
        }
        rows.push(UpdateRow {
            left_out,
            behind,
            caught_up,
            none_serving: None,
            version,
            seconds,
            transfer_ms,
            bytes,
            dense_bytes,
            density: status.delta.map(|d| d.density()),
            base: status.base.as_ref().map(|b| (b.version, b.except.len())),
            gbps: dense_bytes.unwrap_or(bytes) as f64 / seconds / 1e9,
            verified,
            attempts,
            error,
            torn: None,
            live_intact: None,
        });
        progress.say(&format!(
            "version {version} committed in {seconds:.3} s ({}), {}",
            crate::cmd::plan::human_bytes(bytes as f64),
            if verified {
                "every byte verified"
            } else {
                "NOT verified"
            }
        ));
        progress.inc();
        version += 1;
        attempts = 0;
    }
    progress.finish();

    let last = rows
        .iter()
        .filter(|u| u.verified)
        .map(|u| u.version)
        .max()
        .unwrap_or(first);
    if let Some(dir) = &a.dump_dir {
        dump::write_canonical(dir, &a.model, a.lr, r, last)?;
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
    // every rank process was waited for (kill_all reaps each one), so nothing of this run can
    // create a segment after the listing below
    workers.kill_all();
    server.abort();
    let prefix = segments;
    let leaked = own_segments(&prefix);
    let checks = Checks {
        every_byte: checks::every_byte(
            &rows,
            a.updates,
            r.inference.world_size(),
            r.inference.engines(),
            r.spec.infer_fp8.as_ref().map(|f| f.describe()).as_deref(),
        ),
        checksums: a
            .checksums
            .then(|| checks::checksums(checksums_compared, a.updates)),
        shared_memory: checks::shared_memory(&leaked, &prefix),
        dumps: a.dump_dir.as_ref().map(|d| dump::check(d, r, last)),
        deltas: a
            .deltas
            .then(|| checks::deltas(&rows, catch_up_version(a, added.is_some()))),
        engines: a
            .fault_kill_infer_engine
            .map(|e| checks::engines(&rows, e, a.fault_version)),
        fleet: match (added, a.fault_remove_engine) {
            (Some(e), _) => Some(checks::added(&rows, e, a.fault_version, added_serving)),
            (None, Some(e)) => Some(checks::removed(
                &rows,
                e,
                a.fault_version,
                removed_absent,
                removed_exited,
            )),
            (None, None) => None,
        },
    };
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
        model: r.spec.model.name.clone(),
        training: r.spec.train.to_string(),
        inference: r.spec.infer.to_string(),
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
        checks,
        leaked_segments: leaked.clone().unwrap_or_default(),
        segment_prefix: prefix,
        worker_errors,
    })
}

/// Sends `signal` to inference rank E/0 of each engine in `engines`; the engines signalled.
fn signal_infer_ranks(workers: &Workers, engines: &[u32], signal: libc::c_int) -> Vec<u32> {
    let mut done = Vec::new();
    for &e in engines {
        let name = format!("infer {}", RankId::infer(e, 0));
        if let Some((_, c)) = workers.children.iter().find(|(n, _)| *n == name) {
            // SAFETY: a signal to a child process this demo spawned and still holds.
            if unsafe { libc::kill(c.id() as libc::pid_t, signal) } == 0 {
                done.push(e);
            }
        }
    }
    done
}

/// The prefix of the segments of the pair `pair` connected as `uid` (`awex-{pair}-{uid}-`;
/// the pair's alone when the gateway gave no uid).
fn segment_prefix(pair: &str, uid: &str) -> String {
    if uid.is_empty() {
        format!("awex-{pair}-")
    } else {
        format!("awex-{pair}-{uid}-")
    }
}

/// The segments in /dev/shm whose names start with `prefix`; an unreadable /dev/shm is an
/// error, not an empty list (a check that cannot look must not pass).
fn own_segments(prefix: &str) -> Result<Vec<String>, String> {
    let dir = std::fs::read_dir("/dev/shm").map_err(|e| format!("cannot read /dev/shm: {e}"))?;
    let mut names = Vec::new();
    for e in dir {
        let e = e.map_err(|e| format!("cannot read /dev/shm: {e}"))?;
        if let Ok(n) = e.file_name().into_string()
            && n.starts_with(prefix)
        {
            names.push(n);
        }
    }
    names.sort();
    Ok(names)
}

/// The version in which a fault drill's engine catches up (its ranks hold no version: every
/// byte), which `--deltas`' check does not count: an engine added mid-run takes part from
/// `--fault-version`, a killed or stopped one (left out of it) from the version after.
fn catch_up_version(a: &args::Args, added: bool) -> Option<u64> {
    if added {
        Some(a.fault_version)
    } else if a.fault_kill_infer_engine.is_some() || !a.fault_stop_infer_engines.is_empty() {
        Some(a.fault_version + 1)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_segment_prefix_is_the_connects_own() {
        let uid = "0123456789abcdef0123456789abcdef";
        assert_eq!(segment_prefix("demo-7", uid), format!("awex-demo-7-{uid}-"));
        assert_eq!(segment_prefix("demo-7", ""), "awex-demo-7-");
        // a name of another connect of a pair with the same name is not this run's
        let other =
            awex_runtime::shm::segment_name("demo-7", &"f".repeat(32), "t0.0.12345678", "data");
        assert!(!other.starts_with(&segment_prefix("demo-7", uid)));
        let mine = awex_runtime::shm::segment_name("demo-7", uid, "t0.0.12345678", "data");
        assert!(mine.starts_with(&segment_prefix("demo-7", uid)));
    }
}
