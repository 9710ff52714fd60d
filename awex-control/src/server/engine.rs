//! Calls to the inference engines' servers around an update, as the inference backend's
//! [`EngineControl`] describes them. The gateway knows no engine by name: it checks each
//! server at connect, then only executes the calls (for SGLang: pause generation, open the
//! update session, trigger the engine's loader, close the session, continue generation).
//!
//! Each pair with engine URLs has one lane: a task that runs the calls in the order they were
//! queued, so that a retry's pause can never overtake the previous attempt's resume, and the
//! session's end can never overtake its trigger. The lane also remembers which engines an
//! attempt left inside what `before_update` opened (a trigger that failed, a warm-up that
//! stopped half-way) and sends them the backend's `abandon` calls before their next pause or
//! resume: SGLang refuses to open a second update session while one is open.
//!
//! Each step names the engines it addresses ([`Engines`]): under commit policy `all` every
//! engine, under `quorum:K` and `available` the engines taking part (an engine left out of a
//! version gets no more of its calls, and only engines that may serve are resumed). Failures
//! come back per engine ([`EngineFailure`]), so that the pair can leave one engine out instead
//! of failing the version. With per-engine commits a trigger does not hold the lane: each
//! engine's answer is reported as it arrives, so that a hung engine's loader never delays the
//! others' closing and resuming calls.

use awex_core::backend::{
    EngineCall, EngineControl, EngineExpect, EngineFacts, HttpMethod, TriggerWork,
};
use serde_json::Value;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::mpsc;

/// The engines a step addresses, by engine index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Engines(Arc<[bool]>);

impl Engines {
    /// Every one of `n` engines.
    pub(crate) fn all(n: usize) -> Self {
        Engines(vec![true; n].into())
    }

    /// The engines marked in `mask`.
    pub(crate) fn of(mask: Vec<bool>) -> Self {
        Engines(mask.into())
    }

    /// Whether engine `i` is addressed.
    pub(crate) fn has(&self, i: usize) -> bool {
        self.0.get(i).copied().unwrap_or(false)
    }

    /// Whether no engine is addressed.
    pub(crate) fn is_empty(&self) -> bool {
        !self.0.iter().any(|x| *x)
    }
}

/// One engine's failed call: the engine's index and what failed (the message names the
/// engine, the call and the cause).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct EngineFailure {
    pub(crate) engine: u32,
    pub(crate) message: String,
}

/// How the failure of an engine's warm-up before a pause (its ranks were gone) begins.
pub(crate) const WARM_UP_AGAIN: &str = "warming the engine up again (its ranks were gone) failed: ";

/// The messages of `failures`, in their order.
pub(crate) fn messages(failures: &[EngineFailure]) -> Vec<String> {
    failures.iter().map(|f| f.message.clone()).collect()
}

/// A step of the engines' side of an update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum EngineCmd {
    /// The backend's calls once after connect (start the engines' receivers).
    WarmUp,
    /// The backend's calls before `version`/`attempt` runs (pause, open the session), after
    /// the warm-up calls again on the engines of `rewarm` (engines whose ranks are all gone: a
    /// restarted server's receivers start with them). An engine whose warm-up fails is not
    /// paused and counts as failed.
    Pause {
        version: u64,
        attempt: u32,
        engines: Engines,
        rewarm: Engines,
    },
    /// The call that makes the engines' processes receive `version`/`attempt`; it answers once
    /// they received (it may take the whole update).
    Trigger {
        version: u64,
        attempt: u32,
        engines: Engines,
    },
    /// The backend's calls after every rank received (close the session).
    Finish {
        version: u64,
        attempt: u32,
        engines: Engines,
    },
    /// The backend's calls that let the engines serve again (continue generation).
    Continue {
        version: u64,
        attempt: u32,
        engines: Engines,
    },
}

/// What the lane reads of the pair it serves (implemented by the pair's entry).
pub(crate) trait PairVersions {
    /// The pair's last committed version (`None`: none yet).
    fn committed_version(&self) -> Option<u64>;
    /// Per engine, the version it serves whole (`None`: none yet; under commit policy `all`
    /// the pair's last committed version for every engine), handed to
    /// [`EngineControl::abandon`] so that an engine can report it again after a failed attempt.
    fn serving_versions(&self) -> Vec<Option<u64>>;
}

