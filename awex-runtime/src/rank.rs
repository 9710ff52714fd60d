//! A rank of a pair: joins through the gateway, then executes its plan for every update version
//! and reports. Training ranks are writers, inference ranks readers; the code is shared.

use super::RuntimeError;
use super::tensors::TensorSet;
use super::transport::{
    CudaIpcTransport, ExecContext, ExecStats, PairSecret, ShmTransport, StagedTransport,
    TcpTransport, Transport, TransportKind,
};
use awex_control::client::{Client, ClientError};
use awex_control::wire::{
    ApplyMode, CAP_ATOMIC_APPLY, EventKind, JoinRequest, JoinResponse, Report,
};
use awex_core::backend::{BackendSpec, side_layout};
use awex_core::layout::{RankId, RankLayout, Side, SideLayout};
use awex_core::model::{Catalogue, ModelSpec};
use awex_core::plan::{Pair, RankPlan};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Everything a rank needs to know to take part in a pair.
#[derive(Clone, Debug)]
pub struct RankConfig {
    /// Gateway base URL.
    pub gateway: String,
    /// Bearer token.
    pub token: Option<String>,
    /// Pair name.
    pub pair: String,
    /// This rank's side.
    pub side: Side,
    /// This rank.
    pub rank: RankId,
    /// The model.
    pub model: ModelSpec,
    /// Training layout spec.
    pub train: BackendSpec,
    /// Inference layout spec.
    pub infer: BackendSpec,
    /// How bytes move.
    pub transport: TransportKind,
    /// Staging bucket size in bytes.
    pub bucket_bytes: u64,
    /// Host this rank advertises to peers (tcp).
    pub host: String,
    /// The pair's connect uid (`PairStatus::uid`), which names its shared-memory segments;
    /// empty when not known yet ([`pair_uid`] asks the gateway).
    pub uid: String,
    /// How the pair applies updates (`PairOptions::apply`, from its status); an inference
    /// rank of an `atomic` pair receives into staging ([`make_transport`]).
    pub apply: ApplyMode,
}

impl RankConfig {
    /// Where this rank's shared-memory segments are named.
    pub fn shm_scope(&self) -> crate::host::ShmScope {
        crate::host::ShmScope::new(&self.pair, &self.uid)
    }
}

/// The connect uid of the pair a rank is configured for (asks the gateway's status).
pub async fn pair_uid(cfg: &RankConfig) -> Result<String, RankError> {
    Ok(pair_settings(cfg).await?.0)
}

/// The connect uid and the apply mode of the pair a rank is configured for (asks the
/// gateway's status), for [`RankConfig::uid`] and [`RankConfig::apply`].
pub async fn pair_settings(cfg: &RankConfig) -> Result<(String, ApplyMode), RankError> {
    let client = Client::new(&cfg.gateway, cfg.token.clone())?;
    let st = client.status(&cfg.pair).await?;
    Ok((st.uid, st.options.apply))
}

/// A rank's layout and plan, computed before it joins (so tensors can be checked first).
pub struct Prepared {
    /// The model's catalogue.
    pub catalogue: Catalogue,
    /// This rank's local tensors.
    pub layout: RankLayout,
    /// This rank's plan.
    pub plan: Arc<RankPlan>,
}

/// Why a rank failed outside an update.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    /// Talking to the gateway failed.
    #[error(transparent)]
    Gateway(#[from] ClientError),
    /// The runtime failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The layout could not be built.
    #[error("layout: {0}")]
    Layout(String),
    /// The pair was disconnected.
    #[error("pair disconnected")]
    Disconnected,
}

