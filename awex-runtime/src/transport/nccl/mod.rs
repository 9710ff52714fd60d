//! The `nccl` transport: a rank's planned buckets over NCCL point-to-point, on its GPU.
//!
//! Per update, a rank walks its schedule ([`awex_gpu::nccl::schedule()`]): step `k` is one NCCL group
//! with bucket `k` of every peer. Work is queued on the device and ordered by events, so the
//! host never waits per bucket:
//!
//! - training: the copy engine packs step `k` into slot `k % 2` once the sends of step `k-2`
//!   have left that slot; the NCCL stream waits for the pack and sends;
//! - inference: the NCCL stream waits until the unpack of step `k-2` has emptied slot `k % 2`,
//!   receives, and the copy engine unpacks after the receive.
//!
//! An FP8 pair's sender-encoded pieces (every FP8 block, whole on one training rank) are
//! quantised on the training GPU straight into the slot: the step's batch of the block-FP8
//! kernel ([`awex_gpu::cuda::Fp8Kernel`], one job per matrix of a piece:
//! [`awex_gpu::nccl::StepIo::fp8_jobs`]) runs on its own stream once the slot is free, beside the
//! copy engine's packing, and the NCCL stream waits for both; the wire carries e4m3 bytes and
//! scales (about half the bf16 bytes), and the inference rank unpacks them with plain copies
//! into the engine's e4m3 and scale tensors. Blocks holding infinity or NaN are left
//! unwritten and fail the update on the training rank, naming the tensor.
//!
//! A piece whose dtype the engine holds otherwise (bf16 or f16 to and from f32: a bf16 `A_log`
//! into the engines' fp32) is converted the same way, by the element-wise kernel
//! ([`awex_gpu::cuda::transpose`], [`awex_gpu::nccl::StepIo::convert_jobs`]) into the slot on
//! its own stream: the wire and the receiver hold the engine's bytes.
//!
//! Delta updates (both ends published that they take part, and the pair has them on): each
//! step is two groups, the buckets' headers, then their bytes
//! ([`awex_gpu::nccl::BucketHeader`]). The training rank keeps the bytes it last sent of every
//! bucket to such a peer in GPU memory (one copy of its wire bytes: 2 bytes per bf16 element,
//! about 1.03 per FP8 one), encodes each packed bucket against that copy into a frame on its own
//! stream ([`awex_gpu::cuda::delta_wire`]), waits for the frames' lengths, sends the headers and
//! then each frame (or the whole bucket to a peer that does not hold the copy's version, as the
//! gateway's bases say), and applies the frame to its copy. The inference rank waits for the
//! step's headers, gathers the step's boxes from its tensors into the slot (a contiguous bucket
//! is decoded in place), receives, applies each frame there and unpacks as for a whole bucket: a
//! frame against a version its tensors do not hold whole is refused before anything is written.
//!
//! Buckets that lie contiguously in a tensor skip the slots. At the end the host waits for
//! both streams, on a helper thread, while it watches the deadline, the cancel flag and the
//! communicator's error state; any of them aborts the communicator, so no rank hangs. With
//! checksums on, each step is waited for and its wire bytes are hashed on the host (slow; for
//! verification runs).
//!
//! The communicator is built in [`Transport::connect`], once every rank has joined: bucket
//! sizes come from the peers' rendezvous values (their peer counts and budgets), so both ends
//! of every pair cut it alike. An aborted communicator cannot be reused, so every retry (a later
//! attempt of a version) runs on a fresh one without the pair reconnecting
//! ([`awex_gpu::nccl::AttemptComm`]): training rank 0 publishes a new unique id under
//! `nccl.uid.<version>.<attempt>` ([`Transport::kv_before_attempt`]), every other rank reads it
//! ([`Transport::kv_for_attempt`]), and both ends re-initialise before the retry's first group.
//!
//! Whoever holds a unique id can join its communicator (and the id names the bootstrap
//! socket), so the id never goes into the kv in clear: it is sealed with the pair secret under
//! the key it is published as ([`seal_uid`]); every reader opens it ([`open_uid`]) and refuses a
//! value that does not verify (forged by a process without the secret, tampered with, or
//! replayed from another key, version, attempt, pair or connect), waiting for the genuine one
//! until its deadline. No rank ever builds a communicator from an id it could not verify.

mod deltas;

use crate::RuntimeError;
use crate::transport::{ExecContext, ExecStats, PairSecret, SealError, Transport};
use crate::{Location, TensorSet};
use awex_core::encoding::Fp8Quantiser;
use awex_core::layout::{RankId, Side};
use awex_core::plan::RankPlan;
use awex_gpu::cuda::transpose::{TransposeBatch, TransposeKernel};
use awex_gpu::cuda::{
    CopyDesc, CopyEngine, Device, DeviceBuffer, Event, Fp8Batch, Fp8Kernel, Stream,
};
use awex_gpu::nccl::{
    AttemptComm, BucketHeader, CommWorld, Communicator, DeviceTensors, Library, NcclError, P2p,
    Program, UID_KEY, UniqueId, creates_uid, pair_bucket_bytes, peer_buckets, schedule,
};
use deltas::Deltas;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Settings of one rank's NCCL transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclConfig {
    /// The GPU (CUDA ordinal) this rank's tensors live on.
    pub device: u32,
    /// The pair's communicator ranks.
    pub world: CommWorld,
    /// Staging budget of one step; a rank holds at most two steps' staging.
    pub bucket_bytes: u64,
    /// How long communicator init may wait for every rank.
    pub init_timeout: Duration,
    /// How long teardown may flush before it aborts.
    pub teardown_timeout: Duration,
    /// Streams of the pack/unpack copy engine.
    pub copy_streams: usize,
    /// Whether this rank takes part in delta updates when its pair has them on (published
    /// with its rendezvous values: a bucket travels as a delta only between two ranks that
    /// both do). A training rank then keeps a copy of the bytes it sends in GPU memory.
    pub deltas: bool,
}

impl NcclConfig {
    /// Defaults for a rank on `device` of `world`: 256 MiB per step, 120 s init, 10 s teardown,
    /// 2 copy streams, no deltas.
    pub fn new(device: u32, world: CommWorld) -> Self {
        NcclConfig {
            device,
            world,
            bucket_bytes: 256 << 20,
            init_timeout: Duration::from_secs(120),
            teardown_timeout: Duration::from_secs(10),
            copy_streams: 2,
            deltas: false,
        }
    }
}