/// What the lane reports back to the pair it serves (implemented by the pair's entry, so that
/// this module needs nothing of the gateway's state).
pub(crate) trait EngineEvents: PairVersions + Send + Sync + 'static {
    /// The warm-up calls after connect finished.
    fn engines_warmed(&self, errors: Vec<String>);
    /// The calls before `version`/`attempt` finished.
    fn engines_paused(&self, version: u64, attempt: u32, failures: Vec<EngineFailure>);
    /// The trigger of `version`/`attempt` answered on every engine addressed.
    fn engines_triggered(&self, version: u64, attempt: u32, failures: Vec<EngineFailure>);
    /// Per-engine commits: the trigger of `version`/`attempt` answered on `engine` (`error`:
    /// it failed).
    fn engine_triggered(&self, version: u64, attempt: u32, engine: u32, error: Option<String>);
    /// The closing calls of `version`/`attempt` finished.
    fn engines_finished(&self, version: u64, attempt: u32, failures: Vec<EngineFailure>);
    /// The engines were resumed after `version`/`attempt`.
    fn engines_resumed(&self, version: u64, attempt: u32, failures: Vec<EngineFailure>);
}

/// The HTTP client engines are called with.
#[derive(Clone)]
pub(crate) struct EngineClient {
    http: reqwest::Client,
    timeout: Duration,
}

/// What one engine call came to: `Err` names the engine, the call and the cause.
fn describe(i: usize, call: &EngineCall, target: &str, e: &str) -> String {
    let m = match call.method {
        HttpMethod::Get => "GET",
        HttpMethod::Post => "POST",
    };
    format!("engine {i} {m} {target} {e}")
}

impl EngineClient {
    /// A client whose every call times out after `timeout` (a trigger: after its own limit).
    pub(crate) fn new(timeout: Duration) -> Self {
        let http = reqwest::Client::builder()
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        EngineClient { http, timeout }
    }

    /// One call to one server, within `timeout`; `Err` is the cause.
    async fn call(
        &self,
        control: &'static dyn EngineControl,
        base: &str,
        call: &EngineCall,
        timeout: Duration,
    ) -> Result<Value, String> {
        let target = format!("{}{}", base.trim_end_matches('/'), call.path);
        let req = match call.method {
            HttpMethod::Get => self.http.get(&target),
            HttpMethod::Post => self
                .http
                .post(&target)
                .json(call.body.as_ref().unwrap_or(&serde_json::json!({}))),
        };
        match req.timeout(timeout).send().await {
            Ok(r) => {
                let status = r.status();
                // (an answer that is not JSON, or cut off, reads as none; one without end is
                // refused, not read to the timeout)
                let body =
                    match crate::body::read_capped(r, crate::body::MAX_ENGINE_ANSWER_BYTES).await {
                        Ok(bytes) => serde_json::from_slice::<Value>(&bytes).unwrap_or_default(),
                        Err(e @ crate::body::BodyError::TooLarge { .. }) => {
                            return Err(format!("answered {status}, but {e}"));
                        }
                        Err(crate::body::BodyError::Read(_)) => Value::Null,
                    };
                match control.check_answer(call, status.as_u16(), &body) {
                    Err(_) if !status.is_success() && body.is_null() => {
                        Err(format!("answered {status}"))
                    }
                    Err(_) if !status.is_success() && body.get("message").is_none() => {
                        Err(format!("answered {status}: {body}"))
                    }
                    Err(e) => Err(e),
                    Ok(()) => Ok(body),
                }
            }
            Err(e) if e.is_timeout() => Err(format!("timed out after {} ms", timeout.as_millis())),
            Err(e) => Err(format!("unreachable ({e})")),
        }
    }

