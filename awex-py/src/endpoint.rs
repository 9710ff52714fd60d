//! One rank of a pair, driven from Python: `awex.Writer` (a training rank) and `awex.Reader`
//! (an inference rank) are thin Python classes over [`Endpoint`].
//!
//! Lifecycle: the constructor resolves the pair's description on the gateway and computes the
//! rank's layout and plan; `register` checks each tensor against that layout as it arrives;
//! `join` builds the transport and waits for every rank; `update` waits for the gateway's
//! `update` event of a version, executes it and (by default) waits for the version to commit.
//!
//! With the `shm` transport a training rank's tensors must sit in an awex shared-memory segment
//! that inference ranks map. Tensors registered from Python live in their own memory, so the
//! Writer keeps a shared-memory mirror of its layout and copies every registered tensor into it
//! at the start of each update (one extra copy on the sender); the `tcp` transport reads the
//! registered memory directly. Readers always write straight into the registered tensors.

use crate::errors::{Fail, Result};
use crate::memory::{Accept, Held, hold};
use crate::spec::{ModelArg, RankArgs, SideArg, resolve};
use awex_core::layout::{RankId, Side};
use awex_runtime::host::Memory;
use awex_runtime::rank::{
    Failure, Outcome, Prepared, Rank, RankConfig, Work, make_transport, prepare,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMapping};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How often a blocking wait returns to Python to let it handle signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// What `update()` waits for an update to start by default beyond the pair's update deadline
/// (at most; never more than the deadline itself).
pub(crate) const UPDATE_WAIT_MARGIN: Duration = Duration::from_secs(30);

/// A tokio runtime for one rank (or controller): the gateway client and transports run on it.
pub(crate) fn runtime(name: &str) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| Fail::Awex(format!("cannot start the awex runtime: {e}")))
}

/// Runs `fut` to completion with the interpreter released, returning to Python every
/// [`SIGNAL_POLL`] to handle signals (a `KeyboardInterrupt` drops `fut`, cancelling it); gives
/// up with `TimeoutError` after `timeout`.
pub(crate) fn wait<F>(
    py: Python<'_>,
    rt: &tokio::runtime::Runtime,
    what: &str,
    timeout: Option<Duration>,
    fut: F,
) -> Result<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    wait_unless(py, rt, what, timeout, fut, None)
}

/// [`wait`], also giving up (dropping `fut`) once `closing` is set: another thread's `close()`
/// of the rank that waits.
fn wait_unless<F>(
    py: Python<'_>,
    rt: &tokio::runtime::Runtime,
    what: &str,
    timeout: Option<Duration>,
    fut: F,
    closing: Option<&AtomicBool>,
) -> Result<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let mut fut = std::pin::pin!(fut);
    let start = Instant::now();
    loop {
        let slice = match timeout {
            Some(t) => t.saturating_sub(start.elapsed()).min(SIGNAL_POLL),
            None => SIGNAL_POLL,
        };
        let done =
            py.detach(|| rt.block_on(async { tokio::time::timeout(slice, &mut fut).await.ok() }));
        if let Some(out) = done {
            return Ok(out);
        }
        py.check_signals()?;
        if closing.is_some_and(|c| c.load(Ordering::Acquire)) {
            return Err(Fail::Awex(format!(
                "the rank was closed (close() from another thread) while {what}"
            )));
        }
        if let Some(t) = timeout
            && start.elapsed() >= t
        {
            return Err(Fail::Timeout(format!(
                "{what} did not finish within {:.1} s",
                t.as_secs_f64()
            )));
        }
    }
}

/// Seconds from Python as a duration (`None` waits without limit).
pub(crate) fn seconds(s: Option<f64>) -> Result<Option<Duration>> {
    match s {
        None => Ok(None),
        Some(x) if x.is_finite() && x >= 0.0 => Ok(Some(Duration::from_secs_f64(x))),
        Some(x) => Err(Fail::Value(format!(
            "timeout must be a non-negative number of seconds, not {x}"
        ))),
    }
}