/// Computes this rank's layout and plan.
pub fn prepare(cfg: &RankConfig) -> Result<Prepared, RankError> {
    let catalogue = Catalogue::of(&cfg.model);
    let training = side_layout(Side::Training, &cfg.train, &cfg.model)
        .map_err(|e| RankError::Layout(e.to_string()))?;
    let inference = side_layout(Side::Inference, &cfg.infer, &cfg.model)
        .map_err(|e| RankError::Layout(e.to_string()))?;
    let mine: &dyn SideLayout = match cfg.side {
        Side::Training => &*training,
        Side::Inference => &*inference,
    };
    let layout = mine.rank_layout(cfg.rank).ok_or_else(|| {
        RankError::Layout(format!(
            "{} layout {} has no rank {} (world size {})",
            cfg.side,
            match cfg.side {
                Side::Training => &cfg.train,
                Side::Inference => &cfg.infer,
            },
            cfg.rank,
            mine.world_size()
        ))
    })?;
    let pair = Pair {
        catalogue: &catalogue,
        training: &*training,
        inference: &*inference,
    };
    let plan = Arc::new(
        pair.plan_rank(cfg.side, cfg.rank)
            .map_err(RuntimeError::from)?,
    );
    Ok(Prepared {
        catalogue,
        layout,
        plan,
    })
}

/// The kv key under which a rank publishes its rendezvous info.
pub fn rendezvous_key(side: Side, rank: RankId) -> String {
    format!("rdv.{}.{}.{}", side.short(), rank.engine, rank.rank)
}

/// Builds the transport of a rank over its live `tensors`. An inference rank of an atomic pair
/// (`cfg.apply`) gets a [`StagedTransport`]: the transport moves bytes into a staging copy of
/// its tensors (same kind of memory), which is copied into `tensors` only on the gateway's
/// `apply` event.
pub fn make_transport(
    cfg: &RankConfig,
    prepared: &Prepared,
    tensors: Arc<TensorSet>,
) -> Result<Box<dyn Transport>, RuntimeError> {
    if cfg.apply == ApplyMode::Atomic && cfg.side == Side::Inference {
        let staging = Arc::new(tensors.staging_like()?);
        let inner = transport_over(cfg, prepared, staging.clone())?;
        return Ok(Box::new(StagedTransport::new(inner, staging, tensors)));
    }
    transport_over(cfg, prepared, tensors)
}

fn transport_over(
    cfg: &RankConfig,
    prepared: &Prepared,
    tensors: Arc<TensorSet>,
) -> Result<Box<dyn Transport>, RuntimeError> {
    // `awex-{pair}-{uid}-{rank}-ctl`: exact names, liveness by lock (see `crate::shm`)
    let ctl = cfg.shm_scope().name(
        &crate::host::rank_tag(&cfg.side.short()[..1], cfg.rank),
        "ctl",
    );
    if matches!(cfg.transport, TransportKind::Shm | TransportKind::CudaIpc) {
        // the segments of ranks killed earlier on this host (the next connect reclaims them)
        crate::shm::gc(None);
    }
    match cfg.transport {
        TransportKind::Shm => Ok(Box::new(ShmTransport::new(
            prepared.plan.clone(),
            tensors,
            cfg.bucket_bytes,
            &ctl,
        )?)),
        TransportKind::Tcp => {
            let bind = std::env::var("AWEX_TCP_BIND").unwrap_or_else(|_| format!("{}:0", cfg.host));
            Ok(Box::new(TcpTransport::new(
                prepared.plan.clone(),
                tensors,
                cfg.bucket_bytes,
                &bind,
                &cfg.host,
            )?))
        }
        TransportKind::CudaIpc => Ok(Box::new(CudaIpcTransport::new(
            prepared.plan.clone(),
            tensors,
            cfg.bucket_bytes,
            &ctl,
        )?)),
        TransportKind::Nccl => nccl_transport(cfg, prepared, tensors),
    }
}

