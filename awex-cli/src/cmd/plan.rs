//! `awex-cli plan`: the exchange plan between a training layout and an inference layout.

use anyhow::{Context, bail};
use awex_core::backend::side_layout;
use awex_core::layout::{RankId, Side, SideLayout};
use awex_core::plan::{Pair, RankPlan};
use awex_core::{BackendSpec, Catalogue, ModelSpec};
use serde::Serialize;
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// The model used when `--model` is not given.
pub const DEFAULT_MODEL: &str = "qwen3-0.6b";
/// The training layout used when `--train` is not given.
pub const DEFAULT_TRAIN: &str = "megatron:tp=2,pp=2";
/// The inference layout used when `--infer` is not given.
pub const DEFAULT_INFER: &str = "sglang:tp=2,engines=2";

/// Arguments of `awex-cli plan`.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  awex-cli plan\n  awex-cli plan --model qwen3-8b --train megatron:tp=4,dp=2 --infer sglang:tp=8\n  awex-cli plan --model moe-1t --train megatron:tp=8,pp=8,dp=16,ep=32,etp=1 --infer sglang:tp=16,ep=16,engines=8 --json\n  awex-cli plan --rank infer:1/0 --json"
)]
pub struct Args {
    /// Model: a preset name, a config.json, or an HF model directory (whose safetensors weights, if any, are checked too).
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Training side: `backend:key=value,...` (megatron: tp,pp,dp,cp,ep,etp,vpp,first_stage_layers,last_stage_layers; fsdp: dp,replicate,tp).
    #[arg(long, default_value = DEFAULT_TRAIN)]
    pub train: String,
    /// Inference side: `backend:key=value,...` (sglang: tp,ep,engines; vllm: tp,ep,engines).
    #[arg(long, default_value = DEFAULT_INFER)]
    pub infer: String,
    /// Plan only this rank and list its transfers: `train:N` or `infer:E/N`.
    #[arg(long)]
    pub rank: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A pair's model and layouts, resolved from command-line specs.
pub struct Resolved {
    /// The model.
    pub model: ModelSpec,
    /// Its catalogue.
    pub catalogue: Catalogue,
    /// Training spec.
    pub train_spec: BackendSpec,
    /// Inference spec.
    pub infer_spec: BackendSpec,
    /// Training layout.
    pub training: Arc<dyn SideLayout>,
    /// Inference layout.
    pub inference: Arc<dyn SideLayout>,
}

impl Resolved {
    /// Resolves `--model`, `--train` and `--infer`.
    pub fn new(model: &str, train: &str, infer: &str) -> anyhow::Result<Self> {
        let model = ModelSpec::resolve(model)?;
        let catalogue = Catalogue::of(&model);
        let train_spec: BackendSpec = train.parse()?;
        let infer_spec: BackendSpec = infer.parse()?;
        let training = side_layout(Side::Training, &train_spec, &model)
            .with_context(|| format!("training layout `{train}`"))?;
        let inference = side_layout(Side::Inference, &infer_spec, &model)
            .with_context(|| format!("inference layout `{infer}`"))?;
        Ok(Resolved {
            model,
            catalogue,
            train_spec,
            infer_spec,
            training,
            inference,
        })
    }

    /// The pair to plan.
    pub fn pair(&self) -> Pair<'_> {
        Pair {
            catalogue: &self.catalogue,
            training: &*self.training,
            inference: &*self.inference,
        }
    }
}

/// Parses `train:N` or `infer:E/N` (or `infer:N` for engine 0).
pub fn parse_rank(s: &str) -> anyhow::Result<(Side, RankId)> {
    let bad = || anyhow::anyhow!("bad rank `{s}`: expected `train:N` or `infer:E/N`");
    let (side, rest) = s.split_once(':').ok_or_else(bad)?;
    match side {
        "train" | "training" => Ok((
            Side::Training,
            RankId::train(rest.parse().map_err(|_| bad())?),
        )),
        "infer" | "inference" => {
            let (e, r) = match rest.split_once('/') {
                Some((e, r)) => (e.parse().map_err(|_| bad())?, r.parse().map_err(|_| bad())?),
                None => (0, rest.parse().map_err(|_| bad())?),
            };
            Ok((Side::Inference, RankId::infer(e, r)))
        }
        _ => Err(bad()),
    }
}

/// Whole-pair plan statistics (`--json` without `--rank`).
#[derive(Serialize, Debug)]
pub struct PlanSummary {
    /// Model name.
    pub model: String,
    /// Training spec.
    pub training: String,
    /// Inference spec.
    pub inference: String,
    /// Bytes the destinations need (every placed element of every inference rank).
    pub required_bytes: u64,
    /// Bytes the plans move.
    pub moved_bytes: u64,
    /// Largest bytes sent by one training rank.
    pub max_egress_bytes: u64,
    /// Mean bytes sent per training rank.
    pub mean_egress_bytes: f64,
    /// Training ranks that send something.
    pub sending_ranks: usize,
    /// Number of transfers (after coalescing).
    pub transfers: u64,
    /// All ranks of both sides.
    pub ranks: usize,
    /// Training ranks.
    pub training_ranks: usize,
    /// Inference ranks (all engines).
    pub inference_ranks: usize,
    /// The slowest single rank's own planning time.
    pub plan_ms_max: f64,
    /// Every rank planned one after another.
    pub plan_ms_total: f64,
    /// Every peer pair computed the same transfers on both ends.
    pub fingerprints_agree: bool,
    /// Every inference rank receives exactly the bytes its placements need.
    pub exact: bool,
}

