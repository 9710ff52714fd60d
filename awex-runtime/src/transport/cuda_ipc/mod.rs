//! The `cuda-ipc` transport: inference ranks copy their boxes straight out of the training
//! rank's GPU memory, device to device, through CUDA IPC (one copy, no host staging).
//!
//! The protocol is the `shm` transport's, with the bytes on the GPU:
//!
//! - a training rank exports one IPC handle per allocation behind its tensors, once, and
//!   publishes them in a host shared-memory control segment: a header (ready version, done
//!   count), the allocations' handles and sizes, a table of its tensors (allocation, offset,
//!   length), its peers' bucket ranges and per-bucket checksums. Its rendezvous value names
//!   the segment and carries its inter-process "ready" event. (The handles live in the segment
//!   rather than in the rendezvous value because the gateway caps a rank's info at 64 KiB:
//!   qwen3-8b's 291 tensors are 37 KB of handles as hex already.) Per update it records the
//!   event, publishes `ready = (version, attempt)`, and waits until every peer counted itself
//!   done;
//! - an inference rank opens every peer's handles and event once (in `connect`), turns its
//!   planned transfers into device copy descriptors once, and per update waits for `ready`,
//!   makes its copy streams wait on the peer's event, issues the copies with the copy engine,
//!   synchronises, verifies checksums if asked, and counts itself done.
//!
//! A receiver captures a peer's copies into one CUDA graph at join. In it, every copy the copy
//! kernel takes is moved by one launch of the tile kernel (`awex_gpu::cuda::tiles`: the copies
//! cut into 64 KiB tiles in source order, taken by the blocks from a counter), and the copies
//! that go through the driver's device copy run beside it on the other streams. On an H200
//! that read qwen3-8b out of Megatron's one contiguous buffer at 0.985-0.996 x the driver's
//! own copy of that buffer, against 1.010-1.011 x with a launch per copy (`docs/benchmarks.md`,
//! 2026-12-01 20:39 UTC). `AWEX_IPC_KERNEL=copies` launches per copy; a batch whose tile table
//! would pass 16 MiB is launched per copy too.
//!
//! The copies move bytes only; the boxes that convert dtypes (bf16 or f16 to and from f32: a
//! trainer's bf16 `A_log` into the engines' fp32, an fp32 router into a bf16 gate) go to the
//! element-wise kernel with the transposed ones (`awex_gpu::cuda::transpose`), which converts
//! exactly as the CPU transports do; a plan with any other conversion is refused when the
//! transport is built. Checksums are computed on the host (both ends copy their tensors to a
//! host staging set and hash the planned buckets as the other transports do): slow, for
//! verification runs.

mod control;
mod fused;

pub use fused::{Fp8Target, fusable, fused_jobs, join_jobs};

use super::config::{CudaIpcConfig, DriverMin, PeerOrder};
use super::control::NONE;
use super::{ExecContext, ExecStats, Transport};
use crate::bucket::{Bucket, hash_destination, make_buckets, pack, piece_box};
use crate::tensors::{Location, TensorSet, cuda_err};
use crate::{PlacementError, RuntimeError, TransportError};
use awex_core::dtype::DType;
use awex_core::encoding::{Fp8Block, Recipe};
use awex_core::layout::{LocalTensor, RankId, RankLayout, Side};
use awex_core::plan::{RankPlan, Transfer};
use awex_gpu::cuda::transpose::{
    TransposeBatch, TransposeKernel, conversion, convert_jobs, transpose_jobs,
};
use awex_gpu::cuda::{
    CopyDesc, CopyEngine, CopyGraph, CudaError, DescStats, Device, Event, Fp8Batch, Fp8Kernel,
    IpcEventHandle, IpcExport, IpcImport, Stream, merge_contiguous, plan_copies, split_linear,
};
use control::{Control, PeerEntry, Published, TensorEntry};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Spins on `ready()` for up to [`SPIN`] (yielding the core between looks), then waits as
/// [`ExecContext::wait_until`] does. A colocated update lasts milliseconds: the sleeps of the
/// generic back-off (up to 1 ms each) would add a good part of one to every update.
fn wait_fast(ctx: &ExecContext<'_>, mut ready: impl FnMut() -> bool) -> Result<(), RuntimeError> {
    let until = Instant::now() + SPIN;
    while Instant::now() < until {
        if ready() {
            return Ok(());
        }
        std::thread::yield_now();
    }
    ctx.wait_until(ready)
}

/// How long [`wait_fast`] spins before it sleeps between looks.
const SPIN: std::time::Duration = std::time::Duration::from_millis(50);

/// Which of a peer's linear copies go through the driver's device copy (`cuMemcpyDtoDAsync`)
/// instead of awex's copy kernel: those of at least the returned bytes (`None`: none).
///
/// Measured on an H200 (`docs/benchmarks.md`, 2026-12-01): out of allocations of up to a few GB
/// (PyTorch's per-tensor allocations) the driver's copy is about 6 % faster than the kernel on
/// large blocks, so linear copies of at least [`DRIVER_MIN_BYTES`] go through it. Smaller ones
/// are faster through the kernel when there are thousands of them (one tile kernel moves them
/// all, while each driver copy is one node of the graph): qwen3-30b-a3b's 3 MiB experts, and a
/// Qwen3.5-MoE shape's 5,400 4 MiB fp32 experts, 19.80 ms through the driver against 19.10 ms
/// through the kernel (H100, 2026-12-06; 16 MiB is above every expert of the presets and
/// below every tensor the driver won on). Out of one very
/// large mapping (Megatron's contiguous buffer, 16 GB, opened through one legacy IPC handle)
/// the driver reads about 25 % slower than local memory while the kernel, cut into pieces, does
/// not, so the kernel keeps those. Spans of `cuMemMap` chunks (PyTorch's expandable segments)
/// do not count: out of a 16 GB span the driver read at local speed, and sending the large
/// copies through it took qwen3-8b from 8.68 to 8.17 ms and qwen3-30b-a3b from 31.17 to 29.20
/// ms (2026-12-01, 00:33 UTC). `AWEX_IPC_DRIVER_MIN_MIB` (a size in MiB, or `off`) overrides the
/// choice for every peer, for measuring alternatives ([`DriverMin`]).
fn driver_min(largest_allocation: u64, setting: DriverMin) -> Option<u64> {
    match setting {
        DriverMin::Off => None,
        DriverMin::AtLeast(bytes) => Some(bytes),
        DriverMin::Auto => {
            (largest_allocation <= DRIVER_MAX_ALLOCATION).then_some(DRIVER_MIN_BYTES)
        }
    }
}

/// The smallest linear copy [`driver_min`] sends through the driver by default.
const DRIVER_MIN_BYTES: u64 = 16 << 20;

/// The largest source allocation [`driver_min`] sends through the driver by default.
const DRIVER_MAX_ALLOCATION: u64 = 4 << 30;

