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

use awex_core::backend::{
    EngineCall, EngineControl, EngineExpect, EngineFacts, HttpMethod, TriggerWork,
};
use serde_json::Value;
use std::sync::Weak;
use std::time::Duration;
use tokio::sync::mpsc;

/// A step of the engines' side of an update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineCmd {
    /// The backend's calls once after connect (start the engines' receivers).
    WarmUp,
    /// The backend's calls before `version`/`attempt` runs (pause, open the session).
    Pause { version: u64, attempt: u32 },
    /// The call that makes the engines' processes receive `version`/`attempt`; it answers once
    /// they received (it may take the whole update).
    Trigger { version: u64, attempt: u32 },
    /// The backend's calls after every rank received (close the session).
    Finish { version: u64, attempt: u32 },
    /// The backend's calls that let the engines serve again (continue generation).
    Continue { version: u64, attempt: u32 },
}

/// What the lane reads of the pair it serves (implemented by the pair's entry).
pub(crate) trait PairVersions {
    /// The pair's last committed version (`None`: none yet), handed to
    /// [`EngineControl::abandon`] so that an engine can report it again after a failed attempt.
    fn committed_version(&self) -> Option<u64>;
}

/// What the lane reports back to the pair it serves (implemented by the pair's entry, so that
/// this module needs nothing of the gateway's state).
pub(crate) trait EngineEvents: PairVersions + Send + Sync + 'static {
    /// The warm-up calls after connect finished.
    fn engines_warmed(&self, errors: Vec<String>);
    /// The calls before `version`/`attempt` finished.
    fn engines_paused(&self, version: u64, attempt: u32, errors: Vec<String>);
    /// The trigger of `version`/`attempt` answered.
    fn engines_triggered(&self, version: u64, attempt: u32, errors: Vec<String>);
    /// The closing calls of `version`/`attempt` finished.
    fn engines_finished(&self, version: u64, attempt: u32, errors: Vec<String>);
    /// The engines were resumed after `version`/`attempt`.
    fn engines_resumed(&self, version: u64, attempt: u32, errors: Vec<String>);
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
                let body = r.json::<Value>().await.unwrap_or_default();
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

    /// Runs `calls(engine's facts)` on every engine at once (each engine's calls in order,
    /// stopping at its first failure); returns each engine's failure, by engine index.
    async fn call_each(
        &self,
        control: &'static dyn EngineControl,
        urls: &[String],
        facts: &[EngineFacts],
        timeout: Duration,
        calls: impl Fn(usize, &EngineFacts) -> Vec<EngineCall> + Sync,
    ) -> Vec<Option<String>> {
        let mut set = tokio::task::JoinSet::new();
        for (i, url) in urls.iter().enumerate() {
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
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok((i, e)) => out[i] = e,
                Err(e) => {
                    // a panicked task names no engine: blame every engine still without an answer
                    for slot in out.iter_mut().filter(|s| s.is_none()) {
                        *slot = Some(format!("engine call task ended: {e}"));
                    }
                }
            }
        }
        out
    }

    /// [`EngineClient::call_each`] on every engine; returns one message per failed engine, in
    /// engine order.
    async fn call_all(
        &self,
        control: &'static dyn EngineControl,
        urls: &[String],
        facts: &[EngineFacts],
        timeout: Duration,
        calls: impl Fn(&EngineFacts) -> Vec<EngineCall> + Sync,
    ) -> Vec<String> {
        errors(
            self.call_each(control, urls, facts, timeout, |_, f| calls(f))
                .await,
        )
    }

    /// Sends [`EngineControl::abandon`] to every engine marked in `open` (an attempt ended
    /// there without its closing calls), with the pair's last `committed` version, clearing the
    /// marks of those that answered; returns the failures.
    async fn abandon_open(
        &self,
        control: &'static dyn EngineControl,
        urls: &[String],
        facts: &[EngineFacts],
        timeout: Duration,
        open: &mut [bool],
        committed: Option<u64>,
    ) -> Vec<String> {
        if !open.iter().any(|o| *o) {
            return Vec::new();
        }
        let marked = open.to_vec();
        let results = self
            .call_each(control, urls, facts, timeout, |i, f| {
                if marked.get(i).copied().unwrap_or(false) {
                    control.abandon(f, committed)
                } else {
                    Vec::new()
                }
            })
            .await;
        for (o, r) in open.iter_mut().zip(&results) {
            if r.is_none() {
                *o = false;
            }
        }
        errors(results)
    }
}

/// The failures of [`EngineClient::call_each`], in engine order.
fn errors(results: Vec<Option<String>>) -> Vec<String> {
    results.into_iter().flatten().collect()
}

/// The queue of engine calls of one pair.
pub(crate) struct EngineLane {
    tx: mpsc::UnboundedSender<EngineCmd>,
    /// Whether any engine is triggered into receiving (else its ranks receive on their own).
    pub(crate) triggers: bool,
    /// Whether any engine has calls after the ranks received (closing a session).
    pub(crate) finishes: bool,
}

