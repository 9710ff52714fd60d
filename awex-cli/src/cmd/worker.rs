//! `awex-cli worker` (hidden): one training or inference rank process of the demo.
//!
//! It allocates its local tensors in the engine's layout, joins the pair through the gateway,
//! and for every update: a training rank fills its tensors with that version's weights and
//! sends; an inference rank receives, then checks every byte against the version's weights and
//! publishes the verdict (with version and attempt) under the kv key `verify.{engine}.{rank}`.

use anyhow::bail;
use awex_core::layout::{RankId, Side};
use awex_core::runtime::TensorSet;
use awex_core::runtime::fill::{Weights, fill_or_check_from};
use awex_core::runtime::rank::{Rank, RankConfig, make_transport, prepare};
use awex_core::runtime::shm::sweep_dead;
use awex_core::runtime::transport::TransportKind;
use awex_core::{BackendSpec, ModelSpec};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// Arguments of `awex-cli worker`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Gateway base URL.
    #[arg(long)]
    pub gateway: String,
    /// Pair name.
    #[arg(long)]
    pub pair: String,
    /// `train` or `infer`.
    #[arg(long)]
    pub side: String,
    /// Inference engine (0 for training).
    #[arg(long, default_value_t = 0)]
    pub engine: u32,
    /// Rank (global on training, within the engine on inference).
    #[arg(long)]
    pub rank: u32,
    /// Model.
    #[arg(long)]
    pub model: String,
    /// Training spec.
    #[arg(long)]
    pub train: String,
    /// Inference spec.
    #[arg(long)]
    pub infer: String,
    /// Transport.
    #[arg(long, default_value = "shm")]
    pub transport: String,
    /// Bucket size in MiB.
    #[arg(long, default_value_t = 64)]
    pub bucket_mib: u64,
    /// Compute and verify checksums.
    #[arg(long)]
    pub checksum: bool,
    /// Write this rank's tensors here on disconnect.
    #[arg(long)]
    pub dump_dir: Option<PathBuf>,
    /// The first version the demo will ask for (the trainer holds it before joining).
    #[arg(long, default_value_t = 1)]
    pub first_version: u64,
    /// Fault injection: SIGKILL this process when it starts executing this version.
    #[arg(long, hide = true)]
    pub die_at_version: Option<u64>,
    /// Fault injection: corrupt one received byte of this version.
    #[arg(long, hide = true)]
    pub corrupt_version: Option<u64>,
}

/// The weights a `--model` argument implies: an HF directory's checkpoint, else synthetic.
pub fn weights_of(model: &str, cat: &awex_core::Catalogue) -> anyhow::Result<Weights> {
    let dir = std::path::Path::new(model);
    if dir.is_dir() && awex_core::model::Checkpoint::present(dir) {
        let ck = awex_core::model::Checkpoint::open(dir, cat)?;
        return Ok(Weights::Checkpoint(Arc::new(ck)));
    }
    Ok(Weights::Synthetic)
}

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(work(args))
}