/// Where an inference rank's join went (milliseconds; everything before its first update).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct JoinStats {
    /// Creating the copy engine: streams, events, loading the copy kernel.
    pub engine_ms: f64,
    /// Which image the copy kernel loaded from ("cubin sm_90", "ptx"), if the engine has one.
    pub kernel_image: Option<String>,
    /// One small copy on every stream, so that the first update pays for no lazy loading.
    pub warm_up_ms: f64,
    /// Opening the peers' control segments.
    pub control_ms: f64,
    /// Opening the peers' IPC memory handles.
    pub open_ms: f64,
    /// Threads that opened them.
    pub open_threads: usize,
    /// Allocations opened (all peers).
    pub allocations: usize,
    /// Opening the peers' events.
    pub event_ms: f64,
    /// Turning the plan into copy descriptors.
    pub descs_ms: f64,
    /// The copies per update, as issued (all peers).
    pub descriptors: DescStats,
    /// The copies before back-to-back ones were joined across tensors.
    pub descriptors_unjoined: DescStats,
    /// Copies captured into CUDA graphs (replayed with one launch per peer and update).
    pub graph_copies: usize,
    /// Copies that go through the driver's device copy rather than the copy kernel.
    pub driver_copies: usize,
    /// Of the graphs' copies, those moved by one launch of the tile kernel per graph (the
    /// default; none with `AWEX_IPC_KERNEL=copies` or a table over the bound).
    pub tiled_copies: usize,
    /// Tiles of those launches.
    pub tiles: usize,
    /// Device memory of their tile tables.
    pub tile_table_bytes: u64,
}

fn name_hash(name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn add_stats(a: &mut DescStats, b: &DescStats) {
    a.linear += b.linear;
    a.pitched_2d += b.pitched_2d;
    a.pitched_3d += b.pitched_3d;
    a.bytes += b.bytes;
}

fn peer_key(r: RankId) -> u64 {
    ((r.engine as u64) << 32) | r.rank as u64
}

fn transport_err(what: &str) -> impl Fn(CudaError) -> RuntimeError + '_ {
    move |e| match e {
        CudaError::NotBuilt
        | CudaError::NoDriver { .. }
        | CudaError::NoGpu { .. }
        | CudaError::OldDriver { .. }
        | CudaError::NoSuchDevice { .. } => cuda_err(what, e),
        e => TransportError::Cuda {
            what: what.to_string(),
            source: e,
        }
        .into(),
    }
}

/// Refuses a plan with a conversion the GPU does not make ([`Conversion::of`]: bf16 and f16
/// to and from f32 only).
pub(crate) fn refuse_conversions(plan: &RankPlan) -> Result<(), RuntimeError> {
    plan.peers
        .iter()
        .flat_map(|p| &p.transfers)
        .try_for_each(|t| conversion(t).map(drop))
        .map_err(|e| cuda_err("the cuda-ipc copies", e))
}

/// The training rank's side: its export, its event and its control segment.
struct Sender {
    ctl: Control,
    /// Kept for the life of the transport: its handles were published once.
    _export: IpcExport,
    /// The socket serving the descriptors of its `cuMemMap` spans, if it has any.
    fd_socket: Option<std::path::PathBuf>,
    stream: Stream,
    ready: Event,
    ready_handle: IpcEventHandle,
}

/// A training peer as one inference rank sees it.
struct Remote {
    ctl_name: String,
    ctl: Control,
    event: Event,
    descs: Vec<CopyDesc>,
    /// the copies captured into a CUDA graph, replayed with one launch per update, when they
    /// are many ([`CudaIpcConfig::graph_min`]); dropped before the mappings (field order)
    graph: Option<CopyGraph>,
    /// which linear copies go through the driver (see [`driver_min`]), set on the engine
    /// before this peer's copies are captured or queued
    driver_min: Option<u64>,
    /// the FP8 blocks quantised straight out of this peer's memory (see [`FusedFp8`])
    fp8: Option<RemoteFp8>,
    /// the boxes this rank stores transposed, moved by the transpose kernel after the copies
    transposes: Option<TransposeBatch>,
    /// first checksum index of this receiver's buckets
    sums_at: u64,
    /// what opening this peer cost
    stats: JoinStats,
    /// Mapped allocations, closed on drop (after the copies that read them were synchronised,
    /// and after the graph that holds their addresses is destroyed: fields drop in order).
    _import: IpcImport,
}

/// The FP8 tensors an inference rank quantises straight out of its training peers' memory:
/// every transfer into them covers whole blocks ([`fusable`]), so the kernel reads the
/// sender's bf16 where it lies and writes the engine's e4m3 bytes and scales, with no staging
/// and no second pass (set with [`CudaIpcTransport::fuse_fp8`] before the rank connects).
pub struct FusedFp8 {
    /// the quantiser's recipe
    pub recipe: Recipe,
    /// the tensors' encoding
    pub encoding: Fp8Block,
    /// the engine tensors, by name
    pub targets: HashMap<Arc<str>, Fp8Target>,
}

/// The fused FP8 state of an inference rank: its configuration, kernel and stream, and the
/// bf16 scratch a checksummed update copies the fused boxes into (allocated on first use).
struct Fused {
    cfg: FusedFp8,
    kernel: Fp8Kernel,
    stream: Stream,
    verify: Option<Verify>,
}

/// What a checksummed update of fused tensors hashes: the receiver's tensors with a bf16
/// scratch (device) in place of each fused tensor, and its host mirror.
struct Verify {
    /// device views: the scratch for fused tensors, the rank's own tensors for the rest
    device: TensorSet,
    host: TensorSet,
    /// owns the scratch's device memory
    _scratch: TensorSet,
}

/// One peer's fused FP8 work: the kernel's batch over its memory and what to name.
struct RemoteFp8 {
    batch: Fp8Batch,
    /// the engine tensor of each job of the batch
    names: Vec<Arc<str>>,
    /// the fused transfers and their source tensors' addresses here, for verification
    transfers: Vec<Transfer>,
    srcs: Vec<u64>,
    /// copies of the fused boxes into the verification scratch (built on first use)
    verify: Option<Vec<CopyDesc>>,
}

/// CUDA IPC transport for one rank whose tensors live on a GPU.
pub struct CudaIpcTransport {
    side: Side,
    me: RankId,
    plan: Arc<RankPlan>,
    buckets: Vec<Vec<Bucket>>,
    tensors: Arc<TensorSet>,
    dev: Device,
    sender: Option<Sender>,
    engine: Option<CopyEngine>,
    remotes: HashMap<RankId, Remote>,
    /// Host copy of the tensors, for checksums (allocated on first use).
    staging: Option<TensorSet>,
    scratch: Vec<u8>,
    join: JoinStats,
    /// The receivers' copy settings.
    cfg: CudaIpcConfig,
    /// FP8 tensors quantised out of the senders' memory (inference ranks of an FP8 pair)
    fused: Option<Fused>,
    /// Delta updates ([`Transport::enable_deltas`]): an inference rank's graphs write only the
    /// 16-byte vectors that differ from what its tensors hold.
    deltas: bool,
    /// The transpose kernel (inference ranks whose plan writes boxes transposed).
    transpose: Option<TransposeKernel>,
}

