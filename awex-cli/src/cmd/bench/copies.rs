//! `bench ipc --path copies`: the hand-built copy path (its own protocol, the stream/method
//! sweep), kept beside the product's path in [`super::transport`].
//!
//! It runs as two processes: this one is the inference rank; it starts itself again as the
//! training rank (the hidden `bench ipc-sender`). The sender allocates its rank's tensors in one
//! contiguous buffer, as Megatron's contiguous parameter buffer holds them (or, with
//! `--sender-alloc per-tensor`, one allocation per tensor, as PyTorch's caching allocator gives
//! them), fills every tensor with deterministic bytes, exports one IPC handle per allocation and
//! an inter-process "ready" event, and hands them over on its stdout. The receiver allocates its
//! own tensors one allocation each, plans its rank, opens the handles, and per update asks the
//! sender for "ready", then copies every planned box device-to-device after that event and
//! records its own "done" event, which the sender waits on before touching its weights again.
//! It verifies every destination byte after the first and the last update, and measures the
//! floors in the same run.

use super::content::{Content, par_gen, read_line, send_line, tensor_key, verify_with};
use super::floors::{self, FloorPoint};
use super::{IpcArgs, Method, Mode, SenderAlloc, SenderArgs, median};
use crate::cmd::plan::human_bytes;
use anyhow::{Context, anyhow, bail};
use awex_core::layout::{LocalTensor, RankId, Side};
use awex_core::plan::Transfer;
use awex_gpu::cuda::{
    CopyDesc, CopyEngine, CudaError, DescStats, Device, DeviceBuffer, Event, ExportedAllocation,
    IpcEventHandle, IpcExport, IpcImport, RemoteAddr, driver_version, plan_copies, split_linear,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::BufReader;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::time::Instant;

// ---------------------------------------------------------------------------------------------
// the protocol between the two processes (JSON lines)

#[derive(Serialize, Deserialize, Debug)]
struct SenderTensor {
    rank: RankId,
    name: String,
    at: RemoteAddr,
    bytes: u64,
}

#[derive(Serialize, Deserialize, Debug)]
struct Hello {
    device: String,
    allocations: Vec<ExportedAllocation>,
    tensors: Vec<SenderTensor>,
    ready: IpcEventHandle,
    alloc_ms: f64,
    fill_ms: f64,
    export_ms: f64,
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "msg", rename_all = "lowercase")]
enum ToSender {
    /// The receiver's "done" event, waited on before each "ready".
    Done { handle: IpcEventHandle },
    /// Start update `version`: record "ready" and answer.
    Update { version: u32 },
    /// Release everything and exit.
    Quit,
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "msg", rename_all = "lowercase")]
enum ToReceiver {
    Ready { version: u32 },
    Bye,
}

// ---------------------------------------------------------------------------------------------
// the sending (training) process

const ALIGN: u64 = 256;

/// One device allocation of the sender: its training rank and its tensors at byte offsets.
type SenderBuffer = (RankId, DeviceBuffer, Vec<(LocalTensor, u64)>);

