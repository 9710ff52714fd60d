//! The demo's arguments.

use crate::cmd::plan::{DEFAULT_INFER, DEFAULT_MODEL, DEFAULT_TRAIN, spec_help};
use awex_core::layout::Side;
use std::path::PathBuf;

/// Arguments of `awex-cli demo`.
#[derive(clap::Args, Debug, Clone)]
#[command(
    after_help = "Examples:\n  awex-cli demo\n  awex-cli demo --transport tcp --checksums --updates 5\n  awex-cli demo --transport tcp --deltas --lr 1e-6 --updates 5\n  awex-cli demo --transport cuda-ipc --gpu 0   (a build with --features cuda)\n  awex-cli demo --transport nccl --train megatron:tp=1 --infer sglang:tp=1 --train-gpus 0 --infer-gpus 1   (2 GPUs, --features cuda)\n  awex-cli demo --model qwen3-tiny --train megatron:tp=2,dp=2 --infer sglang:tp=4 --json\n  awex-cli demo --model qwen3-tiny --infer sglang:tp=2 --infer-quant fp8 --fp8-block 16x16 --transport tcp"
)]
pub struct Args {
    /// Model: a preset name, a config.json, or an HF model directory.
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Training side (same syntax as `plan`).
    #[arg(long, default_value = DEFAULT_TRAIN, long_help = spec_help(Side::Training))]
    pub train: String,
    /// Inference side (same syntax as `plan`).
    #[arg(long, default_value = DEFAULT_INFER, long_help = spec_help(Side::Inference))]
    pub infer: String,
    /// How bytes move: shm, tcp (CPU); cuda-ipc, nccl (GPU).
    #[arg(long, default_value = "shm")]
    pub transport: String,
    /// GPU of every rank with `--transport cuda-ipc`; the default of `--train-gpus` and
    /// `--infer-gpus` with `--transport nccl` (default 0; refused with shm and tcp).
    #[arg(long)]
    pub gpu: Option<u32>,
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
    /// Staging bucket size in MiB (1 to 65536).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub bucket_mib: u64,
    /// Per-bucket xxh3 checksums, verified by receivers and compared by the gateway.
    #[arg(long, alias = "checksum")]
    pub checksums: bool,
    /// Apply updates atomically (inference ranks receive into staging, then copy into their
    /// live tensors once every rank received).
    #[arg(long)]
    pub atomic: bool,
    /// Delta updates: after the first update, training ranks move only the elements that
    /// changed since the version each inference rank provably holds (a host copy of each
    /// training rank's shard; see docs/deltas.md). Pair with `--lr` for realistic densities.
    #[arg(long)]
    pub deltas: bool,
    /// Training ranks read every tensor they send for infinity and NaN before each update
    /// (pair option `check_finite`; shm, tcp). Needs `--lr`: random-byte versions hold NaN.
    #[arg(long, requires = "lr")]
    pub check_finite: bool,
    /// Make versions as an AdamW step does at this learning rate (a seeded fp32 master, a
    /// step of 0.18 LR per element per version on average, as Adam's once past its first
    /// steps, cast to bf16), instead of random bytes that change every element: deltas are
    /// then measured at real densities (lr 1e-6: about 1 % of bf16 elements and 0.1 % of e4m3
    /// bytes per version; docs/deltas.md).
    #[arg(long, value_parser = parse_lr)]
    pub lr: Option<f64>,
    /// After the last update, write canonical and per-rank safetensors here.
    #[arg(long)]
    pub dump_dir: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Deadline of one update in seconds (1 to 86400).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub deadline_s: u64,
    /// When a version commits across engines: `all` (every engine applied it), `quorum:K` or
    /// `available` (see `awex-cli pair connect --commit`).
    #[arg(long, default_value = "all")]
    pub commit: awex_control::wire::CommitPolicy,
    /// Fault drill: SIGKILL inference rank E/0 during update `--fault-version`; where the commit
    /// policy allows, that version commits on the other engines and engine E is reported
    /// behind; then the rank is restarted and catches up in the next update.
    #[arg(long, hide = true)]
    pub fault_kill_infer_engine: Option<u32>,
    /// Fault drill: SIGSTOP inference rank E/0 of each of these engines as update
    /// `--fault-version` starts; SIGCONT them once it settled, and retry it if it failed.
    #[arg(long, hide = true, value_delimiter = ',')]
    pub fault_stop_infer_engines: Vec<u32>,
    /// Fleet drill: the last engine's slot starts empty (a spare slot); just before update
    /// `--fault-version` the engine is added over HTTP and its ranks started; that version
    /// catches it up with every byte, and it is then reported serving.
    #[arg(long, hide = true)]
    pub fault_add_engine: bool,
    /// Fleet drill: remove engine E over HTTP while update `--fault-version` runs; that version
    /// commits on the other engines, E's ranks exit, and the next update goes to the others.
    #[arg(long, hide = true)]
    pub fault_remove_engine: Option<u32>,
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
    /// The inference side's FP8 encoding (every inference byte is then checked against the
    /// CPU reference quantiser applied to that version's weights).
    #[command(flatten)]
    pub quant: crate::cmd::quant::QuantArgs,
}

impl Args {
    /// The GPU of `--gpu` (0 when not given).
    pub fn gpu(&self) -> u32 {
        self.gpu.unwrap_or(0)
    }
}

/// The first version: 0 when the model is an HF directory with weights (they are version 0), else 1.
/// A learning rate: finite and in (0, 1].
pub fn parse_lr(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number (e.g. 1e-6)"))?;
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("learning rate {s} is outside (0, 1]"))
    }
}

pub fn first_version(a: &Args) -> u64 {
    let dir = std::path::Path::new(&a.model);
    if dir.is_dir() && awex_core::model::Checkpoint::present(dir) {
        0
    } else {
        1
    }
}
