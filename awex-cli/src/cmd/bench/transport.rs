//! `bench ipc` on the product's own path: the rank runtime's `cuda-ipc` transport on both ends.
//!
//! This process is the inference rank; it starts itself again as the training ranks it reads
//! from (the hidden `bench ipc-ranks`). Both ends plan their own rank with the real planner,
//! hold their tensors as the rank runtime does (`TensorSet::allocate_cuda`, one allocation per
//! tensor; or, with `--sender-alloc contiguous`, device views into one buffer per training rank,
//! as Megatron's contiguous parameter buffer holds them; `expandable`: the same buffer made of
//! 20 MiB `cuMemCreate` chunks, as PyTorch's expandable segments hold memory) and build a
//! [`CudaIpcTransport`]. The training side's rendezvous values reach this process over the pipe (the gateway's job in a
//! real pair); per update both ends call `execute` with the same version, exactly as the rank
//! loop does after the gateway's `update` event. Timed here:
//!
//! - `join_ms`: building the inference transport and `connect` (copy engine and kernel load,
//!   control segments, opening every IPC handle and event, the copy descriptors): everything
//!   before the first update;
//! - `first_update_ms` and the steady updates: from asking the training ranks to publish the
//!   version to this rank's `execute` returning (its copies synchronised);
//! - peak extra device memory of this rank (free memory before the transport, minus the least
//!   seen during join and the updates);
//! - the floors of [`super::floors`], out of the same mapped allocations.
//!
//! Every destination byte is checked after the first and the last update.
//!
//! With an FP8 inference side (`--infer-quant fp8`, `--infer-config`) the receiver is the rank
//! runtime's [`EncodingTransport`] around the cuda-ipc transport: the FP8 tensors' copies land
//! in bf16 device staging and the GPU kernel quantises them after the copies, in the update,
//! or (fused, the default) the kernel quantises them straight out of the senders' memory.
//! The senders' weights are made finite; the check quantises the expected bf16 of every FP8
//! tensor with the CPU reference and compares every e4m3 byte and scale. Timed besides: the
//! kernels alone over every FP8 tensor (staged and fused), and the FP8 floor: the device
//! copy's rate (the local copy floor) applied to reading the bf16 once and writing the e4m3
//! bytes and scales once (plus the plain tensors' copies).

use super::content::{
    Content, expected_tensor, make_finite, par_gen, read_line, send_line, tensor_key, verify_with,
};
use super::floors::{self, FloorPoint};
use super::{IpcArgs, SenderAlloc, median};
use anyhow::{Context, anyhow, bail};
use awex_core::encoding::{Encoding, Fp8Block, Fp8Quantiser, InferFp8, Shape2d};
use awex_core::layout::{LocalTensor, RankId, Side};
use awex_core::plan::Transfer;
use awex_gpu::cuda::delta::StepKernel;
use awex_gpu::cuda::{Device, DeviceBuffer, driver_version};
use awex_runtime::transport::{
    CudaIpcTransport, EncodingTransport, ExecContext, ExecStats, JoinStats, Transport,
};
use awex_runtime::{TensorSet, TensorView};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

/// How long one update may take before both ends give up.
const UPDATE_DEADLINE: Duration = Duration::from_secs(60);
/// Alignment of tensors in a contiguous training buffer.
const ALIGN: u64 = 256;

/// Arguments of the hidden `bench ipc-ranks`.
#[derive(clap::Args, Debug)]
pub struct RanksArgs {
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
    #[arg(long)]
    bucket_mib: u64,
    /// The one inference rank that reads them (`E/R`): each training rank's plan keeps that
    /// peer only, so it waits for that reader alone (the bench runs one inference rank).
    #[arg(long)]
    reader: String,
    #[command(flatten)]
    quant: crate::cmd::quant::QuantArgs,
}

/// Applies the synthetic optimiser step `seed` to every tensor of the ranks (changing about
/// `fraction` of their 16-bit elements; see [`Content`]) and waits for it.
fn step_all(
    dev: &Device,
    kernel: &StepKernel,
    held: &[Held],
    seed: u64,
    fraction: f64,
) -> anyhow::Result<()> {
    let stream = dev.stream()?;
    for h in held {
        for v in h.tensors.iter() {
            let Some(ptr) = v.device_ptr() else {
                bail!("`{}` is not in GPU memory", v.name);
            };
            let key = tensor_key(h.rank, &v.name);
            // SAFETY: the view covers `v.len()` bytes of device memory on `dev`, which no
            // transfer reads until the step is synchronised below.
            unsafe { kernel.launch(&stream, ptr, v.len() as u64 / 2, seed ^ key, fraction)? };
        }
    }
    stream.sync()?;
    Ok(())
}

/// What the training ranks tell the inference rank once their transports exist.
#[derive(Serialize, Deserialize, Debug)]
struct Hello {
    device: String,
    /// Each training rank and its transport's rendezvous value.
    ranks: Vec<(RankId, serde_json::Value)>,
    allocations: usize,
    tensors: usize,
    alloc_ms: f64,
    fill_ms: f64,
    /// Building the training transports (exporting the IPC handles, the control segments).
    export_ms: f64,
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "msg", rename_all = "lowercase")]
enum ToRanks {
    Update {
        version: u64,
    },
    /// Apply the synthetic step `seed` changing `fraction` of the elements (`bench ipc --step`).
    Step {
        seed: u64,
        fraction: f64,
    },
    Quit,
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "msg", rename_all = "lowercase")]
enum FromRanks {
    Done { version: u64, error: Option<String> },
    Stepped { seed: u64 },
    Bye,
}

