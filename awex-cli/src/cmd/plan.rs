//! `awex-cli plan`: the exchange plan between a training layout and an inference layout.

use anyhow::bail;
use awex_core::ModelSpec;
use awex_core::backend::{ParallelKey, inference_backends, training_backends};
use awex_core::encoding::Encoding;
use awex_core::layout::{RankId, Side};
use awex_core::plan::RankPlan;
use serde::Serialize;
use std::collections::HashMap;
use std::process::ExitCode;
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
    #[arg(long, default_value = DEFAULT_MODEL, long_help = model_help())]
    pub model: String,
    /// Training side: `backend:key=value,...`.
    #[arg(long, default_value = DEFAULT_TRAIN, long_help = spec_help(Side::Training))]
    pub train: String,
    /// Inference side: `backend:key=value,...`.
    #[arg(long, default_value = DEFAULT_INFER, long_help = spec_help(Side::Inference))]
    pub infer: String,
    /// Plan only this rank and list its transfers: `train:N` or `infer:E/N`.
    #[arg(long)]
    pub rank: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The inference side's FP8 encoding.
    #[command(flatten)]
    pub quant: crate::cmd::quant::QuantArgs,
    /// Who quantises the FP8 blocks: `auto` (as the transport does; `plan` plans as shm,
    /// whose blocks held whole by one training rank move as e4m3 + scales), `sender` (as a
    /// transport that quantises on the sender) or `receiver` (every block quantised by the
    /// receiver from bf16, as cuda-ipc does).
    #[arg(long, value_enum, default_value_t = EncodeAtArg::Auto)]
    pub fp8_encode_at: EncodeAtArg,
    /// Predict a delta update (`docs/deltas.md`): the fraction of elements that changed since
    /// the version the inference ranks hold (bf16 at lr 1e-6: about 0.03; the e4m3 bytes of an
    /// FP8 side change less). Reports the bytes the delta format takes for the planned
    /// transfers at that density, next to the dense bytes.
    #[arg(long, value_name = "D")]
    pub delta_density: Option<f64>,
}

/// `--fp8-encode-at`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncodeAtArg {
    /// As the transport does.
    Auto,
    /// Blocks a sender holds whole are quantised by it.
    Sender,
    /// Every block is quantised by the receiver.
    Receiver,
}

impl EncodeAtArg {
    /// The planner's switch for a pair over `transport`.
    pub fn encode_on_sender(self, transport: awex_core::Transport) -> bool {
        match self {
            EncodeAtArg::Auto => transport.encodes_fp8_on_sender(),
            EncodeAtArg::Sender => true,
            EncodeAtArg::Receiver => false,
        }
    }
}

