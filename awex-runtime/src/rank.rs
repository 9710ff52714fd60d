//! A rank of a pair: joins through the gateway, then executes its plan for every update version
//! and reports. Training ranks are writers, inference ranks readers; the code is shared.

use super::tensors::TensorSet;
use super::transport::{
    CudaIpcTransport, ExecContext, ExecStats, PairSecret, ShmTransport, StagedTransport,
    TcpTransport, Transport, TransportKind,
};
use super::{ConfigMismatch, RuntimeError, TransportError};
use awex_control::client::{Client, ClientError};
use awex_control::wire::{
    ApplyMode, CAP_ATOMIC_APPLY, EventKind, JoinRequest, JoinResponse, Report,
};
use awex_core::backend::BackendSpec;
use awex_core::layout::{RankId, RankLayout, Side};
use awex_core::model::{Catalogue, ModelSpec};
use awex_core::pair::{PairError, PairSpec, ResolvedPair};
use awex_core::plan::RankPlan;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// The pair this rank belongs to, as a [`PairSpec`] (model, both sides, transport).
    pub fn pair_spec(&self) -> PairSpec {
        PairSpec {
            model: self.model.clone(),
            train: self.train.clone(),
            infer: self.infer.clone(),
            transport: self.transport,
        }
    }

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
    /// The pair's catalogue and both sides' layouts ([`RankConfig::pair_spec`] resolved).
    pub pair: Arc<ResolvedPair>,
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
    /// The layout could not be built, or disagrees with the pair's.
    #[error("layout: {0}")]
    Layout(String),
    /// A side's layout could not be built from the rank's specs.
    #[error("layout: {0}")]
    Pair(#[from] PairError),
    /// The pair was disconnected.
    #[error("pair disconnected")]
    Disconnected,
    /// The gateway does not know the pair (404): it restarted without its state, or the pair's
    /// record expired. The rank cannot learn the outcome of its updates.
    #[error(
        "the gateway at {gateway} has no pair `{pair}` (404 unknown pair): it was restarted without its state (--state-dir none) or forgot the pair; this rank cannot learn the outcome of its updates and stops"
    )]
    UnknownPair {
        /// The gateway URL.
        gateway: String,
        /// The pair.
        pair: String,
    },
    /// The gateway stayed unreachable (or answered 5xx) longer than the rank waits for it.
    #[error(
        "the gateway at {gateway} has been unreachable for {waited_s} s while this rank was {doing} (it waits at most {limit_s} s): {last}"
    )]
    GatewayLost {
        /// The gateway URL.
        gateway: String,
        /// What the rank was waiting for.
        doing: String,
        /// Seconds it retried.
        waited_s: u64,
        /// Its limit, seconds.
        limit_s: u64,
        /// The last error.
        last: String,
    },
}

/// How long an idle rank (waiting for work) keeps retrying a gateway it lost before it gives up:
/// `AWEX_GATEWAY_LOST_S` seconds, default 300.
pub fn default_gateway_lost() -> Duration {
    std::env::var("AWEX_GATEWAY_LOST_S")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map_or(Duration::from_secs(300), Duration::from_secs)
}

/// Whether a gateway failure may be transient (the gateway restarting, overloaded, or the
/// network): no connection, a failed exchange, or a 5xx answer.
pub fn transient(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Connect { .. } | ClientError::Transport { .. }
    ) || e.status().is_some_and(|s| s >= 500)
}

