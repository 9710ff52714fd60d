//! Pairs: `POST /v1/pairs` (connect), `GET /v1/pairs/{name}/status`, `DELETE /v1/pairs/{name}`
//! (disconnect), and the per-pair state every other resource hangs off.
//!
//! Connect validates everything before any rank can join: names, world sizes, engine URLs,
//! options, each side's model against its catalogue summary, and that both sides describe the
//! same canonical tensors (dtypes may differ only where the sender converts).

use crate::server::engine::{EngineCmd, EngineEvents, EngineLane};
use crate::server::error::ApiError;
use crate::server::extract::{JsonBody, PathParams, json_error};
use crate::server::state::{AppState, Pair, PairEntry, unix_ms};
use crate::server::store::disk::{Op, Write};
use crate::server::store::roster::Slots;
use crate::server::validate;
use crate::wire::MAX_RANKS;
use crate::wire::{ConnectRequest, PairState, PairStatus, Resume, SideStatus, model_key};
use awex_core::backend::{
    EngineControl, EngineExpect, ParallelConfig, TriggerWork, inference_backend,
};
use awex_core::encoding::InferFp8;
use awex_core::layout::Side;
use awex_core::model::ModelSpec;
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::Value;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

fn backend_name(side: Side, s: &str) -> Result<(), ApiError> {
    let ok = !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(ApiError::Unprocessable(format!(
            "{side}.backend `{}` is not a backend name (1 to 64 characters from A-Z a-z 0-9 - _)",
            validate::clip(s, 80)
        )))
    }
}

fn parallel(side: Side, backend: &str, p: &ParallelConfig) -> Result<(), ApiError> {
    if p.0.len() > 32 {
        return Err(ApiError::Unprocessable(format!(
            "{side}.parallel has {} keys; at most 32 are accepted",
            p.0.len()
        )));
    }
    match p
        .0
        .keys()
        .find(|k| validate::name("key", k).is_err() || k.len() > 64)
    {
        Some(k) => Err(ApiError::Unprocessable(format!(
            "{side}.parallel key `{}` is not a parallel key name",
            validate::clip(k, 80)
        ))),
        // the same bounds as every backend's own config (awex_core::limits)
        None => p
            .check_limits(backend)
            .map_err(|e| ApiError::Unprocessable(format!("{side}.parallel: {e}"))),
    }
}

fn option(name: &str, v: u64, lo: u64, hi: u64) -> Result<(), ApiError> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(ApiError::Unprocessable(format!(
            "options.{name}={v} is out of range; it must be between {lo} and {hi}"
        )))
    }
}

/// The inference backend's engine control, when the pair names engine URLs: a backend that
/// cannot drive its servers refuses URLs instead of ignoring them.
/// What a pair's entry is made of, besides its channels and its engine lane.
struct EntryParts {
    name: String,
    id: u64,
    uid: String,
    secret: String,
    slots: Slots,
    created_unix_ms: u64,
    join_deadline: Instant,
    join_deadline_unix_ms: u64,
    training: SideStatus,
    inference: SideStatus,
    /// the pair's state (`None`: a new pair's, from its slots)
    pair: Option<Pair>,
    facts: Vec<awex_core::backend::EngineFacts>,
    request: ConnectRequest,
}

/// A pair's entry, for a new connect or one restored from the gateway's state: its channels, and
/// the lane that drives its engines when `control` is given and the pair names engine URLs.
fn new_entry(
    gw: &crate::server::state::Gateway,
    e: EntryParts,
    control: Option<&'static dyn EngineControl>,
) -> Arc<PairEntry> {
    let urls = e.request.inference.urls.clone();
    let trigger_timeout = Duration::from_millis(e.request.options.update_deadline_ms);
    let inner = e.pair.unwrap_or_else(|| {
        let mut p = Pair::new(&e.slots);
        // the last `spare` slots start empty: engines added at run time take them
        let present = e.slots.engines.saturating_sub(e.request.inference.spare) as usize;
        for r in p.engines.iter_mut().skip(present) {
            *r = crate::server::store::engines::EngineRecord::absent();
        }
        p
    });
    Arc::new_cyclic(|weak| PairEntry {
        name: e.name,
        id: e.id,
        uid: e.uid,
        secret: e.secret,
        slots: e.slots,
        created_unix_ms: e.created_unix_ms,
        join_deadline: e.join_deadline,
        join_deadline_unix_ms: e.join_deadline_unix_ms,
        training: e.training,
        inference: e.inference,
        inner: Mutex::new(inner),
        roster_tx: watch::Sender::new(()),
        events_tx: watch::Sender::new(0),
        kv_tx: watch::Sender::new(()),
        update_tx: watch::Sender::new(()),
        metrics: gw.metrics.clone(),
        facts: e.facts.clone(),
        store: gw.store.clone(),
        engines: control.filter(|_| !urls.is_empty()).map(|control| {
            EngineLane::spawn(
                weak.clone() as Weak<dyn EngineEvents>,
                control,
                urls,
                e.facts,
                gw.engines.clone(),
                trigger_timeout,
                !e.request.options.commit.is_all(),
            )
        }),
        request: e.request,
    })
}

