//! The `simulate` command: arguments and runner (feature `cli`).
//!
//! A binary that links the backend crates (so that their layouts are registered) wires it
//! with `Simulate(awex_sim::cli::Args)` and `awex_sim::cli::run(args)`.

use crate::exec::{Options, PeerOrder};
use crate::topology::{DeviceKind, Placement, Topology};
use crate::{Names, simulate};
use anyhow::Context;
use awex_core::Transport;
use awex_core::backend::side_layout;
use awex_core::encoding::{Fp8Side, InferFp8};
use awex_core::layout::Side;
use awex_core::plan::Pair;
use awex_core::{BackendSpec, Catalogue, ModelSpec};

/// `simulate`'s examples, for its help.
pub const AFTER_HELP: &str = "Every figure is a PREDICTION from awex's own plans over a flow-level model of the stated cluster.\n\nExamples:\n  simulate --model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1 --topology h200x8 --placement packed\n  simulate --model moe-1t --train megatron:tp=8,pp=4,dp=8,ep=32,etp=1 --infer sglang:tp=16,ep=16,engines=8 --topology h200x8 --json --svg util.svg\n  simulate --model moe-1t --train megatron:tp=8,pp=8,dp=4,ep=32,etp=1 --infer sglang:tp=16,ep=16,engines=8 --infer-quant fp8";

/// Arguments of `simulate`.
#[derive(clap::Args, Debug, Clone)]
#[command(
    after_help = AFTER_HELP
)]
pub struct Args {
    /// Model: a preset name, a config.json, or an HF model directory.
    #[arg(long, default_value = "qwen3-0.6b")]
    pub model: String,
    /// Training side: `backend:key=value,...`.
    #[arg(long, default_value = "megatron:tp=2,pp=2")]
    pub train: String,
    /// Inference side: `backend:key=value,...`.
    #[arg(long, default_value = "sglang:tp=2,engines=2")]
    pub infer: String,
    /// Topology: a preset (h100x8, h200x8, cpu-vm) or a TOML file.
    #[arg(long, default_value = "h200x8")]
    pub topology: String,
    /// Where the ranks run: separate (own nodes), packed (right after the training ranks), colocated.
    #[arg(long)]
    pub placement: Option<String>,
    /// Transport: nccl, cuda-ipc, shm, tcp (default: cuda-ipc when colocated, nccl on GPUs, shm on CPU).
    #[arg(long)]
    pub transport: Option<String>,
    /// Staging bucket size in MiB (the NCCL per-step budget).
    #[arg(long, default_value_t = 64)]
    pub bucket_mib: u64,
    /// Override the topology's NIC bandwidth, GB/s per NIC and direction.
    #[arg(long)]
    pub nic_gbps: Option<f64>,
    /// Override the topology's node count.
    #[arg(long)]
    pub nodes: Option<u32>,
    /// Override the control plane's share of an update, ms.
    #[arg(long)]
    pub control_ms: Option<f64>,
    /// Most flows before consecutive NCCL steps are merged into one simulated group.
    #[arg(long, default_value_t = 300_000)]
    pub max_flows: u64,
    /// Flows ending within this fraction of the lower bound of an event end with it.
    #[arg(long, default_value_t = 1e-4)]
    pub quantum: f64,
    /// How cuda-ipc receivers take their peers' copies: concurrent (every peer's graph at once,
    /// the transport's default), sequential (peer after peer, AWEX_IPC_PEERS=sequential) or
    /// interleaved (one batch taking the peers' copies in turn, a what-if).
    #[arg(long, default_value = "concurrent")]
    pub peers: String,
    /// Predict a delta update at this density (the fraction of elements that changed since
    /// the version the engines hold: about 0.03 for bf16 at lr 1e-6, 0.0035 of the e4m3 bytes
    /// with an FP8 inference side): the flows carry the delta's expected bytes, and the
    /// training ranks' diff and encode pass is added before them.
    #[arg(long)]
    pub delta_density: Option<f64>,
    /// Engines left out of the update (commit policies `quorum:K` and `available`: dead or
    /// stopped engines): their ranks get nothing, and the others' update is predicted alone.
    #[arg(long, value_delimiter = ',')]
    pub failed_engines: Vec<u32>,
    /// Engines that joined the pair since the last update (added at run time, or restarted):
    /// they hold no version, so their ranks take every byte of this update (a full catch-up)
    /// while the others take what `--delta-density` says.
    #[arg(long, value_delimiter = ',')]
    pub joining_engines: Vec<u32>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write a picture of link utilisation over time (SVG) to this file.
    #[arg(long)]
    pub svg: Option<std::path::PathBuf>,
}

/// Resolves the topology with the command line's overrides.
pub fn topology(a: &Args) -> anyhow::Result<Topology> {
    let mut t = Topology::resolve(&a.topology)?;
    if let Some(p) = &a.placement {
        t.placement = p.parse::<Placement>()?;
    }
    if let Some(v) = a.nic_gbps {
        t.nic_gbps = v;
    }
    if let Some(v) = a.nodes {
        t.nodes = v;
    }
    if let Some(v) = a.control_ms {
        t.control_ms = v;
    }
    t.check()?;
    Ok(t)
}

/// The transport an update over `topo` uses: `--transport`, or the simulator's default for
/// the topology (cuda-ipc colocated, nccl on GPUs, shm on CPU hosts).
fn transport_of(a: &Args, topo: &Topology) -> anyhow::Result<Transport> {
    if let Some(t) = a.transport.as_deref() {
        return t.parse::<Transport>().map_err(anyhow::Error::msg);
    }
    Ok(match topo.kind {
        DeviceKind::Cpu => Transport::Shm,
        DeviceKind::Gpu if topo.placement == Placement::Colocated => Transport::CudaIpc,
        DeviceKind::Gpu => Transport::Nccl,
    })
}