/// A joined rank and what it moves.
struct Joined {
    rank: Rank,
    /// What the transport reads (writer) or writes (reader): the registered tensors, or their
    /// shared-memory mirror.
    mem: Memory,
    /// An update event received while waiting for another version, kept for the next call.
    pending: Option<Work>,
    checksums: bool,
    /// How long to wait for a version to commit after this rank's part.
    commit_wait: Duration,
}

/// The state of one rank. Fields drop in order: the transport first, then the registered
/// tensors it addresses, the runtime last.
struct Core {
    joined: Option<Joined>,
    /// Registered tensors, in registration order, and their index by name.
    registered: Vec<Held>,
    by_name: HashMap<String, usize>,
    cfg: RankConfig,
    prepared: Prepared,
    closed: bool,
    rt: tokio::runtime::Runtime,
}

/// A training or inference rank of a pair (the engine of `awex.Writer` / `awex.Reader`).
#[pyclass(name = "_Endpoint", module = "awex._awex")]
pub(crate) struct Endpoint {
    core: Mutex<Core>,
    /// Set by `close()` while another call holds the core: that call's waits (for the join,
    /// an update's event, its commit) give up, so that the close can go ahead.
    closing: AtomicBool,
}

/// How long `close()` waits for a call running on another thread to give the rank up: its
/// waits notice within [`SIGNAL_POLL`]; a transfer in progress ends at the pair's deadline.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

fn side_arg(
    spec: Option<String>,
    backend: Option<String>,
    parallel: Option<BTreeMap<String, u64>>,
) -> SideArg {
    SideArg {
        spec,
        backend,
        parallel,
    }
}

impl Core {
    fn who(&self) -> String {
        match self.cfg.side {
            Side::Training => format!("training rank {}", self.cfg.rank.rank),
            Side::Inference => format!(
                "inference rank {}/{}",
                self.cfg.rank.engine, self.cfg.rank.rank
            ),
        }
    }

    fn open(&self) -> Result<()> {
        if self.closed {
            return Err(Fail::Awex(format!("{} is closed", self.who())));
        }
        Ok(())
    }