    /// Reads and checks every engine's server against the pair (the first of the backend's
    /// info paths that answers); `Err` names the engine and what disagrees or failed.
    pub(crate) async fn check_servers<'a>(
        &self,
        control: &'static dyn EngineControl,
        urls: &[String],
        expect: impl Fn(u32) -> EngineExpect<'a>,
    ) -> Result<Vec<EngineFacts>, String> {
        let mut facts = Vec::with_capacity(urls.len());
        for (i, url) in urls.iter().enumerate() {
            let mut why = Vec::new();
            let mut info = None;
            for path in control.info_paths() {
                let call = EngineCall {
                    method: HttpMethod::Get,
                    path: path.to_string(),
                    body: None,
                };
                match self.call(control, url, &call, self.timeout).await {
                    Ok(v) => {
                        info = Some(v);
                        break;
                    }
                    Err(e) => why.push(format!("GET {url}{path}: {e}")),
                }
            }
            let Some(mut info) = info else {
                return Err(format!(
                    "engine {i} at {url} did not answer: {}",
                    why.join("; ")
                ));
            };
            for path in control.model_info_paths() {
                let call = EngineCall {
                    method: HttpMethod::Get,
                    path: path.to_string(),
                    body: None,
                };
                if let Ok(model) = self.call(control, url, &call, self.timeout).await {
                    if let Some(o) = info.as_object_mut() {
                        o.insert("model_info".into(), model);
                    }
                    break;
                }
            }
            let e = expect(i as u32);
            facts.push(
                control
                    .check_server(&info, &e)
                    .map_err(|m| format!("engine {i} at {url}: {m}"))?,
            );
        }
        Ok(facts)
    }

    /// Runs `calls(engine's facts)` on every engine of `targets` at once (each engine's calls
    /// in order, stopping at its first failure); returns each engine's failure, by engine index
    /// (`None` for an engine not addressed).
    async fn call_each(
        &self,
        control: &'static dyn EngineControl,
        urls: &[String],
        facts: &[EngineFacts],
        targets: &Engines,
        timeout: Duration,
        calls: impl Fn(usize, &EngineFacts) -> Vec<EngineCall> + Sync,
    ) -> Vec<Option<String>> {
        let mut set = tokio::task::JoinSet::new();
        for (i, url) in urls.iter().enumerate() {
            if !targets.has(i) {
                continue;
            }
            let client = self.clone();
            let base = url.trim_end_matches('/').to_string();
            let calls = facts.get(i).map(|f| calls(i, f)).unwrap_or_default();
            set.spawn(async move {
                for call in calls {
                    if let Err(e) = client.call(control, &base, &call, timeout).await {
                        let target = format!("{base}{}", call.path);
                        return (i, Some(describe(i, &call, &target, &e)));
                    }
                }
                (i, None)
            });
        }
        let mut out = vec![None; urls.len()];
        let mut answered = vec![false; urls.len()];
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok((i, e)) => {
                    out[i] = e;
                    answered[i] = true;
                }
                Err(e) => {
                    // a panicked task names no engine: blame every engine addressed still
                    // without an answer
                    for (i, slot) in out.iter_mut().enumerate() {
                        if targets.has(i) && !answered[i] && slot.is_none() {
                            *slot = Some(format!("engine call task ended: {e}"));
                        }
                    }
                }
            }
        }
        out
    }

    /// [`EngineClient::call_each`] on the engines of `targets`; returns the failures, in
    /// engine order.
    async fn call_all(
        &self,
        control: &'static dyn EngineControl,
        urls: &[String],
        facts: &[EngineFacts],
        targets: &Engines,
        timeout: Duration,
        calls: impl Fn(&EngineFacts) -> Vec<EngineCall> + Sync,
    ) -> Vec<EngineFailure> {
        failures(
            self.call_each(control, urls, facts, targets, timeout, |_, f| calls(f))
                .await,
        )
    }

    /// Sends [`EngineControl::abandon`] to every engine of `targets` marked in `open` (an
    /// attempt ended there without its closing calls), with the version each engine serves
    /// (`serving`, by engine), clearing the marks of those that answered; returns the failures.
    #[allow(clippy::too_many_arguments)]
    async fn abandon_open(
        &self,
        control: &'static dyn EngineControl,
        urls: &[String],
        facts: &[EngineFacts],
        targets: &Engines,
        timeout: Duration,
        open: &mut [bool],
        serving: &[Option<u64>],
    ) -> Vec<EngineFailure> {
        let marked: Vec<bool> = open
            .iter()
            .enumerate()
            .map(|(i, o)| *o && targets.has(i))
            .collect();
        if !marked.iter().any(|o| *o) {
            return Vec::new();
        }
        let results = self
            .call_each(
                control,
                urls,
                facts,
                &Engines::of(marked.clone()),
                timeout,
                |i, f| control.abandon(f, serving.get(i).copied().flatten()),
            )
            .await;
        for ((o, r), m) in open.iter_mut().zip(&results).zip(&marked) {
            if *m && r.is_none() {
                *o = false;
            }
        }
        failures(results)
    }
}