/// `n thing` or `n things`.
pub fn plural(n: impl Into<u64>, thing: &str) -> String {
    let n = n.into();
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

/// `--model`'s long help: what it accepts, then every family (its HF class) with its presets.
pub fn model_help() -> String {
    let mut s = String::from(
        "Model: a preset name, a config.json, or an HF model directory (whose safetensors weights, if any, are checked too). A config's `architectures[0]` picks the family. Families and their presets:",
    );
    for f in awex_core::model::family::ALL {
        s.push_str(&format!("\n  {} ({})", f.name, f.hf_class));
        for p in f.presets {
            s.push_str(&format!("\n    {:<18} {}", p.name, p.about));
        }
    }
    s
}

/// One key with its default, as the `--help` texts show it (`tp=1`, `vpp (unset)`).
fn key_with_default(k: &ParallelKey) -> String {
    match k.default {
        Some(d) => format!("{}={d}", k.name),
        None => format!("{} (unset)", k.name),
    }
}

/// The registered backends of `side` with their keys and defaults: `name: key=default, ...`.
pub fn backend_keys(side: Side) -> Vec<(&'static str, &'static [ParallelKey])> {
    match side {
        Side::Training => training_backends()
            .into_iter()
            .map(|b| (b.name(), b.parallel_keys()))
            .collect(),
        Side::Inference => inference_backends()
            .into_iter()
            .map(|b| (b.name(), b.parallel_keys()))
            .collect(),
    }
}

/// The long `--help` of a `--train` / `--infer` flag: every registered backend's every key with
/// its default and meaning, generated from each backend's `parallel_keys()`.
pub fn spec_help(side: Side) -> String {
    let mut s = format!(
        "{} side: `backend:key=value,...`; a backend alone (`{}`) means its defaults. Keys and defaults:",
        match side {
            Side::Training => "Training",
            Side::Inference => "Inference",
        },
        match side {
            Side::Training => "megatron",
            Side::Inference => "sglang",
        }
    );
    for (name, keys) in backend_keys(side) {
        s.push_str(&format!("\n  {name}:"));
        for k in keys {
            s.push_str(&format!("\n    {:<30} {}", key_with_default(k), k.help));
        }
    }
    s
}

/// The note printed when a spec names a backend and no settings (`--train megatron`): its
/// defaults apply.
pub fn defaults_note(flag: &str, spec: &str, side: Side) -> Option<String> {
    let name = spec.trim();
    if name.contains(':') {
        return None;
    }
    let (_, keys) = backend_keys(side).into_iter().find(|(n, _)| *n == name)?;
    let defaults: Vec<String> = keys
        .iter()
        .filter(|k| k.default.is_some())
        .map(key_with_default)
        .collect();
    Some(format!(
        "note: `{flag} {name}` names no settings, so {name}'s defaults apply: {}",
        defaults.join(", ")
    ))
}

/// The model and both layouts a command works on: the core's resolved pair.
pub type Resolved = awex_core::pair::ResolvedPair;

/// Resolves `--model`, `--train` and `--infer` (noting a backend given without keys).
pub fn resolve(model: &str, train: &str, infer: &str) -> anyhow::Result<Resolved> {
    resolve_with(model, train, infer, &Default::default())
}

/// [`resolve`] with the inference side's FP8 flags.
pub fn resolve_with(
    model: &str,
    train: &str,
    infer: &str,
    quant: &crate::cmd::quant::QuantArgs,
) -> anyhow::Result<Resolved> {
    resolve_over(model, train, infer, quant, awex_core::Transport::Shm)
}

/// [`resolve_with`] for a pair over `transport`: what its plans carry depends on it (an FP8
/// side's whole blocks are quantised by the sender over shm and tcp, by the receiver over
/// cuda-ipc, whose copies carry bytes only).
pub fn resolve_over(
    model: &str,
    train: &str,
    infer: &str,
    quant: &crate::cmd::quant::QuantArgs,
    transport: awex_core::Transport,
) -> anyhow::Result<Resolved> {
    for (flag, spec, side) in [
        ("--train", train, Side::Training),
        ("--infer", infer, Side::Inference),
    ] {
        if let Some(note) = defaults_note(flag, spec, side) {
            eprintln!("{note}");
        }
    }
    let arg = model;
    let model = ModelSpec::resolve(arg)?;
    let spec = awex_core::pair::PairSpec {
        infer_fp8: quant.resolve_for(arg, &model)?,
        model,
        train: train.parse()?,
        infer: infer.parse()?,
        transport,
    };
    Ok(spec.resolve()?)
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

/// Refuses a `--rank` outside the side's layout, stating its world size.
pub fn check_rank_exists(r: &Resolved, side: Side, rank: RankId) -> anyhow::Result<()> {
    let (layout, spec) = match side {
        Side::Training => (&r.training, &r.spec.train),
        Side::Inference => (&r.inference, &r.spec.infer),
    };
    if layout.rank_layout(rank).is_some() {
        return Ok(());
    }
    let world = layout.world_size();
    match side {
        Side::Training => bail!(
            "there is no training rank {}: `{spec}` has world size {world} (ranks 0..={})",
            rank.rank,
            world.saturating_sub(1)
        ),
        Side::Inference => {
            let engines = layout.engines().max(1) as usize;
            let per = world / engines;
            bail!(
                "there is no inference rank {rank}: `{spec}` has world size {world} ({} of {}, ranks 0/0..={}/{})",
                plural(engines as u64, "engine"),
                plural(per as u64, "rank"),
                engines - 1,
                per.saturating_sub(1)
            )
        }
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
    /// Trained tensors the inference engine's model class does not hold (its load drops them):
    /// the update moves nothing into them.
    pub dropped_by_inference: Vec<String>,
    /// What a checkpoint of the model may hold that awex does not move, one rule each (the
    /// multi-token-prediction layers of DeepSeek-V3 and GLM-4.5).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_moved: Vec<String>,
    /// The tensors of `--model`'s checkpoint under those rules, skipped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_checkpoint_tensors: Option<usize>,
    /// With an FP8 inference side: what moves and lands per encoding.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fp8: Option<Fp8Bytes>,
    /// With `--delta-density`: the predicted delta bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<PlanDelta>,
    /// Bytes the plans move, by element size on the wire (e4m3 1, bf16 2, scales and fp32 4).
    #[serde(skip)]
    pub moved_by_element: std::collections::BTreeMap<usize, u64>,
}

/// A delta update predicted from the plan (`--delta-density`).
#[derive(Serialize, Debug)]
pub struct PlanDelta {
    /// The fraction of elements that changed.
    pub density: f64,
    /// Bytes the delta format takes for every planned transfer at that density
    /// (`awex_core::encoding::delta::expected_fraction` of each element size's bytes).
    pub expected_bytes: u64,
    /// `expected_bytes` over the dense `moved_bytes`.
    pub fraction_of_dense: f64,
}

impl PlanSummary {
    /// The delta update at `density` over this plan's transfers.
    pub fn predict_delta(&self, density: f64) -> anyhow::Result<PlanDelta> {
        if !(density.is_finite() && (0.0..=1.0).contains(&density)) {
            anyhow::bail!("--delta-density {density} is outside [0, 1]");
        }
        let expected: f64 = self
            .moved_by_element
            .iter()
            .map(|(&e, &b)| b as f64 * awex_core::encoding::delta::expected_fraction(density, e))
            .sum();
        Ok(PlanDelta {
            density,
            expected_bytes: expected.round() as u64,
            fraction_of_dense: if self.moved_bytes == 0 {
                0.0
            } else {
                expected / self.moved_bytes as f64
            },
        })
    }
}

/// Bytes per encoding of an FP8 inference side (all inference ranks together).
#[derive(Serialize, Debug, Default)]
pub struct Fp8Bytes {
    /// The encoding (`fp8 e4m3, 128x128 blocks, fp32 scales, recipe vllm`).
    pub encoding: String,
    /// Where blocks are quantised: `receiver` (every block), `sender` (every block by the
    /// training rank that holds it whole) or `sender+receiver` (the blocks cut between
    /// senders by the receiver, the rest by their sender).
    pub encoded_at: String,
    /// FP8 tensors per engine.
    pub fp8_tensors: usize,
    /// Blocks of every inference rank's FP8 tensors quantised by their sender.
    pub sender_blocks: u64,
    /// Blocks quantised by the receiver.
    pub receiver_blocks: u64,
    /// Bytes the plans move into FP8 tensors: `sender_e4m3_bytes + sender_scale_bytes +
    /// receiver_wire_bytes`.
    pub wire_bytes: u64,
    /// Sender-encoded: e4m3 bytes on the wire (written straight into the engines' tensors).
    pub sender_e4m3_bytes: u64,
    /// Sender-encoded: fp32 scale bytes on the wire (into the engines' scale tensors).
    pub sender_scale_bytes: u64,
    /// Receiver-encoded: canonical-dtype (bf16) bytes on the wire into the receivers' staging.
    pub receiver_wire_bytes: u64,
    /// e4m3 bytes that land in the engines.
    pub e4m3_bytes: u64,
    /// fp32 scale bytes that land in the engines.
    pub scale_bytes: u64,
    /// Bytes moved into plain tensors (embeddings, norms, `lm_head`, router), as before.
    pub plain_bytes: u64,
}

impl Fp8Bytes {
    /// Who quantises, in words, for the table.
    fn who(&self) -> String {
        match (self.sender_blocks, self.receiver_blocks) {
            (0, _) => "every block quantised by the receiver".into(),
            (_, 0) => "every block quantised by its sender".into(),
            (s, r) => format!(
                "{s} blocks quantised by their sender, {r} cut between senders by the receiver"
            ),
        }
    }
}

/// Plans every rank of both sides and summarises.
///
/// FP8 blocks are planned sender-encoded where whole (`encode_on_sender`) or all
/// receiver-encoded.
pub fn summarise_with(r: &Resolved, encode_on_sender: bool) -> anyhow::Result<PlanSummary> {
    let mut pair = r.plan_pair();
    pair.encode_on_sender = encode_on_sender;
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
    let mut fp8 = r.spec.infer_fp8.as_ref().map(|f| Fp8Bytes {
        encoding: f.describe(),
        fp8_tensors: r
            .inference
            .ranks()
            .first()
            .and_then(|&rank| r.inference.rank_layout(rank))
            .map_or(0, |l| {
                l.tensors
                    .iter()
                    .filter(|t| matches!(t.encoding, Encoding::Fp8Block(_)))
                    .count()
            }),
        ..Default::default()
    });
    let mut required = 0u64;
    let mut received = 0u64;
    // what the inference ranks' plans deliver, counted as `need` is (sender-encoded elements
    // in the canonical dtype)
    let mut delivered = 0u64;
    let mut by_element = std::collections::BTreeMap::new();
    for rank in r.inference.ranks() {
        let p = time(Side::Inference, rank)?;
        for peer in &p.peers {
            agree &= fps.remove(&(peer.peer, rank)) == Some(peer.fingerprint);
        }
        let layout = r.inference.rank_layout(rank);
        // what the plan must deliver: FP8 tensors in the canonical dtype (into their staging),
        // scales nothing (the receiver writes them)
        let need: u64 = layout
            .as_ref()
            .map(|l| {
                l.tensors
                    .iter()
                    .flat_map(|t| {
                        t.placements.iter().map(move |p| match &t.encoding {
                            Encoding::Plain(_) => p.region.numel() * t.dtype.size() as u64,
                            Encoding::Fp8Block(_) => r
                                .catalogue
                                .get(&p.canonical)
                                .map_or(0, |c| p.region.numel() * c.dtype.size() as u64),
                            Encoding::Fp8Scales(_) => 0,
                        })
                    })
                    .sum()
            })
            .unwrap_or(0);
        if let (Some(f), Some(l)) = (&mut fp8, &layout) {
            for t in &l.tensors {
                match &t.encoding {
                    Encoding::Fp8Block(_) => f.e4m3_bytes += t.nbytes(),
                    Encoding::Fp8Scales(_) => f.scale_bytes += t.nbytes(),
                    Encoding::Plain(_) => {}
                }
            }
            for t in p.peers.iter().flat_map(|p| p.transfers.iter_owned()) {
                if let Some(s) = t.scale_box() {
                    f.sender_e4m3_bytes += t.numel();
                    f.sender_scale_bytes += t.scale_bytes();
                    f.sender_blocks += s.extent.numel();
                } else if t.encode.is_some() {
                    f.receiver_wire_bytes += t.bytes();
                } else {
                    f.plain_bytes += t.bytes();
                }
            }
        }
        for t in p.peers.iter().flat_map(|p| p.transfers.iter_owned()) {
            if t.scale_box().is_some() {
                *by_element.entry(1).or_default() += t.numel();
                *by_element.entry(4).or_default() += t.scale_bytes();
            } else {
                *by_element.entry(t.dst_dtype.size()).or_default() += t.bytes();
            }
            delivered += if t.sender_encoded() {
                t.numel() * r.catalogue.by_id(t.canonical).dtype.size() as u64
            } else {
                t.bytes()
            };
        }
        required += need;
        received += p.bytes();
    }
    agree &= fps.is_empty();
    let moved: u64 = egress.iter().sum();
    exact &= moved == received && delivered == required;
    if let Some(f) = &mut fp8 {
        f.wire_bytes = f.sender_e4m3_bytes + f.sender_scale_bytes + f.receiver_wire_bytes;
        f.receiver_blocks = (f.scale_bytes / awex_core::plan::SCALE_BYTES) - f.sender_blocks;
        f.encoded_at = match (f.sender_blocks, f.receiver_blocks) {
            (0, _) => "receiver",
            (_, 0) => "sender",
            _ => "sender+receiver",
        }
        .into();
    }
    Ok(PlanSummary {
        model: r.spec.model.name.clone(),
        training: r.spec.train.to_string(),
        inference: r.spec.infer.to_string(),
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
        dropped_by_inference: r.inference.dropped(),
        not_moved: r
            .catalogue
            .not_moved()
            .iter()
            .map(|n| n.describe())
            .collect(),
        skipped_checkpoint_tensors: None,
        fp8,
        delta: None,
        moved_by_element: by_element,
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
    let r = resolve_with(&args.model, &args.train, &args.infer, &args.quant)?;
    let on_sender = args.fp8_encode_at.encode_on_sender(r.spec.transport);
    // An HF directory's weights are what `demo` would send: check them as it would (mapped, not read).
    let dir = std::path::Path::new(&args.model);
    let skipped = if dir.is_dir() && awex_core::model::Checkpoint::present(dir) {
        Some(
            awex_core::model::Checkpoint::open(dir, &r.catalogue)?
                .skipped()
                .len(),
        )
    } else {
        None
    };
    if let Some(rank) = &args.rank {
        let (side, rank) = parse_rank(rank)?;
        check_rank_exists(&r, side, rank)?;
        let t0 = Instant::now();
        let mut pair = r.plan_pair();
        pair.encode_on_sender = on_sender;
        let plan = pair.plan_rank(side, rank)?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        if args.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({ "plan_ms": ms, "plan": plan }))?
            );
        } else {
            println!(
                "{} rank {}: {}, {}, {} (planned in {ms:.2} ms, fingerprint {:016x})",
                side,
                rank,
                plural(plan.peers.len() as u64, "peer"),
                plural(plan.transfers() as u64, "transfer"),
                human_bytes(plan.bytes() as f64),
                plan.fingerprint
            );
            for peer in &plan.peers {
                println!(
                    "  peer {}: {}, {}",
                    peer.peer,
                    plural(peer.transfers.len() as u64, "transfer"),
                    human_bytes(peer.bytes as f64)
                );
                for t in &peer.transfers {
                    println!(
                        "    {}{} @{} -> {}{} @{}  extent {}  {}{}",
                        t.src_tensor,
                        t.src_shape,
                        t.src_offset,
                        t.dst_tensor,
                        t.dst_shape,
                        t.dst_offset,
                        t.extent,
                        human_bytes(t.bytes() as f64),
                        match t.scale_box() {
                            Some(s) => format!(
                                "  (e4m3 + {} into `{}` @{}, fp8 by the sender)",
                                plural(s.extent.numel(), "scale"),
                                s.tensor,
                                s.offset
                            ),
                            None if t.encode.is_some() => {
                                format!("  ({} into staging, fp8 by the receiver)", t.dst_dtype)
                            }
                            None => String::new(),
                        }
                    );
                }
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut s = PlanSummary {
        skipped_checkpoint_tensors: skipped,
        ..summarise_with(&r, on_sender)?
    };
    if let Some(d) = args.delta_density {
        s.delta = Some(s.predict_delta(d)?);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        println!(
            "model        {} ({}, {})",
            s.model,
            plural(r.catalogue.len() as u64, "tensor"),
            human_bytes(r.catalogue.total_bytes() as f64)
        );
        println!(
            "training     {} ({})",
            s.training,
            plural(s.training_ranks as u64, "rank")
        );
        println!(
            "inference    {} ({})",
            s.inference,
            plural(s.inference_ranks as u64, "rank")
        );
        if let Some(f) = &s.fp8 {
            println!("encoding     {} ({})", f.encoding, f.who());
            println!(
                "fp8 bytes    {} e4m3 + {} scales land in the engines; plain tensors {}",
                human_bytes(f.e4m3_bytes as f64),
                human_bytes(f.scale_bytes as f64),
                human_bytes(f.plain_bytes as f64)
            );
            println!(
                "fp8 wire     {}: {} e4m3 + {} scales sender-encoded, {} receiver-encoded (the canonical dtype, into staging)",
                human_bytes(f.wire_bytes as f64),
                human_bytes(f.sender_e4m3_bytes as f64),
                human_bytes(f.sender_scale_bytes as f64),
                human_bytes(f.receiver_wire_bytes as f64)
            );
        }
        println!("required     {}", human_bytes(s.required_bytes as f64));
        println!("moved        {}", human_bytes(s.moved_bytes as f64));
        if let Some(d) = &s.delta {
            println!(
                "delta        {} at {:.2} % of elements changed ({:.2} % of the dense bytes; docs/deltas.md)",
                human_bytes(d.expected_bytes as f64),
                d.density * 100.0,
                d.fraction_of_dense * 100.0
            );
        }
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
        for rule in &s.not_moved {
            println!("not moved    {rule}");
        }
        if let Some(n) = s.skipped_checkpoint_tensors.filter(|&n| n > 0) {
            println!(
                "skipped      {} of the checkpoint under that rule",
                plural(n as u64, "tensor")
            );
        }
        if let Some(first) = s.dropped_by_inference.first() {
            println!(
                "dropped      {} the inference engine does not hold (its load drops them; not moved): {first}{}",
                plural(s.dropped_by_inference.len() as u64, "trained tensor"),
                if s.dropped_by_inference.len() > 1 {
                    ", ..."
                } else {
                    ""
                }
            );
        }
    }
    if !s.fingerprints_agree || !s.exact {
        bail!("plan check failed");
    }
    Ok(ExitCode::SUCCESS)
}