pub(crate) fn engine_control(
    backend: &str,
    urls: &[String],
) -> Result<Option<&'static dyn EngineControl>, ApiError> {
    if urls.is_empty() {
        return Ok(None);
    }
    let b = inference_backend(backend).map_err(|e| ApiError::Unprocessable(e.to_string()))?;
    match b.engine_control() {
        Some(c) => Ok(Some(c)),
        None => Err(ApiError::Unprocessable(format!(
            "inference backend `{backend}` cannot drive its engines' servers; connect without inference.urls"
        ))),
    }
}

fn engine_url(i: usize, url: &str) -> Result<(), ApiError> {
    let parsed = reqwest::Url::parse(url).ok().filter(|u| {
        u.scheme() == "http" && u.host_str().is_some() && u.query().is_none() && url.len() <= 2048
    });
    match parsed {
        Some(_) => Ok(()),
        None => Err(ApiError::Unprocessable(format!(
            "inference.urls[{i}] `{}` is not an engine base URL; expected e.g. http://10.0.0.5:30000",
            validate::clip(url, 200)
        ))),
    }
}

/// When this process has the side's backend registered (as `awex-cli serve` has every one it
/// was built with), refuses a parallel config that backend refuses for the model, as the
/// ranks would when they build their layouts; a gateway without the backend leaves it to them.
fn registered_layout(
    side: Side,
    backend: &str,
    parallel: &ParallelConfig,
    model: &ModelSpec,
    fp8: Option<&InferFp8>,
    no_transpose: Option<&str>,
) -> Result<Vec<String>, ApiError> {
    if let Some(f) = fp8 {
        // a deserialised config is checked as the CLI's and the Python package's are (one
        // check: `Fp8Config::validate`), and the recipe can write its encoding
        f.config
            .validate()
            .map_err(|e| ApiError::Unprocessable(format!("inference.fp8.config: {e}")))?;
        InferFp8::new(f.config.clone(), f.recipe)
            .map_err(|e| ApiError::Unprocessable(format!("inference.fp8: {e}")))?;
    }
    let registered = match side {
        Side::Training => awex_core::backend::training_backend(backend).is_ok(),
        Side::Inference => awex_core::backend::inference_backend(backend).is_ok(),
    };
    if !registered {
        return Ok(Vec::new());
    }
    let spec = awex_core::backend::BackendSpec {
        backend: backend.to_string(),
        parallel: parallel.clone(),
    };
    let layout = awex_core::backend::side_layout(side, &spec, model)
        .map_err(|e| ApiError::Unprocessable(format!("{side}.parallel `{spec}`: {e}")))?;
    if let Some(f) = fp8 {
        // shards that cut a block, fused tensors only partly quantised: refused at connect
        let cat = awex_core::Catalogue::of(model);
        awex_core::encoding::Fp8Side::new(layout.clone(), model, &cat, f.clone())
            .map_err(|e| ApiError::Unprocessable(format!("inference.fp8 with `{spec}`: {e}")))?;
    }
    // an engine that holds boxes transposed (gpt-oss's experts) is moved by cuda-ipc, shm and
    // tcp (the latter two without deltas): refused at connect where the pair would move it otherwise (`no_transpose` says why)
    if let Some(why) = no_transpose {
        let cat = awex_core::Catalogue::of(model);
        if let Some((c, h)) = cat.tensors().iter().find_map(|c| {
            layout
                .holders(&c.name)
                .into_iter()
                .find(|h| h.transposed)
                .map(|h| (c.name.clone(), h.tensor))
        }) {
            return Err(ApiError::Unprocessable(format!(
                "{side}.parallel `{spec}` holds `{c}` transposed (as `{h}`: the engine stores it with its last two dims swapped), which {why} does not move yet; use the cuda-ipc or nccl transport, or shm or tcp without delta updates"
            )));
        }
    }
    Ok(layout.dropped())
}