    /// Checks one registered tensor against the rank's layout.
    fn check(&self, h: &Held) -> Result<()> {
        let v = &h.view;
        let layout = &self.prepared.layout;
        let Some(t) = layout.tensor(&v.name) else {
            let mut names: Vec<&str> = layout.tensors.iter().map(|t| &*t.name).collect();
            names.truncate(3);
            return Err(Fail::Layout(format!(
                "`{}` is not a tensor of {}'s layout ({} {}); it has {} tensors, e.g. {}",
                v.name,
                self.who(),
                self.own_spec(),
                self.cfg.model.name,
                layout.tensors.len(),
                names
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        if v.shape != t.shape {
            return Err(Fail::Layout(format!(
                "`{}` has shape {} but {}'s layout needs {}",
                v.name,
                v.shape,
                self.who(),
                t.shape
            )));
        }
        if v.dtype != t.dtype {
            use awex_core::DType;
            let hint = match (v.dtype, t.dtype) {
                (DType::F8E4m3, _) => {
                    "; the engine holds FP8 weights but the pair was connected with a plain inference side: connect it with the FP8 checkpoint's config (Controller.connect(infer_config=...) or infer_quant=\"fp8\"; awex-cli --infer-config / --infer-quant fp8)"
                }
                (_, DType::F8E4m3) => {
                    "; the pair was connected with an FP8 inference side but the engine holds this weight unquantised: launch the engine from the FP8 checkpoint, or connect the pair without infer_quant / infer_config"
                }
                _ => "",
            };
            return Err(Fail::Layout(format!(
                "`{}` is {} but {}'s layout needs {}{hint}",
                v.name,
                v.dtype,
                self.who(),
                t.dtype
            )));
        }
        Ok(())
    }

    fn own_spec(&self) -> &awex_core::BackendSpec {
        match self.cfg.side {
            Side::Training => &self.cfg.train,
            Side::Inference => &self.cfg.infer,
        }
    }
}

impl Endpoint {
    /// Exclusive access to the rank (calls on one rank from several threads at once are refused).
    fn core(&self) -> Result<std::sync::MutexGuard<'_, Core>> {
        self.core.try_lock().map_err(|e| match e {
            std::sync::TryLockError::WouldBlock => Fail::Awex(
                "another call on this rank is still running (calls on one Writer/Reader must not overlap)".into(),
            ),
            std::sync::TryLockError::Poisoned(_) => {
                Fail::Awex("this rank is unusable after an internal failure".into())
            }
        })
    }
}

/// The pairs of a `register` argument: a mapping or an iterable of `(name, tensor)`.
fn pairs<'py>(obj: &Bound<'py, PyAny>) -> Result<Vec<(String, Bound<'py, PyAny>)>> {
    let items = if let Ok(d) = obj.cast::<PyDict>() {
        d.items().into_any()
    } else if let Ok(m) = obj.cast::<PyMapping>() {
        m.items()?.into_any()
    } else {
        obj.clone()
    };
    let mut out = Vec::new();
    let iter = items.try_iter().map_err(|_| {
        Fail::Type(
            "register takes (name, tensor) pairs: a dict, or an iterable such as model.named_parameters()".into(),
        )
    })?;
    for item in iter {
        let item = item?;
        let (name, t): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item.extract().map_err(|_| {
            Fail::Type(format!(
                "register takes (name, tensor) pairs; got an item of type `{}`",
                item.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        let name: String = name.extract().map_err(|_| {
            Fail::Type(format!(
                "tensor names are strings; got `{}`",
                name.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?;
        out.push((name, t));
    }
    Ok(out)
}

/// `json.loads(text)`.
pub(crate) fn json_to_py<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (text,))
}

/// Any serialisable value as Python data.
pub(crate) fn to_py<'py>(py: Python<'py>, v: &impl serde::Serialize) -> Result<Bound<'py, PyAny>> {
    let text = serde_json::to_string(v).map_err(|e| Fail::Awex(format!("cannot encode: {e}")))?;
    Ok(json_to_py(py, &text)?)
}

#[pymethods]
impl Endpoint {
    /// Resolves the pair on the gateway and computes this rank's layout and plan.
    #[new]
    #[pyo3(signature = (side, gateway, pair, rank, engine=0, *, token=None, model=None, model_json=None,
        train=None, train_backend=None, train_parallel=None,
        infer=None, infer_backend=None, infer_parallel=None,
        transport=None, bucket_mib=None, host=None, timeout=None, deltas=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        side: &str,
        gateway: String,
        pair: String,
        rank: u32,
        engine: u32,
        token: Option<String>,
        model: Option<String>,
        model_json: Option<String>,
        train: Option<String>,
        train_backend: Option<String>,
        train_parallel: Option<BTreeMap<String, u64>>,
        infer: Option<String>,
        infer_backend: Option<String>,
        infer_parallel: Option<BTreeMap<String, u64>>,
        transport: Option<String>,
        bucket_mib: Option<u64>,
        host: Option<String>,
        timeout: Option<f64>,
        deltas: Option<bool>,
    ) -> PyResult<Self> {
        let side = match side {
            "train" | "training" => Side::Training,
            "infer" | "inference" => Side::Inference,
            s => {
                return Err(
                    Fail::Value(format!("side must be `train` or `infer`, not `{s}`")).into(),
                );
            }
        };
        if side == Side::Training && engine != 0 {
            return Err(Fail::Value(format!(
                "training ranks belong to engine 0; got engine={engine}"
            ))
            .into());
        }
        let model = match (model, model_json) {
            (Some(_), Some(_)) => {
                return Err(Fail::Value("give model or model_json, not both".into()).into());
            }
            (Some(m), None) => Some(ModelArg::Resolve(m)),
            (None, Some(j)) => Some(ModelArg::ConfigJson(j)),
            (None, None) => None,
        };
        let args = RankArgs {
            side,
            gateway,
            pair,
            rank: match side {
                Side::Training => RankId::train(rank),
                Side::Inference => RankId::infer(engine, rank),
            },
            token,
            model,
            train: side_arg(train, train_backend, train_parallel),
            infer: side_arg(infer, infer_backend, infer_parallel),
            transport,
            bucket_mib,
            host,
            deltas,
        };
        let rt = runtime(match side {
            Side::Training => "awex-writer",
            Side::Inference => "awex-reader",
        })?;
        let timeout = seconds(timeout.or(Some(60.0)))?;
        let cfg = wait(
            py,
            &rt,
            "resolving the pair on the gateway",
            timeout,
            resolve(&args),
        )??;
        let prepared = py.detach(|| prepare(&cfg).map_err(Fail::from))?;
        Ok(Endpoint {
            core: Mutex::new(Core {
                joined: None,
                registered: Vec::new(),
                by_name: HashMap::new(),
                cfg,
                prepared,
                closed: false,
                rt,
            }),
            closing: AtomicBool::new(false),
        })
    }

    /// Registers `(name, tensor)` pairs (zero copy), checking each against the rank's layout;
    /// on any error nothing of this call is registered.
    fn register(&self, tensors: &Bound<'_, PyAny>) -> PyResult<usize> {
        let mut core = self.core()?;
        core.open()?;
        if core.joined.is_some() {
            return Err(Fail::Awex(format!(
                "{} already joined; register every tensor before join()",
                core.who()
            ))
            .into());
        }
        let writable = core.cfg.side == Side::Inference;
        let accept = match core.cfg.transport.memory() {
            awex_core::transport::Memory::Gpu => Accept::Cuda(core.cfg.transport.as_str()),
            awex_core::transport::Memory::Host => Accept::Host,
        };
        let mut batch: Vec<Held> = Vec::new();
        for (name, obj) in pairs(tensors)? {
            if core.by_name.contains_key(&name) || batch.iter().any(|h| *h.view.name == *name) {
                return Err(Fail::Layout(format!("`{name}` is registered twice")).into());
            }
            let h = hold(&name, &obj, writable, accept)?;
            core.check(&h)?;
            batch.push(h);
        }
        let n = batch.len();
        for h in batch {
            let i = core.registered.len();
            core.by_name.insert(h.view.name.to_string(), i);
            core.registered.push(h);
        }
        Ok(n)
    }

    /// Names the layout needs that are not registered yet, in layout order.
    fn missing(&self) -> PyResult<Vec<String>> {
        let core = self.core()?;
        Ok(core
            .prepared
            .layout
            .tensors
            .iter()
            .filter(|t| !core.by_name.contains_key(&*t.name))
            .map(|t| t.name.to_string())
            .collect())
    }

    /// The rank's computed layout: every local tensor with its shape, dtype and placements.
    fn layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let core = self.core()?;
        Ok(to_py(py, &core.prepared.layout.tensors)?)
    }

    /// Checks the registered tensors, builds the transport and joins the pair, waiting for every
    /// rank of both sides.
    #[pyo3(signature = (timeout=None))]
    fn join(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let mut guard = self.core()?;
        let core = &mut *guard;
        core.open()?;
        if core.joined.is_some() {
            return Err(Fail::Awex(format!("{} already joined", core.who())).into());
        }
        let timeout = seconds(timeout)?;
        let views = core.registered.iter().map(|h| h.view.clone()).collect();
        let mem = Memory::registered(
            views,
            &core.prepared.layout,
            &core.cfg.shm_scope(),
            core.cfg.side,
            core.cfg.transport,
        )
        .map_err(Fail::from)?;
        let tensors = mem.tensors.clone();
        let transport =
            make_transport(&core.cfg, &core.prepared, tensors.clone()).map_err(Fail::from)?;
        let who = core.who();
        let rank = wait_unless(
            py,
            &core.rt,
            &format!("joining pair `{}` as {who}", core.cfg.pair),
            timeout,
            Rank::join(core.cfg.clone(), &core.prepared, &tensors, transport),
            Some(&self.closing),
        )?
        .map_err(Fail::from)?;
        let options = &rank.joined.options;
        let checksums = options.checksums;
        let commit_wait = Duration::from_millis(options.update_deadline_ms.saturating_mul(2))
            + Duration::from_secs(10);
        core.joined = Some(Joined {
            rank,
            mem,
            pending: None,
            checksums,
            commit_wait,
        });
        Ok(())
    }

    /// Waits for the gateway's update event of `version` (the next one when `None`), executes
    /// this rank's part and, with `wait_commit`, waits until the version committed. With
    /// `attempt` (and `version`), the caller already knows the live attempt (the engine's
    /// trigger carries it): the event is not waited for.
    #[pyo3(signature = (version=None, timeout=None, wait_commit=true, attempt=None))]
    fn update<'py>(
        &self,
        py: Python<'py>,
        version: Option<u64>,
        timeout: Option<f64>,
        wait_commit: bool,
        attempt: Option<u32>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut guard = self.core()?;
        let core = &mut *guard;
        core.open()?;
        let who = core.who();
        let pair = core.cfg.pair.clone();
        let explicit = seconds(timeout)?;
        let Some(j) = core.joined.as_mut() else {
            return Err(Fail::Awex(format!("{who} has not joined; call join() first")).into());
        };
        // the default wait is finite: the pair's update deadline plus a margin; when it passes
        // before any update started, the call answers None ("no update yet": call again)
        let deadline = Duration::from_millis(j.rank.joined.options.update_deadline_ms);
        let default_wait = deadline + deadline.min(UPDATE_WAIT_MARGIN);
        let timeout = Some(explicit.unwrap_or(default_wait));
        // 1. the update event (unless the caller was told the attempt)
        let started = Instant::now();
        let given = match (version, attempt) {
            (Some(version), Some(attempt)) if attempt >= 1 => Some(Work { version, attempt }),
            (_, None) => None,
            (None, Some(_)) => {
                return Err(Fail::Value("update(attempt=...) needs the version too".into()).into());
            }
            (Some(_), Some(a)) => {
                return Err(Fail::Value(format!(
                    "attempt {a} is not an attempt (they count from 1)"
                ))
                .into());
            }
        };
        let work = if let Some(w) = given {
            w
        } else {
            loop {
                let next = match j.pending.take() {
                    Some(w) => Some(w),
                    None => {
                        let left = timeout.map(|t| t.saturating_sub(started.elapsed()));
                        let what = match version {
                            Some(v) => format!("waiting for update {v} of pair `{pair}`"),
                            None => format!("waiting for an update of pair `{pair}`"),
                        };
                        match wait_unless(
                            py,
                            &core.rt,
                            &what,
                            left,
                            j.rank.next_live_work(),
                            Some(&self.closing),
                        ) {
                            Err(Fail::Timeout(_)) if explicit.is_none() => {
                                return Ok(py.None().into_bound(py));
                            }
                            r => r?.map_err(Fail::from)?,
                        }
                    }
                };
                let Some(w) = next else {
                    let message = if j.rank.engine_removed() {
                        format!(
                            "this rank's engine was removed from pair `{pair}` while {who} waited for an update; its slot is free (add the engine again to take part)"
                        )
                    } else {
                        format!("pair `{pair}` was disconnected while {who} waited for an update")
                    };
                    return Err(Fail::Disconnected(message).into());
                };
                match version {
                    Some(v) if w.version < v => continue,
                    Some(v) if w.version > v => {
                        j.pending = Some(w);
                        return Err(Fail::Awex(format!(
                        "the gateway started version {} while {who} waited for version {v}; call update({})",
                        w.version, w.version
                    ))
                    .into());
                    }
                    _ => {}
                }
                // (next_live_work skipped events of attempts that are over)
                break w;
            }
        };
        // 2. this rank's part
        let t0 = Instant::now();
        if j.mem.uses_mirror() {
            let mem = &j.mem;
            py.detach(|| mem.refresh()).map_err(Fail::from)?;
        }
        let checksums = j.checksums;
        let rank = &mut j.rank;
        let ran = py.detach(|| core.rt.block_on(rank.run(work, checksums, None)));
        if given.is_some() {
            // told its attempts, this rank never reads work from the event stream
            rank.skip_read_events();
        }
        let stats = match ran {
            Outcome::Executed { stats, .. } => stats,
            Outcome::Failed {
                reason: Failure::Rank(e),
                ..
            } => {
                return Err(Fail::UpdateFailed {
                    version: work.version,
                    message: format!(
                        "{who} failed version {} (attempt {}): {e}",
                        work.version, work.attempt
                    ),
                    ranks: vec![who.clone()],
                }
                .into());
            }
            other => {
                return Err(Fail::Awex(format!("{who}: unexpected outcome {other:?}")).into());
            }
        };
        let moved = t0.elapsed();
        // 3. the commit
        let mut state = "done";
        if wait_commit {
            let limit = j.commit_wait;
            let what = format!(
                "waiting for version {} of pair `{pair}` to commit",
                work.version
            );
            let outcome = j.rank.outcome(work, stats, limit);
            match wait_unless(
                py,
                &core.rt,
                &what,
                Some(limit),
                outcome,
                Some(&self.closing),
            )? {
                Outcome::Committed { .. } => state = "committed",
                Outcome::Failed {
                    reason: Failure::Version(st),
                    ..
                } => return Err(failed_version(&st).into()),
                Outcome::Failed {
                    reason: Failure::Gateway(e),
                    ..
                } => return Err(Fail::from(e).into()),
                Outcome::Disconnected => {
                    return Err(Fail::Disconnected(format!(
                        "pair `{pair}` was disconnected while {who} waited for version {} to commit",
                        work.version
                    ))
                    .into());
                }
                _ => {
                    return Err(Fail::Timeout(format!(
                        "{what} did not finish within {:.1} s",
                        limit.as_secs_f64()
                    ))
                    .into());
                }
            }
        }
        let out = PyDict::new(py);
        out.set_item("version", work.version)?;
        out.set_item("attempt", work.attempt)?;
        out.set_item("bytes", stats.bytes)?;
        out.set_item("buckets", stats.buckets)?;
        out.set_item("checksum", stats.checksum)?;
        out.set_item("seconds", moved.as_secs_f64())?;
        out.set_item("state", state)?;
        Ok(out.into_any())
    }

    /// Tears the transport down (shared memory unlinked, sockets closed) and releases the
    /// registered tensors; idempotent. A call of this rank waiting on another thread (for the
    /// join, an update, a commit) gives up first and raises that the rank was closed.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let mut core = match self.core.try_lock() {
            Ok(c) => c,
            Err(std::sync::TryLockError::Poisoned(_)) => {
                return Err(
                    Fail::Awex("this rank is unusable after an internal failure".into()).into(),
                );
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                self.closing.store(true, Ordering::Release);
                let start = Instant::now();
                loop {
                    match self.core.try_lock() {
                        Ok(c) => break c,
                        Err(std::sync::TryLockError::WouldBlock)
                            if start.elapsed() < CLOSE_WAIT =>
                        {
                            py.detach(|| std::thread::sleep(Duration::from_millis(5)));
                        }
                        Err(_) => {
                            self.closing.store(false, Ordering::Release);
                            return Err(Fail::Awex(format!(
                                "close(): another call on this rank is still running after {} s (a transfer in progress ends at the pair's update deadline); try again",
                                CLOSE_WAIT.as_secs()
                            ))
                            .into());
                        }
                    }
                }
            }
        };
        if let Some(mut j) = core.joined.take() {
            j.rank.close();
        }
        core.registered.clear();
        core.by_name.clear();
        core.closed = true;
        Ok(())
    }

    /// `train` or `infer`.
    #[getter]
    fn side(&self) -> PyResult<&'static str> {
        Ok(self.core()?.cfg.side.short())
    }