/// Whether the simulated plans quantise FP8 blocks on the sender over `t`: where the transport
/// does (nccl's training GPUs quantise as they pack).
pub fn encodes_on_sender(t: Transport) -> bool {
    t.encodes_fp8_on_sender()
}

/// Plans and simulates as the arguments say.
pub fn report(a: &Args) -> anyhow::Result<crate::report::Report> {
    report_with(a, None)
}

/// [`report`] with an FP8 inference side (`--infer-quant fp8` and the other FP8 flags, which
/// the binary resolves as `plan` does).
pub fn report_with(a: &Args, fp8: Option<InferFp8>) -> anyhow::Result<crate::report::Report> {
    let topo = topology(a)?;
    let model = ModelSpec::resolve(&a.model)?;
    let catalogue = Catalogue::of(&model);
    let ts: BackendSpec = a.train.parse()?;
    let is: BackendSpec = a.infer.parse()?;
    let training = side_layout(Side::Training, &ts, &model)
        .with_context(|| format!("training layout `{}`", a.train))?;
    let mut inference = side_layout(Side::Inference, &is, &model)
        .with_context(|| format!("inference layout `{}`", a.infer))?;
    let fp8_name = fp8.as_ref().map(InferFp8::describe);
    if let Some(f) = fp8 {
        inference = std::sync::Arc::new(
            Fp8Side::new(inference, &model, &catalogue, f)
                .with_context(|| format!("inference layout `{}`", a.infer))?,
        );
    }
    let transport = transport_of(a, &topo)?;
    let pair = Pair {
        catalogue: &catalogue,
        training: &*training,
        inference: &*inference,
        encode_on_sender: encodes_on_sender(transport),
    };
    if a.bucket_mib == 0 {
        anyhow::bail!("--bucket-mib must be at least 1");
    }
    if let Some(d) = a.delta_density
        && !(d.is_finite() && (0.0..=1.0).contains(&d))
    {
        anyhow::bail!("--delta-density {d} is outside [0, 1]");
    }
    let element_bytes = if fp8_name.is_some() { 1 } else { 2 };
    let wire_scale = a.delta_density.map_or(1.0, |d| {
        awex_core::encoding::delta::expected_fraction(d, element_bytes)
    });
    let opts = Options {
        wire_scale,
        transport: Some(transport),
        bucket_bytes: a.bucket_mib << 20,
        max_flows: a.max_flows.max(1),
        quantum: a.quantum.max(0.0),
        peers: a.peers.parse::<PeerOrder>()?,
        ..Options::default()
    };
    let names = Names {
        model: model.name.clone(),
        training: ts.to_string(),
        inference: is.to_string(),
    };
    let engines = inference.engines();
    for (flag, list) in [
        ("--failed-engines", &a.failed_engines),
        ("--joining-engines", &a.joining_engines),
    ] {
        if let Some(e) = list.iter().find(|&&e| e >= engines) {
            anyhow::bail!(
                "{flag} names engine {e}, but `{}` has engines 0..{engines}",
                a.infer
            );
        }
    }
    if let Some(e) = a
        .joining_engines
        .iter()
        .find(|e| a.failed_engines.contains(e))
    {
        anyhow::bail!(
            "engine {e} is in both --failed-engines and --joining-engines; an engine left out of the update takes no part in it"
        );
    }
    let opts = Options {
        dense_ranks: inference
            .ranks()
            .iter()
            .map(|r| a.joining_engines.contains(&r.engine))
            .collect(),
        ..opts
    };
    let mut r = if a.failed_engines.is_empty() {
        simulate(&pair, &names, &topo, &opts)?
    } else {
        topo.check()?;
        let mut plans = crate::exec::plan_all(&pair, opts.threads)?;
        let ranks = plans.inference.clone();
        plans
            .pairs
            .retain(|p| !a.failed_engines.contains(&ranks[p.i as usize].engine));
        let mut r = crate::simulate_plans(&plans, &names, &topo, &opts)?;
        r.failed_engines = a.failed_engines.clone();
        r
    };
    r.joining_engines = a.joining_engines.clone();
    if let (Some(f), Some(name)) = (&mut r.fp8, fp8_name) {
        f.encoding = name;
    }
    if let Some(density) = a.delta_density {
        // the busiest sender reads what it sends and its copy of the base (two passes over its
        // egress, dense, in the training dtype: bf16, twice an e4m3 byte), and refreshes the
        // copy (one more)
        let egress = r.moved_bytes as f64 / r.training_ranks.max(1) as f64
            * r.egress_max_over_mean.max(1.0)
            * (2.0 / element_bytes as f64);
        let encode_rate = if topo.kind == crate::topology::DeviceKind::Cpu {
            8e9
        } else {
            4.27e12
        };
        let encode_s = 3.0 * egress / encode_rate;
        r.predicted_s += encode_s;
        r.delta = Some(crate::report::DeltaPrediction {
            density,
            element_bytes,
            wire_scale,
            encode_s,
            encode_rate,
        });
    }
    Ok(r)
}

/// Runs the command: prints the report (text or JSON) and writes the picture.
pub fn run(a: Args) -> anyhow::Result<()> {
    run_with(a, None)
}

/// [`run`] with an FP8 inference side.
pub fn run_with(a: Args, fp8: Option<InferFp8>) -> anyhow::Result<()> {
    let r = report_with(&a, fp8)?;
    if let Some(path) = &a.svg {
        std::fs::write(path, r.svg()).with_context(|| format!("writing {}", path.display()))?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", r.text());
    }
    Ok(())
}
