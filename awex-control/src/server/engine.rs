//! Calls to the inference engines' servers around an update, as the inference backend's
//! [`EngineControl`] describes them. The gateway knows no engine by name: it checks each
//! server at connect, then only executes the calls (for SGLang: pause generation, open the
//! update session, trigger the engine's loader, close the session, continue generation).
//!
//! Each pair with engine URLs has one lane: a task that runs the calls in the order they were
//! queued, so that a retry's pause can never overtake the previous attempt's resume, and the
//! session's end can never overtake its trigger.

use awex_core::backend::{EngineCall, EngineControl, EngineExpect, EngineFacts, HttpMethod};
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

/// What the lane reports back to the pair it serves (implemented by the pair's entry, so that
/// this module needs nothing of the gateway's state).
pub(crate) trait EngineEvents: Send + Sync + 'static {
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
            let Some(info) = info else {
                return Err(format!(
                    "engine {i} at {url} did not answer: {}",
                    why.join("; ")
                ));
            };
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
    /// stopping at its first failure); returns one message per failed engine.
    async fn call_all(
        &self,
        control: &'static dyn EngineControl,
        urls: &[String],
        facts: &[EngineFacts],
        timeout: Duration,
        calls: impl Fn(&EngineFacts) -> Vec<EngineCall> + Sync,
    ) -> Vec<String> {
        let mut set = tokio::task::JoinSet::new();
        for (i, url) in urls.iter().enumerate() {
            let client = self.clone();
            let base = url.trim_end_matches('/').to_string();
            let calls = facts.get(i).map(&calls).unwrap_or_default();
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
        let mut errors: Vec<(usize, String)> = Vec::new();
        while let Some(joined) = set.join_next().await {
            match joined {
                Ok((i, Some(e))) => errors.push((i, e)),
                Ok((_, None)) => {}
                Err(e) => errors.push((usize::MAX, format!("engine call task ended: {e}"))),
            }
        }
        errors.sort();
        errors.into_iter().map(|(_, e)| e).collect()
    }
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
        let triggers = facts.iter().any(|f| control.trigger(f, 0).is_some());
        let finishes = facts.iter().any(|f| !control.after_update(f, 0).is_empty());
        let (tx, mut rx) = mpsc::unbounded_channel::<EngineCmd>();
        let quick = client.timeout;
        tokio::spawn(async move {
            while let Some(cmd) = rx.recv().await {
                match cmd {
                    EngineCmd::WarmUp => {
                        let errors = client
                            .call_all(control, &urls, &facts, trigger_timeout, |f| {
                                control.warm_up(f)
                            })
                            .await;
                        match pair.upgrade() {
                            Some(p) => p.engines_warmed(errors),
                            None => break,
                        }
                    }
                    EngineCmd::Pause { version, attempt } => {
                        let errors = client
                            .call_all(control, &urls, &facts, quick, |f| {
                                control.before_update(f, version)
                            })
                            .await;
                        match pair.upgrade() {
                            Some(p) => p.engines_paused(version, attempt, errors),
                            None => {
                                // The pair is gone: do not leave its engines paused.
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
                                control.trigger(f, version).into_iter().collect()
                            })
                            .await;
                        match pair.upgrade() {
                            Some(p) => p.engines_triggered(version, attempt, errors),
                            None => break,
                        }
                    }
                    EngineCmd::Finish { version, attempt } => {
                        let errors = client
                            .call_all(control, &urls, &facts, quick, |f| {
                                control.after_update(f, version)
                            })
                            .await;
                        match pair.upgrade() {
                            Some(p) => p.engines_finished(version, attempt, errors),
                            None => break,
                        }
                    }
                    EngineCmd::Continue { version, attempt } => {
                        let errors = client
                            .call_all(control, &urls, &facts, quick, |f| control.resume(f))
                            .await;
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