/// The `nccl` transport of a rank over its device tensors: one communicator for the whole
/// pair. Training rank 0 creates the communicator's unique id here and publishes it, sealed
/// with the pair secret, right after it joined ([`Transport::kv_at_join`]); every other rank
/// reads and verifies it once all ranks have joined, so no rank waits on one that waits on it.
fn nccl_transport(
    cfg: &RankConfig,
    prepared: &Prepared,
    tensors: Arc<TensorSet>,
) -> Result<Box<dyn Transport>, RuntimeError> {
    use crate::transport::{NcclConfig, NcclTransport};
    use awex_gpu::nccl::{CommWorld, Library, NcclError, creates_uid};
    if !awex_gpu::cuda::BUILT {
        return Err(RuntimeError::Config(NcclError::NeedsCuda.to_string()));
    }
    let training = side_layout(Side::Training, &cfg.train, &cfg.model)
        .map_err(|e| RuntimeError::Layout(e.to_string()))?;
    let inference = side_layout(Side::Inference, &cfg.infer, &cfg.model)
        .map_err(|e| RuntimeError::Layout(e.to_string()))?;
    let world = CommWorld::of(&*training, &*inference)?;
    let lib = Arc::new(Library::load()?);
    let uid = if creates_uid(cfg.side, cfg.rank) {
        Some(lib.unique_id()?)
    } else {
        None
    };
    // the GPU of the registered tensors (for_rank checks they all share it)
    let device = match tensors.location() {
        Ok(crate::Location::Cuda(d)) => d,
        _ => 0,
    };
    let mut nc = NcclConfig::new(device, world);
    nc.bucket_bytes = cfg.bucket_bytes;
    Ok(Box::new(NcclTransport::for_rank(
        lib,
        nc,
        prepared.plan.clone(),
        tensors,
        uid,
    )?))
}

/// Reads the pair kv value a transport needs after joining ([`Transport::kv_after_join`]) or
/// before a retry, accepted only once `check` passes: a value that fails it (a forged or
/// replayed NCCL id) is refused, and the read waits for a genuine one (the publisher's write
/// replaces it) until `wait` has passed, then fails with the refusal. Its publisher puts it
/// right after joining and every rank has joined, so it is there unless the publisher is not
/// running this transport; the wait is bounded all the same.
pub async fn read_checked_kv(
    client: &Client,
    pair: &str,
    key: &str,
    wait: Duration,
    check: impl Fn(&serde_json::Value) -> Result<(), RuntimeError>,
) -> Result<serde_json::Value, RankError> {
    let end = Instant::now() + wait;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let value = match client.get_kv(pair, key, left).await {
            Ok(e) => e.value,
            Err(e) if e.status() == Some(404) => {
                return Err(RankError::Runtime(RuntimeError::Config(format!(
                    "pair `{pair}` has no kv `{key}` although every rank has joined (waited {wait:?}); the rank that publishes it once joined (training rank 0 for nccl) must run the same transport"
                ))));
            }
            Err(e) => return Err(e.into()),
        };
        match check(&value) {
            Ok(()) => return Ok(value),
            Err(e) if Instant::now() >= end => {
                let why = match e {
                    RuntimeError::Transport(m) => m,
                    e => e.to_string(),
                };
                return Err(RankError::Runtime(RuntimeError::Transport(format!(
                    "{why} (waited {wait:?} for a value that verifies)"
                ))));
            }
            Err(e) => {
                eprintln!("awex: pair `{pair}`: {e}; waiting for the genuine value");
                tokio::time::sleep(Duration::from_millis(100).min(left)).await;
            }
        }
    }
}

/// [`Transport::check_kv`] of a transport held behind a mutex.
fn checked(
    t: &std::sync::Mutex<Box<dyn Transport>>,
    key: &str,
    v: &serde_json::Value,
) -> Result<(), RuntimeError> {
    t.lock()
        .map_err(|_| RuntimeError::Transport("transport lock poisoned".into()))?
        .check_kv(key, v)
}

fn normalised(side: Side, spec: &BackendSpec) -> awex_core::backend::ParallelConfig {
    let keys = match side {
        Side::Training => {
            awex_core::backend::training_backend(&spec.backend).map(|b| b.parallel_keys())
        }
        Side::Inference => {
            awex_core::backend::inference_backend(&spec.backend).map(|b| b.parallel_keys())
        }
    };
    match keys {
        Ok(k) => spec
            .parallel
            .checked(k, &spec.backend)
            .unwrap_or_else(|_| spec.parallel.clone()),
        Err(_) => spec.parallel.clone(),
    }
}