/// Checks a connect request, returning the rank slots and both sides' status templates.
fn check(req: &ConnectRequest, raw: &Value) -> Result<(Slots, SideStatus, SideStatus), ApiError> {
    validate::name("pair name", &req.name)?;
    backend_name(Side::Training, &req.training.backend)?;
    backend_name(Side::Inference, &req.inference.backend)?;
    parallel(
        Side::Training,
        &req.training.backend,
        &req.training.parallel,
    )?;
    parallel(
        Side::Inference,
        &req.inference.backend,
        &req.inference.parallel,
    )?;
    let (tw, iw, e) = (
        req.training.world_size,
        req.inference.world_size,
        req.inference.engines,
    );
    if tw == 0 || iw == 0 || e == 0 {
        return Err(ApiError::Unprocessable(format!(
            "training.world_size={tw}, inference.engines={e} and inference.world_size={iw} must all be at least 1"
        )));
    }
    for (what, w) in [("training.world_size", tw), ("inference.world_size", iw)] {
        awex_core::limits::WORLD_SIZE
            .check(what, u128::from(w))
            .map_err(|e| ApiError::Unprocessable(e.to_string()))?;
    }
    if u64::from(tw) + u64::from(iw) > u64::from(MAX_RANKS) {
        return Err(ApiError::Unprocessable(format!(
            "the pair has {tw} training + {iw} inference ranks; at most {MAX_RANKS} ranks in all are accepted"
        )));
    }
    if iw % e != 0 {
        return Err(ApiError::Unprocessable(format!(
            "inference.world_size={iw} is not a multiple of inference.engines={e}; it counts the ranks of all engines together"
        )));
    }
    let urls = &req.inference.urls;
    if !urls.is_empty() && urls.len() != e as usize {
        return Err(ApiError::Unprocessable(format!(
            "inference.urls has {} URLs for {e} engines; give one per engine or none",
            urls.len()
        )));
    }
    for (i, u) in urls.iter().enumerate() {
        engine_url(i, u)?;
    }
    let o = &req.options;
    option("join_deadline_ms", o.join_deadline_ms, 1, 3_600_000)?;
    option("update_deadline_ms", o.update_deadline_ms, 1, 86_400_000)?;
    option("bucket_mib", o.bucket_mib, 1, 65_536)?;
    option("buckets", u64::from(o.buckets), 1, 64)?;
    commit_policy(o, e)?;
    if o.check_finite && req.transport.on_gpu() {
        return Err(ApiError::Unprocessable(format!(
            "options.check_finite reads the training ranks' sources on the host, and the {} transport keeps them in GPU memory, where awex has no such check yet; use shm or tcp, or connect without check_finite",
            req.transport
        )));
    }
    spare_slots(o, e, req.inference.spare, req.transport)?;

    let null = Value::Null;
    let tm = validate::model(
        Side::Training,
        raw.pointer("/training/model").unwrap_or(&null),
    )?;
    let im = validate::model(
        Side::Inference,
        raw.pointer("/inference/model").unwrap_or(&null),
    )?;
    let dropped_t = registered_layout(
        Side::Training,
        &req.training.backend,
        &req.training.parallel,
        &tm,
        None,
        None,
    )?;
    let dropped_i = registered_layout(
        Side::Inference,
        &req.inference.backend,
        &req.inference.parallel,
        &im,
        req.inference.fp8.as_ref(),
        // cuda-ipc and nccl transpose on the receiving GPU (with or without deltas); shm and
        // tcp transpose on the receiver's CPU, but not through a delta stream
        if o.deltas && !req.transport.on_gpu() {
            Some("options.deltas".to_string())
        } else {
            None
        }
        .as_deref(),
    )?;
    let tc = validate::catalogue(Side::Training, &tm, &req.training.catalogue)?;
    let ic = validate::catalogue(Side::Inference, &im, &req.inference.catalogue)?;
    if let Some(diff) = validate::first_difference(&tc, &ic) {
        return Err(ApiError::Unprocessable(format!(
            "the two sides do not describe the same canonical tensors: {diff}"
        )));
    }
    let side = |backend: &str,
                parallel: &ParallelConfig,
                w,
                e,
                urls: &[String],
                m: &ModelSpec,
                c,
                dropped: Vec<String>,
                fp8: Option<InferFp8>| {
        SideStatus {
            backend: backend.to_string(),
            parallel: parallel.clone(),
            world_size: w,
            engines: e,
            urls: urls.to_vec(),
            model: validate::clip(&m.name, 128),
            fingerprint: format!("{:016x}", m.fingerprint()),
            catalogue: c,
            dropped,
            joined: 0,
            fp8,
        }
    };

    Ok((
        Slots::new(tw, e, iw / e),
        side(
            &req.training.backend,
            &req.training.parallel,
            tw,
            1,
            &[],
            &tm,
            req.training.catalogue.clone(),
            dropped_t,
            None,
        ),
        side(
            &req.inference.backend,
            &req.inference.parallel,
            iw,
            e,
            urls,
            &im,
            req.inference.catalogue.clone(),
            dropped_i,
            // the status takes it from the request: one copy per pair
            None,
        ),
    ))
}