/// One training rank's tensors: the set, and the buffer behind it when it is one buffer.
struct Held {
    rank: RankId,
    tensors: Arc<TensorSet>,
    _buffer: Option<DeviceBuffer>,
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Uploads the deterministic content of every tensor of `set` (training rank `rank`), made
/// finite if asked (an FP8 inference side).
fn fill(dev: &Device, rank: RankId, set: &TensorSet, finite: bool) -> anyhow::Result<()> {
    let chunk = 256usize << 20;
    let mut host = vec![0u8; chunk];
    for v in set.iter() {
        let Some(ptr) = v.device_ptr() else {
            bail!("`{}` is not in GPU memory", v.name);
        };
        let key = tensor_key(rank, &v.name);
        let mut done = 0usize;
        while done < v.len() {
            let n = chunk.min(v.len() - done);
            par_gen(key, done as u64, &mut host[..n]);
            if finite {
                make_finite(done as u64, &mut host[..n]);
            }
            // SAFETY: the view covers `v.len()` bytes of device memory on `dev`.
            unsafe { dev.copy_from_host(ptr + done as u64, &host[..n])? };
            done += n;
        }
    }
    Ok(())
}

/// The training side: holds the ranks, builds their transports, executes each version asked.
pub fn ranks(a: RanksArgs) -> anyhow::Result<ExitCode> {
    let r = resolve_ipc(&a.model, &a.train, &a.infer, &a.quant)?;
    let finite = r.spec.infer_fp8.is_some();
    let ranks: Vec<RankId> = a
        .ranks
        .split(',')
        .map(|s| s.trim().parse::<u32>().map(RankId::train))
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad --ranks `{}`", a.ranks))?;
    let dev = Device::open(a.gpu)?;
    let t0 = Instant::now();
    let mut held = Vec::new();
    for &rank in &ranks {
        let layout = r
            .training
            .rank_layout(rank)
            .ok_or_else(|| anyhow!("training side has no rank {rank}"))?;
        match a.alloc {
            SenderAlloc::PerTensor => held.push(Held {
                rank,
                tensors: Arc::new(TensorSet::allocate_cuda(&layout, &dev)?),
                _buffer: None,
            }),
            SenderAlloc::Contiguous | SenderAlloc::Expandable => {
                let mut off = 0u64;
                let mut at = Vec::new();
                for t in &layout.tensors {
                    at.push(off);
                    off += t.nbytes().div_ceil(ALIGN) * ALIGN;
                }
                let buf = match a.alloc {
                    SenderAlloc::Expandable => dev.alloc_chunked(off, super::EXPANDABLE_CHUNK)?,
                    _ => dev.alloc(off)?,
                };
                let mut views = Vec::new();
                for (t, o) in layout.tensors.iter().zip(at) {
                    // SAFETY: `buf` holds every tensor at its aligned offset and lives in `held`
                    // as long as the set.
                    views.push(unsafe {
                        TensorView::new_cuda(
                            &t.name,
                            buf.ptr() + o,
                            t.nbytes() as usize,
                            t.dtype,
                            t.shape,
                            dev.ordinal(),
                        )?
                    });
                }
                held.push(Held {
                    rank,
                    tensors: Arc::new(TensorSet::from_views(views)?),
                    _buffer: Some(buf),
                });
            }
        }
    }
    let alloc_ms = ms_since(t0);
    let t0 = Instant::now();
    for h in &held {
        fill(&dev, h.rank, &h.tensors, finite)?;
    }
    let fill_ms = ms_since(t0);
    let t0 = Instant::now();
    let mut transports = Vec::new();
    let (_, reader) = crate::cmd::plan::parse_rank(&format!("infer:{}", a.reader))?;
    for h in &held {
        let mut plan = r.plan_pair().plan_rank(Side::Training, h.rank)?;
        plan.peers.retain(|p| p.peer == reader);
        let plan = Arc::new(plan);
        let name = ctl_name(std::process::id(), h.rank.rank);
        transports.push(CudaIpcTransport::new(
            plan,
            h.tensors.clone(),
            a.bucket_mib << 20,
            &name,
            &crate::settings::transports()?.cuda_ipc,
        )?);
    }
    let export_ms = ms_since(t0);
    let hello = Hello {
        device: dev.name()?,
        ranks: held
            .iter()
            .zip(&transports)
            .map(|(h, t)| (h.rank, t.rendezvous()))
            .collect(),
        allocations: held
            .iter()
            .map(|h| match (&h._buffer, a.alloc) {
                // the physical chunks behind the buffer
                (Some(b), SenderAlloc::Expandable) => {
                    b.len().div_ceil(super::EXPANDABLE_CHUNK) as usize
                }
                (Some(_), _) => 1,
                (None, _) => h.tensors.len(),
            })
            .sum(),
        tensors: held.iter().map(|h| h.tensors.len()).sum(),
        alloc_ms,
        fill_ms,
        export_ms,
    };
    let mut out = std::io::stdout().lock();
    send_line(&mut out, &hello)?;
    let mut input = std::io::stdin().lock();
    let cancel = AtomicBool::new(false);
    let no_peers = HashMap::new();
    let mut step_kernel = None;
    loop {
        match read_line::<ToRanks>(&mut input, "inference rank")? {
            ToRanks::Step { seed, fraction } => {
                if step_kernel.is_none() {
                    step_kernel = Some(StepKernel::load(&dev)?);
                }
                if let Some(k) = &step_kernel {
                    step_all(&dev, k, &held, seed, fraction)?;
                }
                send_line(&mut out, &FromRanks::Stepped { seed })?;
            }
            ToRanks::Update { version } => {
                let ctx = ExecContext {
                    version,
                    attempt: 1,
                    deadline: Instant::now() + UPDATE_DEADLINE,
                    cancel: &cancel,
                    checksums: false,
                    peers: &no_peers,
                    corrupt: false,
                    bases: None,
                };
                // every training rank publishes at once and waits for its readers, as each
                // rank process of a real pair does
                let errors: Vec<String> = std::thread::scope(|s| {
                    let hs: Vec<_> = transports
                        .iter_mut()
                        .map(|t| s.spawn(|| t.execute(&ctx).map(|_| ())))
                        .collect();
                    hs.into_iter()
                        .filter_map(|h| match h.join() {
                            Ok(Ok(())) => None,
                            Ok(Err(e)) => Some(e.to_string()),
                            Err(_) => Some("a training rank's thread panicked".into()),
                        })
                        .collect()
                });
                send_line(
                    &mut out,
                    &FromRanks::Done {
                        version,
                        error: (!errors.is_empty()).then(|| errors.join("; ")),
                    },
                )?;
            }
            ToRanks::Quit => {
                for t in &mut transports {
                    t.close();
                }
                drop(transports);
                drop(held);
                send_line(&mut out, &FromRanks::Bye)?;
                return Ok(ExitCode::SUCCESS);
            }
        }
    }
}

/// The training ranks' process, killed if this one stops early.
struct RanksProc {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl RanksProc {
    fn start(a: &IpcArgs, ranks: &[RankId], gpu: u32) -> anyhow::Result<Self> {
        let exe = std::env::current_exe()
            .context("cannot find this executable to start the training ranks")?;
        let ranks: Vec<String> = ranks.iter().map(|r| r.rank.to_string()).collect();
        let mut child = Command::new(exe)
            .args([
                "bench",
                "ipc-ranks",
                "--model",
                &a.model,
                "--train",
                &a.train,
            ])
            .args(["--infer", &a.infer, "--ranks", &ranks.join(",")])
            .args(["--reader", &a.rank])
            .arg("--gpu")
            .arg(gpu.to_string())
            .arg("--alloc")
            .arg(match a.sender_alloc {
                SenderAlloc::Contiguous => "contiguous",
                SenderAlloc::PerTensor => "per-tensor",
                SenderAlloc::Expandable => "expandable",
            })
            .arg("--bucket-mib")
            .arg(a.bucket_mib.to_string())
            .args(a.quant.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the training ranks' process")?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            bail!("the training ranks' process has no pipes");
        };
        Ok(RanksProc {
            child,
            stdin,
            stdout: BufReader::new(stdout),
        })
    }