/// Refuses to join a pair whose description disagrees with this rank's (model, layouts,
/// transport, bucket geometry, connect): everything a rank could get wrong is checked here,
/// before it publishes anything.
async fn check_pair(client: &Client, cfg: &RankConfig) -> Result<(), RankError> {
    let st = client.status(&cfg.pair).await?;
    if st.transport.as_str() != cfg.transport.as_str() {
        return Err(RankError::Runtime(RuntimeError::Config(format!(
            "pair `{}` uses transport {} but this rank was started with {}",
            cfg.pair,
            st.transport.as_str(),
            cfg.transport
        ))));
    }
    let pair_bucket = st.options.bucket_mib.saturating_mul(1 << 20);
    if pair_bucket != cfg.bucket_bytes {
        return Err(RankError::Runtime(RuntimeError::Config(format!(
            "pair `{}` moves buckets of {} MiB but this rank was started with {} bytes ({} MiB); every rank must use the pair's bucket_mib (the bucket geometry is part of the plan every peer checks)",
            cfg.pair,
            st.options.bucket_mib,
            cfg.bucket_bytes,
            cfg.bucket_bytes as f64 / (1u64 << 20) as f64
        ))));
    }
    if !cfg.uid.is_empty() && !st.uid.is_empty() && cfg.uid != st.uid {
        return Err(RankError::Runtime(RuntimeError::Config(format!(
            "pair `{}` was connected again (connect uid {} instead of {}); restart this rank",
            cfg.pair, st.uid, cfg.uid
        ))));
    }
    if st.options.apply != cfg.apply {
        return Err(RankError::Runtime(RuntimeError::Config(format!(
            "pair `{}` applies updates {} but this rank was configured for {}; take the apply mode from the pair's status",
            cfg.pair, st.options.apply, cfg.apply
        ))));
    }
    let fp = format!("{:016x}", cfg.model.fingerprint());
    for (side, spec, theirs) in [
        (Side::Training, &cfg.train, &st.training),
        (Side::Inference, &cfg.infer, &st.inference),
    ] {
        let pair_spec = BackendSpec {
            backend: theirs.backend.clone(),
            parallel: theirs.parallel.clone(),
        };
        if theirs.backend != spec.backend || normalised(side, spec) != normalised(side, &pair_spec)
        {
            return Err(RankError::Layout(format!(
                "this rank was started with {side} layout `{spec}` but pair `{}` was connected with `{pair_spec}`; every rank must use the pair's layouts",
                cfg.pair
            )));
        }
        if theirs.fingerprint != fp {
            return Err(RankError::Layout(format!(
                "this rank's model `{}` (fingerprint {fp}) differs from the {side} model of pair `{}` (`{}`, fingerprint {})",
                cfg.model.name, cfg.pair, theirs.model, theirs.fingerprint
            )));
        }
    }
    Ok(())
}

/// A joined rank.
pub struct Rank {
    client: Client,
    cfg: RankConfig,
    /// The join answer: roster, options.
    pub joined: JoinResponse,
    transport: Option<Box<dyn Transport>>,
    peers: HashMap<RankId, serde_json::Value>,
    last_seq: u64,
    pending: VecDeque<awex_control::wire::Event>,
    /// Test hook: corrupt one received byte of this version.
    pub corrupt_version: Option<u64>,
}

/// One update a rank was asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    /// Version.
    pub version: u64,
    /// Attempt.
    pub attempt: u32,
}