/// `N` bytes from the kernel's random source, in hex (pair uids).
fn random_hex<const N: usize>() -> Result<String, ApiError> {
    use std::io::Read;
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| {
            ApiError::Conflict(format!(
                "the gateway cannot read /dev/urandom for the pair secret: {e}"
            ))
        })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// `POST /v1/pairs`: validates and registers a pair; 201 with its status.
pub(crate) async fn connect(
    State(gw): State<AppState>,
    JsonBody(raw): JsonBody<Value>,
) -> Result<(StatusCode, Json<PairStatus>), ApiError> {
    // however it ends, the parsed body (up to the body limit, several times its size as a JSON
    // tree) and any disconnected pair it replaced are freed: their pages go back
    let _trim = gw.trim.on_drop();
    let req: ConnectRequest = serde_json::from_value(raw.clone()).map_err(|e| json_error(&e))?;
    // validation builds both catalogues and layouts (seconds for a 1T model): off the async
    // workers, and a core fewer at once than the machine has, so that health checks and
    // long-polls keep answering meanwhile
    // (the slot is held for the validation only, not for the engine checks that follow)
    let slot = gw
        .validations
        .acquire()
        .await
        .map_err(|_| ApiError::Unavailable("the gateway is shutting down".to_string()))?;
    let running = gw.metrics.validating();
    let validated = tokio::task::spawn_blocking(move || {
        let _running = running;
        let checked = check(&req, &raw);
        checked.map(|c| (req, c))
    })
    .await;
    drop(slot);
    let (req, (slots, training, inference)) = validated.map_err(|e| {
        ApiError::Unprocessable(format!("validating the connect request failed: {e}"))
    })??;
    let name = req.name.clone();
    let join_deadline = Instant::now() + Duration::from_millis(req.options.join_deadline_ms);
    let urls = req.inference.urls.clone();
    let control = engine_control(&req.inference.backend, &urls)?;
    // engines unreachable or disagreeing with the declared layout fail the connect, not the
    // first update
    let facts = match control {
        Some(c) => {
            let parallel = checked_parallel(&req.inference.backend, &req.inference.parallel);
            let model = req.inference.model.name.clone();
            let architecture = req.inference.model.architecture.hf_name();
            gw.engines
                .check_servers(c, &urls, |engine| EngineExpect {
                    engine,
                    parallel: &parallel,
                    model: Some(&model),
                    architecture,
                })
                .await
                .map_err(ApiError::Unprocessable)?
        }
        None => Vec::new(),
    };
    if req.options.apply == crate::wire::ApplyMode::Atomic
        && let Some(c) = control
        && facts.iter().any(|f| {
            c.trigger(f, &TriggerWork::receive(0, 1)).is_some() && !c.applies_in_trigger(f)
        })
    {
        // these engines' receivers write the live weights as they receive inside the trigger
        // call, with no staging and no wait for `apply` (their backend says so)
        return Err(ApiError::Unprocessable(format!(
            "options.apply = atomic needs inference ranks that stage and wait for apply (awex-cli worker, the Python Reader, awex's SGLang loader and vLLM engine); the `{}` engines receive their weights inside the update trigger, which writes their live weights as it receives; connect with apply = in_place",
            req.inference.backend
        )));
    }
    let uid = random_hex::<16>()?;
    // derived, never stored: a copy of the state directory grants no data plane
    let secret = gw.secrets.pair_secret(&name, &uid);
    let entry = new_entry(
        &gw,
        EntryParts {
            name: name.clone(),
            id: gw.next_id.fetch_add(1, Ordering::Relaxed),
            uid,
            secret,
            slots,
            created_unix_ms: unix_ms(),
            join_deadline,
            join_deadline_unix_ms: unix_ms() + req.options.join_deadline_ms,
            training,
            inference,
            pair: None,
            facts,
            request: req,
        },
        control,
    );
    {
        let mut pairs = gw.pairs.write().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = pairs.get(&name) {
            if old.state() != PairState::Disconnected {
                return Err(ApiError::Conflict(format!(
                    "a pair named `{name}` already exists (state {}); disconnect it first or pick another name",
                    old.state().as_str()
                )));
            }
        }
        // live pairs count toward the limit; disconnected ones (remembered for their ranks to
        // see `disconnect`) do not, and at most as many of them as the limit are remembered:
        // the oldest is forgotten early to make room
        let mut tombstones: Vec<(u64, String)> = Vec::new();
        let mut live = 0;
        for (n, p) in pairs.iter() {
            let q = p.lock();
            if q.state == PairState::Disconnected {
                if *n != name {
                    tombstones.push((q.disconnected_unix_ms.unwrap_or(0), n.clone()));
                }
            } else {
                live += 1;
            }
        }
        if live >= gw.config.max_pairs {
            return Err(ApiError::Conflict(format!(
                "the gateway holds {live} live pairs, its limit; disconnect one, or raise the limit"
            )));
        }
        if tombstones.len() >= gw.config.max_pairs {
            tombstones.sort();
            let excess = tombstones.len() + 1 - gw.config.max_pairs;
            for (_, old) in tombstones.into_iter().take(excess) {
                pairs.remove(&old);
                if let Some(store) = &gw.store {
                    store.submit(vec![Write::DeletePair(old)]);
                }
            }
        }
        if let Some(store) = &gw.store {
            // a remembered disconnected pair of that name is replaced: its rows go first
            let mut rows = vec![
                Write::DeletePair(name.clone()),
                Write::Pair(
                    name.clone(),
                    serde_json::to_vec(&entry.record()).unwrap_or_default(),
                ),
            ];
            rows.push(Write::NextId(entry.id + 1));
            store.submit(rows);
            entry.lock().changed(Op::State);
        }
        store_models(&entry);
        pairs.insert(name, entry.clone());
    }
    entry.engine_cmd(EngineCmd::WarmUp);
    let weak = Arc::downgrade(&entry);
    tokio::spawn(async move {
        tokio::time::sleep_until(join_deadline).await;
        if let Some(e) = weak.upgrade() {
            e.enforce_join_deadline();
        }
    });
    tracing::info!(
        pair = %entry.name,
        id = entry.id,
        training = %format_args!("{}:{}", entry.request.training.backend, entry.request.training.parallel),
        inference = %format_args!("{}:{}", entry.request.inference.backend, entry.request.inference.parallel),
        transport = %entry.request.transport,
        engines = entry.request.inference.urls.len(),
        "pair connected"
    );
    Ok((StatusCode::CREATED, Json(entry.status())))
}