    fn send(&mut self, m: &ToRanks) -> anyhow::Result<()> {
        send_line(&mut self.stdin, m)?;
        self.stdin.flush()?;
        Ok(())
    }

    fn recv<T: for<'de> Deserialize<'de>>(&mut self) -> anyhow::Result<T> {
        read_line(&mut self.stdout, "training ranks")
    }

    fn finish(mut self) -> anyhow::Result<()> {
        self.send(&ToRanks::Quit)?;
        match self.recv::<FromRanks>()? {
            FromRanks::Bye => {}
            other => bail!("the training ranks answered {other:?} to quit"),
        }
        let status = self.child.wait()?;
        if !status.success() {
            bail!("the training ranks exited with {status}");
        }
        Ok(())
    }
}

impl Drop for RanksProc {
    /// On an error path: asks the training ranks to quit (they close their transports, which
    /// unlinks their control segments) and kills them only if they have not within 10 s.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.send(&ToRanks::Quit);
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Everything `bench ipc --json` prints (the transport path).
#[derive(Serialize, Debug)]
struct Report {
    path: &'static str,
    model: String,
    training: String,
    inference: String,
    rank: String,
    device: String,
    driver_version: i32,
    gpu: u32,
    sender_gpu: u32,
    sender_alloc: SenderAlloc,
    sender_allocations: usize,
    sender_tensors: usize,
    sender_fill_ms: f64,
    sender_export_ms: f64,
    receiver_tensors: usize,
    bytes: u64,
    transfers: usize,
    bucket_bytes: u64,
    plan_ms: f64,
    /// Everything before the first update (the inference transport built and connected).
    join_ms: f64,
    join: JoinStats,
    first_update_ms: f64,
    steady_ms: Vec<f64>,
    steady_median_ms: f64,
    steady_gbps: f64,
    /// Peak device memory this rank took beyond its tensors, during join and the updates.
    extra_device_bytes: u64,
    extra_device_buckets: f64,
    floors: Vec<FloorPoint>,
    floor_ms: f64,
    ratio: f64,
    ipc_floor_ms: f64,
    ipc_ratio: f64,
    verified: bool,
    verify_detail: String,
    /// With an FP8 inference side: what was quantised, the kernel alone and the FP8 floor.
    fp8: Option<Fp8Figures>,
    /// Delta updates (`--deltas`): the receiver wrote only the vectors that differ.
    deltas: bool,
    /// The synthetic step between updates (`--step`): the fraction of 16-bit elements changed.
    step: Option<f64>,
    /// Bytes each steady update wrote into the receiver's tensors (with deltas: the vectors
    /// that differed, plus what was copied whole).
    steady_written_bytes: Vec<u64>,
    /// With deltas, over the steady updates: 16-byte vectors the diff kernel read on both ends,
    /// and those that differed (each written, with its 32-byte sector's other half).
    delta_vectors: u64,
    delta_changed_vectors: u64,
    unix_time: u64,
}

/// `bench ipc` with an FP8 inference side: bytes, the kernel alone, the floor, the ratio.
#[derive(Serialize, Debug)]
struct Fp8Figures {
    encoding: String,
    fp8_tensors: usize,
    /// bf16 bytes copied into the FP8 tensors' staging (read once by the kernel)
    bf16_bytes: u64,
    /// e4m3 bytes and scale bytes the kernel writes
    e4m3_bytes: u64,
    scale_bytes: u64,
    /// bytes of the plain tensors (copied as they are)
    plain_bytes: u64,
    /// device memory of the staging (held for the pair's life)
    staging_bytes: u64,
    /// FP8 tensors quantised straight out of the training ranks' memory (`AWEX_IPC_FP8=fused`,
    /// the default: no staging) and through the staging
    fused_tensors: usize,
    staged_tensors: usize,
    /// the fused kernel's batch: 128 x 128 blocks and jobs (one per matrix of a box)
    fused_blocks: u64,
    fused_jobs: u64,
    /// the kernels alone over every FP8 tensor (the staging's batch, then the fused batches),
    /// every run (the first warms up), and the median
    kernel_runs_ms: Vec<f64>,
    kernel_ms: f64,
    /// its bytes read + written per second, and that over the local device copy's rate
    kernel_gbps: f64,
    kernel_vs_copy: f64,
    /// the floor: reading the bf16 once, writing e4m3 + scales once, and copying the plain
    /// tensors, at the local device copy's rate (its read + write bytes per second)
    floor_ms: f64,
    /// the steady update over that floor
    ratio: f64,
}

/// What the byte-for-byte check covers: the transfers into plain tensors and those tensors
/// (FP8 tensors are checked against the CPU reference, their scale tensors with them).
fn plain_part(transfers: &[Transfer], lts: &[LocalTensor]) -> (Vec<Transfer>, Vec<LocalTensor>) {
    let plain: Vec<LocalTensor> = lts
        .iter()
        .filter(|t| matches!(t.encoding, Encoding::Plain(_)))
        .cloned()
        .collect();
    let transfers = transfers
        .iter()
        .filter(|t| plain.iter().any(|p| p.name == t.dst_tensor))
        .cloned()
        .collect();
    (transfers, plain)
}

/// The pair both ends of the bench plan: over cuda-ipc (an FP8 side's blocks are all
/// quantised by the receiver, out of bf16: its copies carry bytes only).
fn resolve_ipc(
    model: &str,
    train: &str,
    infer: &str,
    quant: &crate::cmd::quant::QuantArgs,
) -> anyhow::Result<crate::cmd::plan::Resolved> {
    crate::cmd::plan::resolve_over(model, train, infer, quant, awex_core::Transport::CudaIpc)
}

/// The receiving rank's transport: the cuda-ipc transport, or the FP8 encoding around it.
enum Receiver {
    Plain(Box<CudaIpcTransport>),
    Fp8(Box<EncodingTransport>),
}

impl Receiver {
    fn t(&mut self) -> &mut dyn Transport {
        match self {
            Receiver::Plain(t) => &mut **t,
            Receiver::Fp8(t) => &mut **t,
        }
    }

