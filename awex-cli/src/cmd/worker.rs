//! `awex-cli worker` (hidden): one training or inference rank process of the demo.
//!
//! It allocates its local tensors in the engine's layout, joins the pair through the gateway,
//! and for every update: a training rank fills its tensors with that version's weights and
//! sends; an inference rank receives, then checks every byte against the version's weights and
//! publishes the verdict (with version and attempt) under the kv key `verify.{engine}.{rank}`.
//!
//! With `--transport cuda-ipc` the tensors live on GPU `--gpu`: a training rank generates each
//! version on the host, in a staging copy of its tensors, and uploads it before the update
//! starts (publishing `filled.{rank}` once it is there); an inference rank downloads its
//! tensors to a host staging copy after each committed update and checks that.
//!
//! `--transport nccl` keeps the tensors on GPU `--gpu` the same way (the demo gives every rank
//! its own GPU); training rank 0 creates the pair's NCCL unique id and the runtime shares it
//! through the gateway (`runtime::rank`).

use anyhow::bail;
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use awex_core::{BackendSpec, ModelSpec};
use awex_runtime::fill::Weights;
use awex_runtime::host::Memory;
use awex_runtime::rank::{Failure, Outcome, Rank, RankConfig, make_transport, prepare};
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
    /// Bucket size in MiB (1 to 65536).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub bucket_mib: u64,
    /// Compute and verify checksums.
    #[arg(long, alias = "checksum")]
    pub checksums: bool,
    /// GPU of this rank's tensors (cuda-ipc, nccl).
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    /// Write this rank's tensors here on disconnect.
    #[arg(long)]
    pub dump_dir: Option<PathBuf>,
    /// Versions made by an optimiser-like step at this learning rate (`demo --lr`).
    #[arg(long, value_parser = crate::cmd::demo::parse_lr)]
    pub lr: Option<f64>,
    /// The first version the demo will ask for (the trainer holds it before joining).
    #[arg(long, default_value_t = 1)]
    pub first_version: u64,
    /// Fault injection: SIGKILL this process when it starts executing this version.
    #[arg(long, hide = true)]
    pub die_at_version: Option<u64>,
    /// Fault injection: corrupt one received byte of this version.
    #[arg(long, hide = true)]
    pub corrupt_version: Option<u64>,
    /// The inference side's FP8 encoding (the demo passes its own flags).
    #[command(flatten)]
    pub quant: crate::cmd::quant::QuantArgs,
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

/// The weights of a demo: [`weights_of`], made finite (`Weights::Finite`) when the inference
/// side is FP8 (its quantisers refuse infinity and NaN, which random bytes hold); both sides
/// and the canonical dump use the same.
pub fn demo_weights(
    model: &str,
    cat: &awex_core::Catalogue,
    infer_fp8: bool,
    lr: Option<f64>,
) -> anyhow::Result<Weights> {
    let w = weights_of(model, cat)?;
    // optimiser-like versions are finite by construction
    if let Some(lr) = lr {
        let start = match w {
            Weights::Checkpoint(ck) => Some(ck),
            _ => None,
        };
        return Ok(Weights::Stepped(Arc::new(
            awex_core::weights::Stepped::new(cat, lr, start),
        )));
    }
    Ok(if infer_fp8 {
        Weights::Finite(Box::new(w))
    } else {
        w
    })
}

/// The dtype the training ranks hold each canonical tensor of this rank's plan in (the
/// transfers' source dtype): a trainer that keeps a tensor narrower than the checkpoint (a
/// bf16 FSDP trainer's fp32 `A_log`) sends it rounded, which is what its receivers must hold.
fn held_by_trainer(p: &awex_runtime::rank::Prepared) -> Vec<(String, awex_core::DType)> {
    let tensors = p.catalogue.tensors();
    let mut seen = std::collections::HashSet::new();
    p.plan
        .peers
        .iter()
        .flat_map(|peer| peer.transfers.iter())
        .filter(|t| seen.insert(t.canonical))
        .filter_map(|t| Some((tensors.get(t.canonical as usize)?.name.clone(), t.src_dtype)))
        .collect()
}