/// Puts both sides' models of the connect request under [`model_key`] before the pair can be
/// read: ranks that were not given the model (SGLang's loader, warmed up by this connect)
/// resolve it from there, and must find it however soon they ask.
fn store_models(entry: &PairEntry) {
    let mut p = entry.lock();
    for (side, model) in [
        (Side::Training, &entry.request.training.model),
        (Side::Inference, &entry.request.inference.model),
    ] {
        let Ok(raw) = serde_json::value::to_raw_value(model) else {
            continue;
        };
        let key = model_key(side);
        p.kv.revision += 1;
        let revision = p.kv.revision;
        p.kv.values.insert(key.clone(), (raw, revision));
        p.changed(Op::Kv(key));
    }
}

/// The inference side's parallel config with the backend's defaults filled in (as given when
/// the backend is unknown here; connect has refused unknown backends already).
fn checked_parallel(backend: &str, p: &ParallelConfig) -> ParallelConfig {
    inference_backend(backend)
        .ok()
        .and_then(|b| p.checked(b.parallel_keys(), backend).ok())
        .unwrap_or_else(|| p.clone())
}

/// Checks the commit policy against the pair: a quorum no larger than the engines, and the
/// combinations that per-engine commits do not support yet refused, each saying why.
fn commit_policy(o: &crate::wire::PairOptions, engines: u32) -> Result<(), ApiError> {
    use crate::wire::CommitPolicy;
    let policy = o.commit;
    if let CommitPolicy::Quorum(k) = policy
        && k > engines
    {
        return Err(ApiError::Unprocessable(format!(
            "options.commit = `{policy}` needs {k} engines to apply each version, but the pair has inference.engines={engines}; use quorum:K with 1 <= K <= {engines}, or `available`"
        )));
    }
    if policy.is_all() {
        return Ok(());
    }
    let why = if o.checksums {
        "options.checksums is on, and it compares the two sides' checksum sums, which are not per engine: a version left out by an engine could never commit; connect with checksums off, or with commit = all"
    } else {
        return Ok(());
    };
    Err(ApiError::Unprocessable(format!(
        "options.commit = `{policy}` is refused: {why}"
    )))
}