/// What the transport publishes when it joins, and reads from its peers.
fn rendezvous_value(
    me: u32,
    peers: usize,
    budget: u64,
    version: &str,
    deltas: bool,
) -> serde_json::Value {
    serde_json::json!({
        "nccl_rank": me,
        "peers": peers,
        "bucket_bytes": budget,
        "nccl_version": version,
        "deltas": deltas,
    })
}

/// A peer's published values: (communicator rank, peer count, budget, NCCL version, whether it
/// takes part in deltas: false where an older awex published nothing).
fn peer_values(
    side: Side,
    peer: RankId,
    v: Option<&serde_json::Value>,
) -> Result<(u64, usize, u64, String, bool), NcclError> {
    let missing = |what: &str| {
        NcclError::Rendezvous(format!(
            "{side} rank {peer} published no `{what}` in its nccl rendezvous; is it running the nccl transport of this awex version?"
        ))
    };
    let v = v.ok_or_else(|| missing("nccl_rank"))?;
    let num = |k: &str| v.get(k).and_then(|x| x.as_u64()).ok_or_else(|| missing(k));
    let version = v
        .get("nccl_version")
        .and_then(|x| x.as_str())
        .ok_or_else(|| missing("nccl_version"))?;
    Ok((
        num("nccl_rank")?,
        num("peers")? as usize,
        num("bucket_bytes")?,
        version.to_string(),
        v.get("deltas").and_then(|x| x.as_bool()).unwrap_or(false),
    ))
}

/// The device objects of the rank.
struct Gpu {
    dev: Device,
    nccl_stream: Arc<Stream>,
    engine: Arc<CopyEngine>,
    /// `ready[s]`: slot `s` is packed (training) or received (inference).
    ready: [Event; 2],
    /// `free[s]`: slot `s` may be written again.
    free: [Event; 2],
}

/// What `connect` builds (the communicator lives in [`AttemptComm`], renewed per retry).
struct Connected {
    program: Program,
    /// `copies[k][s]`: pack or unpack copies of step `k` when it uses slot `s`.
    copies: Vec<[Vec<CopyDesc>; 2]>,
    /// The FP8 quantisation of a training rank whose plan has sender-encoded pieces.
    fp8: Option<Fp8Pack>,
    slots: Option<[DeviceBuffer; 2]>,
    /// Delta updates with the peers that take part (deltas on).
    deltas: Option<Deltas>,
    /// An inference rank's transposed pieces (boxes the engine stores with their last two
    /// dims swapped).
    transposes: Option<Transposes>,
    /// A training rank's converting pieces (bf16 or f16 to and from f32), packed in the
    /// inference dtype.
    converts: Option<ConvertPack>,
}

/// A training rank's converting pack: the element-wise kernel, its stream, and per step and
/// slot the batch that converts the step's converting pieces into the slot.
struct ConvertPack {
    kernel: TransposeKernel,
    stream: Stream,
    /// `done[s]`: the conversions into slot `s` finished.
    done: [Event; 2],
    /// `batches[k]`: step `k`'s batch for slot 0 and slot 1 (`None`: nothing to convert).
    batches: Vec<Option<[TransposeBatch; 2]>>,
}

/// The transpose kernel and, per step (with the slot it uses), the batch that unpacks its
/// transposed pieces and the batch that gathers them back for a delta.
struct Transposes {
    kernel: TransposeKernel,
    unpack: Vec<Option<TransposeBatch>>,
    gather: Vec<Option<TransposeBatch>>,
}

/// A training rank's FP8 packing: the kernel, its stream, and per step and slot the batch of
/// jobs that quantise the step's sender-encoded pieces into the slot.
struct Fp8Pack {
    q: Fp8Quantiser,
    kernel: Fp8Kernel,
    stream: Stream,
    /// `done[s]`: the quantisation into slot `s` finished.
    done: [Event; 2],
    /// `batches[k]`: step `k`'s batch for slot 0 and slot 1 (`None`: nothing to quantise).
    batches: Vec<Option<[Fp8Batch; 2]>>,
    /// `names[k]`: the destination tensor of each job of step `k`'s batch.
    names: Vec<Vec<Arc<str>>>,
}

/// NCCL transport for one rank.
pub struct NcclTransport {
    lib: Arc<Library>,
    cfg: NcclConfig,
    plan: Arc<RankPlan>,
    tensors: Arc<DeviceTensors>,
    /// Keeps the memory behind `tensors` allocated when the transport was built from a set.
    _owner: Option<Arc<TensorSet>>,
    /// The communicator of the current attempt, and the id it is built from (`None` until
    /// the rank has read training rank 0's id, after joining).
    comms: AttemptComm,
    me: u32,
    gpu: Gpu,
    conn: Option<Connected>,
    /// The pair secret (from the join answer), which seals and opens the unique ids.
    secret: Option<PairSecret>,
    /// The quantiser of sender-encoded FP8 transfers (a training rank of an FP8 pair).
    fp8: Option<Fp8Quantiser>,
    /// Deltas turned on ([`Transport::enable_deltas`]): the pair has them and this rank takes part.
    deltas_on: bool,
}

impl NcclTransport {
    /// A transport for the rank of `plan`, moving `tensors` (device memory on `cfg.device`)
    /// through the communicator `uid` (created by training rank 0, shared under
    /// [`awex_gpu::nccl::UID_KEY`]). Nothing talks to peers until [`Transport::connect`].
    pub fn new(
        lib: Arc<Library>,
        cfg: NcclConfig,
        plan: Arc<RankPlan>,
        tensors: Arc<DeviceTensors>,
        uid: UniqueId,
    ) -> Result<NcclTransport, NcclError> {
        Self::build(lib, cfg, plan, tensors, None, Some(uid))
    }

    /// A transport for the rank of `plan` over its runtime tensors (device memory of one GPU,
    /// which becomes `cfg.device`), kept alive by the transport. `uid` is the communicator id
    /// for training rank 0, which creates it; the other ranks pass `None` and receive it in
    /// [`Transport::joined`], read from the pair's kv once every rank has joined.
    pub fn for_rank(
        lib: Arc<Library>,
        mut cfg: NcclConfig,
        plan: Arc<RankPlan>,
        tensors: Arc<TensorSet>,
        uid: Option<UniqueId>,
    ) -> Result<NcclTransport, NcclError> {
        if !awex_gpu::cuda::BUILT {
            return Err(NcclError::NeedsCuda);
        }
        let (device, dev_tensors) = device_tensors(&tensors)?;
        cfg.device = device;
        Self::build(lib, cfg, plan, Arc::new(dev_tensors), Some(tensors), uid)
    }