/// The kv key under which a training rank says which version its tensors hold (cuda-ipc).
pub fn filled_key(rank: u32) -> String {
    format!("filled.{rank}")
}

/// The kv key under which a rank on a GPU transport says its transport is connected (every
/// peer's handles opened, its copies built): the demo counts that into its join time, not into
/// the first update.
pub fn connected_key(side: Side, rank: RankId) -> String {
    format!(
        "connected.{}",
        awex_runtime::rank::rendezvous_key(side, rank)
    )
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
    let transport: Transport = args.transport.parse().map_err(anyhow::Error::msg)?;
    let model = ModelSpec::resolve(&args.model)?;
    let infer_fp8 = args.quant.resolve(&model)?;
    let cfg = RankConfig {
        infer_fp8,
        gateway: args.gateway.clone(),
        token: std::env::var("AWEX_TOKEN").ok(),
        pair: args.pair.clone(),
        side,
        rank,
        model,
        train: args.train.parse::<BackendSpec>()?,
        infer: args.infer.parse::<BackendSpec>()?,
        transport,
        bucket_bytes: args.bucket_mib << 20,
        host: std::env::var("AWEX_HOST").unwrap_or_else(|_| "127.0.0.1".into()),
        uid: String::new(),
        apply: Default::default(),
        transports: crate::settings::transports()?,
        gateway_lost: crate::settings::gateway_lost()?,
        deltas: true,
    };
    let mut cfg = cfg;
    (cfg.uid, cfg.apply) = awex_runtime::rank::pair_settings(&cfg).await?;
    let prepared = prepare(&cfg)?;
    let weights = demo_weights(
        &args.model,
        &prepared.catalogue,
        cfg.infer_fp8.is_some(),
        args.lr,
    )?
    .held_as(&prepared.catalogue, held_by_trainer(&prepared));
    let on_gpu = transport.on_gpu();
    let mut mem = Memory::allocate(
        &prepared.layout,
        &cfg.shm_scope(),
        side,
        transport,
        args.gpu,
    )?;
    mem.fp8 = cfg.infer_fp8.clone();
    let tensors = mem.tensors.clone();
    let (layout, cat) = (&prepared.layout, &prepared.catalogue);
    let mut filled: Option<u64> = None;
    if side == Side::Training {
        // the trainer holds version 1's weights before the first update starts
        mem.fill(&weights, layout, cat, args.first_version)?;
        filled = Some(args.first_version);
    }
    let t = make_transport(&cfg, &prepared, tensors.clone())?;
    let mut me = Rank::join(cfg, &prepared, &tensors, t).await?;
    me.corrupt_version = args.corrupt_version;
    let checksums = me.joined.options.checksums || args.checksums;
    // the last version that committed: what a training rank's dump must hold
    let mut committed = args.first_version;
    // with weights on the GPU, or versions that take a while to compute (`--lr`), the
    // controller waits for each version's weights before timing its update
    let say_filled = side == Side::Training && (on_gpu || args.lr.is_some());
    if on_gpu {
        let key = connected_key(side, rank);
        me.client()
            .put_kv(
                &args.pair,
                &key,
                serde_json::json!({ "pid": std::process::id() }),
            )
            .await
            .map_err(|e| anyhow::Error::new(e).context(format!("publishing {key}")))?;
    }
    if say_filled {
        put_filled(&me, &args.pair, rank.rank, args.first_version).await?;
    }

    // refill / verify only once the whole update is over, so that this work does not compete
    // with peers still moving bytes
    let commit_wait = Some(std::time::Duration::from_secs(600));
    loop {
        let outcome = me
            .step(None, checksums, commit_wait, |work| {
                if side == Side::Training && filled != Some(work.version) {
                    mem.fill(&weights, layout, cat, work.version)?;
                    filled = Some(work.version);
                }
                if args.die_at_version == Some(work.version) {
                    // SAFETY: sending SIGKILL to ourselves.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                Ok(())
            })
            .await?;
        let Some(work) = outcome.work() else {
            break; // disconnected
        };
        if let Outcome::Committed { .. } = outcome {
            committed = committed.max(work.version);
        }
        match side {
            Side::Training => {
                if outcome.part_done() {
                    // the next version's weights, while the controller starts it
                    let next = work.version + 1;
                    mem.fill(&weights, layout, cat, next)?;
                    filled = Some(next);
                    if say_filled {
                        put_filled(&me, &args.pair, rank.rank, next).await?;
                    }
                }
            }
            Side::Inference => {
                let verdict = match &outcome {
                    Outcome::Failed {
                        reason: Failure::Rank(e),
                        ..
                    } => serde_json::json!({ "ok": false, "error": e.to_string() }),
                    _ => match mem.check(&weights, layout, cat, work.version) {
                        Ok(()) => serde_json::json!({ "ok": true }),
                        Err(e) => serde_json::json!({ "ok": false, "error": e }),
                    },
                };
                let mut verdict = verdict;
                if !matches!(outcome, Outcome::Committed { .. }) {
                    // what a failed attempt left in the live tensors (atomic pairs: untouched)
                    verdict["live_holds_committed"] =
                        mem.check(&weights, layout, cat, committed).is_ok().into();
                }
                verdict["version"] = work.version.into();
                verdict["attempt"] = work.attempt.into();
                if let Some(d) = me.transfer_time(work) {
                    verdict["transfer_ms"] = (d.as_secs_f64() * 1e3).into();
                }
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
        // a training rank pre-fills the next version after each commit: dump what was moved
        if side == Side::Training && filled != Some(committed) {
            mem.fill(&weights, layout, cat, committed)?;
        }
        let path = match side {
            Side::Training => dir
                .join("train")
                .join(format!("rank-{}.safetensors", rank.rank)),
            Side::Inference => dir
                .join("infer")
                .join(format!("engine-{}", rank.engine))
                .join(format!("rank-{}.safetensors", rank.rank)),
        };
        let host = mem.host_view()?;
        let items: Vec<(String, awex_core::DType, Vec<u64>, &[u8])> = host
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

/// Publishes that this training rank's tensors hold `version` (the pair may be gone: then
/// nobody waits for it).
async fn put_filled(me: &Rank, pair: &str, rank: u32, version: u64) -> anyhow::Result<()> {
    let key = filled_key(rank);
    match me
        .client()
        .put_kv(pair, &key, serde_json::json!({ "version": version }))
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.status(), Some(404) | Some(410)) => Ok(()),
        Err(e) => Err(anyhow::Error::new(e).context(format!("publishing {key}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use awex_runtime::TensorSet;
    use awex_runtime::fill::{fill_or_check_from, fill_or_check_parallel};

    #[test]
    fn parallel_fill_and_check_agree_with_the_serial_ones() {
        let model = ModelSpec::resolve("qwen3-tiny").unwrap();
        let cfg_train: BackendSpec = "megatron:tp=2".parse().unwrap();
        let layout = awex_core::backend::side_layout(Side::Training, &cfg_train, &model)
            .unwrap()
            .rank_layout(RankId::train(1))
            .unwrap();
        let cat = awex_core::Catalogue::of(&model);
        let w = Weights::Synthetic;
        let serial = TensorSet::allocate_host(&layout).unwrap();
        fill_or_check_from(&w, &layout, &cat, &serial, 3, false).unwrap();
        let parallel = TensorSet::allocate_host(&layout).unwrap();
        fill_or_check_parallel(&w, &layout, &cat, &parallel, 3, false).unwrap();
        for v in serial.iter() {
            assert_eq!(
                v.bytes(),
                parallel.get(&v.name).unwrap().bytes(),
                "{}",
                v.name
            );
        }
        fill_or_check_parallel(&w, &layout, &cat, &parallel, 3, true).unwrap();
        let e = fill_or_check_parallel(&w, &layout, &cat, &parallel, 4, true).unwrap_err();
        assert!(e.contains("differs from version 4"), "{e}");
    }
}