/// Checks the spare engine slots: fewer than the slots, and only where engines may be missing
/// from a version (a commit policy other than `all`), with a quorum the engines present at
/// connect can meet.
fn spare_slots(
    o: &crate::wire::PairOptions,
    engines: u32,
    spare: u32,
    transport: crate::wire::Transport,
) -> Result<(), ApiError> {
    use crate::wire::CommitPolicy;
    if spare == 0 {
        return Ok(());
    }
    if let Some(why) = crate::server::fleet::fixed_engines(transport) {
        return Err(ApiError::Unprocessable(format!(
            "inference.spare={spare} is refused: {why}"
        )));
    }
    if spare >= engines {
        return Err(ApiError::Unprocessable(format!(
            "inference.spare={spare} leaves none of the inference.engines={engines} slots to an engine at connect; spare slots are at most engines - 1"
        )));
    }
    if o.commit.is_all() {
        return Err(ApiError::Unprocessable(format!(
            "inference.spare={spare} needs a commit policy other than `all`: an empty slot, or an engine whose ranks are still joining, applies no version, and under `all` every engine must; connect with options.commit = quorum:K or available"
        )));
    }
    if let CommitPolicy::Quorum(k) = o.commit
        && k > engines - spare
    {
        return Err(ApiError::Unprocessable(format!(
            "options.commit = `{}` needs {k} engines, but only {} of the {engines} slots hold an engine at connect (inference.spare={spare}); lower K or the spare slots",
            o.commit,
            engines - spare
        )));
    }
    Ok(())
}

/// `POST /v1/pairs/{name}/resume`: lets the engines serve again outside an update. Refused
/// while an update runs, and (without `accept_torn`) while the last failed version left the
/// weights partially written.
pub(crate) async fn resume(
    State(gw): State<AppState>,
    PathParams(name): PathParams<String>,
    JsonBody(req): JsonBody<Resume>,
) -> Result<Json<PairStatus>, ApiError> {
    let entry = gw.pair(&name)?;
    {
        let mut p = entry.lock();
        if p.state == PairState::Disconnected {
            return Err(ApiError::disconnected(&name));
        }
        let latest = p
            .updates
            .latest()
            .map(|u| (u.version(), u.attempt(), u.state()));
        if let Some((v, _, st)) = latest {
            if !st.is_final() {
                return Err(ApiError::Conflict(format!(
                    "version {v} of pair `{name}` is {}; resume once it committed or failed",
                    st.as_str()
                )));
            }
        }
        if let Some(torn) = p.updates.torn() {
            if !req.accept_torn {
                return Err(ApiError::Conflict(format!(
                    "version {torn} of pair `{name}` failed after its ranks started writing: the inference weights are partially written; retry version {torn}, or resume with accept_torn to serve them anyway"
                )));
            }
            p.updates.accept_torn();
            p.changed(Op::State);
        }
        let torn: Vec<String> = p
            .engines
            .iter()
            .enumerate()
            .filter_map(|(e, r)| r.torn.map(|v| format!("engine {e} (version {v})")))
            .collect();
        if !torn.is_empty() {
            if !req.accept_torn {
                return Err(ApiError::Conflict(format!(
                    "{} of pair `{name}` failed an update after their ranks started writing: their weights are partially written; they catch up in the next update, or resume with accept_torn to serve them anyway",
                    torn.join(", ")
                )));
            }
            for r in &mut p.engines {
                r.accept_torn();
            }
            p.changed(Op::State);
        }
        if let Some((version, attempt, _)) = latest {
            entry.resume_engines(&mut p, version, attempt, false);
        }
    }
    Ok(Json(entry.status()))
}

/// `GET /v1/pairs/{name}/status`.
pub(crate) async fn status(
    State(gw): State<AppState>,
    PathParams(name): PathParams<String>,
) -> Result<Json<PairStatus>, ApiError> {
    Ok(Json(gw.pair(&name)?.status()))
}