impl Rank {
    /// Joins the pair (publishing the transport's rendezvous) and waits for every rank.
    pub async fn join(
        cfg: RankConfig,
        prepared: &Prepared,
        tensors: &TensorSet,
        transport: Box<dyn Transport>,
    ) -> Result<Rank, RankError> {
        // everything is validated before anything is published (kv, roster): a mis-started
        // rank refuses itself without touching the pair
        tensors.check_layout(&prepared.layout)?;
        if transport.kind() != cfg.transport {
            return Err(RankError::Runtime(RuntimeError::Config(format!(
                "this rank was configured for transport {} but built a {} transport",
                cfg.transport,
                transport.kind()
            ))));
        }
        let client = Client::new(&cfg.gateway, cfg.token.clone())?;
        check_pair(&client, &cfg).await?;
        let mut transport = transport;
        let info = serde_json::json!({
            "transport": transport.rendezvous(),
            "plan_fingerprint": format!("{:016x}", prepared.plan.fingerprint),
            "bucket_bytes": cfg.bucket_bytes,
            "pid": std::process::id(),
        });
        client
            .put_kv(&cfg.pair, &rendezvous_key(cfg.side, cfg.rank), info.clone())
            .await?;
        let joined = client
            .join(
                &cfg.pair,
                &JoinRequest {
                    side: cfg.side,
                    rank: cfg.rank,
                    info,
                    // only atomic pairs need it: gateways that predate the field accept the rest
                    capabilities: match cfg.apply {
                        ApplyMode::Atomic => vec![CAP_ATOMIC_APPLY.to_string()],
                        ApplyMode::InPlace => Vec::new(),
                    },
                },
            )
            .await?;
        if joined.options.apply != cfg.apply
            || (cfg.apply == ApplyMode::Atomic
                && cfg.side == Side::Inference
                && !transport.stages())
        {
            return Err(RankError::Runtime(RuntimeError::Config(format!(
                "pair `{}` applies updates {} but this rank's transport was built for {} (make_transport with the pair's apply mode)",
                cfg.pair,
                joined.options.apply,
                if transport.stages() {
                    "atomic"
                } else {
                    "in_place"
                }
            ))));
        }
        if joined.transport.as_str() != cfg.transport.as_str() {
            // checked before publishing; only a pair connected again meanwhile gets here
            return Err(RankError::Runtime(RuntimeError::Config(format!(
                "pair `{}` uses transport {} but this rank was started with {}",
                cfg.pair,
                joined.transport.as_str(),
                cfg.transport
            ))));
        }
        match joined
            .secret
            .as_ref()
            .and_then(|k| PairSecret::from_hex(&cfg.pair, &k.0))
        {
            Some(k) => transport.authenticate(&k),
            None if matches!(cfg.transport, TransportKind::Tcp | TransportKind::Nccl) => {
                return Err(RankError::Runtime(RuntimeError::Config(format!(
                    "the gateway's join answer for pair `{}` carries no pair secret; the {} transport authenticates its peers (tcp) or seals its rendezvous (nccl) with it (upgrade the gateway)",
                    cfg.pair, cfg.transport
                ))));
            }
            None => {}
        }
        if let Some((key, value)) = transport.kv_at_join()? {
            client.put_kv(&cfg.pair, &key, value).await?;
        }
        let other = cfg.side.other();
        let peers = joined
            .roster
            .iter()
            .filter(|e| e.side == other)
            .map(|e| (e.rank, e.info.get("transport").cloned().unwrap_or_default()))
            .collect();
        let join_deadline = Duration::from_millis(joined.options.join_deadline_ms);
        let shared = match transport.kv_after_join() {
            Some(key) => {
                // (behind a mutex: the check runs between awaits, and a transport is not Sync)
                let t = std::sync::Mutex::new(transport);
                let v = read_checked_kv(&client, &cfg.pair, &key, join_deadline, |v| {
                    checked(&t, &key, v)
                })
                .await;
                transport = t.into_inner().unwrap_or_else(|e| e.into_inner());
                Some(v?)
            }
            None => None,
        };
        transport.joined(shared.as_ref(), join_deadline)?;
        transport.connect(&peers)?;
        Ok(Rank {
            client,
            last_seq: joined.last_event_seq,
            joined,
            cfg,
            transport: Some(transport),
            peers,
            pending: VecDeque::new(),
            corrupt_version: None,
        })
    }

