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

use super::content::{par_gen, read_line, send_line, tensor_key, verify_with};
use super::floors::{self, FloorPoint};
use super::{IpcArgs, SenderAlloc, median};
use anyhow::{Context, anyhow, bail};
use awex_core::layout::{LocalTensor, RankId, Side};
use awex_gpu::cuda::{Device, DeviceBuffer, driver_version};
use awex_runtime::transport::{CudaIpcTransport, ExecContext, JoinStats, Transport};
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
    Update { version: u64 },
    Quit,
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "msg", rename_all = "lowercase")]
enum FromRanks {
    Done { version: u64, error: Option<String> },
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

/// Uploads the deterministic content of every tensor of `set` (training rank `rank`).
fn fill(dev: &Device, rank: RankId, set: &TensorSet) -> anyhow::Result<()> {
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
            // SAFETY: the view covers `v.len()` bytes of device memory on `dev`.
            unsafe { dev.copy_from_host(ptr + done as u64, &host[..n])? };
            done += n;
        }
    }
    Ok(())
}

/// The training side: holds the ranks, builds their transports, executes each version asked.
pub fn ranks(a: RanksArgs) -> anyhow::Result<ExitCode> {
    let r = crate::cmd::plan::resolve(&a.model, &a.train, &a.infer)?;
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
        fill(&dev, h.rank, &h.tensors)?;
    }
    let fill_ms = ms_since(t0);
    let t0 = Instant::now();
    let mut transports = Vec::new();
    for h in &held {
        let plan = Arc::new(r.plan_pair().plan_rank(Side::Training, h.rank)?);
        let name = format!("awex-bench-{}-train{}-ctl", std::process::id(), h.rank.rank);
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
    loop {
        match read_line::<ToRanks>(&mut input, "inference rank")? {
            ToRanks::Update { version } => {
                let ctx = ExecContext {
                    version,
                    attempt: 1,
                    deadline: Instant::now() + UPDATE_DEADLINE,
                    cancel: &cancel,
                    checksums: false,
                    peers: &no_peers,
                    corrupt: false,
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
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
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
    unix_time: u64,
}

/// `bench ipc` (transport path): see the module doc.
pub fn run(a: IpcArgs) -> anyhow::Result<ExitCode> {
    let (_, rank) = crate::cmd::plan::parse_rank(&format!("infer:{}", a.rank))?;
    let sender_gpu = a.sender_gpu.unwrap_or(a.gpu);
    let dev = Device::open(a.gpu)?;
    let r = crate::cmd::plan::resolve(&a.model, &a.train, &a.infer)?;
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
    let mut tr = CudaIpcTransport::new(
        plan.clone(),
        tensors.clone(),
        a.bucket_mib << 20,
        "-",
        &settings.cuda_ipc,
    )?;
    tr.connect(&peers)?;
    let join_ms = ms_since(t_join);
    least_free = least_free.min(dev.mem_info()?.0);

    let cancel = AtomicBool::new(false);
    let mut update = |version: u64, proc: &mut RanksProc| -> anyhow::Result<f64> {
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
        };
        let got = tr.execute(&ctx);
        let ms = ms_since(t0);
        let answer = proc.recv::<FromRanks>()?;
        got.with_context(|| format!("inference rank {rank}, version {version}"))?;
        match answer {
            FromRanks::Done {
                version: v,
                error: None,
            } if v == version => Ok(ms),
            other => bail!("the training ranks answered {other:?} to version {version}"),
        }
    };
    let first_update_ms = update(1, &mut proc)?;
    least_free = least_free.min(dev.mem_info()?.0);
    let check = || -> anyhow::Result<(bool, String)> {
        verify_with(&transfers, &lts, &mut |i, out: &mut [u8]| {
            let v = tensors
                .get(&lts[i].name)
                .ok_or_else(|| anyhow!("no tensor `{}`", lts[i].name))?;
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
        })
    };
    let (mut verified, mut detail) = if a.no_verify {
        (false, "not checked (--no-verify)".to_string())
    } else {
        check()?
    };
    let mut steady = Vec::new();
    for v in 2..=a.updates as u64 {
        if v == a.updates as u64 && !a.no_verify {
            poison()?;
        }
        steady.push(update(v, &mut proc)?);
        least_free = least_free.min(dev.mem_info()?.0);
    }
    if !a.no_verify {
        let (ok, d) = check()?;
        if verified && !ok {
            detail = format!("last update: {d}");
        }
        verified &= ok;
    }
    let bytes = plan.bytes();
    let (ipc_src, ipc_bytes) = peers_wanted
        .iter()
        .filter_map(|p| tr.largest_mapping(*p))
        .max_by_key(|m| m.1)
        .ok_or_else(|| anyhow!("no training memory was mapped"))?;
    let fl = floors::measure(&dev, bytes, ipc_src, ipc_bytes)?;
    let join = tr.join_stats().clone();
    tr.close();
    drop(tr);
    proc.finish()?;
    let steady_median_ms = median(&steady);
    let floor_ms = fl.first().map_or(f64::NAN, |f| f.ms);
    let ipc_floor_ms = fl.get(1).map_or(f64::NAN, |f| f.ms);
    let extra = free_before.saturating_sub(least_free);
    let bucket_bytes = a.bucket_mib << 20;
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
    println!("verified     {}  ({})", r.verified, r.verify_detail);
}

#[cfg(test)]
mod tests {
    use super::super::content::gen_bytes;
    use super::*;

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
    fn generated_bytes_key_on_rank_and_name() {
        let mut a = [0u8; 16];
        let mut b = [0u8; 16];
        gen_bytes(tensor_key(RankId::train(0), "x"), 0, &mut a);
        gen_bytes(tensor_key(RankId::train(1), "x"), 0, &mut b);
        assert_ne!(a, b);
    }
}