/// `DELETE /v1/pairs/{name}`: disconnects; ranks see `disconnect` on their event stream.
pub(crate) async fn disconnect(
    State(gw): State<AppState>,
    PathParams(name): PathParams<String>,
) -> Result<Json<PairStatus>, ApiError> {
    let entry = gw.pair(&name)?;
    if entry.state() == PairState::Disconnected {
        return Err(ApiError::disconnected(&name));
    }
    entry.disconnect();
    gw.trim.freed();
    forget_later(&gw, name, entry.id, gw.config.tombstone);
    Ok(Json(entry.status()))
}

/// Forgets the disconnected pair `name` (incarnation `id`) after `keep`, in memory and on disk,
/// unless a new pair took the name meanwhile.
pub(crate) fn forget_later(gw: &AppState, name: String, id: u64, keep: Duration) {
    let gateway = Arc::downgrade(gw);
    tokio::spawn(async move {
        tokio::time::sleep(keep).await;
        if let Some(gw) = gateway.upgrade() {
            let mut pairs = gw.pairs.write().unwrap_or_else(|e| e.into_inner());
            if pairs.get(&name).is_some_and(|p| p.id == id) {
                pairs.remove(&name);
                if let Some(store) = &gw.store {
                    store.submit(vec![Write::DeletePair(name)]);
                }
                // once most pairs are gone the map shrinks too
                if pairs.capacity() > 4 * pairs.len() + 64 {
                    pairs.shrink_to_fit();
                }
                drop(pairs);
                gw.trim.freed();
            }
        }
    });
}