/// Calls `f` until it succeeds, fails for good, or transient failures ([`transient`]) have
/// lasted `limit`; waits with capped exponential backoff (0.2 s doubling up to 5 s) between
/// tries and logs each retry on stderr. `doing` names the wait in the log and the error.
pub async fn retry_gateway<T, F, Fut>(
    gateway: &str,
    doing: &str,
    limit: Duration,
    mut f: F,
) -> Result<T, RankError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let start = Instant::now();
    let mut backoff = Duration::from_millis(200);
    let mut tries = 0u32;
    loop {
        match f().await {
            Ok(v) => {
                if tries > 0 {
                    tracing::info!(
                        "awex rank: the gateway at {gateway} answers again after {:.1} s ({doing})",
                        start.elapsed().as_secs_f64()
                    );
                }
                return Ok(v);
            }
            Err(e) if transient(&e) => {
                let waited = start.elapsed();
                if waited >= limit {
                    return Err(RankError::GatewayLost {
                        gateway: gateway.to_string(),
                        doing: doing.to_string(),
                        waited_s: waited.as_secs(),
                        limit_s: limit.as_secs(),
                        last: e.to_string(),
                    });
                }
                tries += 1;
                let pause = backoff.min(limit - waited);
                tracing::warn!(
                    "awex rank: gateway at {gateway} failed while {doing} (try {tries}, {:.1} s of at most {} s): {e}; retrying in {:.1} s",
                    waited.as_secs_f64(),
                    limit.as_secs(),
                    pause.as_secs_f64()
                );
                tokio::time::sleep(pause).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// A random id of one rank process's claim on its slot (16 hex digits).
fn incarnation_id() -> String {
    use std::io::Read;
    let mut b = [0u8; 8];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if read.is_err() {
        // no kernel random source: the pid and the clock still tell two processes apart
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        b = (t ^ (u64::from(std::process::id()) << 32)).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Computes this rank's layout and plan.
pub fn prepare(cfg: &RankConfig) -> Result<Prepared, RankError> {
    let pair = cfg.pair_spec().resolve()?;
    let mine = pair.side(cfg.side);
    let layout = mine.rank_layout(cfg.rank).ok_or_else(|| {
        RankError::Layout(format!(
            "{} layout {} has no rank {} (world size {})",
            cfg.side,
            pair.backend(cfg.side),
            cfg.rank,
            mine.world_size()
        ))
    })?;
    let plan = Arc::new(
        pair.plan_pair()
            .plan_rank(cfg.side, cfg.rank)
            .map_err(RuntimeError::from)?,
    );
    Ok(Prepared {
        catalogue: pair.catalogue.clone(),
        pair: Arc::new(pair),
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
        return Err(RuntimeError::Nccl(NcclError::NeedsCuda));
    }
    let world = CommWorld::of(&*prepared.pair.training, &*prepared.pair.inference)?;
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
) -> Result<serde_json::Value, RuntimeError> {
    let end = Instant::now() + wait;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let value = match client.get_kv(pair, key, left).await {
            Ok(e) => e.value,
            Err(e) if e.status() == Some(404) => {
                return Err(RuntimeError::MissingKv {
                    pair: pair.to_string(),
                    key: key.to_string(),
                    waited: wait,
                });
            }
            Err(source) => {
                return Err(RuntimeError::Gateway {
                    what: "pair kv",
                    source,
                });
            }
        };
        match check(&value) {
            Ok(()) => return Ok(value),
            Err(e) if Instant::now() >= end => {
                return Err(RuntimeError::UnverifiedKv {
                    waited: wait,
                    cause: Box::new(e),
                });
            }
            Err(e) => {
                tracing::warn!(pair, key, error = %e, "refused a pair kv value; waiting for the genuine one");
                tokio::time::sleep(Duration::from_millis(100).min(left)).await;
            }
        }
    }
}

/// [`Transport::check_kv`] of a transport held behind a mutex (the check runs between awaits,
/// and a transport is not `Sync`).
fn checked(
    t: &std::sync::Mutex<Box<dyn Transport>>,
    key: &str,
    v: &serde_json::Value,
) -> Result<(), RuntimeError> {
    t.lock().unwrap_or_else(|e| e.into_inner()).check_kv(key, v)
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

fn transport_mismatch(pair: &str, theirs: &str, ours: TransportKind) -> RuntimeError {
    ConfigMismatch::Pair {
        pair: pair.to_string(),
        field: "uses transport",
        expected: theirs.to_string(),
        got: ours.to_string(),
        hint: "",
    }
    .into()
}

/// Refuses to join a pair whose description disagrees with this rank's (model, layouts,
/// transport, bucket geometry, connect): everything a rank could get wrong is checked here,
/// before it publishes anything.
fn check_pair(st: &awex_control::wire::PairStatus, cfg: &RankConfig) -> Result<(), RankError> {
    if st.transport.as_str() != cfg.transport.as_str() {
        return Err(transport_mismatch(&cfg.pair, st.transport.as_str(), cfg.transport).into());
    }
    let pair_bucket = st.options.bucket_mib.saturating_mul(1 << 20);
    if pair_bucket != cfg.bucket_bytes {
        return Err(RuntimeError::from(ConfigMismatch::Pair {
            pair: cfg.pair.clone(),
            field: "moves buckets of",
            expected: format!("{} MiB", st.options.bucket_mib),
            got: format!(
                "{} bytes ({} MiB)",
                cfg.bucket_bytes,
                cfg.bucket_bytes as f64 / (1u64 << 20) as f64
            ),
            hint: "; every rank must use the pair's bucket_mib (the bucket geometry is part of the plan every peer checks)",
        })
        .into());
    }
    if !cfg.uid.is_empty() && !st.uid.is_empty() && cfg.uid != st.uid {
        return Err(RuntimeError::from(ConfigMismatch::Reconnected {
            pair: cfg.pair.clone(),
            expected: cfg.uid.clone(),
            got: st.uid.clone(),
        })
        .into());
    }
    if st.options.apply != cfg.apply {
        return Err(RuntimeError::from(ConfigMismatch::Pair {
            pair: cfg.pair.clone(),
            field: "applies updates",
            expected: st.options.apply.to_string(),
            got: cfg.apply.to_string(),
            hint: "; take the apply mode from the pair's status (rank::pair_settings)",
        })
        .into());
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

/// What became of one step of a rank ([`Rank::step`], [`Rank::run`]).
#[derive(Debug)]
pub enum Outcome {
    /// This rank did its part and the version committed.
    Committed {
        /// the work
        work: Work,
        /// what this rank moved
        stats: ExecStats,
    },
    /// This rank did its part; the outcome was not waited for.
    Executed {
        /// the work
        work: Work,
        /// what this rank moved
        stats: ExecStats,
    },
    /// The update did not commit.
    Failed {
        /// the work
        work: Work,
        /// what this rank moved, when its own part succeeded
        stats: Option<ExecStats>,
        /// why
        reason: Failure,
    },
    /// The wait ran out: for work (`work` is `None`) or for the outcome of `work`.
    TimedOut {
        /// the work whose outcome did not arrive in time
        work: Option<Work>,
    },
    /// The pair was disconnected.
    Disconnected,
}

impl Outcome {
    /// The work the step was about (`None` when there was none: disconnected, timed out).
    pub fn work(&self) -> Option<Work> {
        match self {
            Outcome::Committed { work, .. }
            | Outcome::Executed { work, .. }
            | Outcome::Failed { work, .. } => Some(*work),
            Outcome::TimedOut { work } => *work,
            Outcome::Disconnected => None,
        }
    }

    /// Whether this rank's own part succeeded (whatever became of the version).
    pub fn part_done(&self) -> bool {
        match self {
            Outcome::Committed { .. } | Outcome::Executed { .. } => true,
            Outcome::Failed { stats, .. } => stats.is_some(),
            Outcome::TimedOut { work } => work.is_some(),
            Outcome::Disconnected => false,
        }
    }
}

/// A 404 from the gateway is the pair unknown to it (a restart without state); other errors
/// pass through.
fn unknown_pair(e: RankError, cfg: &RankConfig) -> RankError {
    match e {
        RankError::Gateway(c) if c.status() == Some(404) => RankError::UnknownPair {
            gateway: cfg.gateway.clone(),
            pair: cfg.pair.clone(),
        },
        e => e,
    }
}

/// How long a rank whose slot is held by another process keeps trying to join: a little more
/// than the gateway's liveness window (15 s), so that a restarted rank gets the slot of its
/// dead predecessor, and a duplicate of a live rank is refused.
const CLAIM_WAIT: Duration = Duration::from_secs(20);

/// Whether the gateway refused a join because another live process holds the slot.
fn held_by_another(e: &ClientError) -> bool {
    e.status() == Some(409) && e.to_string().contains("is held by a live process")
}

/// Joins (or re-attaches to) this rank's slot, retrying a lost gateway until `limit`, and
/// publishes the rank's rendezvous value once the gateway accepted it as the slot's holder.
async fn join_retrying(
    client: &Client,
    cfg: &RankConfig,
    req: &JoinRequest,
    limit: Duration,
    key: &str,
    info: &serde_json::Value,
) -> Result<JoinResponse, RankError> {
    let gw = &cfg.gateway;
    let start = Instant::now();
    let mut published = false;
    loop {
        let left = limit
            .saturating_sub(start.elapsed())
            .max(Duration::from_secs(1));
        // the rendezvous value first, then one join: the join answer's event cursor is then
        // the one of the moment the pair became ready, so no update started after it is missed
        let step = if published {
            retry_gateway(gw, "joining", left, || client.join(&cfg.pair, req))
                .await
                .map(Some)
        } else {
            retry_gateway(gw, "publishing rendezvous", left, || {
                client.put_kv(&cfg.pair, key, info.clone())
            })
            .await
            .map(|_| None)
        };
        match step.map_err(|e| unknown_pair(e, cfg)) {
            Ok(Some(r)) => return Ok(r),
            Ok(None) => published = true,
            // the slot is held: by this rank's predecessor (killed moments ago, its liveness
            // running out) or by a live duplicate (then this rank gives up after the wait);
            // the gateway refuses both the rendezvous value and the join without touching it
            Err(RankError::Gateway(c)) if held_by_another(&c) && start.elapsed() < CLAIM_WAIT => {
                tracing::warn!(
                    "awex rank: {} {} of pair `{}`: {c}; retrying for up to {} s",
                    cfg.side,
                    cfg.rank,
                    cfg.pair,
                    CLAIM_WAIT.saturating_sub(start.elapsed()).as_secs()
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Why an update did not commit, as one rank learns it.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// This rank's own part failed (the error it reported).
    #[error(transparent)]
    Rank(RuntimeError),
    /// The version failed elsewhere (aborted, another rank, the engines): its status.
    #[error("version {} did not commit: {}", .0.version, .0.error.as_deref().unwrap_or("failed"))]
    Version(Box<awex_control::wire::UpdateStatus>),
    /// The outcome could not be read from the gateway.
    #[error("reading the outcome: {0}")]
    Gateway(ClientError),
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
    /// The newest event seq the update watchers of this rank read (see
    /// [`Rank::skip_read_events`]).
    watched_seq: Arc<AtomicU64>,
    pending: VecDeque<awex_control::wire::Event>,
    /// The stream's `disconnect` was taken.
    disconnected: bool,
    /// Test hook: corrupt one received byte of this version.
    pub corrupt_version: Option<u64>,
    /// How long this rank keeps retrying a lost gateway while it waits for work
    /// ([`default_gateway_lost`]).
    pub gateway_lost: Duration,
    /// The join request this rank re-attaches with after losing the gateway.
    join_request: JoinRequest,
    /// The last work whose bytes this rank's transport moved, and how long that took.
    last_transfer: Option<(Work, Duration)>,
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
        let t0 = Instant::now();
        // everything is validated before anything is published (kv, roster): a mis-started
        // rank refuses itself without touching the pair
        tensors.check_layout(&prepared.layout)?;
        if transport.kind() != cfg.transport {
            return Err(RuntimeError::from(ConfigMismatch::BuiltTransport {
                configured: cfg.transport,
                built: transport.kind(),
            })
            .into());
        }
        let client = Client::new(&cfg.gateway, cfg.token.clone())?;
        let lost = default_gateway_lost();
        let gw = cfg.gateway.clone();
        let st = retry_gateway(&gw, "checking the pair", lost, || client.status(&cfg.pair))
            .await
            .map_err(|e| unknown_pair(e, &cfg))?;
        check_pair(&st, &cfg)?;
        let join_limit = Duration::from_millis(st.options.join_deadline_ms);
        let mut transport = transport;
        let incarnation = incarnation_id();
        let info = serde_json::json!({
            "transport": transport.rendezvous(),
            "plan_fingerprint": format!("{:016x}", prepared.plan.fingerprint),
            "bucket_bytes": cfg.bucket_bytes,
            "pid": std::process::id(),
            "incarnation": incarnation,
        });
        let key = rendezvous_key(cfg.side, cfg.rank);
        let req = JoinRequest {
            side: cfg.side,
            rank: cfg.rank,
            info: info.clone(),
            // only atomic pairs need it: gateways that predate the field accept the rest
            capabilities: match cfg.apply {
                ApplyMode::Atomic => vec![CAP_ATOMIC_APPLY.to_string()],
                ApplyMode::InPlace => Vec::new(),
            },
        };
        // a second live claimant of the slot gets 409 for both, and changes nothing
        let joined = join_retrying(&client, &cfg, &req, join_limit, &key, &info).await?;
        tracing::info!(
            pair = %cfg.pair,
            side = %cfg.side,
            rank = %cfg.rank,
            transport = %cfg.transport,
            ranks = joined.roster.len(),
            ms = t0.elapsed().as_millis() as u64,
            "rank joined"
        );
        if joined.transport.as_str() != cfg.transport.as_str() {
            // checked before publishing; only a pair connected again meanwhile gets here
            return Err(
                transport_mismatch(&cfg.pair, joined.transport.as_str(), cfg.transport).into(),
            );
        }
        let staged = if transport.stages() {
            ApplyMode::Atomic
        } else {
            ApplyMode::InPlace
        };
        if joined.options.apply != cfg.apply || (cfg.side == Side::Inference && staged != cfg.apply)
        {
            return Err(RuntimeError::from(ConfigMismatch::Pair {
                pair: cfg.pair.clone(),
                field: "applies updates",
                expected: joined.options.apply.to_string(),
                got: format!("a transport built for {staged}"),
                hint: "; build the transport with make_transport and the pair's apply mode",
            })
            .into());
        }
        match joined
            .secret
            .as_ref()
            .and_then(|k| PairSecret::from_hex(&cfg.pair, &k.0))
        {
            Some(k) => transport.authenticate(&k),
            None if matches!(cfg.transport, TransportKind::Tcp | TransportKind::Nccl) => {
                return Err(RuntimeError::from(ConfigMismatch::NoSecret {
                    pair: cfg.pair.clone(),
                    transport: cfg.transport,
                })
                .into());
            }
            None => {}
        }
        if let Some((key, value)) = transport.kv_at_join()? {
            retry_gateway(&gw, "publishing rendezvous", join_limit, || {
                client.put_kv(&cfg.pair, &key, value.clone())
            })
            .await
            .map_err(|e| unknown_pair(e, &cfg))?;
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
        tracing::info!(
            pair = %cfg.pair,
            side = %cfg.side,
            rank = %cfg.rank,
            ms = t0.elapsed().as_millis() as u64,
            "rank ready"
        );
        Ok(Rank {
            client,
            last_seq: joined.last_event_seq,
            watched_seq: Arc::new(AtomicU64::new(joined.last_event_seq)),
            joined,
            cfg,
            transport: Some(transport),
            peers,
            pending: VecDeque::new(),
            disconnected: false,
            corrupt_version: None,
            gateway_lost: lost,
            join_request: req,
            last_transfer: None,
        })
    }

    /// How long this rank's transport took to move its bytes of `work`, when that was the last
    /// work it moved and the move succeeded: the data plane alone (from the transport's start to
    /// its end, waiting for peers included), without the gateway's round trips around it. An
    /// atomic pair's apply is not in it.
    pub fn transfer_time(&self, work: Work) -> Option<Duration> {
        self.last_transfer
            .filter(|(w, _)| *w == work)
            .map(|(_, d)| d)
    }

    /// This rank process's claim id on its slot (random per [`Rank`]), sent with its join.
    pub fn incarnation(&self) -> &str {
        self.join_request
            .info
            .get("incarnation")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
    }

    /// After the gateway was lost: joins this rank's slot again with the same info (plan
    /// fingerprint, incarnation); the gateway answers the current roster. A pair connected
    /// again meanwhile (another uid) is an error.
    async fn reattach(&mut self) -> Result<(), RankError> {
        let limit = self.gateway_lost;
        let r = retry_gateway(&self.cfg.gateway, "re-attaching", limit, || {
            self.client.join(&self.cfg.pair, &self.join_request)
        })
        .await
        .map_err(|e| self.classify(e))?;
        if !self.joined.uid.is_empty() && r.uid != self.joined.uid {
            return Err(RuntimeError::from(ConfigMismatch::Reconnected {
                pair: self.cfg.pair.clone(),
                expected: self.joined.uid.clone(),
                got: r.uid.clone(),
            })
            .into());
        }
        tracing::info!(
            "awex rank: {} {} re-attached to pair `{}` (last event {})",
            self.cfg.side,
            self.cfg.rank,
            self.cfg.pair,
            r.last_event_seq
        );
        Ok(())
    }

    /// 404 is the pair unknown to the gateway, 410 its disconnect; others pass through.
    fn classify(&self, e: RankError) -> RankError {
        match e {
            RankError::Gateway(c) if c.status() == Some(410) => RankError::Disconnected,
            e => unknown_pair(e, &self.cfg),
        }
    }

    /// The gateway client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Waits for the next piece of work; `None` when the pair was disconnected by its
    /// controller (a `disconnect` event, or 410 Gone), at once on every later call (the
    /// `disconnect` event is the stream's last). A gateway that cannot be reached (or answers
    /// 5xx) is retried with backoff for [`Rank::gateway_lost`], then the rank re-attaches; a
    /// gateway that does not know the pair (404) is [`RankError::UnknownPair`].
    pub async fn next_work(&mut self) -> Result<Option<Work>, RankError> {
        if self.disconnected {
            return Ok(None);
        }
        loop {
            while let Some(ev) = self.pending.pop_front() {
                match ev.kind {
                    EventKind::Disconnect => {
                        self.disconnected = true;
                        return Ok(None);
                    }
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
            let me = self.incarnation().to_string();
            let r = self
                .client
                .events_as(
                    &self.cfg.pair,
                    self.last_seq,
                    Duration::from_secs(30),
                    Some(&me),
                )
                .await;
            match r {
                Ok(r) => {
                    self.last_seq = r.last_seq.max(self.last_seq);
                    self.pending.extend(r.events);
                }
                Err(e) if e.status() == Some(410) => return Ok(None),
                Err(e) if transient(&e) => {
                    // the gateway is restarting (or overloaded): wait for it, then re-attach
                    let (pair, after) = (self.cfg.pair.clone(), self.last_seq);
                    let me = me.clone();
                    let client = self.client.clone();
                    let first = std::sync::Mutex::new(Some(e));
                    let r = retry_gateway(
                        &self.cfg.gateway,
                        "waiting for work",
                        self.gateway_lost,
                        || {
                            let first = first.lock().ok().and_then(|mut f| f.take());
                            let client = client.clone();
                            let pair = pair.clone();
                            let me = me.clone();
                            async move {
                                match first {
                                    Some(e) => Err(e),
                                    None => {
                                        client
                                            .events_as(&pair, after, Duration::ZERO, Some(&me))
                                            .await
                                    }
                                }
                            }
                        },
                    )
                    .await;
                    match r.map_err(|e| self.classify(e)) {
                        Ok(_) => self.reattach().await?,
                        Err(RankError::Disconnected) => return Ok(None),
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(self.classify(e.into())),
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
            let st = retry_gateway(
                &self.cfg.gateway,
                "reading the update's state",
                self.update_limit(),
                || self.client.update_status(&self.cfg.pair, w.version),
            )
            .await
            .map_err(|e| self.classify(e));
            match st {
                Ok(st)
                    if st.attempt > w.attempt
                        || (st.attempt == w.attempt && st.state.is_final()) =>
                {
                    continue;
                }
                Ok(_) => return Ok(Some(w)),
                Err(RankError::Disconnected) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }

    /// For a rank that is told each attempt it runs (an engine's trigger names it) and never
    /// waits for work on the event stream: forgets the events its last update's watchers read,
    /// so that the next update's watchers do not read the whole history again. A rank that
    /// takes its work from [`Rank::next_work`] must not call it (it would skip those events).
    pub fn skip_read_events(&mut self) {
        self.last_seq = self.last_seq.max(self.watched_seq.load(Ordering::Acquire));
        self.pending.clear();
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

    /// The longest a rank waits for a lost gateway during an update: the pair's update
    /// deadline plus 30 s.
    pub fn update_limit(&self) -> Duration {
        Duration::from_millis(self.joined.options.update_deadline_ms) + Duration::from_secs(30)
    }

    /// Waits until `version` is over (committed or failed), at most `limit`; returns its status.
    /// A lost gateway is retried within `limit`.
    pub async fn wait_outcome(
        &self,
        version: u64,
        limit: Duration,
    ) -> Result<awex_control::wire::UpdateStatus, RankError> {
        let start = Instant::now();
        retry_gateway(
            &self.cfg.gateway,
            "waiting for the update's outcome",
            limit,
            || {
                let left = limit.saturating_sub(start.elapsed());
                self.client.wait_update(&self.cfg.pair, version, left)
            },
        )
        .await
        .map_err(|e| self.classify(e))
    }

    /// One update, start to end: waits for the next live work (until `deadline`, or without
    /// limit), hands it to `before` (a training rank fills its tensors, a mirror is refreshed),
    /// executes and reports this rank's part, and with `commit_wait` waits that long for the
    /// version's outcome ([`Rank::run`]). An error of `before` ends the step with that error.
    pub async fn step(
        &mut self,
        deadline: Option<Instant>,
        checksums: bool,
        commit_wait: Option<Duration>,
        before: impl FnOnce(Work) -> Result<(), RankError>,
    ) -> Result<Outcome, RankError> {
        let next = match deadline {
            None => self.next_live_work().await?,
            Some(d) => match tokio::time::timeout_at(d.into(), self.next_live_work()).await {
                Ok(next) => next?,
                Err(_) => return Ok(Outcome::TimedOut { work: None }),
            },
        };
        let Some(work) = next else {
            return Ok(Outcome::Disconnected);
        };
        before(work)?;
        Ok(self.run(work, checksums, commit_wait).await)
    }

    /// Executes and reports this rank's part of `work` and, with `commit_wait`, waits that
    /// long for the version's outcome (without, a part that succeeded is
    /// [`Outcome::Executed`]).
    pub async fn run(
        &mut self,
        work: Work,
        checksums: bool,
        commit_wait: Option<Duration>,
    ) -> Outcome {
        let (pair, side, rank) = (&self.cfg.pair, self.cfg.side, self.cfg.rank);
        let (version, attempt) = (work.version, work.attempt);
        tracing::info!(%pair, %side, %rank, version, attempt, "update started");
        let t0 = Instant::now();
        let stats = match self.execute(work, checksums).await {
            Ok(s) => {
                tracing::info!(
                    pair = %self.cfg.pair,
                    side = %self.cfg.side,
                    rank = %self.cfg.rank,
                    version,
                    attempt,
                    bytes = s.bytes,
                    buckets = s.buckets,
                    ms = t0.elapsed().as_millis() as u64,
                    "update part done"
                );
                s
            }
            Err(e) => {
                tracing::warn!(
                    pair = %self.cfg.pair,
                    side = %self.cfg.side,
                    rank = %self.cfg.rank,
                    version,
                    attempt,
                    ms = t0.elapsed().as_millis() as u64,
                    reason = %e,
                    "update failed on this rank"
                );
                return Outcome::Failed {
                    work,
                    stats: None,
                    reason: Failure::Rank(e),
                };
            }
        };
        let Some(limit) = commit_wait else {
            return Outcome::Executed { work, stats };
        };
        let outcome = self.outcome(work, stats, limit).await;
        let (pair, side, rank) = (&self.cfg.pair, self.cfg.side, self.cfg.rank);
        let ms = t0.elapsed().as_millis() as u64;
        match &outcome {
            Outcome::Committed { .. } => {
                tracing::info!(%pair, %side, %rank, version, attempt, ms, "update committed")
            }
            Outcome::Failed { reason, .. } => tracing::warn!(
                %pair, %side, %rank, version, attempt, ms, %reason, "update did not commit"
            ),
            Outcome::TimedOut { .. } => tracing::warn!(
                %pair, %side, %rank, version, attempt, ms, waited_ms = limit.as_millis() as u64,
                "no outcome of the update in time"
            ),
            Outcome::Disconnected => {
                tracing::info!(%pair, %side, %rank, version, attempt, "pair disconnected")
            }
            Outcome::Executed { .. } => {}
        }
        outcome
    }

    /// Waits at most `limit` for the outcome of `work`, whose part this rank did (`stats`).
    /// The future owns what it needs (a Python binding polls it in slices, between signal
    /// checks, and may drop it).
    pub fn outcome(
        &self,
        work: Work,
        stats: ExecStats,
        limit: Duration,
    ) -> impl std::future::Future<Output = Outcome> + Send + 'static {
        let client = self.client.clone();
        let pair = self.cfg.pair.clone();
        async move {
            match client.wait_update(&pair, work.version, limit).await {
                Ok(st) if st.state == awex_control::wire::UpdateState::Committed => {
                    Outcome::Committed { work, stats }
                }
                Ok(st) => Outcome::Failed {
                    work,
                    stats: Some(stats),
                    reason: Failure::Version(Box::new(st)),
                },
                Err(ClientError::StillRunning { .. }) => Outcome::TimedOut { work: Some(work) },
                Err(e) if matches!(e.status(), Some(404) | Some(410)) => Outcome::Disconnected,
                Err(e) => Outcome::Failed {
                    work,
                    stats: Some(stats),
                    reason: Failure::Gateway(e),
                },
            }
        }
    }

    async fn refresh_peers(&mut self) -> Result<(), ClientError> {
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
            .ok_or(TransportError::Closed("transport"))?;
        let gw = |source: ClientError| RuntimeError::Gateway {
            what: "pair kv",
            source,
        };
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
                    .ok_or(TransportError::Closed("transport"))?,
            );
            let value = read_checked_kv(&self.client, &self.cfg.pair, &key, wait, |v| {
                checked(&t, &key, v)
            })
            .await;
            self.transport = Some(t.into_inner().unwrap_or_else(|e| e.into_inner()));
            let value = value?;
            let t = self
                .transport
                .as_mut()
                .ok_or(TransportError::Closed("transport"))?;
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
                    .report(
                        work,
                        Err(RuntimeError::Gateway {
                            what: "reading the peers' rendezvous values",
                            source: e,
                        }),
                    )
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
            .ok_or(TransportError::Closed("transport"))?;
        let peers = self.peers.clone();
        let corrupt = self.corrupt_version == Some(work.version);
        let c2 = cancel.clone();
        let t_moved = Instant::now();
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
            let me = self.incarnation().to_string();
            let watched = self.watched_seq.clone();
            tokio::spawn(async move {
                loop {
                    let polled = client
                        .events_as(&pair, after, Duration::from_secs(2), Some(&me))
                        .await;
                    match polled {
                        Ok(r) => {
                            after = r.last_seq.max(after);
                            watched.fetch_max(after, Ordering::AcqRel);
                            let stop = r.events.iter().any(|ev| match ev.kind {
                                // (an earlier attempt's abort stays in the stream: a rank
                                // told its attempt directly starts watching before it)
                                EventKind::Abort => {
                                    ev.version == Some(work.version)
                                        && ev.attempt.unwrap_or(1) >= work.attempt
                                }
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
        let (transport, result) = job.await.map_err(TransportError::Task)?;
        watcher.abort();
        if result.is_ok() {
            self.last_transfer = Some((work, t_moved.elapsed()));
        }
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
            .ok_or(TransportError::Closed("transport"))?;
        let job = tokio::task::spawn_blocking(move || {
            let r = transport.apply();
            (transport, r)
        });
        let (transport, applied) = job.await.map_err(TransportError::Task)?;
        self.transport = Some(transport);
        let applied = applied.map(|_| received).map_err(|e| RuntimeError::Apply {
            version: work.version,
            cause: Box::new(e),
        });
        self.report(work, applied).await
    }

    /// Atomic pairs, inference ranks: waits for the gateway's `apply` event of `work` (every
    /// rank of both sides received). Its abort, a later attempt, a disconnect or the deadline
    /// end the wait with an error: the live tensors were not touched.
    async fn wait_apply(&mut self, work: Work, deadline: Instant) -> Result<(), RuntimeError> {
        let mut after = self.last_seq;
        let v = Some(work.version);
        let me = self.incarnation().to_string();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RuntimeError::Deadline(work.version));
            }
            let polled = self
                .client
                .events_as(
                    &self.cfg.pair,
                    after,
                    left.min(Duration::from_secs(30)),
                    Some(&me),
                )
                .await;
            match polled {
                Ok(r) => {
                    after = r.last_seq.max(after);
                    self.watched_seq.fetch_max(after, Ordering::AcqRel);
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
                incarnation: Some(self.incarnation().to_string()),
            },
            Err(e) => Report {
                side: self.cfg.side,
                rank: self.cfg.rank,
                ok: false,
                bytes: 0,
                checksum: None,
                error: Some(e.to_string()),
                attempt: Some(work.attempt),
                incarnation: Some(self.incarnation().to_string()),
            },
        };
        // a report that may have arrived is re-sent only after a transient failure: the gateway
        // refuses a duplicate with 409, which is what a version that failed meanwhile answers
        let sent = retry_gateway(&self.cfg.gateway, "reporting", self.update_limit(), || {
            self.client.report(&self.cfg.pair, work.version, &report)
        })
        .await;
        if let Err(e) = sent {
            let refused = matches!(&e, RankError::Gateway(c) if c.status() == Some(409));
            // a report refused because the version already failed is not this rank's error
            if result.is_ok() && !refused {
                return Err(match e {
                    RankError::Gateway(source) => RuntimeError::Gateway {
                        what: "report to the gateway failed",
                        source,
                    },
                    RankError::Runtime(r) => r,
                    other => RuntimeError::GatewayLost {
                        what: "report to the gateway failed",
                        reason: other.to_string(),
                    },
                });
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
    // the backends register themselves (inventory) only when linked
    use awex_megatron as _;
    use awex_sglang as _;

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
            pair: Arc::new(cfg.pair_spec().resolve().unwrap()),
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