/// Plans every rank of both sides and summarises.
pub fn summarise(r: &Resolved) -> anyhow::Result<PlanSummary> {
    let pair = r.pair();
    let mut ms_max = 0f64;
    let mut ms_total = 0f64;
    let mut fps: HashMap<(RankId, RankId), u64> = HashMap::new();
    let mut egress = Vec::new();
    let mut transfers = 0u64;
    let mut time = |side: Side, rank: RankId| -> anyhow::Result<RankPlan> {
        let t0 = Instant::now();
        let p = pair.plan_rank(side, rank)?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        ms_max = ms_max.max(ms);
        ms_total += ms;
        Ok(p)
    };
    for rank in r.training.ranks() {
        let p = time(Side::Training, rank)?;
        for peer in &p.peers {
            fps.insert((rank, peer.peer), peer.fingerprint);
        }
        transfers += p.transfers() as u64;
        egress.push(p.bytes());
    }
    let mut agree = true;
    let mut exact = true;
    let mut required = 0u64;
    let mut received = 0u64;
    for rank in r.inference.ranks() {
        let p = time(Side::Inference, rank)?;
        for peer in &p.peers {
            agree &= fps.remove(&(peer.peer, rank)) == Some(peer.fingerprint);
        }
        let need: u64 = r
            .inference
            .rank_layout(rank)
            .map(|l| {
                l.tensors
                    .iter()
                    .flat_map(|t| {
                        t.placements
                            .iter()
                            .map(move |p| p.region.numel() * t.dtype.size() as u64)
                    })
                    .sum()
            })
            .unwrap_or(0);
        exact &= need == p.bytes();
        required += need;
        received += p.bytes();
    }
    agree &= fps.is_empty();
    let moved: u64 = egress.iter().sum();
    exact &= moved == received;
    Ok(PlanSummary {
        model: r.model.name.clone(),
        training: r.train_spec.to_string(),
        inference: r.infer_spec.to_string(),
        required_bytes: required,
        moved_bytes: moved,
        max_egress_bytes: egress.iter().copied().max().unwrap_or(0),
        mean_egress_bytes: if egress.is_empty() {
            0.0
        } else {
            moved as f64 / egress.len() as f64
        },
        sending_ranks: egress.iter().filter(|&&b| b > 0).count(),
        transfers,
        ranks: r.training.world_size() + r.inference.world_size(),
        training_ranks: r.training.world_size(),
        inference_ranks: r.inference.world_size(),
        plan_ms_max: ms_max,
        plan_ms_total: ms_total,
        fingerprints_agree: agree,
        exact,
    })
}

/// Formats a byte count for people.
pub fn human_bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1000.0 && u < UNITS.len() - 1 {
        v /= 1000.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let r = Resolved::new(&args.model, &args.train, &args.infer)?;
    // An HF directory's weights are what `demo` would send: check them as it would (mapped, not read).
    let dir = std::path::Path::new(&args.model);
    if dir.is_dir() && awex_core::model::Checkpoint::present(dir) {
        awex_core::model::Checkpoint::open(dir, &r.catalogue)?;
    }
    if let Some(rank) = &args.rank {
        let (side, rank) = parse_rank(rank)?;
        let t0 = Instant::now();
        let plan = r.pair().plan_rank(side, rank)?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        if args.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({ "plan_ms": ms, "plan": plan }))?
            );
        } else {
            println!(
                "{} rank {}: {} peers, {} transfers, {} (planned in {ms:.2} ms, fingerprint {:016x})",
                side,
                rank,
                plan.peers.len(),
                plan.transfers(),
                human_bytes(plan.bytes() as f64),
                plan.fingerprint
            );
            for peer in &plan.peers {
                println!(
                    "  peer {}: {} transfers, {}",
                    peer.peer,
                    peer.transfers.len(),
                    human_bytes(peer.bytes as f64)
                );
                for t in &peer.transfers {
                    println!(
                        "    {}{} @{} -> {}{} @{}  extent {}  {}",
                        t.src_tensor,
                        t.src_shape,
                        t.src_offset,
                        t.dst_tensor,
                        t.dst_shape,
                        t.dst_offset,
                        t.extent,
                        human_bytes(t.bytes() as f64)
                    );
                }
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let s = summarise(&r)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        println!(
            "model        {} ({} tensors, {})",
            s.model,
            r.catalogue.len(),
            human_bytes(r.catalogue.total_bytes() as f64)
        );
        println!("training     {} ({} ranks)", s.training, s.training_ranks);
        println!("inference    {} ({} ranks)", s.inference, s.inference_ranks);
        println!("required     {}", human_bytes(s.required_bytes as f64));
        println!("moved        {}", human_bytes(s.moved_bytes as f64));
        println!(
            "egress max   {}  (mean {}, {} of {} training ranks send)",
            human_bytes(s.max_egress_bytes as f64),
            human_bytes(s.mean_egress_bytes),
            s.sending_ranks,
            s.training_ranks
        );
        println!("transfers    {}", s.transfers);
        println!(
            "plan time    {:.2} ms slowest rank, {:.1} ms all ranks",
            s.plan_ms_max, s.plan_ms_total
        );
        println!(
            "agreement    {}",
            if s.fingerprints_agree {
                "both ends of every peer pair agree"
            } else {
                "MISMATCH"
            }
        );
        println!(
            "exact        {}",
            if s.exact {
                "every destination byte written once"
            } else {
                "NOT EXACT"
            }
        );
    }
    if !s.fingerprints_agree || !s.exact {
        bail!("plan check failed");
    }
    Ok(ExitCode::SUCCESS)
}