    fn ipc(&self) -> anyhow::Result<&CudaIpcTransport> {
        match self {
            Receiver::Plain(t) => Ok(t),
            Receiver::Fp8(t) => t
                .cuda_ipc()
                .ok_or_else(|| anyhow!("the FP8 receiver holds no cuda-ipc transport")),
        }
    }
}

/// The CPU reference's e4m3 bytes and scales of `mats` dense `rows x cols` bf16 matrices `x`,
/// quantised in bands of whole block rows on every core (the same bytes as one call per matrix:
/// blocks are independent).
fn reference_fp8(
    q: &Fp8Quantiser,
    x: &[u16],
    mats: usize,
    rows: usize,
    cols: usize,
) -> anyhow::Result<(Vec<u8>, Vec<f32>)> {
    let [bn, _] = q.encoding.block.map(|b| b as usize);
    let [sr, sc] = q
        .encoding
        .scale_shape(rows as u64, cols as u64)
        .map(|x| x as usize);
    let mut want_q = vec![0u8; mats * rows * cols];
    let mut want_s = vec![0f32; mats * sr * sc];
    // bands of whole block rows, quantised on every core
    let band = (rows.div_ceil(bn).div_ceil(super::content::threads()).max(1)) * bn;
    let mut work = Vec::new();
    for (mat, (qm, sm)) in want_q
        .chunks_mut(rows * cols)
        .zip(want_s.chunks_mut(sr * sc))
        .enumerate()
    {
        let xm = &x[mat * rows * cols..(mat + 1) * rows * cols];
        work.extend(
            xm.chunks(band * cols)
                .zip(qm.chunks_mut(band * cols))
                .zip(sm.chunks_mut(band / bn * sc)),
        );
    }
    let work = std::sync::Mutex::new(work);
    let failed = std::sync::Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..super::content::threads() {
            scope.spawn(|| {
                loop {
                    let next = work.lock().unwrap_or_else(|p| p.into_inner()).pop();
                    let Some(((xb, qb), sb)) = next else { break };
                    let r = xb.len() / cols;
                    if let Err(e) = q.quantise(xb, Shape2d::dense(r, cols), qb, cols, sb, sc) {
                        failed
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e.to_string());
                    }
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        bail!("{e}");
    }
    Ok((want_q, want_s))
}

/// Checks every e4m3 byte and scale of the FP8 tensors `fp8s` (of `lts`) against the CPU
/// reference quantiser applied to the bf16 the plan's `transfers` put in their staging.
fn verify_fp8(
    dev: &Device,
    tensors: &TensorSet,
    transfers: &[Transfer],
    fp8s: &[&LocalTensor],
    f: &InferFp8,
    content: &Content,
) -> anyhow::Result<(bool, String)> {
    let q = f.quantiser();
    let (mut e4m3, mut scales) = (0u64, 0u64);
    for t in fp8s {
        let ts: Vec<&Transfer> = transfers
            .iter()
            .filter(|x| *x.dst_tensor == *t.name)
            .collect();
        let s = t.shape.as_slice();
        let nd = s.len();
        if nd < 2 {
            bail!("FP8 tensor `{}` has shape {s:?}", t.name);
        }
        let mats = s[..nd - 2].iter().product::<u64>() as usize;
        let (rows, cols) = (s[nd - 2] as usize, s[nd - 1] as usize);
        let bf16 = expected_tensor(&ts, 2 * mats * rows * cols, content)?;
        let mut x = vec![0u16; bf16.len() / 2];
        let per = x.len().div_ceil(super::content::threads()).max(1 << 16);
        std::thread::scope(|scope| {
            for (xs, bs) in x.chunks_mut(per).zip(bf16.chunks(2 * per)) {
                scope.spawn(move || {
                    for (v, w) in xs.iter_mut().zip(bs.chunks_exact(2)) {
                        *v = u16::from_le_bytes([w[0], w[1]]);
                    }
                });
            }
        });
        drop(bf16);
        let (want_q, want_s) = reference_fp8(&q, &x, mats, rows, cols)
            .with_context(|| format!("the CPU reference refused `{}`", t.name))?;
        let scale_name = Fp8Block::scale_name(&t.name);
        let mut got_q = vec![0u8; want_q.len()];
        let mut got_s = vec![0u8; 4 * want_s.len()];
        for (name, out) in [(&*t.name, &mut got_q), (&*scale_name, &mut got_s)] {
            let v = tensors
                .get(name)
                .ok_or_else(|| anyhow!("no tensor `{name}`"))?;
            let p = v
                .device_ptr()
                .ok_or_else(|| anyhow!("`{name}` is not on the GPU"))?;
            if v.len() != out.len() {
                bail!("`{name}`: {} bytes, expected {}", v.len(), out.len());
            }
            // SAFETY: the view covers `out.len()` bytes of this rank's device memory, and the
            // update that wrote it was synchronised by `execute`.
            unsafe { dev.copy_to_host(p, out)? };
        }
        if got_q != want_q
            && let Some(i) = got_q.iter().zip(&want_q).position(|(a, b)| a != b)
        {
            return Ok((
                false,
                format!(
                    "`{}` e4m3 byte {i}: got {:#04x}, the CPU reference ({}) wants {:#04x}",
                    t.name,
                    got_q[i],
                    f.recipe.name(),
                    want_q[i]
                ),
            ));
        }
        let want_sb: Vec<u8> = want_s.iter().flat_map(|x| x.to_le_bytes()).collect();
        if got_s != want_sb
            && let Some(i) = got_s.iter().zip(&want_sb).position(|(a, b)| a != b)
        {
            return Ok((
                false,
                format!(
                    "`{scale_name}` scale {}: got {:?}, the CPU reference ({}) wants {}",
                    i / 4,
                    got_s[i / 4 * 4..i / 4 * 4 + 4]
                        .try_into()
                        .map(f32::from_le_bytes),
                    f.recipe.name(),
                    want_s[i / 4]
                ),
            ));
        }
        e4m3 += got_q.len() as u64;
        scales += want_s.len() as u64;
    }
    Ok((
        true,
        format!(
            "{} FP8 tensors: all {e4m3} e4m3 bytes and {scales} scales equal the CPU reference's ({})",
            fp8s.len(),
            f.recipe.name()
        ),
    ))
}

/// `bench ipc` (transport path): see the module doc.
pub fn run(a: IpcArgs) -> anyhow::Result<ExitCode> {
    let (_, rank) = crate::cmd::plan::parse_rank(&format!("infer:{}", a.rank))?;
    let sender_gpu = a.sender_gpu.unwrap_or(a.gpu);
    let dev = Device::open(a.gpu)?;
    let r = resolve_ipc(&a.model, &a.train, &a.infer, &a.quant)?;
    let fp8 = r.spec.infer_fp8.clone();
    if let Some(f) = &fp8 {
        awex_runtime::transport::refuse_on_gpu(f)?;
    }
    let t0 = Instant::now();
    let plan = Arc::new(r.plan_pair().plan_rank(Side::Inference, rank)?);
    let plan_ms = ms_since(t0);
    let transfers: Vec<_> = plan
        .peers
        .iter()
        .flat_map(|p| p.transfers.iter().cloned())
        .collect();
    let layout = r
        .inference
        .rank_layout(rank)
        .ok_or_else(|| anyhow!("inference side has no rank {rank}"))?;
    let tensors = Arc::new(TensorSet::allocate_cuda(&layout, &dev)?);
    let lts: Vec<LocalTensor> = tensors
        .iter()
        .map(|v| {
            layout
                .tensors
                .iter()
                .find(|t| *t.name == *v.name)
                .cloned()
                .ok_or_else(|| anyhow!("`{}` is not in the rank's layout", v.name))
        })
        .collect::<anyhow::Result<_>>()?;
    let stream = dev.stream()?;
    let poison = || -> anyhow::Result<()> {
        for v in tensors.iter() {
            if let Some(p) = v.device_ptr() {
                // SAFETY: the view covers `v.len()` bytes of this rank's own device memory;
                // nothing else uses it until the sync below. (A bf16 NaN pattern: never what
                // an update writes everywhere.)
                unsafe { dev.fill_u16(p, v.len() as u64 / 2, 0x7FC1, &stream)? };
            }
        }
        stream.sync()?;
        Ok(())
    };
    poison()?;
    let peers_wanted: Vec<RankId> = plan.peers.iter().map(|p| p.peer).collect();
    let mut proc = RanksProc::start(&a, &peers_wanted, sender_gpu)?;
    let hello: Hello = proc.recv()?;
    let peers: HashMap<RankId, serde_json::Value> = hello.ranks.iter().cloned().collect();

    let (free_before, _) = dev.mem_info()?;
    let mut least_free = free_before;
    let t_join = Instant::now();
    let settings = crate::settings::transports()?;
    let ipc = |over: Arc<TensorSet>| {
        CudaIpcTransport::new(
            plan.clone(),
            over,
            a.bucket_mib << 20,
            "-",
            &settings.cuda_ipc,
        )
    };
    let mut tr = match &fp8 {
        None => Receiver::Plain(Box::new(ipc(tensors.clone())?)),
        Some(f) => Receiver::Fp8(Box::new(EncodingTransport::on_gpu(
            &layout,
            &r.catalogue,
            &plan,
            f,
            tensors.clone(),
            settings.cuda_ipc.fuse_fp8,
            |over| Ok(Box::new(ipc(over)?) as Box<dyn Transport>),
        )?)),
    };
    if a.deltas && !tr.t().enable_deltas()? {
        bail!(
            "--deltas: this GPU's copy engine has no diff kernel (it needs the copy kernel: drop --method driver)"
        );
    }
    tr.t().connect(&peers)?;
    let join_ms = ms_since(t_join);
    least_free = least_free.min(dev.mem_info()?.0);

    let cancel = AtomicBool::new(false);
    let mut update = |version: u64, proc: &mut RanksProc| -> anyhow::Result<(f64, ExecStats)> {
        let t0 = Instant::now();
        proc.send(&ToRanks::Update { version })?;
        let ctx = ExecContext {
            version,
            attempt: 1,
            deadline: Instant::now() + UPDATE_DEADLINE,
            cancel: &cancel,
            checksums: false,
            peers: &peers,
            corrupt: false,
            bases: None,
        };
        let got = tr.t().execute(&ctx);
        let ms = ms_since(t0);
        let answer = proc.recv::<FromRanks>()?;
        let stats = got.with_context(|| format!("inference rank {rank}, version {version}"))?;
        match answer {
            FromRanks::Done {
                version: v,
                error: None,
            } if v == version => Ok((ms, stats)),
            other => bail!("the training ranks answered {other:?} to version {version}"),
        }
    };
    let (first_update_ms, _) = update(1, &mut proc)?;
    let mut content = Content {
        finite: fp8.is_some(),
        steps: Vec::new(),
        threshold: awex_gpu::cuda::delta::step_threshold(a.step.unwrap_or(0.0)),
    };
    least_free = least_free.min(dev.mem_info()?.0);
    // the FP8 tensors are checked against the CPU reference, the rest byte for byte
    let is_fp8 = |name: &str| {
        layout
            .tensors
            .iter()
            .any(|t| *t.name == *name && matches!(t.encoding, Encoding::Fp8Block(_)))
    };
    let (plain_transfers, plain_lts) = plain_part(&transfers, &lts);
    let fp8_lts: Vec<&LocalTensor> = lts
        .iter()
        .filter(|t| matches!(t.encoding, Encoding::Fp8Block(_)))
        .collect();
    let check = |content: &Content| -> anyhow::Result<(bool, String)> {
        let (ok, detail) = verify_with(
            &plain_transfers,
            &plain_lts,
            content,
            &mut |i, out: &mut [u8]| {
                let v = tensors
                    .get(&plain_lts[i].name)
                    .ok_or_else(|| anyhow!("no tensor `{}`", plain_lts[i].name))?;
                let p = v
                    .device_ptr()
                    .ok_or_else(|| anyhow!("`{}` is not on the GPU", v.name))?;
                if out.len() != v.len() {
                    bail!(
                        "`{}`: {} bytes, the layout says {}",
                        v.name,
                        v.len(),
                        out.len()
                    );
                }
                // SAFETY: the view covers `out.len()` bytes of this rank's device memory, and the
                // copies into it were synchronised by `execute`.
                unsafe { dev.copy_to_host(p, out)? };
                Ok(())
            },
        )?;
        match &fp8 {
            Some(f) if ok => {
                let (ok8, d8) = verify_fp8(&dev, &tensors, &transfers, &fp8_lts, f, content)?;
                Ok((ok8, format!("{detail}; {d8}")))
            }
            _ => Ok((ok, detail)),
        }
    };
    let (mut verified, mut detail) = if a.no_verify {
        (false, "not checked (--no-verify)".to_string())
    } else {
        check(&content)?
    };
    let mut steady = Vec::new();
    let mut steady_written = Vec::new();
    let mut delta = awex_core::encoding::DeltaStats::default();
    for v in 2..=a.updates as u64 {
        // a dense update's last run writes every byte over a poisoned receiver; a delta
        // update's is checked as it left the tensors, after every step
        if v == a.updates as u64 && !a.no_verify && !a.deltas {
            poison()?;
        }
        if let Some(fraction) = a.step {
            proc.send(&ToRanks::Step { seed: v, fraction })?;
            match proc.recv::<FromRanks>()? {
                FromRanks::Stepped { seed } if seed == v => content.steps.push(v),
                other => bail!("the training ranks answered {other:?} to step {v}"),
            }
        }
        let (ms, stats) = update(v, &mut proc)?;
        steady.push(ms);
        steady_written.push(stats.bytes);
        delta.add(&stats.delta);
        least_free = least_free.min(dev.mem_info()?.0);
    }
    if !a.no_verify {
        let (ok, d) = check(&content)?;
        if verified && !ok {
            detail = format!("last update: {d}");
        }
        verified &= ok;
    }
    let bytes = plan.bytes();
    // the kernels alone over every FP8 tensor (the staging's batch, then the fused batches out
    // of the senders' memory) as the last update left them: they write the same bytes
    let mut kernel_runs_ms = Vec::new();
    if let Receiver::Fp8(t) = &tr {
        for _ in 0..6 {
            let t0 = Instant::now();
            t.quantise_on_gpu()?;
            tr.ipc()?.quantise_fused_alone()?;
            kernel_runs_ms.push(ms_since(t0));
        }
    }
    let (staging_bytes, (fused_tensors, staged_tensors)) = match &tr {
        Receiver::Fp8(t) => (t.staging_bytes(), t.fused_and_staged()),
        Receiver::Plain(_) => (0, (0, 0)),
    };
    let (fused_blocks, fused_jobs) = tr.ipc()?.fused_fp8_stats();
    let (ipc_src, ipc_bytes) = peers_wanted
        .iter()
        .filter_map(|p| tr.ipc().ok()?.largest_mapping(*p))
        .max_by_key(|m| m.1)
        .ok_or_else(|| anyhow!("no training memory was mapped"))?;
    let fl = floors::measure(&dev, bytes, ipc_src, ipc_bytes)?;
    let join = tr.ipc()?.join_stats().clone();
    tr.t().close();
    drop(tr);
    proc.finish()?;
    let steady_median_ms = median(&steady);
    let floor_ms = fl.first().map_or(f64::NAN, |f| f.ms);
    let ipc_floor_ms = fl.get(1).map_or(f64::NAN, |f| f.ms);
    let extra = free_before.saturating_sub(least_free);
    let bucket_bytes = a.bucket_mib << 20;
    let fp8_figures = fp8.as_ref().map(|f| {
        let e4m3_bytes: u64 = fp8_lts.iter().map(|t| t.nbytes()).sum();
        let scale_bytes: u64 = layout
            .tensors
            .iter()
            .filter(|t| matches!(t.encoding, Encoding::Fp8Scales(_)))
            .map(|t| t.nbytes())
            .sum();
        let bf16_bytes: u64 = transfers
            .iter()
            .filter(|t| is_fp8(&t.dst_tensor))
            .map(Transfer::bytes)
            .sum();
        let plain_bytes = bytes - bf16_bytes;
        let kernel_ms = median(kernel_runs_ms.get(1..).unwrap_or(&[]));
        let moved = (bf16_bytes + e4m3_bytes + scale_bytes) as f64;
        let kernel_gbps = moved / kernel_ms / 1e6;
        // the local copy floor moves `bytes` read + `bytes` written in floor_ms
        let traffic = (2 * plain_bytes + bf16_bytes + e4m3_bytes + scale_bytes) as f64;
        let floor = floor_ms * traffic / (2.0 * bytes as f64);
        Fp8Figures {
            encoding: f.describe(),
            fp8_tensors: fp8_lts.len(),
            bf16_bytes,
            e4m3_bytes,
            scale_bytes,
            plain_bytes,
            staging_bytes,
            fused_tensors,
            staged_tensors,
            fused_blocks,
            fused_jobs,
            kernel_runs_ms: kernel_runs_ms.clone(),
            kernel_ms,
            kernel_gbps,
            kernel_vs_copy: kernel_gbps / fl.first().map_or(f64::NAN, |f| f.gbps),
            floor_ms: floor,
            ratio: steady_median_ms / floor,
        }
    });
    let report = Report {
        path: "transport",
        model: r.spec.model.name.clone(),
        training: r.spec.train.to_string(),
        inference: r.spec.infer.to_string(),
        rank: rank.to_string(),
        device: dev.name()?,
        driver_version: driver_version()?,
        gpu: a.gpu,
        sender_gpu,
        sender_alloc: a.sender_alloc,
        sender_allocations: hello.allocations,
        sender_tensors: hello.tensors,
        sender_fill_ms: hello.fill_ms,
        sender_export_ms: hello.export_ms,
        receiver_tensors: tensors.len(),
        bytes,
        transfers: transfers.len(),
        bucket_bytes,
        plan_ms,
        join_ms,
        join,
        first_update_ms,
        steady_median_ms,
        steady_gbps: bytes as f64 * 2.0 / steady_median_ms / 1e6,
        steady_ms: steady,
        extra_device_bytes: extra,
        extra_device_buckets: extra as f64 / bucket_bytes.max(1) as f64,
        floors: fl,
        floor_ms,
        ratio: steady_median_ms / floor_ms,
        ipc_floor_ms,
        ipc_ratio: steady_median_ms / ipc_floor_ms,
        verified,
        verify_detail: detail,
        fp8: fp8_figures,
        deltas: a.deltas,
        step: a.step,
        steady_written_bytes: steady_written,
        delta_vectors: delta.elements,
        delta_changed_vectors: delta.changed,
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    if !a.no_verify && !report.verified {
        bail!("verification failed: {}", report.verify_detail);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(r: &Report) {
    let j = &r.join;
    let n = |d: &awex_gpu::cuda::DescStats| d.linear + d.pitched_2d + d.pitched_3d;
    println!(
        "model        {}  ({} -> {}, rank {}), cuda-ipc transport",
        r.model, r.training, r.inference, r.rank
    );
    println!(
        "device       {} (driver {}.{}), GPU {} <- GPU {}",
        r.device,
        r.driver_version / 1000,
        r.driver_version % 1000 / 10,
        r.gpu,
        r.sender_gpu
    );
    println!(
        "moved        {:.2} GB in {} transfers = {} copies ({} before joining back-to-back ones)",
        r.bytes as f64 / 1e9,
        r.transfers,
        n(&j.descriptors),
        n(&j.descriptors_unjoined)
    );
    println!(
        "sender       {:?}: {} allocation(s) for {} tensors; transports built in {:.1} ms",
        r.sender_alloc, r.sender_allocations, r.sender_tensors, r.sender_export_ms
    );
    println!(
        "join         {:.1} ms  (engine {:.1} [{}], warm-up {:.1}, control {:.1}, open {} handles {:.1} on {} thread(s), events {:.1}, copies {:.1})",
        r.join_ms,
        j.engine_ms,
        j.kernel_image.as_deref().unwrap_or("driver copies"),
        j.warm_up_ms,
        j.control_ms,
        j.allocations,
        j.open_ms,
        j.open_threads,
        j.event_ms,
        j.descs_ms
    );
    println!(
        "copies       {} in CUDA graphs, {} through the driver, {} in {} tiles of the tile kernel ({:.1} MiB of tables)",
        j.graph_copies,
        j.driver_copies,
        j.tiled_copies,
        j.tiles,
        j.tile_table_bytes as f64 / (1u64 << 20) as f64
    );
    println!("first update {:.2} ms", r.first_update_ms);
    let runs: Vec<String> = r.steady_ms.iter().map(|m| format!("{m:.2}")).collect();
    println!(
        "steady       {:.2} ms median  ({:.0} GB/s read+write; runs {})",
        r.steady_median_ms,
        r.steady_gbps,
        runs.join(" ")
    );
    if r.deltas || r.step.is_some() {
        let written: u64 = r.steady_written_bytes.iter().sum();
        let steady = r.steady_written_bytes.len().max(1) as u64;
        println!(
            "deltas       {}; step {}; {:.3} GB written per steady update on average; {} of {} 16-byte vectors differed ({:.2} %)",
            if r.deltas { "on" } else { "off" },
            r.step.map_or("none".to_string(), |f| format!(
                "{:.3} % of the elements",
                f * 100.0
            )),
            written as f64 / steady as f64 / 1e9,
            r.delta_changed_vectors,
            r.delta_vectors,
            100.0 * r.delta_changed_vectors as f64 / r.delta_vectors.max(1) as f64
        );
    }
    println!(
        "memory       {:.1} MiB extra on this rank at peak ({:.2} buckets of {} MiB)",
        r.extra_device_bytes as f64 / (1u64 << 20) as f64,
        r.extra_device_buckets,
        r.bucket_bytes >> 20
    );
    for f in &r.floors {
        println!(
            "  floor      {:.2} ms  {:.0} GB/s  {}",
            f.ms, f.gbps, f.name
        );
    }
    println!(
        "ratio        {:.3} x local copy floor, {:.3} x one copy out of the sender's memory",
        r.ratio, r.ipc_ratio
    );
    if let Some(f) = &r.fp8 {
        let gb = |b: u64| b as f64 / 1e9;
        println!(
            "fp8          {}: {} tensors, {:.2} GB bf16 into staging ({:.2} GB of device memory) -> {:.2} GB e4m3 + {:.1} MB scales; {:.2} GB plain",
            f.encoding,
            f.fp8_tensors,
            gb(f.bf16_bytes),
            gb(f.staging_bytes),
            gb(f.e4m3_bytes),
            f.scale_bytes as f64 / 1e6,
            gb(f.plain_bytes)
        );
        println!(
            "  kernel     {:.2} ms alone over the staging ({:.0} GB/s read+write, {:.2} x the local device copy's rate)",
            f.kernel_ms, f.kernel_gbps, f.kernel_vs_copy
        );
        println!(
            "  floor      {:.2} ms  read the bf16 once, write e4m3 + scales once, copy the plain tensors, at the local device copy's rate",
            f.floor_ms
        );
        println!("ratio fp8    {:.3} x that floor", f.ratio);
    }
    println!("verified     {}  ({})", r.verified, r.verify_detail);
}

/// The control segment of the bench's training rank `rank` in process `pid`: named as the
/// runtime names its segments (pair `bench-{pid}`), so that `awex-cli gc` removes it when the
/// bench is killed before it could.
fn ctl_name(pid: u32, rank: u32) -> String {
    awex_runtime::shm::segment_name(
        &format!("bench-{pid}"),
        &format!("{pid:032x}"),
        &format!("t0.{rank}"),
        "ctl",
    )
}

#[cfg(test)]
mod tests {
    use super::super::content::{gen_bytes, make_finite};
    use super::*;

    #[test]
    fn a_killed_bench_s_control_segments_are_named_for_gc() {
        let n = awex_runtime::shm::parse_name(&ctl_name(4242, 3))
            .expect("gc parses the bench's control segment name");
        assert_eq!(
            (n.pair.as_str(), n.who.as_str(), n.kind.as_str()),
            ("bench-4242", "t0.3", "ctl")
        );
    }

    #[test]
    fn rank_messages_are_tagged_json_lines() {
        let mut out = Vec::new();
        send_line(&mut out, &ToRanks::Update { version: 4 }).unwrap();
        assert_eq!(out, b"{\"msg\":\"update\",\"version\":4}\n");
        let mut out = Vec::new();
        send_line(
            &mut out,
            &FromRanks::Done {
                version: 4,
                error: None,
            },
        )
        .unwrap();
        let back: FromRanks = read_line(&mut &out[..], "training ranks").unwrap();
        assert!(matches!(
            back,
            FromRanks::Done {
                version: 4,
                error: None
            }
        ));
    }

    #[test]
    fn the_banded_cpu_reference_equals_one_call_per_matrix() {
        use awex_core::encoding::Recipe;
        let q = Fp8Quantiser::new(Recipe::Vllm, Fp8Block::default());
        // 2 matrices of 300 x 260: partial blocks on both edges, several bands
        let (mats, rows, cols) = (2, 300, 260);
        let mut bytes = vec![0u8; 2 * mats * rows * cols];
        gen_bytes(7, 0, &mut bytes);
        make_finite(0, &mut bytes);
        let x: Vec<u16> = bytes
            .chunks_exact(2)
            .map(|w| u16::from_le_bytes([w[0], w[1]]))
            .collect();
        let (got_q, got_s) = reference_fp8(&q, &x, mats, rows, cols).unwrap();
        let (sr, sc) = (3, 3);
        for m in 0..mats {
            let mut wq = vec![0u8; rows * cols];
            let mut ws = vec![0f32; sr * sc];
            q.quantise(
                &x[m * rows * cols..(m + 1) * rows * cols],
                Shape2d::dense(rows, cols),
                &mut wq,
                cols,
                &mut ws,
                sc,
            )
            .unwrap();
            assert_eq!(&got_q[m * rows * cols..(m + 1) * rows * cols], &wq[..]);
            assert_eq!(&got_s[m * sr * sc..(m + 1) * sr * sc], &ws[..]);
        }
        // a NaN is refused, not quantised
        let mut bad = x.clone();
        bad[5] = 0x7fc0;
        assert!(reference_fp8(&q, &bad, mats, rows, cols).is_err());
    }

    #[test]
    fn the_byte_check_of_an_fp8_rank_covers_its_plain_tensors_whole() {
        use crate::cmd::quant::QuantArgs;
        let q = QuantArgs {
            infer_quant: Some("fp8".into()),
            fp8_block: Some("16x16".into()),
            ..QuantArgs::default()
        };
        let r = crate::cmd::plan::resolve_with("qwen3-tiny", "megatron:tp=2", "sglang:tp=1", &q)
            .unwrap();
        let rank = RankId::infer(0, 0);
        let plan = r.plan_pair().plan_rank(Side::Inference, rank).unwrap();
        let transfers: Vec<Transfer> = plan
            .peers
            .iter()
            .flat_map(|p| p.transfers.iter().cloned())
            .collect();
        let lts = r.inference.rank_layout(rank).unwrap().tensors;
        assert!(
            lts.iter()
                .any(|t| matches!(t.encoding, Encoding::Fp8Scales(_)))
        );
        let (pt, pl) = plain_part(&transfers, &lts);
        assert!(pt.len() < transfers.len() && !pt.is_empty());
        assert!(pl.iter().all(|t| matches!(t.encoding, Encoding::Plain(_))));
        let mut fetch = |i: usize, out: &mut [u8]| {
            let ts: Vec<&Transfer> = pt.iter().filter(|x| x.dst_tensor == pl[i].name).collect();
            out.copy_from_slice(&super::super::content::expected_tensor(
                &ts,
                out.len(),
                &Content::plain(true),
            )?);
            Ok(())
        };
        let (ok, detail) = verify_with(&pt, &pl, &Content::plain(true), &mut fetch).unwrap();
        assert!(ok, "{detail}");
    }

    #[test]
    fn the_bench_plans_every_fp8_block_for_the_receiver_as_cuda_ipc_copies_bytes_only() {
        use crate::cmd::quant::QuantArgs;
        let q = QuantArgs {
            infer_quant: Some("fp8".into()),
            fp8_block: Some("16x16".into()),
            ..QuantArgs::default()
        };
        let transfers = |r: &crate::cmd::plan::Resolved| -> Vec<Transfer> {
            let plan = r
                .plan_pair()
                .plan_rank(Side::Inference, RankId::infer(0, 0))
                .unwrap();
            plan.peers
                .iter()
                .flat_map(|p| p.transfers.iter().cloned())
                .collect()
        };
        let ipc =
            transfers(&resolve_ipc("qwen3-tiny", "megatron:tp=2", "sglang:tp=1", &q).unwrap());
        assert!(ipc.iter().any(|t| t.encode.is_some()));
        assert!(
            ipc.iter()
                .all(|t| !t.sender_encoded() && t.src_dtype == t.dst_dtype)
        );
        // planned as shm, the same pair's whole blocks would travel as e4m3 (which the
        // cuda-ipc copies refuse: "the CUDA path copies bytes only")
        let shm = crate::cmd::plan::resolve_with("qwen3-tiny", "megatron:tp=2", "sglang:tp=1", &q);
        assert!(transfers(&shm.unwrap()).iter().any(|t| t.sender_encoded()));
    }

    #[test]
    fn generated_bytes_key_on_rank_and_name() {
        let mut a = [0u8; 16];
        let mut b = [0u8; 16];
        gen_bytes(tensor_key(RankId::train(0), "x"), 0, &mut a);
        gen_bytes(tensor_key(RankId::train(1), "x"), 0, &mut b);
        assert_ne!(a, b);
    }
}