    /// The gateway client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Waits for the next piece of work; `None` when the pair was disconnected.
    pub async fn next_work(&mut self) -> Result<Option<Work>, RankError> {
        loop {
            while let Some(ev) = self.pending.pop_front() {
                match ev.kind {
                    EventKind::Disconnect => return Ok(None),
                    EventKind::Update => {
                        if let Some(version) = ev.version {
                            return Ok(Some(Work {
                                version,
                                attempt: ev.attempt.unwrap_or(1),
                            }));
                        }
                    }
                    EventKind::Abort | EventKind::Apply => {}
                }
            }
            let r = self
                .client
                .events(&self.cfg.pair, self.last_seq, Duration::from_secs(30))
                .await;
            match r {
                Ok(r) => {
                    self.last_seq = r.last_seq.max(self.last_seq);
                    self.pending.extend(r.events);
                }
                Err(e) if matches!(e.status(), Some(404) | Some(410)) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Waits for the next piece of work whose attempt is still live: an `update` event that
    /// this rank took late (after a stall, or catching up on queued events) may be for an
    /// attempt that is already over, with its `abort` or its retry queued right behind it;
    /// such work is skipped, never executed (executing it would publish readiness for a dead
    /// attempt and hold up the retry). `None` when the pair was disconnected.
    pub async fn next_live_work(&mut self) -> Result<Option<Work>, RankError> {
        loop {
            let Some(w) = self.next_work().await? else {
                return Ok(None);
            };
            if self.queued_behind(w) {
                continue;
            }
            match self.client.update_status(&self.cfg.pair, w.version).await {
                Ok(st)
                    if st.attempt > w.attempt
                        || (st.attempt == w.attempt && st.state.is_final()) =>
                {
                    continue;
                }
                Ok(_) => return Ok(Some(w)),
                Err(e) if matches!(e.status(), Some(404) | Some(410)) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Whether an event already fetched ends `w` (its abort, a later attempt, or a disconnect).
    fn queued_behind(&self, w: Work) -> bool {
        self.pending.iter().any(|ev| match ev.kind {
            EventKind::Abort => {
                ev.version == Some(w.version) && ev.attempt.unwrap_or(1) >= w.attempt
            }
            EventKind::Update => {
                ev.version == Some(w.version) && ev.attempt.unwrap_or(1) > w.attempt
            }
            EventKind::Disconnect => true,
            EventKind::Apply => false,
        })
    }

    /// Waits until `version` is over (committed or failed), at most `limit`; returns its status.
    pub async fn wait_outcome(
        &self,
        version: u64,
        limit: Duration,
    ) -> Result<awex_control::wire::UpdateStatus, RankError> {
        Ok(self
            .client
            .wait_update(&self.cfg.pair, version, limit)
            .await?)
    }

    async fn refresh_peers(&mut self) -> Result<(), RankError> {
        let other = self.cfg.side.other();
        let ranks: Vec<RankId> = self.peers.keys().copied().collect();
        for r in ranks {
            let e = self
                .client
                .get_kv(&self.cfg.pair, &rendezvous_key(other, r), Duration::ZERO)
                .await?;
            self.peers
                .insert(r, e.value.get("transport").cloned().unwrap_or_default());
        }
        Ok(())
    }

    /// Before a retry: publishes what the transport publishes for it, reads what it reads
    /// (waiting at most the update deadline) and hands that to the transport.
    async fn attempt_kv(&mut self, work: Work) -> Result<(), RuntimeError> {
        let t = self
            .transport
            .as_mut()
            .ok_or_else(|| RuntimeError::Transport("transport is closed".into()))?;
        let gw = |e: ClientError| RuntimeError::Transport(format!("pair kv: {e}"));
        if let Some((key, value)) = t.kv_before_attempt(work.version, work.attempt)? {
            self.client
                .put_kv(&self.cfg.pair, &key, value)
                .await
                .map_err(gw)?;
        }
        if let Some(key) = t.kv_for_attempt(work.version, work.attempt) {
            let wait = Duration::from_millis(self.joined.options.update_deadline_ms);
            let t = std::sync::Mutex::new(
                self.transport
                    .take()
                    .ok_or_else(|| RuntimeError::Transport("transport is closed".into()))?,
            );
            let value = read_checked_kv(&self.client, &self.cfg.pair, &key, wait, |v| {
                checked(&t, &key, v)
            })
            .await;
            self.transport = Some(t.into_inner().unwrap_or_else(|e| e.into_inner()));
            let value = value.map_err(|e| match e {
                RankError::Runtime(e) => e,
                e => RuntimeError::Transport(e.to_string()),
            })?;
            let t = self
                .transport
                .as_mut()
                .ok_or_else(|| RuntimeError::Transport("transport is closed".into()))?;
            t.begin_attempt(&key, &value)?;
        }
        Ok(())
    }

    /// Executes one piece of work and reports it; returns what moved, or the error reported.
    pub async fn execute(
        &mut self,
        work: Work,
        checksums: bool,
    ) -> Result<ExecStats, RuntimeError> {
        if work.attempt > 1 {
            // a restarted peer publishes new rendezvous values
            if let Err(e) = self.refresh_peers().await {
                return self
                    .report(work, Err(RuntimeError::Transport(e.to_string())))
                    .await;
            }
            // nccl: a fresh communicator per retry, its id shared through the kv
            if let Err(e) = self.attempt_kv(work).await {
                return self.report(work, Err(e)).await;
            }
        }
        let deadline =
            Instant::now() + Duration::from_millis(self.joined.options.update_deadline_ms);
        let cancel = Arc::new(AtomicBool::new(false));
        let mut transport = self
            .transport
            .take()
            .ok_or_else(|| RuntimeError::Transport("transport is closed".into()))?;
        let peers = self.peers.clone();
        let corrupt = self.corrupt_version == Some(work.version);
        let c2 = cancel.clone();
        let job = tokio::task::spawn_blocking(move || {
            let ctx = ExecContext {
                version: work.version,
                attempt: work.attempt,
                deadline,
                cancel: &c2,
                checksums,
                peers: &peers,
                corrupt,
            };
            let r = transport.execute(&ctx);
            (transport, r)
        });
        // watch the event stream for an abort of this version while the bytes move; the events
        // stay on the gateway, so `next_work` still sees them afterwards
        let watcher = {
            let client = self.client.clone();
            let pair = self.cfg.pair.clone();
            let cancel = cancel.clone();
            let mut after = self.last_seq;
            tokio::spawn(async move {
                loop {
                    match client.events(&pair, after, Duration::from_secs(2)).await {
                        Ok(r) => {
                            after = r.last_seq.max(after);
                            let stop = r.events.iter().any(|ev| match ev.kind {
                                EventKind::Abort => ev.version == Some(work.version),
                                EventKind::Disconnect => true,
                                EventKind::Update | EventKind::Apply => false,
                            });
                            if stop {
                                cancel.store(true, Ordering::Release);
                            }
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
            })
        };
        let (transport, result) = job
            .await
            .map_err(|e| RuntimeError::Transport(format!("execution task failed: {e}")))?;
        watcher.abort();
        let stages = transport.stages();
        self.transport = Some(transport);
        let received = self.report(work, result).await?;
        if !stages {
            return Ok(received);
        }
        // atomic: received and verified into staging; the live tensors change only on `apply`
        self.wait_apply(work, deadline).await?;
        let mut transport = self
            .transport
            .take()
            .ok_or_else(|| RuntimeError::Transport("transport is closed".into()))?;
        let job = tokio::task::spawn_blocking(move || {
            let r = transport.apply();
            (transport, r)
        });
        let (transport, applied) = job
            .await
            .map_err(|e| RuntimeError::Transport(format!("apply task failed: {e}")))?;
        self.transport = Some(transport);
        let applied = applied.map(|_| received).map_err(|e| {
            RuntimeError::Transport(format!(
                "copying the staged version {} into the live tensors failed: {e}",
                work.version
            ))
        });
        self.report(work, applied).await
    }

    /// Atomic pairs, inference ranks: waits for the gateway's `apply` event of `work` (every
    /// rank of both sides received). Its abort, a later attempt, a disconnect or the deadline
    /// end the wait with an error: the live tensors were not touched.
    async fn wait_apply(&mut self, work: Work, deadline: Instant) -> Result<(), RuntimeError> {
        let mut after = self.last_seq;
        let v = Some(work.version);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RuntimeError::Deadline(work.version));
            }
            match self
                .client
                .events(&self.cfg.pair, after, left.min(Duration::from_secs(30)))
                .await
            {
                Ok(r) => {
                    after = r.last_seq.max(after);
                    for ev in r.events {
                        let attempt = ev.attempt.unwrap_or(1);
                        match ev.kind {
                            EventKind::Apply if ev.version == v && attempt == work.attempt => {
                                return Ok(());
                            }
                            EventKind::Abort if ev.version == v && attempt >= work.attempt => {
                                return Err(RuntimeError::Aborted(work.version));
                            }
                            EventKind::Update
                                if ev.version > v
                                    || (ev.version == v && attempt > work.attempt) =>
                            {
                                return Err(RuntimeError::Aborted(work.version));
                            }
                            EventKind::Disconnect => {
                                return Err(RuntimeError::Aborted(work.version));
                            }
                            _ => {}
                        }
                    }
                }
                Err(e) if matches!(e.status(), Some(404) | Some(410)) => {
                    return Err(RuntimeError::Aborted(work.version));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn report(
        &mut self,
        work: Work,
        result: Result<ExecStats, RuntimeError>,
    ) -> Result<ExecStats, RuntimeError> {
        let report = match &result {
            Ok(s) => Report {
                side: self.cfg.side,
                rank: self.cfg.rank,
                ok: true,
                bytes: s.bytes,
                checksum: Some(s.checksum),
                error: None,
                attempt: Some(work.attempt),
            },
            Err(e) => Report {
                side: self.cfg.side,
                rank: self.cfg.rank,
                ok: false,
                bytes: 0,
                checksum: None,
                error: Some(e.to_string()),
                attempt: Some(work.attempt),
            },
        };
        if let Err(e) = self
            .client
            .report(&self.cfg.pair, work.version, &report)
            .await
        {
            // a report refused because the version already failed is not this rank's error
            if result.is_ok() && e.status() != Some(409) {
                return Err(RuntimeError::Transport(format!(
                    "report to the gateway failed: {e}"
                )));
            }
        }
        result
    }

    /// Tears the transport down.
    pub fn close(&mut self) {
        if let Some(mut t) = self.transport.take() {
            t.close();
        }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    #[cfg(not(feature = "cuda"))]
    use super::*;

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn nccl_without_the_cuda_feature_says_the_build_lacks_cuda() {
        let model = awex_core::model::ModelSpec::resolve("qwen3-tiny").unwrap();
        let catalogue = Catalogue::of(&model);
        let cfg = RankConfig {
            gateway: "http://127.0.0.1:1".into(),
            token: None,
            pair: "p".into(),
            side: Side::Training,
            rank: RankId::train(0),
            model,
            train: "megatron:tp=1".parse().unwrap(),
            infer: "sglang:tp=1".parse().unwrap(),
            transport: TransportKind::Nccl,
            bucket_bytes: 1 << 20,
            host: "127.0.0.1".into(),
            uid: String::new(),
            apply: ApplyMode::InPlace,
        };
        let prepared = Prepared {
            catalogue,
            layout: RankLayout {
                rank: RankId::train(0),
                tensors: vec![],
            },
            plan: Arc::new(RankPlan {
                side: Side::Training,
                rank: RankId::train(0),
                peers: vec![],
                fingerprint: 0,
            }),
        };
        let tensors = Arc::new(TensorSet::allocate_host(&prepared.layout).unwrap());
        let e = make_transport(&cfg, &prepared, tensors).err().unwrap();
        assert_eq!(
            e.to_string(),
            "the nccl transport needs awex built with --features cuda"
        );
    }
}