impl CudaIpcTransport {
    /// A transport for one rank whose tensors live on one GPU (`TensorSet::allocate_cuda`, or
    /// registered device views). A training rank exports its allocations and creates its
    /// control segment `ctl_name` here; a plan that converts dtypes is refused.
    pub fn new(
        plan: Arc<RankPlan>,
        tensors: Arc<TensorSet>,
        bucket_bytes: u64,
        ctl_name: &str,
        cfg: &CudaIpcConfig,
    ) -> Result<Self, RuntimeError> {
        refuse_conversions(&plan)?;
        if tensors.location()? == Location::Host && !tensors.is_empty() {
            return Err(PlacementError::HostTensors.into());
        }
        let dev = tensors.cuda_device()?;
        let buckets = plan
            .peers
            .iter()
            .map(|p| make_buckets(&p.transfers, bucket_bytes))
            .collect();
        let mut t = CudaIpcTransport {
            side: plan.side,
            me: plan.rank,
            plan,
            buckets,
            tensors,
            dev,
            sender: None,
            engine: None,
            remotes: HashMap::new(),
            staging: None,
            scratch: Vec::new(),
            join: JoinStats::default(),
            cfg: cfg.clone(),
            fused: None,
            deltas: false,
            transpose: None,
        };
        match t.side {
            Side::Training => t.sender = Some(t.export(ctl_name)?),
            Side::Inference => {
                let t0 = Instant::now();
                let streams = t.cfg.streams.clamp(1, 32);
                let engine = CopyEngine::with_method(&t.dev, streams, t.cfg.copy)
                    .or_else(|_| CopyEngine::new(&t.dev, streams))
                    .map_err(transport_err("creating the copy engine"))?;
                engine.set_order(t.cfg.order);
                engine.set_tiles(t.cfg.tiles);
                t.join.engine_ms = ms_since(t0);
                t.join.kernel_image = engine.kernel_image().map(str::to_string);
                let t0 = Instant::now();
                engine
                    .warm_up()
                    .map_err(transport_err("warming up the copy engine"))?;
                t.join.warm_up_ms = ms_since(t0);
                t.engine = Some(engine);
                let element_wise = t.plan.first_transposed().is_some()
                    || t.plan
                        .peers
                        .iter()
                        .flat_map(|p| &p.transfers)
                        .any(|x| x.converts());
                if element_wise {
                    t.transpose = Some(
                        TransposeKernel::load(&t.dev)
                            .map_err(transport_err("loading the transpose kernel"))?,
                    );
                }
            }
        }
        Ok(t)
    }