    /// The rank (global on the training side, within its engine on the inference side).
    #[getter]
    fn rank(&self) -> PyResult<u32> {
        Ok(self.core()?.cfg.rank.rank)
    }

    /// The inference engine (0 on the training side).
    #[getter]
    fn engine(&self) -> PyResult<u32> {
        Ok(self.core()?.cfg.rank.engine)
    }

    /// This process's claim id on its slot once joined (`None` before): the gateway accepts
    /// a report for the slot only with it (awex's SGLang loader reporting an early failure).
    #[getter]
    fn incarnation(&self) -> PyResult<Option<String>> {
        Ok(self
            .core()?
            .joined
            .as_ref()
            .map(|j| j.rank.incarnation().to_string()))
    }

    /// The pair's name.
    #[getter]
    fn pair(&self) -> PyResult<String> {
        Ok(self.core()?.cfg.pair.clone())
    }

    /// The transport (`shm`, `tcp`, `cuda-ipc`).
    #[getter]
    fn transport(&self) -> PyResult<&'static str> {
        Ok(self.core()?.cfg.transport.as_str())
    }

    /// The training layout, `backend:k=v,...`.
    #[getter]
    fn train(&self) -> PyResult<String> {
        Ok(self.core()?.cfg.train.to_string())
    }

    /// The inference layout, `backend:k=v,...`.
    #[getter]
    fn infer(&self) -> PyResult<String> {
        Ok(self.core()?.cfg.infer.to_string())
    }

    /// The model's name.
    #[getter]
    fn model(&self) -> PyResult<String> {
        Ok(self.core()?.cfg.model.name.clone())
    }

    /// Whether the rank joined its pair (and is not closed).
    #[getter]
    fn joined(&self) -> PyResult<bool> {
        Ok(self.core()?.joined.is_some())
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> PyResult<bool> {
        Ok(self.core()?.closed)
    }

    /// Bytes this rank sends (training) or receives (inference) per update.
    #[getter]
    fn plan_bytes(&self) -> PyResult<u64> {
        Ok(self.core()?.prepared.plan.bytes())
    }

    /// Whether updates go through a shared-memory mirror of the registered tensors.
    #[getter]
    fn uses_mirror(&self) -> PyResult<bool> {
        let core = self.core()?;
        Ok(core.cfg.side == Side::Training && core.cfg.transport.sends_from_shared_memory())
    }

    fn __repr__(&self) -> PyResult<String> {
        let core = self.core()?;
        Ok(format!(
            "<{} of pair `{}` ({} -> {}, {}), {} of {} tensors registered{}>",
            core.who(),
            core.cfg.pair,
            core.cfg.train,
            core.cfg.infer,
            core.cfg.transport,
            core.registered.len(),
            core.prepared.layout.tensors.len(),
            if core.closed {
                ", closed"
            } else if core.joined.is_some() {
                ", joined"
            } else {
                ""
            }
        ))
    }
}

/// A version that did not commit, with the ranks that did not succeed.
fn failed_version(st: &awex_control::wire::UpdateStatus) -> Fail {
    let ranks = st
        .ranks
        .iter()
        .filter(|r| r.state != awex_control::wire::RankReportState::Ok)
        .map(|r| match r.side {
            Side::Training => format!("training rank {}", r.rank.rank),
            Side::Inference => format!("inference rank {}/{}", r.rank.engine, r.rank.rank),
        })
        .collect();
    Fail::UpdateFailed {
        version: st.version,
        message: format!(
            "version {} did not commit: {}",
            st.version,
            st.error.as_deref().unwrap_or("failed")
        ),
        ranks,
    }
}