    fn build(
        lib: Arc<Library>,
        cfg: NcclConfig,
        plan: Arc<RankPlan>,
        tensors: Arc<DeviceTensors>,
        owner: Option<Arc<TensorSet>>,
        uid: Option<UniqueId>,
    ) -> Result<NcclTransport, NcclError> {
        if !awex_gpu::cuda::BUILT {
            return Err(NcclError::NeedsCuda);
        }
        if cfg.copy_streams == 0 {
            return Err(NcclError::Usage(
                "the nccl transport needs at least one copy stream".into(),
            ));
        }
        let me = cfg.world.comm_rank(plan.side, plan.rank)?;
        let dev = Device::open(cfg.device)?;
        let gpu = Gpu {
            nccl_stream: Arc::new(dev.stream()?),
            engine: Arc::new(CopyEngine::new(&dev, cfg.copy_streams)?),
            ready: [dev.event(false)?, dev.event(false)?],
            free: [dev.event(false)?, dev.event(false)?],
            dev,
        };
        let mut comms = AttemptComm::new(lib.clone(), cfg.world.nranks(), me);
        if let Some(uid) = uid {
            comms.set_uid(UID_KEY, uid);
        }
        Ok(NcclTransport {
            lib,
            cfg,
            plan,
            tensors,
            _owner: owner,
            comms,
            me,
            gpu,
            conn: None,
            secret: None,
            fp8: None,
            deltas_on: false,
        })
    }

    /// Quantises the plan's sender-encoded FP8 transfers with `q` (the pair's recipe and
    /// encoding) on the training GPU as it packs a bucket; set before [`Transport::connect`].
    pub fn set_fp8(&mut self, q: Option<Fp8Quantiser>) {
        self.fp8 = q;
    }

    /// The communicator's unique id, once known.
    pub fn unique_id(&self) -> Option<UniqueId> {
        self.comms.uid().map(|(_, u)| u)
    }

    /// How many communicators this rank has initialised (one per retry after the first).
    pub fn communicators_built(&self) -> u32 {
        self.comms.built()
    }

    /// This rank's communicator rank.
    pub fn comm_rank(&self) -> u32 {
        self.me
    }

    /// The device program, once connected (for reports: steps, staging, direct buckets).
    pub fn program(&self) -> Option<&Program> {
        self.conn.as_ref().map(|c| &c.program)
    }

    fn usable(&self) -> Result<(), NcclError> {
        match self.comms.failed() {
            Some(why) => Err(NcclError::Aborted(why.to_string())),
            None => Ok(()),
        }
    }

    /// Builds the bucket cuts, the program, the staging slots and the communicator.
    fn open(&mut self, peers: &HashMap<RankId, serde_json::Value>) -> Result<(), NcclError> {
        self.usable()?;
        if self.conn.is_some() {
            // a retry's fresh communicator is initialised before its first group
            self.gpu.dev.bind()?;
            self.comms.get(self.cfg.init_timeout)?;
            return Ok(());
        }
        let plan = self.plan.clone();
        let other = plan.side.other();
        let mine = self.lib.version().to_string();
        let mut sizes = HashMap::with_capacity(plan.peers.len());
        let mut delta_peers = Vec::with_capacity(plan.peers.len());
        for p in &plan.peers {
            let (rank, their_peers, budget, version, theirs) =
                peer_values(other, p.peer, peers.get(&p.peer))?;
            delta_peers.push(self.deltas_on && theirs);
            let want = self.cfg.world.comm_rank(other, p.peer)?;
            if rank != u64::from(want) {
                return Err(NcclError::Rendezvous(format!(
                    "{other} rank {} says it is communicator rank {rank}, but this rank numbers it {want}; both sides must describe the same pair ({})",
                    p.peer, self.cfg.world
                )));
            }
            if version != mine {
                return Err(NcclError::Rendezvous(format!(
                    "this rank loaded NCCL {mine} but {other} rank {} loaded NCCL {version}; every rank of a pair must load the same NCCL",
                    p.peer
                )));
            }
            let size =
                pair_bucket_bytes(self.cfg.bucket_bytes, plan.peers.len(), budget, their_peers);
            sizes.insert(p.peer, size);
        }
        let buckets = peer_buckets(&plan, |peer| sizes.get(&peer).copied().unwrap_or(1));
        let steps = schedule(&plan, &buckets)?;
        let program = Program::build(&plan, &buckets, &steps, &self.tensors, &self.cfg.world)?;
        self.gpu.dev.bind()?;
        let slots = if program.slot_bytes > 0 {
            Some([
                self.gpu.dev.alloc(program.slot_bytes)?,
                self.gpu.dev.alloc(program.slot_bytes)?,
            ])
        } else {
            None
        };
        let base = |s: usize| slots.as_ref().map_or(0, |b| b[s].ptr());
        let copies = program
            .steps
            .iter()
            .map(|st| {
                [
                    st.copies(program.side, base(0)),
                    st.copies(program.side, base(1)),
                ]
            })
            .collect();
        let fp8 = self.fp8_pack(&program, &base)?;
        let deltas = if delta_peers.iter().any(|&d| d) {
            Some(deltas::setup(&self.gpu.dev, &program, &delta_peers, &base)?)
        } else {
            None
        };
        let transposes = if program.steps.iter().any(|st| st.has_transposes()) {
            let kernel = TransposeKernel::load(&self.gpu.dev)?;
            let (mut unpack, mut gather) = (Vec::new(), Vec::new());
            for (k, st) in program.steps.iter().enumerate() {
                let slot = base(k % 2);
                unpack.push(kernel.batch(&st.transpose_jobs(slot))?);
                gather.push(if deltas.is_some() {
                    kernel.batch(&st.gather_transpose_jobs(slot))?
                } else {
                    None
                });
            }
            Some(Transposes {
                kernel,
                unpack,
                gather,
            })
        } else {
            None
        };
        let converts = if program.steps.iter().any(|st| st.has_converts()) {
            let kernel = TransposeKernel::load(&self.gpu.dev)?;
            let mut batches = Vec::with_capacity(program.steps.len());
            for st in &program.steps {
                let b = |s: usize| kernel.batch(&st.convert_jobs(base(s)));
                batches.push(match (b(0)?, b(1)?) {
                    (Some(b0), Some(b1)) => Some([b0, b1]),
                    _ => None,
                });
            }
            Some(ConvertPack {
                stream: self.gpu.dev.stream()?,
                done: [self.gpu.dev.event(false)?, self.gpu.dev.event(false)?],
                kernel,
                batches,
            })
        } else {
            None
        };
        self.comms.get(self.cfg.init_timeout)?;
        self.conn = Some(Connected {
            program,
            copies,
            fp8,
            slots,
            deltas,
            transposes,
            converts,
        });
        Ok(())
    }