async fn work(args: Args) -> anyhow::Result<ExitCode> {
    let side = match args.side.as_str() {
        "train" => Side::Training,
        "infer" => Side::Inference,
        s => bail!("--side must be train or infer, not `{s}`"),
    };
    let rank = match side {
        Side::Training => RankId::train(args.rank),
        Side::Inference => RankId::infer(args.engine, args.rank),
    };
    let transport: TransportKind = args.transport.parse()?;
    let model = ModelSpec::resolve(&args.model)?;
    let cfg = RankConfig {
        gateway: args.gateway.clone(),
        token: std::env::var("AWEX_TOKEN").ok(),
        pair: args.pair.clone(),
        side,
        rank,
        model,
        train: args.train.parse::<BackendSpec>()?,
        infer: args.infer.parse::<BackendSpec>()?,
        transport,
        bucket_bytes: args.bucket_mib.max(1) << 20,
        host: std::env::var("AWEX_HOST").unwrap_or_else(|_| "127.0.0.1".into()),
    };
    let prepared = prepare(&cfg)?;
    let weights = weights_of(&args.model, &prepared.catalogue)?;
    let tensors = if side == Side::Training && transport == TransportKind::Shm {
        // a rank killed earlier may have left its segments behind
        sweep_dead(&format!("awex-{}-", args.pair));
        let name = format!(
            "awex-{}-train0.{}-{}-data",
            args.pair,
            rank.rank,
            std::process::id()
        );
        TensorSet::allocate_shm(&prepared.layout, &name)?
    } else {
        TensorSet::allocate_host(&prepared.layout)?
    };
    let tensors = Arc::new(tensors);
    let mut filled: Option<u64> = None;
    if side == Side::Training {
        // the trainer holds version 1's weights before the first update starts
        fill_or_check_from(
            &weights,
            &prepared.layout,
            &prepared.catalogue,
            &tensors,
            args.first_version,
            false,
        )
        .map_err(anyhow::Error::msg)?;
        filled = Some(args.first_version);
    }
    let t = make_transport(&cfg, &prepared, tensors.clone())?;
    let mut me = Rank::join(cfg, &prepared, &tensors, t).await?;
    me.corrupt_version = args.corrupt_version;
    let checksums = me.joined.options.checksums || args.checksum;

    while let Some(work) = me.next_work().await? {
        if side == Side::Training && filled != Some(work.version) {
            fill_or_check_from(
                &weights,
                &prepared.layout,
                &prepared.catalogue,
                &tensors,
                work.version,
                false,
            )
            .map_err(anyhow::Error::msg)?;
            filled = Some(work.version);
        }
        if args.die_at_version == Some(work.version) {
            // SAFETY: sending SIGKILL to ourselves.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let result = me.execute(work, checksums).await;
        if result.is_ok() {
            // refill / verify only once the whole update is over, so that this work does not
            // compete with peers still moving bytes
            let _ = me
                .client()
                .wait_update(
                    &args.pair,
                    work.version,
                    std::time::Duration::from_secs(600),
                )
                .await;
        }
        match side {
            Side::Training => {
                if result.is_ok() {
                    // the next version's weights, while the controller starts it
                    let next = work.version + 1;
                    fill_or_check_from(
                        &weights,
                        &prepared.layout,
                        &prepared.catalogue,
                        &tensors,
                        next,
                        false,
                    )
                    .map_err(anyhow::Error::msg)?;
                    filled = Some(next);
                }
            }
            Side::Inference => {
                let verdict = match &result {
                    Ok(_) => match fill_or_check_from(
                        &weights,
                        &prepared.layout,
                        &prepared.catalogue,
                        &tensors,
                        work.version,
                        true,
                    ) {
                        Ok(()) => serde_json::json!({ "ok": true }),
                        Err(e) => serde_json::json!({ "ok": false, "error": e }),
                    },
                    Err(e) => serde_json::json!({ "ok": false, "error": e.to_string() }),
                };
                let mut verdict = verdict;
                verdict["version"] = work.version.into();
                verdict["attempt"] = work.attempt.into();
                let key = format!("verify.{}.{}", rank.engine, rank.rank);
                match me.client().put_kv(&args.pair, &key, verdict).await {
                    Ok(_) => {}
                    // the pair was disconnected meanwhile: nobody waits for the verdict
                    Err(e) if matches!(e.status(), Some(404) | Some(410)) => {}
                    Err(e) => {
                        return Err(anyhow::Error::new(e).context(format!("publishing {key}")));
                    }
                }
            }
        }
    }
    if let Some(dir) = &args.dump_dir {
        let path = match side {
            Side::Training => dir
                .join("train")
                .join(format!("rank-{}.safetensors", rank.rank)),
            Side::Inference => dir
                .join("infer")
                .join(format!("engine-{}", rank.engine))
                .join(format!("rank-{}.safetensors", rank.rank)),
        };
        let items: Vec<(String, awex_core::DType, Vec<u64>, &[u8])> = tensors
            .iter()
            .map(|v| {
                (
                    v.name.to_string(),
                    v.dtype,
                    v.shape.as_slice().to_vec(),
                    v.bytes(),
                )
            })
            .collect();
        crate::safetensors::write(&path, &items)?;
    }
    me.close();
    Ok(ExitCode::SUCCESS)
}