/// The failures of [`EngineClient::call_each`], in engine order.
fn failures(results: Vec<Option<String>>) -> Vec<EngineFailure> {
    results
        .into_iter()
        .enumerate()
        .filter_map(|(i, r)| {
            r.map(|message| EngineFailure {
                engine: i as u32,
                message,
            })
        })
        .collect()
}

/// The queue of engine calls of one pair.
pub(crate) struct EngineLane {
    tx: mpsc::UnboundedSender<EngineCmd>,
    /// Per engine, whether it is triggered into receiving (has a trigger call).
    pub(crate) triggered: Vec<bool>,
    /// Whether any engine has calls after the ranks received (closing a session).
    pub(crate) finishes: bool,
}

impl EngineLane {
    /// Starts the lane's task for engines with these checked `facts`; it ends when the pair is
    /// dropped. A trigger may take up to `trigger_timeout` (the pair's update deadline).
    /// `per_engine` (commit policies `quorum:K`, `available`): each engine's trigger answer is
    /// reported on its own as it arrives ([`EngineEvents::engine_triggered`]) while the lane
    /// goes on with the next steps.
    pub(crate) fn spawn(
        pair: Weak<dyn EngineEvents>,
        control: &'static dyn EngineControl,
        urls: Vec<String>,
        facts: Vec<EngineFacts>,
        client: EngineClient,
        trigger_timeout: Duration,
        per_engine: bool,
    ) -> Self {
        let triggered: Vec<bool> = facts
            .iter()
            .map(|f| control.trigger(f, &TriggerWork::receive(0, 1)).is_some())
            .collect();
        let finishes = facts.iter().any(|f| !control.after_update(f, 0).is_empty());
        let (tx, mut rx) = mpsc::unbounded_channel::<EngineCmd>();
        let quick = client.timeout;
        let every = Engines::all(urls.len());
        let urls: Arc<[String]> = urls.into();
        let facts: Arc<[EngineFacts]> = facts.into();
        tokio::spawn(async move {
            // Engines where an attempt (or the warm-up) may have left open what `before_update`
            // opens (SGLang's update session): `abandon` closes it before their next
            // `before_update` or `resume`.
            let mut open = vec![false; urls.len()];
            while let Some(cmd) = rx.recv().await {
                match cmd {
                    EngineCmd::WarmUp => {
                        let results = client
                            .call_each(control, &urls, &facts, &every, trigger_timeout, |_, f| {
                                control.warm_up(f)
                            })
                            .await;
                        for (o, r) in open.iter_mut().zip(&results) {
                            *o = r.is_some();
                        }
                        match pair.upgrade() {
                            Some(p) => p.engines_warmed(messages(&failures(results))),
                            None => break,
                        }
                    }
                    EngineCmd::Pause {
                        version,
                        attempt,
                        engines,
                        rewarm,
                    } => {
                        let mut cold = Vec::new();
                        let engines = if rewarm.is_empty() {
                            engines
                        } else {
                            let results = client
                                .call_each(
                                    control,
                                    &urls,
                                    &facts,
                                    &rewarm,
                                    trigger_timeout,
                                    |_, f| control.warm_up(f),
                                )
                                .await;
                            for (i, (o, r)) in open.iter_mut().zip(&results).enumerate() {
                                if rewarm.has(i) {
                                    *o = r.is_some();
                                }
                            }
                            cold = failures(results);
                            for f in &mut cold {
                                f.message = format!("{WARM_UP_AGAIN}{}", f.message);
                            }
                            Engines::of(
                                (0..urls.len())
                                    .map(|i| {
                                        engines.has(i)
                                            && !cold.iter().any(|f| f.engine as usize == i)
                                    })
                                    .collect(),
                            )
                        };
                        let serving = pair
                            .upgrade()
                            .map(|p| p.serving_versions())
                            .unwrap_or_default();
                        let left = client
                            .abandon_open(
                                control, &urls, &facts, &engines, quick, &mut open, &serving,
                            )
                            .await;
                        if !left.is_empty() {
                            tracing::warn!(
                                version,
                                attempt,
                                errors = %messages(&left).join("; "),
                                "closing the previous attempt on the inference engines failed"
                            );
                        }
                        let results = client
                            .call_each(control, &urls, &facts, &engines, quick, |_, f| {
                                control.before_update(f, version)
                            })
                            .await;
                        for (i, (o, r)) in open.iter_mut().zip(&results).enumerate() {
                            *o |= engines.has(i) && r.is_none();
                        }
                        let mut failed = failures(results);
                        failed.extend(cold);
                        failed.sort_by_key(|f| f.engine);
                        // what could not be closed may be why an engine's pause failed
                        for f in &mut failed {
                            for l in left.iter().filter(|l| l.engine == f.engine) {
                                f.message = format!("{}; {}", f.message, l.message);
                            }
                        }
                        match pair.upgrade() {
                            Some(p) => p.engines_paused(version, attempt, failed),
                            None => {
                                // The pair is gone: do not leave its engines paused.
                                client
                                    .abandon_open(
                                        control, &urls, &facts, &every, quick, &mut open, &serving,
                                    )
                                    .await;
                                client
                                    .call_all(control, &urls, &facts, &every, quick, |f| {
                                        control.resume(f)
                                    })
                                    .await;
                                break;
                            }
                        }
                    }
                    EngineCmd::Trigger {
                        version,
                        attempt,
                        engines,
                    } => {
                        let work = TriggerWork::receive(version, attempt);
                        if per_engine {
                            // each engine's answer on its own, without holding the lane
                            for i in (0..urls.len()).filter(|&i| engines.has(i)) {
                                let Some(call) =
                                    facts.get(i).and_then(|f| control.trigger(f, &work))
                                else {
                                    continue;
                                };
                                let (client, pair, base) =
                                    (client.clone(), pair.clone(), urls[i].clone());
                                tokio::spawn(async move {
                                    let base = base.trim_end_matches('/').to_string();
                                    let error = client
                                        .call(control, &base, &call, trigger_timeout)
                                        .await
                                        .err()
                                        .map(|e| {
                                            let target = format!("{base}{}", call.path);
                                            describe(i, &call, &target, &e)
                                        });
                                    if let Some(p) = pair.upgrade() {
                                        p.engine_triggered(version, attempt, i as u32, error);
                                    }
                                });
                            }
                            continue;
                        }
                        let failed = client
                            .call_all(control, &urls, &facts, &engines, trigger_timeout, |f| {
                                control.trigger(f, &work).into_iter().collect()
                            })
                            .await;
                        match pair.upgrade() {
                            Some(p) => p.engines_triggered(version, attempt, failed),
                            None => break,
                        }
                    }
                    EngineCmd::Finish {
                        version,
                        attempt,
                        engines,
                    } => {
                        let results = client
                            .call_each(control, &urls, &facts, &engines, quick, |_, f| {
                                control.after_update(f, version)
                            })
                            .await;
                        for (i, (o, r)) in open.iter_mut().zip(&results).enumerate() {
                            if engines.has(i) {
                                *o = r.is_some();
                            }
                        }
                        match pair.upgrade() {
                            Some(p) => p.engines_finished(version, attempt, failures(results)),
                            None => break,
                        }
                    }
                    EngineCmd::Continue {
                        version,
                        attempt,
                        engines,
                    } => {
                        let (committed, serving) = pair
                            .upgrade()
                            .map(|p| (p.committed_version(), p.serving_versions()))
                            .unwrap_or_default();
                        if committed == Some(version) {
                            // the attempt committed on the engines resumed, so every closing
                            // call of theirs succeeded; engines without closing calls (no
                            // session) were never unmarked
                            for (i, o) in open.iter_mut().enumerate() {
                                if engines.has(i) {
                                    *o = false;
                                }
                            }
                        }
                        let mut failed = client
                            .abandon_open(
                                control, &urls, &facts, &engines, quick, &mut open, &serving,
                            )
                            .await;
                        failed.extend(
                            client
                                .call_all(control, &urls, &facts, &engines, quick, |f| {
                                    control.resume(f)
                                })
                                .await,
                        );
                        if let Some(p) = pair.upgrade() {
                            p.engines_resumed(version, attempt, failed);
                        }
                    }
                }
            }
        });
        EngineLane {
            tx,
            triggered,
            finishes,
        }
    }

    /// Queues a call.
    pub(crate) fn send(&self, cmd: EngineCmd) {
        // The receiver lives as long as the pair; a send can fail only while it is being dropped.
        let _ = self.tx.send(cmd);
    }
}