    /// The kernel and per-step batches that quantise a training program's sender-encoded
    /// pieces into the slots at `base(0)` and `base(1)`; `None` when it has none.
    fn fp8_pack(
        &self,
        program: &Program,
        base: &dyn Fn(usize) -> u64,
    ) -> Result<Option<Fp8Pack>, NcclError> {
        let Some(first) = program.steps.iter().find(|s| s.has_fp8()) else {
            return Ok(None);
        };
        let tensor = first.fp8_tensors().next().unwrap_or("?");
        let Some(q) = self.fp8.clone() else {
            return Err(NcclError::Plan(format!(
                "the plan quantises `{tensor}` on this sender, but the rank was not given the inference side's FP8 config; both sides must be built with the same FP8 inference config"
            )));
        };
        if program.fp8.as_ref() != Some(&q.encoding) {
            return Err(NcclError::Plan(format!(
                "the plan encodes `{tensor}` as {:?}, but this rank was given {:?}; both sides must be built with the same FP8 inference config",
                program.fp8, q.encoding
            )));
        }
        let dev = &self.gpu.dev;
        let kernel = Fp8Kernel::load(dev)?;
        let mut batches = Vec::with_capacity(program.steps.len());
        let mut names = Vec::with_capacity(program.steps.len());
        for st in &program.steps {
            if !st.has_fp8() {
                batches.push(None);
                names.push(Vec::new());
                continue;
            }
            let batch = |s: usize| kernel.batch(&st.fp8_jobs(base(s)), &q.encoding);
            batches.push(Some([batch(0)?, batch(1)?]));
            names.push(st.fp8_tensors().map(Arc::from).collect());
        }
        Ok(Some(Fp8Pack {
            stream: dev.stream()?,
            done: [dev.event(false)?, dev.event(false)?],
            q,
            kernel,
            batches,
            names,
        }))
    }

    /// After an update's streams finished: an error naming the first tensor whose blocks held
    /// infinity or NaN (left unwritten on the wire; the update fails).
    fn fp8_status(&self) -> Result<(), RuntimeError> {
        let Some(f) = self.conn.as_ref().and_then(|c| c.fp8.as_ref()) else {
            return Ok(());
        };
        let err = |e: awex_gpu::cuda::CudaError| {
            RuntimeError::Fp8(format!("waiting for the FP8 kernel on the sender: {e}"))
        };
        let st = f.kernel.take_batch_status(&f.stream).map_err(err)?;
        if st.blocks == 0 {
            return Ok(());
        }
        // the status word is shared by the steps' batches: run each again alone to name the
        // tensor (into slot 0, which no operation uses any more: the streams finished)
        for (k, b) in f.batches.iter().enumerate() {
            let Some(b) = b else { continue };
            // SAFETY: the batch's jobs read registered tensors and write slot 0, both alive;
            // every operation of the update has finished.
            unsafe {
                f.kernel
                    .launch_batch(&f.stream, &b[0], f.q.recipe, &f.q.encoding)
            }
            .map_err(err)?;
            let again = f.kernel.take_batch_status(&f.stream).map_err(err)?;
            if let Some(j) = again.first_job {
                let name = f.names[k].get(j as usize).map_or("?", |n| &**n);
                return Err(RuntimeError::Fp8(format!(
                    "quantising `{name}` to FP8 ({}) on the training GPU failed: {} block(s) hold infinity or NaN; the update is not committed",
                    f.q.recipe.name(),
                    again.blocks
                )));
            }
        }
        Err(RuntimeError::Fp8(format!(
            "the FP8 kernel counted {} block(s) holding infinity or NaN, but none when quantising each step again; the update is not committed",
            st.blocks
        )))
    }

    /// After an error with a live communicator: aborts it (peers blocked on this rank are
    /// released) and marks the transport failed. Errors before the communicator exists (a peer
    /// not published yet, a bad registration) leave the transport usable for a retry.
    fn fail(&mut self, e: NcclError) -> NcclError {
        self.comms.fail(&e.to_string());
        e
    }

