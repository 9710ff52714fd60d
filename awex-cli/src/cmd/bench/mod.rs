//! `awex-cli bench`: measured runs of awex's data paths against floors measured in the same run.
//!
//! `bench ipc` times a colocated weight update over CUDA IPC through the product's own path
//! ([`transport`]: the `cuda-ipc` transport of the rank runtime, real plans, two processes).
//! `bench ipc --path copies` keeps the hand-built copy path ([`copies`]), with its stream/method
//! sweep. The training ranks' deterministic contents and the byte check are in [`content`].
//! The floors both print are in [`floors`], shared with `demo`. `bench apply` ([`apply`])
//! measures what atomic apply costs on the CPU transports, `bench delta` ([`delta`]) what delta
//! updates save on them. `bench fp8` ([`fp8`]) times the block-FP8
//! quantisers (CPU reference and GPU kernel) and checks their bytes against each other.
//! `bench delta-kernel` ([`delta_kernel`]) times the GPU delta wire kernels against a device copy.

mod apply;
mod content;
mod copies;
mod delta;
mod delta_kernel;
pub mod floors;
mod fp8;
mod local;
mod transport;

use awex_gpu::cuda::CopyMethod;
use serde::Serialize;
use std::process::ExitCode;

/// Arguments of `awex-cli bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand, Debug)]
enum What {
    /// Colocated weight update over CUDA IPC between two processes (needs `--features cuda` and a GPU).
    #[command(
        after_help = "Examples:\n  awex-cli bench ipc --model qwen3-8b\n  awex-cli bench ipc --model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1 --updates 7 --gpu 0 --json\n  awex-cli bench ipc --model qwen3-0.6b --sender-gpu 1 --gpu 0\n  awex-cli bench ipc --model qwen3-8b --infer-quant fp8   (the receiver quantises on the GPU)"
    )]
    Ipc(IpcArgs),
    /// What atomic apply costs: the same CPU pair in place and atomically, the apply copy alone
    /// and the memcpy floor, measured in one run.
    #[command(
        after_help = "Examples:\n  awex-cli bench apply\n  awex-cli bench apply --model qwen3-8b --transport tcp --updates 4 --json"
    )]
    Apply(apply::ApplyArgs),
    /// What delta updates save on the data plane: the same CPU pair dense and with deltas, on
    /// versions made by an optimiser-like step, each update timed start to commit with the
    /// next version written and the last one checked outside the timed window, measured in one
    /// run with the memcpy floor.
    #[command(
        after_help = "Examples:\n  awex-cli bench delta\n  awex-cli bench delta --model qwen3-0.6b --transport shm --lr 1e-6 --updates 5 --json"
    )]
    Delta(delta::DeltaArgs),
    /// The block-FP8 quantisers on model-shaped random bf16: the CPU reference against a memcpy
    /// floor and, with a GPU, the kernel's bytes against the CPU's and its bandwidth against a
    /// device copy, measured in the same run.
    #[command(
        after_help = "Examples:\n  awex-cli bench fp8 --cpu-only\n  awex-cli bench fp8 --shapes 4096x4096,qwen3-8b --recipe vllm --gpu 0\n  awex-cli bench fp8 --recipe awex-python --dump /tmp/fp8 --json"
    )]
    Fp8(fp8::Fp8Args),
    /// The GPU delta wire kernels on a model-sized bf16 buffer: the encode's read rate
    /// against a device copy measured in the same run, the decode's time, every byte checked
    /// (needs `--features cuda` and a GPU).
    #[command(
        after_help = "Examples:\n  awex-cli bench delta-kernel\n  awex-cli bench delta-kernel --step 0.01 --runs 10 --json\n  awex-cli bench delta-kernel --bytes 1073741824 --step 0,0.001,0.01,0.03,0.3,1"
    )]
    DeltaKernel(delta_kernel::DeltaKernelArgs),
    /// The training side of `bench ipc --path copies` (started by it).
    #[command(hide = true)]
    IpcSender(SenderArgs),
    /// The training ranks of `bench ipc` (started by it).
    #[command(hide = true)]
    IpcRanks(transport::RanksArgs),
}

/// Which path `bench ipc` times.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Path {
    /// The product: the `cuda-ipc` transport of the rank runtime, on both ends.
    Transport,
    /// The hand-built copy path (its own protocol, the stream/method sweep).
    Copies,
}

/// How the receiver issues its copies.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Mode {
    /// One driver call per copy descriptor, every update.
    Launch,
    /// The copies captured once into a CUDA graph, replayed with one launch per update.
    Graph,
}

/// What moves the bytes (the command-line face of [`CopyMethod`]).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Method {
    /// `cuMemcpyDtoDAsync` / `cuMemcpy2DAsync` / `cuMemcpy3DAsync`.
    Driver,
    /// awex's copy kernel (16-byte vectors on the SMs), the driver for what it cannot take.
    Kernel,
}