    /// Makes this inference rank quantise the FP8 tensors of `fp8` straight out of its
    /// training peers' memory (before it connects): every planned transfer into them must
    /// cover whole blocks ([`fusable`]), and their bytes are not copied.
    pub fn fuse_fp8(&mut self, fp8: FusedFp8) -> Result<(), RuntimeError> {
        if self.side != Side::Inference {
            return Err(RuntimeError::Fp8(
                "only an inference rank quantises FP8 blocks".into(),
            ));
        }
        for t in self.plan.peers.iter().flat_map(|p| &p.transfers) {
            if fp8.targets.contains_key(&t.dst_tensor) && !fusable(t, &fp8.encoding) {
                return Err(RuntimeError::Fp8(format!(
                    "the transfer into `{}` at {:?} (extent {:?}) does not cover whole {}x{} blocks; it cannot be quantised out of the sender's memory",
                    t.dst_tensor,
                    t.dst_offset.as_slice(),
                    t.extent.as_slice(),
                    fp8.encoding.block[0],
                    fp8.encoding.block[1]
                )));
            }
        }
        let cuda = |what: &'static str| {
            move |source| RuntimeError::Cuda {
                what: what.into(),
                source,
            }
        };
        let kernel = Fp8Kernel::load(&self.dev).map_err(cuda("loading the FP8 kernel"))?;
        let stream = self
            .dev
            .stream()
            .map_err(cuda("creating the FP8 kernel's stream"))?;
        self.fused = Some(Fused {
            cfg: fp8,
            kernel,
            stream,
            verify: None,
        });
        Ok(())
    }

    /// Runs every connected peer's fused FP8 batch again, alone (no copy), and waits: what the
    /// kernel takes without the copies beside it (`bench ipc`). It writes the bytes the last
    /// update wrote as long as the senders still hold that version. `false` without fused
    /// tensors.
    pub fn quantise_fused_alone(&self) -> Result<bool, RuntimeError> {
        let Some(f) = &self.fused else {
            return Ok(false);
        };
        let mut any = false;
        for rf in self.remotes.values().filter_map(|r| r.fp8.as_ref()) {
            // SAFETY: as for the launch in `receive`: the batch's jobs were built against this
            // peer's mappings (open while it is connected) and this rank's e4m3 and scale
            // tensors; nothing else runs on them between updates, and `fused_status` below
            // synchronises the stream.
            unsafe {
                f.kernel
                    .launch_batch(&f.stream, &rf.batch, f.cfg.recipe, &f.cfg.encoding)
            }
            .map_err(transport_err("queueing the FP8 kernel"))?;
            any = true;
        }
        self.fused_status()?;
        Ok(any)
    }

    /// Blocks and jobs of the fused FP8 batches over every connected peer (zeros without).
    pub fn fused_fp8_stats(&self) -> (u64, u64) {
        self.remotes
            .values()
            .filter_map(|r| r.fp8.as_ref())
            .fold((0, 0), |(b, j), f| {
                (b + f.batch.blocks() as u64, j + f.batch.jobs() as u64)
            })
    }

    fn add_join(&mut self, p: &JoinStats) {
        let j = &mut self.join;
        j.control_ms += p.control_ms;
        j.open_ms += p.open_ms;
        j.open_threads = p.open_threads;
        j.allocations += p.allocations;
        j.event_ms += p.event_ms;
        j.descs_ms += p.descs_ms;
        add_stats(&mut j.descriptors, &p.descriptors);
        add_stats(&mut j.descriptors_unjoined, &p.descriptors_unjoined);
        j.graph_copies += p.graph_copies;
        j.driver_copies += p.driver_copies;
        j.tiled_copies += p.tiled_copies;
        j.tiles += p.tiles;
        j.tile_table_bytes += p.tile_table_bytes;
    }

    /// Where this rank's join went (an inference rank's; zeros for a training rank).
    pub fn join_stats(&self) -> &JoinStats {
        &self.join
    }

    /// The local address and size of the largest allocation of `peer` this rank mapped (for
    /// measuring a copy floor out of the sender's memory), once connected.
    pub fn largest_mapping(&self, peer: RankId) -> Option<(u64, u64)> {
        self.remotes.get(&peer)?._import.largest()
    }

    fn export(&self, ctl_name: &str) -> Result<Sender, RuntimeError> {
        let views: Vec<_> = self.tensors.iter().collect();
        let ranges: Vec<(u64, u64)> = views
            .iter()
            .filter_map(|v| v.device_ptr().map(|p| (p, v.len() as u64)))
            .collect();
        let err = transport_err("exporting the training tensors");
        let mut export = IpcExport::of_ranges(&self.dev, &ranges).map_err(&err)?;
        // memory mapped with cuMemMap travels as file descriptors: served on a socket too, for
        // receivers the kernel does not let take them with pidfd_getfd
        let fd_socket = export
            .serve_fds(&crate::shm::fd_socket_path(ctl_name))
            .map_err(&err)?;
        let mut tensors = Vec::with_capacity(views.len());
        for v in &views {
            let ptr = v.device_ptr().ok_or_else(|| {
                RuntimeError::from(PlacementError::NotDevice {
                    name: v.name.to_string(),
                })
            })?;
            tensors.push(TensorEntry {
                hash: name_hash(&v.name),
                at: export.locate_range(ptr, v.len() as u64).map_err(&err)?,
                len: v.len() as u64,
            });
        }
        let mut peers = Vec::with_capacity(self.plan.peers.len());
        let mut first = 0u64;
        for (p, b) in self.plan.peers.iter().zip(&self.buckets) {
            peers.push(PeerEntry {
                key: peer_key(p.peer),
                first_sum: first,
                buckets: b.len() as u64,
            });
            first += b.len() as u64;
        }
        let published = Published {
            device: self.dev.ordinal(),
            allocations: export.allocations().to_vec(),
            tensors,
            peers,
            sums: first as usize,
        };
        let stream = self.dev.stream().map_err(&err)?;
        let ready = self.dev.event(true).map_err(&err)?;
        // recorded once, so that a receiver opening it early waits on a real record
        ready.record(&stream).map_err(&err)?;
        stream.sync().map_err(&err)?;
        let ready_handle = ready.ipc_handle().map_err(&err)?;
        let ctl = Control::create(ctl_name, &published)?;
        Ok(Sender {
            ctl,
            _export: export,
            fd_socket,
            stream,
            ready,
            ready_handle,
        })
    }

    fn open_remote(&self, peer: RankId, info: &serde_json::Value) -> Result<Remote, RuntimeError> {
        let field = |k: &str| {
            info.get(k).and_then(|v| v.as_str()).ok_or_else(|| {
                RuntimeError::from(TransportError::NoRendezvous {
                    peer,
                    transport: "cuda-ipc",
                    field: k.to_string(),
                    suffix: "",
                    info: info.to_string(),
                })
            })
        };
        let ctl_name = field("ctl")?.to_string();
        // where the training rank serves the descriptors of its cuMemMap spans, if it has any
        let fd_socket = info
            .get("fds")
            .and_then(|v| v.as_str())
            .map(std::path::PathBuf::from);
        let event: IpcEventHandle = field("event")?
            .parse()
            .map_err(|source| TransportError::Event { peer, source })?;
        let t0 = Instant::now();
        let (ctl, published) = Control::open(&ctl_name)?;
        let control_ms = ms_since(t0);
        let me = peer_key(self.me);
        let sums_at = published
            .peers
            .iter()
            .find(|e| e.key == me)
            .map(|e| e.first_sum)
            .ok_or_else(|| RuntimeError::from(TransportError::NoPlanFor { peer, me: self.me }))?;
        let err = transport_err("opening the training rank's memory");
        let threads = self.cfg.open_threads.clamp(1, 64);
        let t0 = Instant::now();
        let import = IpcImport::open_from(
            &self.dev,
            &published.allocations,
            threads,
            fd_socket.as_deref(),
        )
        .map_err(&err)?;
        let open_ms = ms_since(t0);
        let t0 = Instant::now();
        let event = self.dev.open_event(&event).map_err(&err)?;
        let event_ms = ms_since(t0);
        let t0 = Instant::now();
        let remote_tensors: HashMap<u64, TensorEntry> =
            published.tensors.iter().map(|t| (t.hash, *t)).collect();
        let transfers = self
            .plan
            .peers
            .iter()
            .find(|p| p.peer == peer)
            .map(|p| &p.transfers[..])
            .unwrap_or(&[]);
        let src_addr = |t: &Transfer| {
            let src = remote_tensors
                .get(&name_hash(&t.src_tensor))
                .ok_or_else(|| CudaError::MissingTensor {
                    holder: format!("training rank {peer}"),
                    tensor: t.src_tensor.to_string(),
                })?;
            let need = t.src_shape.numel() * t.src_dtype.size() as u64;
            if src.len != need {
                return Err(CudaError::MissingTensor {
                    holder: format!(
                        "training rank {peer} (it shares {} bytes, the plan needs {need})",
                        src.len
                    ),
                    tensor: t.src_tensor.to_string(),
                });
            }
            import.ptr(src.at, src.len)
        };
        let addr = |t: &Transfer| {
            let src = src_addr(t)?;
            let dst = self
                .tensors
                .get(&t.dst_tensor)
                .and_then(|v| v.device_ptr())
                .ok_or_else(|| CudaError::MissingTensor {
                    holder: format!("inference rank {}", self.me),
                    tensor: t.dst_tensor.to_string(),
                })?;
            Ok((src, dst))
        };
        // the fused FP8 transfers become kernel jobs reading this peer's memory; the rest copies
        let (fp8, plain) = match &self.fused {
            None => (None, std::borrow::Cow::Borrowed(transfers)),
            Some(f) => {
                let mut jobs = Vec::new();
                let mut names = Vec::new();
                let mut plain = Vec::new();
                let (mut fused, mut srcs) = (Vec::new(), Vec::new());
                for t in transfers {
                    let Some(target) = f.cfg.targets.get(&t.dst_tensor) else {
                        plain.push(t.clone());
                        continue;
                    };
                    let src = src_addr(t).map_err(transport_err("opening the FP8 sources"))?;
                    fused.push(t.clone());
                    srcs.push(src);
                    let js = fused_jobs(t, src, target, &f.cfg.encoding).ok_or_else(|| {
                        RuntimeError::Fp8(format!(
                            "the transfer into `{}` from training rank {peer} cannot be quantised out of its memory (its box or shape changed since the pair was built)",
                            t.dst_tensor
                        ))
                    })?;
                    names.extend(std::iter::repeat_n(t.dst_tensor.clone(), js.len()));
                    jobs.extend(js);
                }
                // a sender holding a layer's experts back to back gives one job per stack
                let (jobs, names) = join_jobs(jobs, names, &f.cfg.encoding, |s0, s1| {
                    import.allocation_of(s0, s1 - s0).is_some()
                });
                let batch = f
                    .kernel
                    .batch(&jobs, &f.cfg.encoding)
                    .map_err(transport_err("building the FP8 kernel's jobs"))?;
                let fp8 = RemoteFp8 {
                    batch,
                    names,
                    transfers: fused,
                    srcs,
                    verify: None,
                };
                (Some(fp8), std::borrow::Cow::Owned(plain))
            }
        };
        // boxes the engine stores transposed and boxes that convert go to the element-wise
        // kernel; the rest are copies
        let mut tjobs = Vec::new();
        let mut copied = Vec::with_capacity(plain.len());
        for t in plain.iter() {
            let jobs = if t.transposed || t.converts() {
                let (src, dst) = addr(t).map_err(transport_err("building the transposes"))?;
                match transpose_jobs(t, src, dst)
                    .map_err(transport_err("building the transposes"))?
                {
                    Some(j) => Some(j),
                    None => convert_jobs(t, src, dst)
                        .map_err(transport_err("building the conversions"))?,
                }
            } else {
                None
            };
            match jobs {
                Some(j) => tjobs.extend(j),
                None => copied.push(t.clone()),
            }
        }
        let transposes = match (&self.transpose, tjobs.is_empty()) {
            (_, true) => None,
            (Some(k), false) => k
                .batch(&tjobs)
                .map_err(transport_err("uploading the transposes"))?,
            (None, false) => {
                return Err(TransportError::Unsupported(
                    "cuda-ipc: this plan writes boxes transposed or converted, and the element-wise kernel did not load on this GPU".into(),
                )
                .into());
            }
        };
        let merged = plan_copies(&copied, self.cfg.merge_pitched, addr)
            .map_err(transport_err("building the copies"))?;
        // join back-to-back copies across tensors (a layer's experts) where both joined ranges
        // stay in one source allocation and one destination tensor
        let mut dst_ranges: Vec<(u64, u64)> = self
            .tensors
            .iter()
            .filter_map(|v| v.device_ptr().map(|p| (p, p + v.len() as u64)))
            .collect();
        dst_ranges.sort_unstable();
        let in_one_dst = |a: u64, b: u64| {
            let i = dst_ranges.partition_point(|r| r.0 <= a);
            i > 0 && dst_ranges[i - 1].1 >= b
        };
        let joined = merge_contiguous(&merged, |s0, s1, d0, d1| {
            import.allocation_of(s0, s1 - s0).is_some() && in_one_dst(d0, d1)
        });
        let descs = split_linear(&joined, self.cfg.split_bytes.max(1));
        let driver_min = driver_min(
            import.largest_ipc_mapping().map_or(0, |(_, size)| size),
            self.cfg.driver_min,
        );
        let driver_copies = match &self.engine {
            Some(e) => {
                e.set_driver_min(driver_min);
                descs.iter().filter(|d| !e.by_kernel(d)).count()
            }
            None => 0,
        };
        let min = self.cfg.graph_min;
        let graph = match &self.engine {
            Some(e) if self.deltas => {
                // SAFETY: as below; the diff kernel also reads this rank's own tensors.
                Some(
                    unsafe { e.capture_diff(&descs) }
                        .map_err(transport_err("capturing the delta copies"))?,
                )
            }
            Some(e) if min > 0 && descs.len() >= min => {
                // SAFETY: the graph holds descriptors built above over this peer's mappings
                // and this rank's tensors; it is replayed only from `receive` while both live
                // (the graph drops before the mappings, see `Remote`).
                Some(unsafe { e.capture(&descs) }.map_err(transport_err("capturing the copies"))?)
            }
            _ => None,
        };
        let joined_stats = JoinStats {
            graph_copies: graph.as_ref().map_or(0, |g| g.copies),
            tiled_copies: graph.as_ref().map_or(0, |g| g.tiled_copies),
            tiles: graph.as_ref().map_or(0, |g| g.tiles),
            tile_table_bytes: graph.as_ref().map_or(0, |g| g.table_bytes),
            driver_copies,
            control_ms,
            open_ms,
            open_threads: threads,
            allocations: import.len(),
            event_ms,
            descs_ms: ms_since(t0),
            descriptors: DescStats::of(&descs),
            descriptors_unjoined: DescStats::of(&merged),
            ..JoinStats::default()
        };
        Ok(Remote {
            graph,
            driver_min,
            stats: joined_stats,
            ctl_name,
            ctl,
            _import: import,
            event,
            descs,
            fp8,
            transposes,
            sums_at,
        })
    }

    fn staging(&mut self) -> Result<&TensorSet, RuntimeError> {
        if self.staging.is_none() {
            self.staging = Some(self.tensors.host_mirror()?);
        }
        self.staging
            .as_ref()
            .ok_or_else(|| TransportError::NoStaging.into())
    }

    fn send(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        ctx.check()?;
        let mut stats = ExecStats::default();
        if ctx.checksums {
            // hash every bucket as the receivers see it, from a host copy of the weights
            self.staging()?;
            let staging = self.staging.as_ref().ok_or(TransportError::NoStaging)?;
            self.tensors.download_to(staging)?;
            let sender = self
                .sender
                .as_ref()
                .ok_or(TransportError::Closed("cuda-ipc transport"))?;
            let mut idx = 0u64;
            for (peer, buckets) in self.plan.peers.iter().zip(&self.buckets) {
                for b in buckets {
                    self.scratch.resize(b.bytes as usize, 0);
                    let n = pack(b, &peer.transfers, staging, &mut self.scratch, None)?;
                    let h = xxhash_rust::xxh3::xxh3_64(&self.scratch[..n]);
                    sender.ctl.sum(idx)?.store(h, Ordering::Relaxed);
                    stats.checksum = stats.checksum.wrapping_add(h);
                    idx += 1;
                }
            }
        }
        let sender = self
            .sender
            .as_ref()
            .ok_or(TransportError::Closed("cuda-ipc transport"))?;
        for (peer, buckets) in self.plan.peers.iter().zip(&self.buckets) {
            stats.buckets += buckets.len() as u64;
            stats.bytes += peer.bytes;
        }
        // the weights are complete when the update starts (the caller synchronised its own
        // work); the event orders the receivers' copies after anything queued on this stream
        sender
            .ready
            .record(&sender.stream)
            .map_err(transport_err("recording the ready event"))?;
        let ctl = &sender.ctl;
        ctl.done().store(0, Ordering::Relaxed);
        ctl.ready().store(ctx.tag(), Ordering::Release);
        let want = self.plan.peers.len() as u64;
        let result = wait_fast(ctx, || ctl.done().load(Ordering::Acquire) >= want);
        // every peer synchronised its copies before counting itself done (or this rank gave
        // up): nobody may read these weights as this version any more
        ctl.ready().store(NONE, Ordering::Release);
        result.map(|_| stats)
    }

    fn receive(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        for peer in &self.plan.peers {
            let info = ctx.peers.get(&peer.peer).cloned().unwrap_or_default();
            let stale = match (
                self.remotes.get(&peer.peer),
                info.get("ctl").and_then(|v| v.as_str()),
            ) {
                (Some(r), Some(name)) => r.ctl_name != name,
                _ => true,
            };
            if stale {
                // a restarted peer: close the old mappings before opening the new ones
                self.remotes.remove(&peer.peer);
                let r = self.open_remote(peer.peer, &info)?;
                self.remotes.insert(peer.peer, r);
            }
        }
        let engine = self
            .engine
            .as_ref()
            .ok_or(TransportError::Closed("cuda-ipc transport"))?;
        let concurrent = self.cfg.peers == PeerOrder::Concurrent;
        let copied = (|| {
            for (lane, peer) in self.plan.peers.iter().enumerate() {
                let remote = &self.remotes[&peer.peer];
                wait_fast(ctx, || {
                    remote.ctl.ready().load(Ordering::Acquire) == ctx.tag()
                })?;
                // SAFETY: every descriptor was built in `open_remote` from the plan against
                // this peer's mapped allocations (bounds-checked by `IpcImport::ptr`, joins kept
                // inside one allocation) and this rank's own tensors; the mappings live in
                // `remote` until the sync below, and the tensors in `self.tensors`.
                match &remote.graph {
                    // SAFETY: as below, for the captured copies. Concurrent: each peer's graph
                    // on its own stream, joined below; their destinations never overlap (the
                    // plan writes every destination byte once).
                    Some(g) if concurrent => unsafe {
                        engine.replay_on(g, lane, Some(&remote.event))
                    },
                    Some(g) => unsafe { engine.replay(g, Some(&remote.event), None) },
                    None => {
                        engine.set_driver_min(remote.driver_min);
                        unsafe { engine.launch(&remote.descs, Some(&remote.event), None) }
                    }
                }
                .map_err(transport_err("queueing the copies"))?;
                if let (Some(k), Some(tb)) = (&self.transpose, &remote.transposes) {
                    // SAFETY: the jobs were built in `open_remote` from the plan against this
                    // peer's mappings (bounds-checked by `IpcImport::ptr`, the boxes checked
                    // against both tensors' shapes) and this rank's tensors, which no copy
                    // writes at those bytes; the stream waits for the peer's event and joins
                    // the sync below, before the mappings can close.
                    let s = engine.main_stream();
                    s.wait(&remote.event)
                        .and_then(|()| unsafe { k.launch(s, tb) })
                        .map_err(transport_err("queueing the transposes"))?;
                }
                if let (Some(f), Some(rf)) = (&self.fused, &remote.fp8) {
                    // SAFETY: the batch's jobs were built in `open_remote` from the plan against
                    // this peer's mappings (bounds-checked by `IpcImport::ptr`) and this rank's
                    // e4m3 and scale tensors, which no copy writes; the stream waits for the
                    // peer's event and is synchronised below, before the mappings can close.
                    f.stream
                        .wait(&remote.event)
                        .and_then(|()| unsafe {
                            f.kernel.launch_batch(
                                &f.stream,
                                &rf.batch,
                                f.cfg.recipe,
                                &f.cfg.encoding,
                            )
                        })
                        .map_err(transport_err("queueing the FP8 kernel"))?;
                }
            }
            engine
                .join_lanes()
                .and_then(|()| engine.sync())
                .map_err(transport_err("waiting for the copies"))?;
            self.fused_status()
        })();
        if let Err(e) = copied {
            // leave no copy running into memory that the caller may reuse
            let _ = engine.join_lanes();
            let _ = engine.sync();
            if let Some(f) = &self.fused {
                let _ = f.kernel.take_batch_status(&f.stream);
            }
            return Err(e);
        }
        if ctx.checksums && self.fused.is_some() {
            self.copy_fused_for_checksums()?;
        }
        if ctx.corrupt {
            self.corrupt_first_byte()?;
        }
        let mut stats = ExecStats::default();
        if ctx.checksums {
            let staging = match self.fused.as_ref().and_then(|f| f.verify.as_ref()) {
                Some(v) => {
                    v.device.download_to(&v.host)?;
                    &v.host
                }
                None => {
                    self.staging()?;
                    let staging = self.staging.as_ref().ok_or(TransportError::NoStaging)?;
                    self.tensors.download_to(staging)?;
                    staging
                }
            };
            for (pi, peer) in self.plan.peers.iter().enumerate() {
                let remote = &self.remotes[&peer.peer];
                for (bi, b) in self.buckets[pi].iter().enumerate() {
                    let h = hash_destination(b, &peer.transfers, staging)?;
                    let want = remote
                        .ctl
                        .sum(remote.sums_at + bi as u64)?
                        .load(Ordering::Relaxed);
                    if h != want {
                        return Err(RuntimeError::Checksum {
                            peer: peer.peer,
                            bucket: bi as u64,
                        });
                    }
                    stats.checksum = stats.checksum.wrapping_add(h);
                }
            }
        }
        for (pi, peer) in self.plan.peers.iter().enumerate() {
            let remote = &self.remotes[&peer.peer];
            if remote.ctl.ready().load(Ordering::Acquire) != ctx.tag() {
                return Err(TransportError::Withdrawn {
                    peer: peer.peer,
                    version: ctx.version,
                }
                .into());
            }
            stats.buckets += self.buckets[pi].len() as u64;
            stats.bytes += peer.bytes;
            if let Some(g) = remote.graph.as_ref().filter(|g| g.diff) {
                // the diff launch's bytes count as the vectors that differed; 16-byte vectors
                // are its elements
                let written = g
                    .changed_vectors()
                    .map_err(transport_err("reading the delta count"))?
                    .unwrap_or(0);
                stats.bytes = stats.bytes - g.diff_bytes.min(stats.bytes) + written * 16;
                stats.delta.add(&awex_core::encoding::DeltaStats {
                    elements: g.diff_bytes / 16,
                    changed: written,
                    dense_bytes: g.diff_bytes,
                    delta_bytes: written * 16,
                });
            }
        }
        for peer in &self.plan.peers {
            self.remotes[&peer.peer]
                .ctl
                .done()
                .fetch_add(1, Ordering::AcqRel);
        }
        Ok(stats)
    }

    /// Waits for the fused FP8 kernel and reads its status: an error naming the first tensor
    /// holding infinity or NaN (its blocks are left unwritten; the update fails).
    fn fused_status(&self) -> Result<(), RuntimeError> {
        let Some(f) = &self.fused else {
            return Ok(());
        };
        let err = transport_err("waiting for the FP8 kernel");
        let st = f.kernel.take_batch_status(&f.stream).map_err(&err)?;
        if st.blocks == 0 {
            return Ok(());
        }
        // the status word is shared by the peers' batches: run each again alone to name it
        // (the kernel writes the same bytes again; the senders still hold this version)
        for peer in &self.plan.peers {
            let Some(rf) = self.remotes.get(&peer.peer).and_then(|r| r.fp8.as_ref()) else {
                continue;
            };
            // SAFETY: as for the launch in `receive`; the mappings are open.
            unsafe {
                f.kernel
                    .launch_batch(&f.stream, &rf.batch, f.cfg.recipe, &f.cfg.encoding)
            }
            .map_err(&err)?;
            let again = f.kernel.take_batch_status(&f.stream).map_err(&err)?;
            if let Some(j) = again.first_job {
                let name = rf.names.get(j as usize).map_or("?", |n| &**n);
                return Err(RuntimeError::Fp8(format!(
                    "quantising `{name}` to FP8 ({}) on the GPU failed: {} block(s) hold infinity or NaN (training rank {}); the update is not committed",
                    f.cfg.recipe.name(),
                    again.blocks,
                    peer.peer
                )));
            }
        }
        Err(RuntimeError::Fp8(format!(
            "the GPU FP8 kernel counted {} block(s) holding infinity or NaN, but none when quantising each peer's tensors again; the update is not committed",
            st.blocks
        )))
    }

    /// A checksummed update of fused FP8 tensors: copies their boxes (bf16, as the senders
    /// hashed them) out of the senders' memory into a scratch of the fused tensors (allocated,
    /// and the copies built, on the first such update), which the checksums then hash in
    /// place of the engine's e4m3 tensors.
    fn copy_fused_for_checksums(&mut self) -> Result<(), RuntimeError> {
        let (Some(f), Some(engine)) = (self.fused.as_mut(), self.engine.as_ref()) else {
            return Ok(());
        };
        if f.verify.is_none() {
            let scratch = RankLayout {
                rank: self.me,
                tensors: f
                    .cfg
                    .targets
                    .iter()
                    .map(|(n, t)| LocalTensor::plain(n.clone(), t.shape, DType::Bf16, vec![]))
                    .collect(),
            };
            let scratch = TensorSet::allocate_cuda(&scratch, &self.dev)?;
            let device = TensorSet::from_views(
                self.tensors
                    .iter()
                    .map(|v| scratch.get(&v.name).unwrap_or(v).clone())
                    .collect(),
            )?;
            let host = device.host_mirror()?;
            f.verify = Some(Verify {
                device,
                host,
                _scratch: scratch,
            });
        }
        let Some(v) = f.verify.as_ref() else {
            return Ok(());
        };
        let err = transport_err("copying the FP8 sources for the checksums");
        for peer in &self.plan.peers {
            let Some(rf) = self
                .remotes
                .get_mut(&peer.peer)
                .and_then(|r| r.fp8.as_mut())
            else {
                continue;
            };
            if rf.verify.is_none() {
                let mut srcs = rf.srcs.iter();
                let descs = plan_copies(&rf.transfers, self.cfg.merge_pitched, |t| {
                    let src = *srcs.next().ok_or(CudaError::MissingTensor {
                        holder: "the fused FP8 sources".into(),
                        tensor: t.src_tensor.to_string(),
                    })?;
                    let dst = v
                        .device
                        .get(&t.dst_tensor)
                        .and_then(|x| x.device_ptr())
                        .ok_or_else(|| CudaError::MissingTensor {
                            holder: "the FP8 checksum scratch".into(),
                            tensor: t.dst_tensor.to_string(),
                        })?;
                    Ok((src, dst))
                })
                .map_err(&err)?;
                rf.verify = Some(descs);
            }
            if let Some(descs) = &rf.verify {
                // SAFETY: built above from the fused transfers' sources in this peer's open
                // mappings and the scratch held by `f.verify`; synchronised below.
                unsafe { engine.launch(descs, None, None) }.map_err(&err)?;
            }
        }
        engine.sync().map_err(&err)
    }

    /// Flips one received byte on the GPU (fault injection for tests).
    fn corrupt_first_byte(&self) -> Result<(), RuntimeError> {
        let Some((peer, b)) = self
            .plan
            .peers
            .iter()
            .zip(&self.buckets)
            .find_map(|(p, b)| b.first().map(|b| (p, b)))
        else {
            return Ok(());
        };
        let Some(piece) = b.pieces.first() else {
            return Ok(());
        };
        let t = &peer.transfers[piece.transfer as usize];
        // a fused FP8 tensor's received bytes are its checksum scratch's (bf16)
        let set = match self.fused.as_ref().and_then(|f| f.verify.as_ref()) {
            Some(v) => &v.device,
            None => &*self.tensors,
        };
        let Some(v) = set.get(&t.dst_tensor) else {
            return Ok(());
        };
        let Some(base) = v.device_ptr() else {
            return Ok(());
        };
        let (_, d, _) = piece_box(t, piece);
        let at = base + v.shape.linear(&d) * v.dtype.size() as u64;
        let err = transport_err("corrupting a byte");
        let mut x = [0u8];
        // SAFETY: `at` is a byte of a planned box inside the device tensor `v`.
        unsafe { self.dev.copy_to_host(at, &mut x) }.map_err(&err)?;
        x[0] ^= 0x5a;
        // SAFETY: as above; the copies have been synchronised.
        unsafe { self.dev.copy_from_host(at, &x) }.map_err(&err)
    }
}