impl EngineLane {
    /// Starts the lane's task for engines with these checked `facts`; it ends when the pair is
    /// dropped. A trigger may take up to `trigger_timeout` (the pair's update deadline).
    pub(crate) fn spawn(
        pair: Weak<dyn EngineEvents>,
        control: &'static dyn EngineControl,
        urls: Vec<String>,
        facts: Vec<EngineFacts>,
        client: EngineClient,
        trigger_timeout: Duration,
    ) -> Self {
        let triggers = facts
            .iter()
            .any(|f| control.trigger(f, &TriggerWork::receive(0, 1)).is_some());
        let finishes = facts.iter().any(|f| !control.after_update(f, 0).is_empty());
        let (tx, mut rx) = mpsc::unbounded_channel::<EngineCmd>();
        let quick = client.timeout;
        tokio::spawn(async move {
            // Engines where an attempt (or the warm-up) may have left open what `before_update`
            // opens (SGLang's update session): `abandon` closes it before their next
            // `before_update` or `resume`.
            let mut open = vec![false; urls.len()];
            while let Some(cmd) = rx.recv().await {
                match cmd {
                    EngineCmd::WarmUp => {
                        let results = client
                            .call_each(control, &urls, &facts, trigger_timeout, |_, f| {
                                control.warm_up(f)
                            })
                            .await;
                        for (o, r) in open.iter_mut().zip(&results) {
                            *o = r.is_some();
                        }
                        match pair.upgrade() {
                            Some(p) => p.engines_warmed(errors(results)),
                            None => break,
                        }
                    }
                    EngineCmd::Pause { version, attempt } => {
                        let committed = pair.upgrade().and_then(|p| p.committed_version());
                        let left = client
                            .abandon_open(control, &urls, &facts, quick, &mut open, committed)
                            .await;
                        if !left.is_empty() {
                            tracing::warn!(
                                version,
                                attempt,
                                errors = %left.join("; "),
                                "closing the previous attempt on the inference engines failed"
                            );
                        }
                        let results = client
                            .call_each(control, &urls, &facts, quick, |_, f| {
                                control.before_update(f, version)
                            })
                            .await;
                        for (o, r) in open.iter_mut().zip(&results) {
                            *o |= r.is_none();
                        }
                        let mut errors = errors(results);
                        if !errors.is_empty() {
                            // what could not be closed may be why this attempt's pause failed
                            errors.extend(left);
                        }
                        match pair.upgrade() {
                            Some(p) => p.engines_paused(version, attempt, errors),
                            None => {
                                // The pair is gone: do not leave its engines paused.
                                client
                                    .abandon_open(
                                        control, &urls, &facts, quick, &mut open, committed,
                                    )
                                    .await;
                                client
                                    .call_all(control, &urls, &facts, quick, |f| control.resume(f))
                                    .await;
                                break;
                            }
                        }
                    }
                    EngineCmd::Trigger { version, attempt } => {
                        let errors = client
                            .call_all(control, &urls, &facts, trigger_timeout, |f| {
                                control
                                    .trigger(f, &TriggerWork::receive(version, attempt))
                                    .into_iter()
                                    .collect()
                            })
                            .await;
                        match pair.upgrade() {
                            Some(p) => p.engines_triggered(version, attempt, errors),
                            None => break,
                        }
                    }
                    EngineCmd::Finish { version, attempt } => {
                        let results = client
                            .call_each(control, &urls, &facts, quick, |_, f| {
                                control.after_update(f, version)
                            })
                            .await;
                        for (o, r) in open.iter_mut().zip(&results) {
                            *o = r.is_some();
                        }
                        match pair.upgrade() {
                            Some(p) => p.engines_finished(version, attempt, errors(results)),
                            None => break,
                        }
                    }
                    EngineCmd::Continue { version, attempt } => {
                        let committed = pair.upgrade().and_then(|p| p.committed_version());
                        if committed == Some(version) {
                            // the attempt committed, so every closing call succeeded; engines
                            // without closing calls (no session) were never unmarked
                            open.fill(false);
                        }
                        let mut errors = client
                            .abandon_open(control, &urls, &facts, quick, &mut open, committed)
                            .await;
                        errors.extend(
                            client
                                .call_all(control, &urls, &facts, quick, |f| control.resume(f))
                                .await,
                        );
                        if let Some(p) = pair.upgrade() {
                            p.engines_resumed(version, attempt, errors);
                        }
                    }
                }
            }
        });
        EngineLane {
            tx,
            triggers,
            finishes,
        }
    }

    /// Queues a call.
    pub(crate) fn send(&self, cmd: EngineCmd) {
        // The receiver lives as long as the pair; a send can fail only while it is being dropped.
        let _ = self.tx.send(cmd);
    }
}