impl From<Method> for CopyMethod {
    fn from(m: Method) -> CopyMethod {
        match m {
            Method::Driver => CopyMethod::Driver,
            Method::Kernel => CopyMethod::Kernel,
        }
    }
}

/// Arguments of `awex-cli bench ipc`.
#[derive(clap::Args, Debug)]
struct IpcArgs {
    /// What is timed: the product's transport, or the hand-built copy path.
    #[arg(long, value_enum, default_value_t = Path::Transport)]
    path: Path,
    /// Staging bucket size of the transport, in MiB (the rank runtime's default).
    #[arg(long, default_value_t = 64)]
    bucket_mib: u64,
    /// Model: a preset name, a config.json, or an HF model directory.
    #[arg(long, default_value = "qwen3-8b")]
    model: String,
    /// Training side (one process holds every training rank the receiving rank reads from).
    #[arg(long, default_value = "megatron:tp=1")]
    train: String,
    /// Inference side.
    #[arg(long, default_value = "sglang:tp=1")]
    infer: String,
    /// The receiving inference rank, `E/N`.
    #[arg(long, default_value = "0/0")]
    rank: String,
    /// Updates to run; the first is the cold one, the rest give the steady-state median.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(2..))]
    updates: u32,
    /// GPU of the receiving (inference) process.
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// GPU of the sending (training) process; defaults to `--gpu`.
    #[arg(long)]
    sender_gpu: Option<u32>,
    /// Streams the copies are spread over.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// How the copies are issued.
    #[arg(long, value_enum, default_value_t = Mode::Launch)]
    mode: Mode,
    /// How the sending process allocates its tensors.
    #[arg(long, value_enum, default_value_t = SenderAlloc::Contiguous)]
    sender_alloc: SenderAlloc,
    /// What moves the bytes: the driver's copy calls, or awex's copy kernel.
    #[arg(long, value_enum, default_value_t = Method::Kernel)]
    method: Method,
    /// Issue one copy per planned box instead of merging regular series into 2-D copies.
    #[arg(long)]
    no_coalesce: bool,
    /// Cut linear copies longer than this many MiB into pieces spread over the streams (0: never).
    #[arg(long, default_value_t = 256)]
    split_mb: u64,
    /// Skip the bit-for-bit check of every destination byte.
    #[arg(long)]
    no_verify: bool,
    /// Also time other stream counts and both modes (steady state only).
    #[arg(long)]
    sweep: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Delta updates (transport path): the receiver's copies write only the 16-byte vectors
    /// that differ from what its tensors hold (the diff kernel). Pair with `--step`.
    #[arg(long)]
    deltas: bool,
    /// Before each update after the first, the training ranks change about this fraction of
    /// their 16-bit elements by one unit in the last place, element by element, on the GPU (a
    /// synthetic optimiser step; `demo --lr 1e-6` measures about 0.01 for bf16), outside the
    /// timed window (transport path).
    #[arg(long, value_parser = parse_fraction)]
    step: Option<f64>,
    /// An FP8 inference side (transport path): the receiver's FP8 tensors land in bf16 device
    /// staging and the GPU kernel quantises them; the senders' weights are made finite.
    #[command(flatten)]
    quant: crate::cmd::quant::QuantArgs,
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!(
            "`{s}` is not a fraction between 0 and 1 (e.g. 0.01 for 1 % of the elements)"
        )),
    }
}

/// Arguments of the hidden `bench ipc-sender`.
#[derive(clap::Args, Debug)]
struct SenderArgs {
    #[arg(long)]
    model: String,
    #[arg(long)]
    train: String,
    #[arg(long)]
    infer: String,
    /// Training ranks to hold, comma-separated.
    #[arg(long)]
    ranks: String,
    #[arg(long)]
    gpu: u32,
    #[arg(long, value_enum)]
    alloc: SenderAlloc,
}

/// How the sending process lays out its tensors in device memory.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum SenderAlloc {
    /// One buffer per training rank holding every tensor (Megatron's contiguous param buffer).
    Contiguous,
    /// One allocation per tensor (what PyTorch's caching allocator gives large tensors).
    PerTensor,
    /// One buffer per training rank as `contiguous`, made of 20 MiB `cuMemCreate` chunks mapped
    /// back to back (what PyTorch's expandable segments hold), shared through file descriptors
    /// (the transport path only).
    Expandable,
}

/// Chunk size of `--sender-alloc expandable` (PyTorch's large-pool segment size).
const EXPANDABLE_CHUNK: u64 = 20 << 20;

/// Runs the subcommand.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.what {
        What::Apply(a) => apply::run(a),
        What::Delta(a) => delta::run(a),
        What::Fp8(a) => fp8::run(a),
        What::DeltaKernel(a) => delta_kernel::run(a),
        What::Ipc(a) if a.path == Path::Transport => transport::run(a),
        What::Ipc(a) => copies::ipc(a),
        What::IpcSender(a) => copies::sender(a),
        What::IpcRanks(a) => transport::ranks(a),
    }
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