pub(super) fn sender(a: SenderArgs) -> anyhow::Result<ExitCode> {
    let r = crate::cmd::plan::resolve(&a.model, &a.train, &a.infer)?;
    let ranks: Vec<RankId> = a
        .ranks
        .split(',')
        .map(|s| s.trim().parse::<u32>().map(RankId::train))
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad --ranks `{}`", a.ranks))?;
    let dev = Device::open(a.gpu)?;
    let t0 = Instant::now();
    // contiguous: one buffer per training rank, tensors at 256-byte aligned offsets;
    // per tensor: one allocation each
    let mut buffers: Vec<SenderBuffer> = Vec::new();
    for &rank in &ranks {
        let layout = r
            .training
            .rank_layout(rank)
            .ok_or_else(|| anyhow!("training side has no rank {rank}"))?;
        match a.alloc {
            SenderAlloc::Contiguous => {
                let mut off = 0u64;
                let mut placed = Vec::new();
                for t in layout.tensors {
                    let n = t.nbytes();
                    placed.push((t, off));
                    off += n.div_ceil(ALIGN) * ALIGN;
                }
                buffers.push((rank, dev.alloc(off)?, placed));
            }
            SenderAlloc::PerTensor => {
                for t in layout.tensors {
                    buffers.push((rank, dev.alloc(t.nbytes())?, vec![(t, 0)]));
                }
            }
            SenderAlloc::Expandable => {
                bail!(
                    "--sender-alloc expandable is measured on the transport path (`bench ipc` without --path copies)"
                )
            }
        }
    }
    let alloc_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t0 = Instant::now();
    let chunk = 256u64 << 20;
    let mut host = vec![0u8; chunk as usize];
    for (rank, buf, placed) in &buffers {
        for (t, off) in placed {
            let key = tensor_key(*rank, &t.name);
            let mut done = 0u64;
            while done < t.nbytes() {
                let n = chunk.min(t.nbytes() - done) as usize;
                par_gen(key, done, &mut host[..n]);
                buf.upload(off + done, &host[..n])?;
                done += n as u64;
            }
        }
    }
    drop(host);
    let fill_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t0 = Instant::now();
    let ptrs: Vec<u64> = buffers
        .iter()
        .flat_map(|(_, b, placed)| placed.iter().map(|(_, off)| b.ptr() + off))
        .collect();
    let export = IpcExport::new(&dev, &ptrs)?;
    let mut tensors = Vec::new();
    for (rank, b, placed) in &buffers {
        for (t, off) in placed {
            tensors.push(SenderTensor {
                rank: *rank,
                name: t.name.to_string(),
                at: export.locate(b.ptr() + off)?,
                bytes: t.nbytes(),
            });
        }
    }
    let stream = dev.stream()?;
    let ready = dev.event(true)?;
    ready.record(&stream)?;
    stream.sync()?;
    let hello = Hello {
        device: dev.name()?,
        allocations: export.allocations().to_vec(),
        tensors,
        ready: ready.ipc_handle()?,
        alloc_ms,
        fill_ms,
        export_ms: t0.elapsed().as_secs_f64() * 1e3,
    };
    let mut out = std::io::stdout().lock();
    send_line(&mut out, &hello)?;
    let mut input = std::io::stdin().lock();
    let mut peer_done: Option<Event> = None;
    loop {
        match read_line::<ToSender>(&mut input, "receiver")? {
            ToSender::Done { handle } => peer_done = Some(dev.open_event(&handle)?),
            ToSender::Update { version } => {
                // the training step would run here; it must not start before the last pull ended
                if let Some(e) = &peer_done {
                    stream.wait(e)?;
                }
                ready.record(&stream)?;
                send_line(&mut out, &ToReceiver::Ready { version })?;
            }
            ToSender::Quit => {
                stream.sync()?;
                drop(peer_done);
                drop(ready);
                drop(export);
                drop(buffers);
                send_line(&mut out, &ToReceiver::Bye)?;
                return Ok(ExitCode::SUCCESS);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// the receiving (inference) process

/// The sender process, killed if the receiver stops early.
struct SenderProc {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl SenderProc {
    fn start(a: &IpcArgs, ranks: &[RankId], gpu: u32) -> anyhow::Result<Self> {
        let exe =
            std::env::current_exe().context("cannot find this executable to start the sender")?;
        let ranks: Vec<String> = ranks.iter().map(|r| r.rank.to_string()).collect();
        let mut child = Command::new(exe)
            .args([
                "bench",
                "ipc-sender",
                "--model",
                &a.model,
                "--train",
                &a.train,
            ])
            .args(["--infer", &a.infer, "--ranks", &ranks.join(","), "--gpu"])
            .arg(gpu.to_string())
            .arg("--alloc")
            .arg(match a.sender_alloc {
                SenderAlloc::Contiguous => "contiguous",
                SenderAlloc::PerTensor => "per-tensor",
                SenderAlloc::Expandable => "expandable",
            })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the sender process")?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            bail!("the sender process has no pipes");
        };
        Ok(SenderProc {
            child,
            stdin,
            stdout: BufReader::new(stdout),
        })
    }

    fn send(&mut self, m: &ToSender) -> anyhow::Result<()> {
        send_line(&mut self.stdin, m)
    }

    fn recv<T: for<'de> Deserialize<'de>>(&mut self) -> anyhow::Result<T> {
        read_line(&mut self.stdout, "sender")
    }

    fn finish(mut self) -> anyhow::Result<()> {
        self.send(&ToSender::Quit)?;
        match self.recv::<ToReceiver>()? {
            ToReceiver::Bye => {}
            other => bail!("sender answered {other:?} to quit"),
        }
        let status = self.child.wait()?;
        if !status.success() {
            bail!("the sender exited with {status}");
        }
        Ok(())
    }
}

impl Drop for SenderProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One timed configuration of the sweep.
#[derive(Serialize, Debug)]
struct SweepPoint {
    streams: usize,
    mode: Mode,
    method: Method,
    coalesced: bool,
    split_mb: u64,
    median_ms: f64,
    runs_ms: Vec<f64>,
}

/// Sender-side figures.
#[derive(Serialize, Debug)]
struct SenderReport {
    device: String,
    alloc: SenderAlloc,
    allocations: usize,
    tensors: usize,
    alloc_ms: f64,
    fill_ms: f64,
    export_ms: f64,
}

/// Everything `bench ipc --json` prints.
#[derive(Serialize, Debug)]
struct IpcReport {
    model: String,
    training: String,
    inference: String,
    rank: String,
    device: String,
    driver_version: i32,
    receiver_gpu: u32,
    sender_gpu: u32,
    bytes: u64,
    transfers: usize,
    descriptors: DescStats,
    uncoalesced: DescStats,
    coalesced: bool,
    split_mb: u64,
    streams: usize,
    mode: Mode,
    method: Method,
    sender: SenderReport,
    receiver_tensors: usize,
    plan_ms: f64,
    open_ms: f64,
    descs_ms: f64,
    first_copy_ms: f64,
    first_update_ms: f64,
    steady_ms: Vec<f64>,
    steady_median_ms: f64,
    steady_gbps: f64,
    floor_ms: f64,
    floor_runs_ms: Vec<f64>,
    floor_gbps: f64,
    floors: Vec<FloorPoint>,
    ipc_floor_ms: f64,
    ipc_ratio: f64,
    ratio: f64,
    verified: bool,
    verify_detail: String,
    verify_ms: f64,
    sweep: Vec<SweepPoint>,
    unix_time: u64,
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// One update: ask for "ready", copy after it on the device, record "done", wait for the end.
fn one_update(
    sender: &mut SenderProc,
    version: u32,
    engine: &CopyEngine,
    work: &Work,
    ready: &Event,
    done: &Event,
) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    sender.send(&ToSender::Update { version })?;
    match sender.recv::<ToReceiver>()? {
        ToReceiver::Ready { version: v } if v == version => {}
        other => bail!("sender answered {other:?} to update {version}"),
    }
    match work {
        // SAFETY: the descriptors were built from the plan over the sender's mapped allocations
        // (bounds-checked by `IpcImport::ptr`) and this process's own buffers, all alive until
        // the sync below.
        Work::Launch(descs) => unsafe { engine.launch(descs, Some(ready), Some(done))? },
        // SAFETY: as above, for the captured descriptors.
        Work::Graph(g) => unsafe { engine.replay(g, Some(ready), Some(done))? },
    }
    engine.sync()?;
    Ok(ms_since(t0))
}

enum Work<'a> {
    Launch(&'a [CopyDesc]),
    Graph(awex_gpu::cuda::CopyGraph),
}

/// The receiver's tensors: one device allocation each.
struct DstTensors {
    tensors: Vec<(LocalTensor, DeviceBuffer)>,
    by_name: HashMap<String, usize>,
}

impl DstTensors {
    fn poison(&self, engine: &CopyEngine) -> anyhow::Result<()> {
        for (_, b) in &self.tensors {
            // a bf16 NaN pattern: never what a real update writes everywhere
            b.fill_u16(0x7FC1, engine.main_stream())?;
        }
        engine.sync()?;
        Ok(())
    }
}

/// Checks every destination byte the plan writes against the sender's deterministic content.
fn verify(transfers: &[Transfer], dst: &DstTensors) -> anyhow::Result<(bool, String)> {
    let tensors: Vec<LocalTensor> = dst.tensors.iter().map(|(t, _)| t.clone()).collect();
    verify_with(
        transfers,
        &tensors,
        &Content::plain(false),
        &mut |i, out: &mut [u8]| {
            dst.tensors[i].1.download(0, out)?;
            Ok(())
        },
    )
}

pub(super) fn ipc(a: IpcArgs) -> anyhow::Result<ExitCode> {
    if a.quant.infer_quant.is_some() || a.quant.infer_config.is_some() {
        bail!("an FP8 inference side is benchmarked on the transport path: drop --path copies");
    }
    let (_, rank) = crate::cmd::plan::parse_rank(&format!("infer:{}", a.rank))?;
    let sender_gpu = a.sender_gpu.unwrap_or(a.gpu);
    let dev = Device::open(a.gpu)?;
    let device = dev.name()?;
    let r = crate::cmd::plan::resolve(&a.model, &a.train, &a.infer)?;
    let t0 = Instant::now();
    let plan = r.plan_pair().plan_rank(Side::Inference, rank)?;
    let plan_ms = ms_since(t0);
    let transfers: Vec<Transfer> = plan
        .peers
        .iter()
        .flat_map(|p| p.transfers.iter().cloned())
        .collect();
    if let Some(t) = transfers.iter().find(|t| t.converts()) {
        bail!(
            "`{}` converts {} to {}; bench ipc copies bytes only: give both sides the same dtype",
            t.dst_tensor,
            t.src_dtype,
            t.dst_dtype
        );
    }
    let ranks: Vec<RankId> = plan.peers.iter().map(|p| p.peer).collect();
    let bytes = plan.bytes();
    let layout = r
        .inference
        .rank_layout(rank)
        .ok_or_else(|| anyhow!("inference side has no rank {rank}"))?;
    let mut dst = DstTensors {
        tensors: Vec::new(),
        by_name: HashMap::new(),
    };
    for t in layout.tensors {
        let b = dev.alloc(t.nbytes())?;
        dst.by_name.insert(t.name.to_string(), dst.tensors.len());
        dst.tensors.push((t, b));
    }
    let engine = CopyEngine::with_method(&dev, a.streams, a.method.into())?;
    dst.poison(&engine)?;

    let mut sender = SenderProc::start(&a, &ranks, sender_gpu)?;
    let hello: Hello = sender.recv()?;
    let done = dev.event(true)?;
    sender.send(&ToSender::Done {
        handle: done.ipc_handle()?,
    })?;
    let remote: HashMap<(RankId, &str), &SenderTensor> = hello
        .tensors
        .iter()
        .map(|t| ((t.rank, t.name.as_str()), t))
        .collect();

    // first update: open the handles and the event, build the copies, run them
    let t_first = Instant::now();
    let import = IpcImport::open(&dev, &hello.allocations)?;
    let ready = dev.open_event(&hello.ready)?;
    let open_ms = ms_since(t_first);
    let t0 = Instant::now();
    let addr = |t: &Transfer| {
        let src =
            remote
                .get(&(t.src_rank, &*t.src_tensor))
                .ok_or_else(|| CudaError::MissingTensor {
                    holder: format!("training rank {}", t.src_rank),
                    tensor: t.src_tensor.to_string(),
                })?;
        let dst_i = dst
            .by_name
            .get(&*t.dst_tensor)
            .ok_or_else(|| CudaError::MissingTensor {
                holder: "this inference rank".into(),
                tensor: t.dst_tensor.to_string(),
            })?;
        Ok((import.ptr(src.at, src.bytes)?, dst.tensors[*dst_i].1.ptr()))
    };
    let raw_descs = plan_copies(&transfers, false, addr)?;
    let merged = plan_copies(&transfers, true, addr)?;
    let chosen = split_linear(
        if a.no_coalesce { &raw_descs } else { &merged },
        a.split_mb << 20,
    );
    let descs: &[CopyDesc] = &chosen;
    let descs_ms = ms_since(t0);
    let work = match a.mode {
        Mode::Launch => Work::Launch(descs),
        // SAFETY: every replay goes through `one_update` (see there).
        Mode::Graph => Work::Graph(unsafe { engine.capture(descs)? }),
    };
    let first_copy_ms = one_update(&mut sender, 1, &engine, &work, &ready, &done)?;
    let first_update_ms = ms_since(t_first);

    let verify_on = !a.no_verify;
    let t0 = Instant::now();
    let (mut verified, mut detail) = if verify_on {
        verify(&transfers, &dst)?
    } else {
        (false, "not checked (--no-verify)".to_string())
    };
    let mut verify_ms = ms_since(t0);

    let mut steady = Vec::new();
    for v in 2..=a.updates {
        if v == a.updates && verify_on {
            dst.poison(&engine)?;
        }
        steady.push(one_update(&mut sender, v, &engine, &work, &ready, &done)?);
    }
    if verify_on {
        let t0 = Instant::now();
        let (ok, d) = verify(&transfers, &dst)?;
        verify_ms += ms_since(t0);
        if verified && !ok {
            detail = format!("last update: {d}");
        }
        verified &= ok;
    }
    drop(work);

    let mut sweep = Vec::new();
    let mut version = a.updates;
    if a.sweep {
        use Method::{Driver, Kernel};
        for (streams, mode, method, coalesced, split_mb) in [
            (4, Mode::Launch, Driver, true, 0),
            (8, Mode::Launch, Driver, false, 0),
            (4, Mode::Launch, Kernel, true, 0),
            (4, Mode::Launch, Kernel, true, 64),
            (4, Mode::Launch, Kernel, true, 128),
            (4, Mode::Launch, Kernel, true, 256),
            (4, Mode::Launch, Kernel, true, 512),
            (2, Mode::Launch, Kernel, true, 128),
            (2, Mode::Launch, Kernel, true, 256),
            (8, Mode::Launch, Kernel, true, 128),
            (8, Mode::Launch, Kernel, true, 256),
            (4, Mode::Graph, Kernel, true, 256),
        ] {
            let e = CopyEngine::with_method(&dev, streams, method.into())?;
            let d = split_linear(if coalesced { &merged } else { &raw_descs }, split_mb << 20);
            let w = match mode {
                Mode::Launch => Work::Launch(&d),
                // SAFETY: as above.
                Mode::Graph => Work::Graph(unsafe { e.capture(&d)? }),
            };
            let mut runs = Vec::new();
            for _ in 0..6 {
                version += 1;
                runs.push(one_update(&mut sender, version, &e, &w, &ready, &done)?);
            }
            // the first run of a configuration warms it up
            sweep.push(SweepPoint {
                streams,
                mode,
                method,
                coalesced,
                split_mb,
                median_ms: median(&runs[1..]),
                runs_ms: runs,
            });
        }
    }

    // the floor: one large copy of the same byte count, local to local; beside it, copies out of
    // the sender's largest allocation (times scaled to the same bytes) and the copy kernel
    let floor_bytes = hello
        .allocations
        .iter()
        .map(|x| x.size)
        .max()
        .ok_or_else(|| anyhow!("the sender exported no allocation"))?
        .min(bytes);
    let biggest = hello
        .allocations
        .iter()
        .position(|x| x.size >= floor_bytes)
        .unwrap_or(0);
    let ipc_src = import.ptr(
        RemoteAddr {
            allocation: biggest as u32,
            offset: 0,
        },
        floor_bytes,
    )?;
    let floors = floors::measure(&dev, bytes, ipc_src, floor_bytes)?;
    let floor_ms = floors[0].ms;
    let floor_runs = floors[0].runs_ms.clone();
    let ipc_floor_ms = floors[1].ms;
    drop(import);
    drop(ready);
    sender.finish()?;

    let steady_median_ms = median(&steady);
    let report = IpcReport {
        model: r.spec.model.name.clone(),
        training: r.spec.train.to_string(),
        inference: r.spec.infer.to_string(),
        rank: rank.to_string(),
        device,
        driver_version: driver_version()?,
        receiver_gpu: a.gpu,
        sender_gpu,
        bytes,
        transfers: transfers.len(),
        descriptors: DescStats::of(descs),
        uncoalesced: DescStats::of(&raw_descs),
        coalesced: !a.no_coalesce,
        split_mb: a.split_mb,
        streams: a.streams,
        mode: a.mode,
        method: a.method,
        sender: SenderReport {
            device: hello.device,
            alloc: a.sender_alloc,
            allocations: hello.allocations.len(),
            tensors: hello.tensors.len(),
            alloc_ms: hello.alloc_ms,
            fill_ms: hello.fill_ms,
            export_ms: hello.export_ms,
        },
        receiver_tensors: dst.tensors.len(),
        plan_ms,
        open_ms,
        descs_ms,
        first_copy_ms,
        first_update_ms,
        steady_gbps: bytes as f64 * 2.0 / steady_median_ms / 1e6,
        steady_median_ms,
        steady_ms: steady,
        floor_gbps: bytes as f64 * 2.0 / floor_ms / 1e6,
        floor_ms,
        floor_runs_ms: floor_runs,
        floors,
        ratio: steady_median_ms / floor_ms,
        ipc_floor_ms,
        ipc_ratio: steady_median_ms / ipc_floor_ms,
        verified,
        verify_detail: detail,
        verify_ms,
        sweep,
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    if verify_on && !report.verified {
        bail!("verification failed: {}", report.verify_detail);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_table(r: &IpcReport) {
    println!(
        "model        {}  ({} -> {}, rank {})",
        r.model, r.training, r.inference, r.rank
    );
    println!(
        "device       {} (driver {}.{}), receiver GPU {}, sender GPU {}",
        r.device,
        r.driver_version / 1000,
        r.driver_version % 1000 / 10,
        r.receiver_gpu,
        r.sender_gpu
    );
    let n = |d: &DescStats| d.linear + d.pitched_2d + d.pitched_3d;
    println!(
        "moved        {} in {} transfers = {} copies ({} linear, {} 2-D, {} 3-D; {} before merging); {} streams, {:?}",
        human_bytes(r.bytes as f64),
        r.transfers,
        n(&r.descriptors),
        r.descriptors.linear,
        r.descriptors.pitched_2d,
        r.descriptors.pitched_3d,
        n(&r.uncoalesced),
        r.streams,
        r.mode
    );
    println!(
        "sender       {} allocation(s) for {} tensors; fill {:.0} ms, export {:.1} ms",
        r.sender.allocations, r.sender.tensors, r.sender.fill_ms, r.sender.export_ms
    );
    println!(
        "first update {:.1} ms  (open handles {:.1} ms, build copies {:.1} ms, copy {:.1} ms; plan {:.1} ms before)",
        r.first_update_ms, r.open_ms, r.descs_ms, r.first_copy_ms, r.plan_ms
    );
    let runs: Vec<String> = r.steady_ms.iter().map(|m| format!("{m:.2}")).collect();
    println!(
        "steady       {:.2} ms median  ({:.0} GB/s read+write; runs {})",
        r.steady_median_ms,
        r.steady_gbps,
        runs.join(" ")
    );
    println!(
        "floor        {:.2} ms  (one cuMemcpyDtoD of the same bytes, {:.0} GB/s read+write)",
        r.floor_ms, r.floor_gbps
    );
    for f in &r.floors {
        println!(
            "  floor      {:.2} ms  {:.0} GB/s  {}",
            f.ms, f.gbps, f.name
        );
    }
    println!(
        "ratio        {:.2} x floor  ({:.2} x one copy out of the sender's memory)",
        r.ratio, r.ipc_ratio
    );
    println!(
        "verified     {}  ({}; {:.0} ms)",
        r.verified, r.verify_detail, r.verify_ms
    );
    for p in &r.sweep {
        println!(
            "sweep        {} streams {:?} {:?}{}, split {} MiB: {:.2} ms median",
            p.streams,
            p.mode,
            p.method,
            if p.coalesced { "" } else { " (unmerged)" },
            p.split_mb,
            p.median_ms
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_messages_are_tagged_json_lines() {
        let mut out = Vec::new();
        send_line(&mut out, &ToSender::Update { version: 3 }).unwrap();
        assert_eq!(out, b"{\"msg\":\"update\",\"version\":3}\n");
        let back: ToSender = read_line(&mut &out[..], "receiver").unwrap();
        assert!(matches!(back, ToSender::Update { version: 3 }));
        let e = read_line::<ToReceiver>(&mut &b""[..], "sender").unwrap_err();
        assert_eq!(
            e.to_string(),
            "the sender closed its pipe (it exited; see its error above)"
        );
    }
}