    fn run(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, NcclError> {
        self.usable()?;
        self.open(ctx.peers)?;
        let Some(conn) = self.conn.as_mut() else {
            return Err(NcclError::Usage(
                "the nccl transport is not connected".into(),
            ));
        };
        let gpu = &self.gpu;
        gpu.dev.bind()?;
        let Some(comm) = self.comms.live() else {
            return Err(NcclError::Usage(
                "the nccl transport has no communicator".into(),
            ));
        };
        let side = conn.program.side;
        let raw_stream = gpu.nccl_stream.as_raw();
        let mut stats = ExecStats::default();
        // an update that does not end well leaves the copy holding no version and the
        // receiver holding nothing whole
        let held = conn.deltas.as_mut().and_then(|d| {
            d.copy_version = None;
            d.held.take()
        });
        let bases = ctx.bases;
        let mut decoded: Vec<(usize, usize)> = Vec::new();
        let steps = conn.program.steps.len();
        for k in 0..steps {
            let s = k % 2;
            let slot = conn.slots.as_ref().map_or(0, |b| b[s].ptr());
            let step = &conn.program.steps[k];
            let dstep = conn
                .deltas
                .as_ref()
                .map(|d| (d, &d.steps[k]))
                .filter(|(_, ds)| ds.ops.iter().any(|o| o.is_some()));
            let mut ops: Vec<P2p> = step
                .ops
                .iter()
                .map(|o| P2p {
                    kind: o.op.kind,
                    addr: o.wire.addr(slot),
                    bytes: o.op.bytes,
                    peer: o.peer_comm,
                })
                .collect();
            let mut stop = || stop_reason(ctx, k);
            match side {
                Side::Training => {
                    if let Some((f, b)) = conn
                        .fp8
                        .as_ref()
                        .and_then(|f| Some((f, f.batches[k].as_ref()?)))
                    {
                        f.stream.wait(&gpu.free[s])?;
                        // SAFETY: the batch's jobs read registered tensor ranges and write
                        // their own ranges of slot `s` (built by `Program::build`, disjoint
                        // from the copies'), once the sends of step `k - 2` left the slot.
                        unsafe {
                            f.kernel
                                .launch_batch(&f.stream, &b[s], f.q.recipe, &f.q.encoding)?
                        };
                        f.done[s].record(&f.stream)?;
                        gpu.nccl_stream.wait(&f.done[s])?;
                    }
                    if let Some((c, b)) = conn
                        .converts
                        .as_ref()
                        .and_then(|c| Some((c, c.batches[k].as_ref()?)))
                    {
                        c.stream.wait(&gpu.free[s])?;
                        // SAFETY: the batch's jobs read registered tensor ranges and write
                        // their own ranges of slot `s` (built by `Program::build`, disjoint
                        // from the copies' and the quantisations'), once the sends of step
                        // `k - 2` left the slot.
                        unsafe { c.kernel.launch(&c.stream, &b[s])? };
                        c.done[s].record(&c.stream)?;
                        gpu.nccl_stream.wait(&c.done[s])?;
                    }
                    if step.has_copies() {
                        // SAFETY: the copies were built by `Program::build` over registered tensor
                        // ranges and staging slots, ordered by the events above.
                        unsafe {
                            gpu.engine.launch(
                                &conn.copies[k][s],
                                Some(&gpu.free[s]),
                                Some(&gpu.ready[s]),
                            )?
                        };
                        gpu.nccl_stream.wait(&gpu.ready[s])?;
                    }
                    if let Some((d, ds)) = dstep {
                        // the kernels that packed part of the slot beside the copies
                        let packed: Vec<&Event> = conn
                            .fp8
                            .as_ref()
                            .filter(|f| f.batches[k].is_some())
                            .map(|f| &f.done[s])
                            .into_iter()
                            .chain(
                                conn.converts
                                    .as_ref()
                                    .filter(|c| c.batches[k].is_some())
                                    .map(|c| &c.done[s]),
                            )
                            .collect();
                        let heads = deltas::send(
                            gpu, d, ds, step, s, &packed, bases, comm, ctx, k, &mut stats,
                        )?;
                        for (i, h) in heads {
                            if let BucketHeader::Delta { len, .. } = h
                                && let Some((off, _)) = ds.frames.at[i]
                            {
                                ops[i].addr = d.frames[s].ptr() + off;
                                ops[i].bytes = len;
                            }
                        }
                    }
                    // SAFETY: the stream is this device's; every address is a registered
                    // tensor range, a staging slot or a frame (checked by `Program::build`
                    // and the frame layout), ordered by the events above.
                    unsafe { comm.group(&ops, raw_stream, &mut stop)? };
                    if let Some((d, _)) = dstep {
                        // the copy's update reads the frames: both done before the slot and
                        // the frames are reused
                        gpu.nccl_stream.wait(&d.done[s])?;
                    }
                    gpu.free[s].record(&gpu.nccl_stream)?;
                }
                Side::Inference => {
                    gpu.nccl_stream.wait(&gpu.free[s])?;
                    if let Some((d, ds)) = dstep {
                        let heads = deltas::receive_headers(gpu, d, ds, step, held, comm, ctx, k)?;
                        let mut any = false;
                        for &(i, h) in &heads {
                            if let BucketHeader::Delta { len, .. } = h
                                && let Some((off, _)) = ds.frames.at[i]
                            {
                                ops[i].addr = d.frames[s].ptr() + off;
                                ops[i].bytes = len;
                                any = true;
                            }
                        }
                        if any && !ds.gathers.is_empty() {
                            // SAFETY: the gathers read registered tensor ranges into slot
                            // `s`, once the unpack of step `k - 2` emptied it.
                            unsafe {
                                gpu.engine.launch(
                                    &ds.gathers,
                                    Some(&gpu.free[s]),
                                    Some(&d.done[s]),
                                )?
                            };
                            gpu.nccl_stream.wait(&d.done[s])?;
                        }
                        if let (true, Some(t)) = (any, conn.transposes.as_ref())
                            && let Some(b) = &t.gather[k]
                        {
                            // SAFETY: the jobs read the transposed boxes of registered tensors
                            // into their ranges of slot `s` (free: this stream waited above).
                            unsafe { t.kernel.launch(&gpu.nccl_stream, b)? };
                        }
                        // SAFETY: as for sends; the frames of step `k - 2` were applied on
                        // this stream before.
                        unsafe { comm.group(&ops, raw_stream, &mut stop)? };
                        for (i, h) in heads {
                            let (BucketHeader::Delta { len, .. }, Some((off, _)), Some(od)) =
                                (h, ds.frames.at[i], ds.ops[i].as_ref())
                            else {
                                continue;
                            };
                            // SAFETY: the work's segments are the bucket's place (a registered
                            // tensor range or the slot), the frame lies in the frame buffer
                            // (`len` within the bucket's longest frame, checked with the
                            // header); both are used by nothing else until the step's unpack.
                            unsafe {
                                d.kernels.launch_decode(
                                    &gpu.nccl_stream,
                                    &od.work,
                                    d.frames[s].ptr() + off,
                                    len,
                                )?
                            };
                            decoded.push((k, i));
                            stats.delta.elements += od.elements;
                            stats.delta.dense_bytes += step.ops[i].op.bytes;
                            stats.delta.delta_bytes += len;
                        }
                    } else {
                        // SAFETY: as for sends; the slot is free once `free[s]` has passed.
                        unsafe { comm.group(&ops, raw_stream, &mut stop)? };
                    }
                    let transposed = conn.transposes.as_ref().and_then(|t| {
                        let b = t.unpack[k].as_ref()?;
                        Some((&t.kernel, b))
                    });
                    if let Some((kernel, b)) = transposed {
                        // SAFETY: the jobs read slot `s` (received above, on this stream) and
                        // write the transposed boxes of registered tensors, each once.
                        unsafe { kernel.launch(&gpu.nccl_stream, b)? };
                    }
                    if step.has_copies() {
                        gpu.ready[s].record(&gpu.nccl_stream)?;
                        // SAFETY: as for sends.
                        unsafe {
                            gpu.engine.launch(
                                &conn.copies[k][s],
                                Some(&gpu.ready[s]),
                                Some(&gpu.free[s]),
                            )?
                        };
                    } else if transposed.is_some() {
                        // the slot is free once the transposes read it (a delta's gather
                        // into it waits for this)
                        gpu.free[s].record(&gpu.nccl_stream)?;
                    }
                }
            }
            stats.bytes += ops.iter().map(|o| o.bytes).sum::<u64>();
            stats.buckets += step.ops.len() as u64;
            if ctx.checksums {
                wait_streams(gpu, dstep.map(|(d, _)| &d.stream), comm, ctx, k)?;
                let mut buf = Vec::new();
                // the buckets' bytes as they end up (a delta's result, not its frame)
                for (i, o) in step.ops.iter().enumerate() {
                    buf.resize(o.op.bytes as usize, 0);
                    // SAFETY: the address is a registered tensor range or a staging slot of
                    // `o.op.bytes` bytes, its step synchronised above.
                    unsafe { gpu.dev.copy_to_host(o.wire.addr(slot), &mut buf)? };
                    if ctx.corrupt && side == Side::Inference && k == 0 && i == 0 && !buf.is_empty()
                    {
                        buf[0] ^= 0x5a;
                    }
                    stats.checksum = stats
                        .checksum
                        .wrapping_add(xxhash_rust::xxh3::xxh3_64(&buf));
                }
            }
        }
        let dstream = conn.deltas.as_ref().map(|d| &d.stream);
        wait_streams(gpu, dstream, comm, ctx, steps)?;
        if let Some(d) = conn.deltas.as_ref() {
            // every frame applied, or none of the bucket written: the kernels check a frame
            // whole before they write
            for &(k, i) in &decoded {
                if let Some(od) = d.steps[k].ops[i].as_ref() {
                    d.kernels
                        .finish_decode(&gpu.nccl_stream, &od.work)
                        .map_err(|e| {
                            NcclError::Plan(format!(
                                "applying the delta of bucket {} from {} failed: {e}; the update is not committed",
                                conn.program.steps[k].ops[i].op.bucket,
                                conn.program.steps[k].ops[i].op.peer
                            ))
                        })?;
                }
            }
            for (k, ds) in d.steps.iter().enumerate() {
                for (i, od) in ds.ops.iter().enumerate() {
                    if let Some(w) = od.as_ref().and_then(|o| o.into_copy.as_ref()) {
                        d.kernels.finish_decode(&d.stream, w).map_err(|e| {
                            NcclError::Plan(format!(
                                "updating this rank's copy of bucket {} to {} failed: {e}; the update is not committed",
                                conn.program.steps[k].ops[i].op.bucket,
                                conn.program.steps[k].ops[i].op.peer
                            ))
                        })?;
                    }
                }
            }
        }
        Ok(stats)
    }

    /// After an update completed on this rank (every byte moved, FP8 blocks finite): the copy
    /// holds the version sent, the tensors hold the version received.
    fn deltas_done(&mut self, version: u64) {
        if let Some(d) = self.conn.as_mut().and_then(|c| c.deltas.as_mut()) {
            match self.plan.side {
                Side::Training => d.copy_version = Some(version),
                Side::Inference => d.held = Some(version),
            }
        }
    }
}

/// The kv value of unique id `uid` published under `key`: `{"sealed": hex}`, sealed with the
/// pair secret and bound to `key` (which names the version and attempt).
pub fn seal_uid(secret: &PairSecret, key: &str, uid: &UniqueId) -> serde_json::Value {
    serde_json::json!({ "sealed": secret.seal(key, &uid.0) })
}

/// Opens the unique id published under `key` ([`seal_uid`]); refuses, naming why, a value
/// that is not sealed or does not verify with the pair secret for `key`.
pub fn open_uid(
    secret: &PairSecret,
    key: &str,
    value: &serde_json::Value,
) -> Result<UniqueId, NcclError> {
    let refused = |why: String| {
        NcclError::Rendezvous(format!(
            "refused the NCCL unique id in kv `{key}` of pair `{}`: {why}; no communicator is built from it",
            secret.pair()
        ))
    };
    let Some(sealed) = value.get("sealed").and_then(|v| v.as_str()) else {
        return Err(refused(
            "it is not sealed with the pair secret (a bare id is what a process without the secret, or an awex that predates sealing, writes)".into(),
        ));
    };
    let plain = secret.open(key, sealed).map_err(|e| match e {
        SealError::Forged => refused(e.to_string()),
        SealError::Malformed(m) => refused(format!("its sealed form is malformed ({m})")),
    })?;
    let bytes: [u8; 128] = plain
        .as_slice()
        .try_into()
        .map_err(|_| refused(format!("it holds {} bytes, not 128", plain.len())))?;
    Ok(UniqueId(bytes))
}

/// What a rank publishes once joined: the sealed unique id, from training rank 0 only.
fn uid_at_join(
    side: Side,
    rank: RankId,
    uid: Option<UniqueId>,
    secret: Option<&PairSecret>,
) -> Result<Option<(String, serde_json::Value)>, NcclError> {
    match uid {
        Some(uid) if creates_uid(side, rank) => {
            let secret = need_secret(secret)?;
            Ok(Some((UID_KEY.to_string(), seal_uid(secret, UID_KEY, &uid))))
        }
        _ => Ok(None),
    }
}

fn need_secret(secret: Option<&PairSecret>) -> Result<&PairSecret, NcclError> {
    secret.ok_or_else(|| {
        NcclError::Rendezvous(
            "the nccl transport seals its unique id with the pair secret, but this rank has none (the gateway's join answer carried no secret: upgrade the gateway)".into(),
        )
    })
}

/// What a rank reads once every rank has joined: the unique id, on every rank but its creator.
fn uid_after_join(side: Side, rank: RankId) -> Option<String> {
    (!creates_uid(side, rank)).then(|| UID_KEY.to_string())
}

/// The device tensors of a runtime tensor set, and the GPU they all live on.
pub(crate) fn device_tensors(set: &TensorSet) -> Result<(u32, DeviceTensors), NcclError> {
    let device = match set.location() {
        Ok(Location::Cuda(d)) => d,
        Ok(Location::Host) => {
            return Err(NcclError::Plan(
                "the nccl transport moves tensors in GPU memory, but this rank's tensors live in host memory; allocate them with TensorSet::allocate_cuda or register device views, or use the shm or tcp transport".into(),
            ));
        }
        Err(e) => return Err(NcclError::Plan(e.to_string())),
    };
    let mut out = Vec::with_capacity(set.len());
    for v in set.iter() {
        let ptr = v.device_ptr().ok_or_else(|| {
            NcclError::Plan(format!("`{}` does not live on GPU {device}", v.name))
        })?;
        out.push(awex_gpu::nccl::DeviceTensor {
            name: v.name.clone(),
            ptr,
            dtype: v.dtype,
            shape: v.shape,
        });
    }
    // SAFETY: the views are device memory on `device` that the set's owner keeps allocated and
    // leaves alone during updates (the contract of `TensorView::new_cuda`); the transport
    // holds the set.
    let tensors = unsafe { DeviceTensors::new(out)? };
    Ok((device, tensors))
}

/// Why the update must stop now, if it must.
fn stop_reason(ctx: &ExecContext<'_>, step: usize) -> Option<NcclError> {
    if ctx.cancel.load(Ordering::Acquire) {
        return Some(NcclError::Cancelled(ctx.version));
    }
    if Instant::now() >= ctx.deadline {
        return Some(NcclError::OpTimeout {
            step,
            detail: format!("update {} reached its deadline", ctx.version),
        });
    }
    None
}

/// Waits for everything queued on the NCCL stream, the copy engine and `extra` (the delta
/// stream), watching the deadline, the cancel flag and the communicator; aborts the
/// communicator when one of them says stop.
fn wait_streams(
    gpu: &Gpu,
    extra: Option<&Arc<Stream>>,
    comm: &mut Communicator,
    ctx: &ExecContext<'_>,
    step: usize,
) -> Result<(), NcclError> {
    let (nccl, engine, extra) = (gpu.nccl_stream.clone(), gpu.engine.clone(), extra.cloned());
    wait_watching(
        move || {
            nccl.sync()?;
            engine.sync()?;
            extra.map_or(Ok(()), |s| s.sync())
        },
        comm,
        ctx,
        step,
    )
}

/// Waits for everything queued on `stream`, as [`wait_streams`] does.
fn wait_one(
    stream: &Arc<Stream>,
    comm: &mut Communicator,
    ctx: &ExecContext<'_>,
    step: usize,
) -> Result<(), NcclError> {
    let s = stream.clone();
    wait_watching(move || s.sync(), comm, ctx, step)
}

/// Runs `sync` on a helper thread while the host watches the deadline, the cancel flag and
/// the communicator; aborts the communicator when one of them says stop.
fn wait_watching(
    sync: impl FnOnce() -> Result<(), awex_gpu::cuda::CudaError> + Send + 'static,
    comm: &mut Communicator,
    ctx: &ExecContext<'_>,
    step: usize,
) -> Result<(), NcclError> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("awex-nccl-wait".into())
        .spawn(move || {
            let _ = tx.send(sync());
        })
        .map_err(|e| NcclError::Usage(format!("cannot start the stream waiter: {e}")))?;
    let mut pause = Duration::from_micros(20);
    loop {
        match rx.recv_timeout(pause) {
            Ok(r) => return r.map_err(NcclError::from),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(NcclError::Usage("the stream waiter stopped".into()));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        pause = (pause * 2).min(Duration::from_millis(2));
        comm.check()?;
        if let Some(e) = stop_reason(ctx, step) {
            comm.abort(&e.to_string());
            // aborting ends NCCL's kernels, so the streams drain; give them a moment
            let _ = rx.recv_timeout(Duration::from_secs(10));
            return Err(e);
        }
    }
}

impl Transport for NcclTransport {
    fn kind(&self) -> awex_core::Transport {
        awex_core::Transport::Nccl
    }