impl Transport for CudaIpcTransport {
    fn kind(&self) -> awex_core::Transport {
        awex_core::Transport::CudaIpc
    }

    fn cuda_ipc(&self) -> Option<&CudaIpcTransport> {
        Some(self)
    }

    fn cuda_ipc_mut(&mut self) -> Option<&mut CudaIpcTransport> {
        Some(self)
    }

    fn rendezvous(&self) -> serde_json::Value {
        match &self.sender {
            Some(s) => {
                let mut v = serde_json::json!({
                    "ctl": s.ctl.seg.segment().name(),
                    "event": s.ready_handle.to_string(),
                    "device": self.dev.ordinal(),
                });
                if let Some(p) = &s.fd_socket {
                    v["fds"] = p.to_string_lossy().into_owned().into();
                }
                v
            }
            None => serde_json::json!({ "device": self.dev.ordinal() }),
        }
    }

    fn connect(&mut self, peers: &HashMap<RankId, serde_json::Value>) -> Result<(), RuntimeError> {
        if self.side == Side::Inference {
            let plan = self.plan.clone();
            for p in &plan.peers {
                if let Some(info) = peers.get(&p.peer) {
                    self.remotes.remove(&p.peer);
                    let r = self.open_remote(p.peer, info)?;
                    self.add_join(&r.stats);
                    self.remotes.insert(p.peer, r);
                }
            }
        }
        Ok(())
    }

    fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        match self.side {
            Side::Training => self.send(ctx),
            Side::Inference => self.receive(ctx),
        }
    }

    /// Inference ranks whose copy engine has the diff kernel capture their copies with it
    /// ([`CopyEngine::capture_diff`]): each 16-byte vector is read on both ends and written only
    /// where it differs, so the result is the dense update's bytes whatever the tensors held (a
    /// torn or restarted rank is repaired by the same pass), and a training rank keeps no copy.
    /// FP8 tensors quantised out of the trainer's memory are written whole.
    fn enable_deltas(&mut self) -> Result<bool, RuntimeError> {
        let on = match (&self.side, &self.engine) {
            (Side::Training, _) => true,
            (Side::Inference, Some(e)) => e.diffs(),
            (Side::Inference, None) => false,
        };
        if self.side == Side::Inference && !self.remotes.is_empty() {
            return Err(TransportError::Unsupported(
                "cuda-ipc: delta updates must be turned on before the rank connects".into(),
            )
            .into());
        }
        self.deltas = on;
        Ok(on)
    }

    fn holds_base(&self) -> bool {
        self.deltas && self.side == Side::Inference
    }

    fn close(&mut self) {
        if let Some(e) = &self.engine {
            let _ = e.sync();
        }
        // closes the mappings and the peers' events
        self.remotes.clear();
        if let Some(s) = self.sender.take() {
            let _ = s.stream.sync();
            s.ctl.seg.segment().unlink();
        }
        if let Some(f) = self.fused.take() {
            let _ = f.stream.sync();
        }
        self.engine = None;
        self.staging = None;
    }
}