/// Brings back every pair the store holds (at start): in-flight updates are failed (the
/// gateway cannot know what happened while it was down: never committed, torn when the ranks
/// had been told to write), disconnected pairs are remembered for what is left of their
/// tombstone, joining pairs keep their join deadline. Returns how many pairs came back.
pub(crate) fn restore(gw: &AppState, loaded: Vec<crate::server::store::disk::Loaded>) -> usize {
    use crate::server::store::updates::{RankSlot, Update};
    use crate::wire::Event;
    let now = Instant::now();
    let now_ms = unix_ms();
    let ago = |unix: u64| {
        now.checked_sub(Duration::from_millis(now_ms.saturating_sub(unix)))
            .unwrap_or(now)
    };
    let mut count = 0;
    for l in loaded {
        let rec = l.pair;
        let st = l.state;
        let slots = Slots::new(rec.slots[0], rec.slots[1], rec.slots[2]);
        let total = slots.total();
        let mut p = Pair::new(&slots);
        p.state = st.state.unwrap_or(PairState::Joining);
        p.join_error = st.join_error;
        p.engine_errors = st.engine_errors;
        p.disconnected_unix_ms = st.disconnected_unix_ms;
        for (slot, r) in l.roster {
            let slot = slot as usize;
            if slot < total {
                let size = validate::json_size(&r.info);
                if p.roster.put(slot, r.info, size).is_ok() {
                    if let Some(Some(j)) = p.roster.slots.get_mut(slot) {
                        j.unix_ms = r.unix_ms;
                        // its holder keeps the slot until it re-attaches (with its claim id)
                        // or the operator releases it: no connection of it was seen to close;
                        // it counts as live for the join deadline
                        j.live_until =
                            now + Duration::from_millis(rec.request.options.join_deadline_ms);
                    }
                }
            }
        }
        let mut rev = st.kv_revision;
        for (k, r) in l.kv {
            rev = rev.max(r.revision);
            p.kv.values.insert(k, (r.value, r.revision));
        }
        p.kv.revision = rev;
        for (version, u, reports) in l.updates {
            let mut ranks = if u.detail {
                vec![RankSlot::default(); total]
            } else {
                Vec::new()
            };
            let (mut succeeded, mut bytes, mut sums) = (0, [0u64; 2], [0u64; 2]);
            let mut applied = 0;
            for (slot, r) in reports {
                let slot = slot as usize;
                let side = usize::from(!slots.is_training(slot));
                bytes[side] = bytes[side].saturating_add(r.bytes);
                sums[side] = sums[side].wrapping_add(r.checksum.unwrap_or(0));
                succeeded += usize::from(r.ok == Some(true));
                applied += usize::from(r.applied == Some(true));
                if let Some(x) = ranks.get_mut(slot) {
                    *x = RankSlot {
                        state: r.ok,
                        missing: r.missing,
                        bytes: r.bytes,
                        checksum: r.checksum,
                        error: r.error,
                        after_ms: r.after_ms,
                        applied: r.applied,
                        claim: None,
                        delta: r.delta,
                    };
                }
            }
            let (started, finished) = match u.elapsed_ms {
                Some(e) => (
                    now.checked_sub(Duration::from_millis(e)).unwrap_or(now),
                    Some(now),
                ),
                None => (ago(u.started_unix_ms), None),
            };
            p.updates.history.insert(
                version,
                Update {
                    version,
                    attempt: u.attempt,
                    state: u.state,
                    started,
                    started_unix_ms: u.started_unix_ms,
                    deadline: Duration::from_millis(u.deadline_ms),
                    pause: u.pause_ms.map(Duration::from_millis),
                    finished,
                    ranks,
                    base: None,
                    held: None,
                    succeeded,
                    bytes,
                    checksums: sums,
                    error: u.error,
                    engine_errors: u.engine_errors,
                    trigger_waiting: false,
                    finishing: false,
                    applying: u.applying,
                    applied,
                    resuming: false,
                    unwritten: vec![false; slots.engines as usize],
                    trigger_open: vec![false; slots.engines as usize],
                    left_out: {
                        let mut out = vec![None; slots.engines as usize];
                        for l in u.left_out {
                            if let Some(x) = out.get_mut(l.engine as usize) {
                                *x = Some(l.error);
                            }
                        }
                        out
                    },
                },
            );
        }
        p.updates.committed = st.committed;
        p.updates.torn = st.torn;
        p.updates.serving_torn = st.serving_torn;
        if st.engines.len() == slots.engines as usize {
            p.engines = st.engines;
        }
        let mut events: Vec<Event> = l.events;
        events.sort_by_key(|e| e.seq);
        p.events.last = st.last_event_seq.max(events.last().map_or(0, |e| e.seq));
        p.events.events = events.into();
        let join_deadline =
            now + Duration::from_millis(rec.join_deadline_unix_ms.saturating_sub(now_ms));
        let secret = if rec.secret.is_empty() {
            let derived = gw.secrets.pair_secret(&rec.request.name, &rec.uid);
            if crate::server::secret::check_value(&derived) != rec.secret_check
                && p.state != PairState::Disconnected
            {
                // ranks running hold the old secret; one joining now would get the new one
                tracing::error!(pair = %rec.request.name, "the gateway's token changed since this pair was connected: pair join_failed");
                p.state = PairState::JoinFailed;
                p.join_error = Some(
                    "the gateway's token changed since this pair was connected, and its data-plane secret derives from the token: ranks joining now could not reach the ranks already running. Start the gateway with the old token, or disconnect the pair and connect it again".into(),
                );
                p.changed(Op::State);
            }
            derived
        } else {
            // stored by a gateway before derived secrets: kept until the pair goes
            rec.secret
        };
        let req = rec.request;
        let urls = req.inference.urls.clone();
        let control = engine_control(&req.inference.backend, &urls).ok().flatten();
        let facts = rec.facts;
        let name = req.name.clone();
        let entry = new_entry(
            gw,
            EntryParts {
                name: name.clone(),
                id: rec.id,
                uid: rec.uid,
                secret,
                slots,
                created_unix_ms: rec.created_unix_ms,
                join_deadline,
                join_deadline_unix_ms: rec.join_deadline_unix_ms,
                training: rec.training,
                inference: rec.inference,
                pair: Some(p),
                facts,
                request: req,
            },
            control,
        );
        gw.next_id.fetch_max(rec.id + 1, Ordering::Relaxed);
        gw.pairs
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), entry.clone());
        count += 1;
        let state = entry.state();
        match state {
            PairState::Disconnected => {
                let age = Duration::from_millis(
                    now_ms.saturating_sub(entry.lock().disconnected_unix_ms.unwrap_or(now_ms)),
                );
                forget_later(gw, name, entry.id, gw.config.tombstone.saturating_sub(age));
            }
            PairState::Joining => {
                let weak = Arc::downgrade(&entry);
                tokio::spawn(async move {
                    tokio::time::sleep_until(join_deadline).await;
                    if let Some(e) = weak.upgrade() {
                        e.enforce_join_deadline();
                    }
                });
            }
            PairState::Ready | PairState::JoinFailed => {}
        }
        let mut p = entry.lock();
        let in_flight = p
            .updates
            .latest()
            .filter(|u| !u.state.is_final())
            .map(|u| u.version);
        if let Some(v) = in_flight {
            entry.fail(&mut p, format!("gateway restarted during update {v}"));
            let torn = p.updates.torn() == Some(v);
            tracing::warn!(
                pair = %entry.name,
                version = v,
                torn,
                "an update was in flight when the gateway stopped: failed"
            );
        }
    }
    count
}