    fn rendezvous(&self) -> serde_json::Value {
        rendezvous_value(
            self.me,
            self.plan.peers.len(),
            self.cfg.bucket_bytes,
            &self.lib.version().to_string(),
            self.cfg.deltas,
        )
    }

    fn authenticate(&mut self, secret: &PairSecret) {
        self.secret = Some(secret.clone());
    }

    fn kv_at_join(&self) -> Result<Option<(String, serde_json::Value)>, RuntimeError> {
        Ok(uid_at_join(
            self.plan.side,
            self.plan.rank,
            self.unique_id(),
            self.secret.as_ref(),
        )?)
    }

    fn kv_after_join(&self) -> Option<String> {
        uid_after_join(self.plan.side, self.plan.rank)
    }

    fn check_kv(&self, key: &str, value: &serde_json::Value) -> Result<(), RuntimeError> {
        open_uid(need_secret(self.secret.as_ref())?, key, value)?;
        Ok(())
    }

    fn joined(
        &mut self,
        value: Option<&serde_json::Value>,
        join_deadline: Duration,
    ) -> Result<(), RuntimeError> {
        if let Some(v) = value {
            let uid = open_uid(need_secret(self.secret.as_ref())?, UID_KEY, v)?;
            self.comms.set_uid(UID_KEY, uid);
        }
        self.cfg.init_timeout = join_deadline;
        Ok(())
    }