impl Drop for CudaIpcTransport {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TensorView;
    use awex_core::dtype::DType;
    use awex_core::layout::Dims;
    use awex_core::plan::{PeerPlan, Transfer};

    #[test]
    fn large_copies_go_through_the_driver_only_out_of_moderate_allocations() {
        // PyTorch-sized allocations: copies of 16 MiB and more through the driver
        assert_eq!(driver_min(1 << 30, DriverMin::Auto), Some(16 << 20));
        assert_eq!(driver_min(4 << 30, DriverMin::Auto), Some(16 << 20));
        // one huge mapping (Megatron's contiguous buffer): the kernel for every copy
        assert_eq!(driver_min((4 << 30) + 1, DriverMin::Auto), None);
        assert_eq!(driver_min(16 << 30, DriverMin::Auto), None);
        // the override, either way
        assert_eq!(driver_min(16 << 30, DriverMin::AtLeast(0)), Some(0));
        assert_eq!(
            driver_min(1 << 30, DriverMin::AtLeast(64 << 20)),
            Some(64 << 20)
        );
        assert_eq!(driver_min(1 << 30, DriverMin::Off), None);
    }

    fn plan_with(src: DType, dst: DType) -> RankPlan {
        let t = Transfer {
            encode: None,
            src_rank: RankId::train(0),
            dst_rank: RankId::infer(0, 0),
            canonical: 0,
            src_tensor: Arc::from("w"),
            src_shape: Dims::new(&[4, 8]),
            src_offset: Dims::new(&[0, 0]),
            src_dtype: src,
            dst_tensor: Arc::from("model.w"),
            dst_shape: Dims::new(&[4, 8]),
            dst_offset: Dims::new(&[0, 0]),
            dst_dtype: dst,
            extent: Dims::new(&[4, 8]),
            transposed: false,
        };
        RankPlan {
            side: Side::Inference,
            rank: RankId::infer(0, 0),
            peers: vec![PeerPlan {
                peer: RankId::train(0),
                bytes: t.bytes(),
                transfers: vec![t].into(),
                fingerprint: 0,
            }],
            fingerprint: 0,
        }
    }