    fn connect(&mut self, peers: &HashMap<RankId, serde_json::Value>) -> Result<(), RuntimeError> {
        self.open(peers).map_err(|e| self.fail(e).into())
    }

    fn execute(&mut self, ctx: &ExecContext<'_>) -> Result<ExecStats, RuntimeError> {
        let stats = self.run(ctx).map_err(|e| -> RuntimeError {
            match e {
                // a transport already failed reports its first reason
                e @ NcclError::Aborted(_) => e.into(),
                e => self.fail(e).into(),
            }
        })?;
        // every operation completed: a non-finite block fails this update, not the transport
        self.fp8_status()?;
        self.deltas_done(ctx.version);
        Ok(stats)
    }

    fn enable_deltas(&mut self) -> Result<bool, RuntimeError> {
        if !self.cfg.deltas {
            return Ok(false);
        }
        if self.conn.is_some() {
            return Err(crate::TransportError::Unsupported(
                "nccl: delta updates must be turned on before the rank connects".into(),
            )
            .into());
        }
        self.deltas_on = true;
        Ok(true)
    }

    fn holds_base(&self) -> bool {
        self.deltas_on && self.plan.side == Side::Inference
    }

    fn kv_before_attempt(
        &mut self,
        version: u64,
        attempt: u32,
    ) -> Result<Option<(String, serde_json::Value)>, RuntimeError> {
        let _ = self.gpu.dev.bind();
        let Some((key, _)) =
            self.comms
                .publish_for_attempt(self.plan.side, self.plan.rank, version, attempt)?
        else {
            return Ok(None);
        };
        let secret = need_secret(self.secret.as_ref())?;
        let uid = self
            .comms
            .uid()
            .map(|(_, u)| u)
            .ok_or_else(|| NcclError::Usage(format!("no unique id for kv `{key}`")))?;
        Ok(Some((key.clone(), seal_uid(secret, &key, &uid))))
    }

    fn kv_for_attempt(&self, version: u64, attempt: u32) -> Option<String> {
        AttemptComm::read_for_attempt(self.plan.side, self.plan.rank, version, attempt)
    }

    fn begin_attempt(&mut self, key: &str, value: &serde_json::Value) -> Result<(), RuntimeError> {
        let _ = self.gpu.dev.bind();
        let uid = open_uid(need_secret(self.secret.as_ref())?, key, value)?;
        self.comms.set_uid(key, uid);
        Ok(())
    }