    #[test]
    fn a_plan_with_a_conversion_the_gpu_does_not_make_gets_the_cuda_conversion_error() {
        assert!(refuse_conversions(&plan_with(DType::Bf16, DType::Bf16)).is_ok());
        // the element-wise kernel's conversions pass
        for (a, b) in [
            (DType::F32, DType::Bf16),
            (DType::Bf16, DType::F32),
            (DType::F16, DType::F32),
            (DType::F32, DType::F16),
        ] {
            assert!(refuse_conversions(&plan_with(a, b)).is_ok(), "{a} -> {b}");
        }
        let e = refuse_conversions(&plan_with(DType::F64, DType::F32)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "`model.w`: this transfer converts f64 to f32, which the GPU transports do not (they convert bf16 and f16 to and from f32); keep both sides in the same dtype, or use a CPU transport (shm, tcp)"
        );
        let t = CudaIpcTransport::new(
            Arc::new(plan_with(DType::F64, DType::F32)),
            Arc::new(TensorSet::from_views(vec![]).unwrap()),
            1 << 20,
            "awex-test-unused-ctl",
            &CudaIpcConfig::default(),
        );
        assert_eq!(t.err().unwrap().to_string(), e.to_string());
    }

    #[test]
    fn host_tensors_are_refused_with_the_fix_named() {
        let mut buf = vec![0u8; 64];
        // SAFETY: the buffer outlives the set.
        let v = unsafe {
            TensorView::new(
                "model.w",
                buf.as_mut_ptr(),
                64,
                DType::Bf16,
                Dims::new(&[4, 8]),
            )
        }
        .unwrap();
        let t = CudaIpcTransport::new(
            Arc::new(plan_with(DType::Bf16, DType::Bf16)),
            Arc::new(TensorSet::from_views(vec![v]).unwrap()),
            1 << 20,
            "awex-test-unused-ctl",
            &CudaIpcConfig::default(),
        );
        assert_eq!(
            t.err().unwrap().to_string(),
            "the cuda-ipc transport moves tensors in GPU memory, but this rank's tensors live in host memory; allocate them with TensorSet::allocate_cuda or register device views, or use the shm or tcp transport"
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn device_tensors_without_the_cuda_feature_say_the_build_lacks_cuda() {
        // SAFETY: the address is never dereferenced: without CUDA nothing touches it.
        let v = unsafe {
            TensorView::new_cuda(
                "model.w",
                0x7f00_0000_0000,
                64,
                DType::Bf16,
                Dims::new(&[4, 8]),
                0,
            )
        }
        .unwrap();
        let t = CudaIpcTransport::new(
            Arc::new(plan_with(DType::Bf16, DType::Bf16)),
            Arc::new(TensorSet::from_views(vec![v]).unwrap()),
            1 << 20,
            "awex-test-unused-ctl",
            &CudaIpcConfig::default(),
        );
        assert_eq!(
            t.err().unwrap().to_string(),
            "awex was built without CUDA; rebuild with `--features cuda`"
        );
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_tensors_without_a_driver_say_no_cuda_driver_found() {
        if awex_gpu::cuda::driver_present() {
            eprintln!("libcuda is present here; the GPU demo covers this machine");
            return;
        }
        // SAFETY: the address is never dereferenced: without a driver nothing touches it.
        let v = unsafe {
            TensorView::new_cuda(
                "model.w",
                0x7f00_0000_0000,
                64,
                DType::Bf16,
                Dims::new(&[4, 8]),
                0,
            )
        }
        .unwrap();
        let t = CudaIpcTransport::new(
            Arc::new(plan_with(DType::Bf16, DType::Bf16)),
            Arc::new(TensorSet::from_views(vec![v]).unwrap()),
            1 << 20,
            "awex-test-unused-ctl",
            &CudaIpcConfig::default(),
        );
        assert_eq!(
            t.err().unwrap().to_string(),
            "no CUDA driver found: libcuda could not be loaded (tried libcuda.so and libcuda.so.1 on the library search path); install the NVIDIA driver or run on a machine with a GPU"
        );
    }
}