    fn close(&mut self) {
        let _ = self.gpu.dev.bind();
        // flushing may fail when a peer is gone; destroy then aborts, which never hangs
        let _ = self.comms.close(self.cfg.teardown_timeout);
        self.conn = None;
    }
}

impl Drop for NcclTransport {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_training_rank_0_publishes_the_uid_sealed_and_every_other_rank_reads_it() {
        let uid = UniqueId([0xab; 128]);
        let secret = PairSecret::random("p");
        let (key, value) = uid_at_join(Side::Training, RankId::train(0), Some(uid), Some(&secret))
            .unwrap()
            .unwrap();
        assert_eq!(key, "nccl.uid");
        // the kv value reveals nothing of the id
        assert!(!value.to_string().contains(&"ab".repeat(8)), "{value}");
        assert_eq!(open_uid(&secret, "nccl.uid", &value).unwrap(), uid);
        assert_eq!(uid_after_join(Side::Training, RankId::train(0)), None);
        for (side, rank) in [
            (Side::Training, RankId::train(1)),
            (Side::Inference, RankId::infer(0, 0)),
            (Side::Inference, RankId::infer(1, 3)),
        ] {
            assert_eq!(
                uid_at_join(side, rank, Some(uid), Some(&secret)).unwrap(),
                None
            );
            assert_eq!(uid_after_join(side, rank), Some("nccl.uid".to_string()));
        }
        // without the secret the creator refuses to publish a bare id
        let e = uid_at_join(Side::Training, RankId::train(0), Some(uid), None).unwrap_err();
        assert!(e.to_string().contains("has none"), "{e}");
    }

    #[test]
    fn forged_tampered_and_replayed_uids_are_refused() {
        let secret = PairSecret::random("p");
        let uid = UniqueId([0x11; 128]);
        // a bare id, as an injector with everything public (or an old awex) writes it
        let e = open_uid(&secret, "nccl.uid", &UniqueId([0x22; 128]).to_kv()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "refused the NCCL unique id in kv `nccl.uid` of pair `p`: it is not sealed with the pair secret (a bare id is what a process without the secret, or an awex that predates sealing, writes); no communicator is built from it"
        );
        // sealed with another secret (the injector's own)
        let forged = seal_uid(&PairSecret::random("p"), "nccl.uid", &UniqueId([0x22; 128]));
        let e = open_uid(&secret, "nccl.uid", &forged)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not verify with the pair secret"), "{e}");
        // replayed from a retry's key (another version or attempt)
        let retry = seal_uid(&secret, "nccl.uid.3.2", &uid);
        assert_eq!(open_uid(&secret, "nccl.uid.3.2", &retry).unwrap(), uid);
        assert!(open_uid(&secret, "nccl.uid.4.2", &retry).is_err());
        assert!(open_uid(&secret, "nccl.uid.3.3", &retry).is_err());
        // tampered
        let mut t = retry.clone();
        let s = t["sealed"].as_str().unwrap().to_string();
        let flipped = format!("{}{}", if s.starts_with('0') { "1" } else { "0" }, &s[1..]);
        t["sealed"] = flipped.into();
        assert!(open_uid(&secret, "nccl.uid.3.2", &t).is_err());
        let e = open_uid(&secret, "nccl.uid", &serde_json::json!({"sealed": "xyz"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("malformed"), "{e}");
    }

    #[test]
    fn host_tensors_are_refused_with_the_way_to_put_them_on_a_gpu() {
        let layout = awex_core::layout::RankLayout {
            rank: RankId::train(0),
            tensors: vec![awex_core::layout::LocalTensor {
                name: Arc::from("w"),
                shape: awex_core::layout::Dims::new(&[2, 4]),
                dtype: awex_core::dtype::DType::Bf16,
                encoding: awex_core::encoding::Encoding::Plain(awex_core::dtype::DType::Bf16),
                placements: vec![],
            }],
        };
        let set = TensorSet::allocate_host(&layout).unwrap();
        assert_eq!(
            device_tensors(&set).unwrap_err().to_string(),
            "the nccl transport moves tensors in GPU memory, but this rank's tensors live in host memory; allocate them with TensorSet::allocate_cuda or register device views, or use the shm or tcp transport"
        );
    }

    #[test]
    fn the_rank_gpu_is_the_one_its_registered_tensors_live_on() {
        use crate::TensorView;
        use awex_core::dtype::DType;
        use awex_core::layout::Dims;
        // device views are only stored, never dereferenced: no driver needed
        let view = |name: &str, ptr: u64, device: u32| {
            // SAFETY: the addresses are never touched.
            unsafe { TensorView::new_cuda(name, ptr, 32, DType::F32, Dims::new(&[8]), device) }
                .unwrap()
        };
        let set = TensorSet::from_views(vec![
            view("a", 0x7f00_0000_0000, 3),
            view("b", 0x7f00_0000_1000, 3),
        ])
        .unwrap();
        let (device, tensors) = device_tensors(&set).unwrap();
        assert_eq!(device, 3);
        assert_eq!(tensors.len(), 2);
        let mixed = TensorSet::from_views(vec![
            view("a", 0x7f00_0000_0000, 0),
            view("b", 0x7f00_0000_1000, 1),
        ])
        .unwrap();
        assert_eq!(
            device_tensors(&mixed).unwrap_err().to_string(),
            "tensor: `a` lives in GPU 0 memory but `b` in GPU 1 memory; register every tensor of a rank in one place"
        );
    }

    #[test]
    fn rendezvous_values_round_trip_and_missing_ones_are_named() {
        let v = rendezvous_value(5, 3, 1 << 20, "2.21.5", true);
        assert_eq!(
            peer_values(Side::Training, RankId::train(5), Some(&v)).unwrap(),
            (5, 3, 1 << 20, "2.21.5".to_string(), true)
        );
        // a peer that publishes nothing about deltas (an older awex) takes no part in them
        let mut old = v.clone();
        old.as_object_mut().unwrap().remove("deltas");
        assert!(
            !peer_values(Side::Training, RankId::train(5), Some(&old))
                .unwrap()
                .4
        );
        let e = peer_values(
            Side::Inference,
            RankId::infer(1, 2),
            Some(&serde_json::json!({"addr": "x"})),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "inference rank 1/2 published no `nccl_version` in its nccl rendezvous; is it running the nccl transport of this awex version?"
        );
        let e = peer_values(Side::Training, RankId::train(0), None).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("training rank 0/0 published no `nccl_rank`")
        );
    }
}
