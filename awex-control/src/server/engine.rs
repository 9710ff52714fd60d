//! Calls to the inference engines around an update, as the inference backend's
//! [`EngineControl`] describes them (for SGLang: `POST /pause_generation` before the ranks move
//! bytes, `POST /continue_generation` after a commit or a failure). The gateway knows no engine
//! by name: it only executes the calls.
//!
//! Each pair with engine URLs has one lane: a task that runs the calls in the order they were
//! queued, so that a retry's pause can never overtake the previous attempt's resume.

use super::pairs::PairEntry;
use awex_core::backend::{EngineCall, EngineControl, EngineFacts, HttpMethod};
use std::sync::Weak;
use std::time::Duration;
use tokio::sync::mpsc;

/// A call to every engine of a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineCmd {
    /// The backend's calls before `version`/`attempt` runs (pause generation).
    Pause { version: u64, attempt: u32 },
    /// The backend's calls after `version`/`attempt` committed or failed (continue generation).
    Continue { version: u64, attempt: u32 },
}

/// The HTTP client engines are called with.
#[derive(Clone)]
pub(crate) struct EngineClient {
    http: reqwest::Client,
}

impl EngineClient {
    /// A client whose every call times out after `timeout`.
    pub(crate) fn new(timeout: Duration) -> Self {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        EngineClient { http }
    }

    /// Runs `calls(engine)` on every engine at once (each engine's calls in order, stopping at
    /// its first failure); returns one message per failed engine.
    async fn call_all(
        &self,
        control: &'static dyn EngineControl,
        urls: &[String],
        calls: impl Fn(&EngineFacts) -> Vec<EngineCall>,
    ) -> Vec<String> {
        let facts = EngineFacts::default();
        let mut set = tokio::task::JoinSet::new();
        for (i, url) in urls.iter().enumerate() {
            let http = self.http.clone();
            let base = url.trim_end_matches('/').to_string();
            let calls = calls(&facts);
            set.spawn(async move {
                for call in calls {
                    let target = format!("{base}{}", call.path);
                    let req = match call.method {
                        HttpMethod::Get => http.get(&target),
                        HttpMethod::Post => http
                            .post(&target)
                            .json(call.body.as_ref().unwrap_or(&serde_json::json!({}))),
                    };
                    let verdict = match req.send().await {
                        Ok(r) => {
                            let status = r.status();
                            let body = r.json::<serde_json::Value>().await.unwrap_or_default();
                            match control.check_answer(&call, status.as_u16(), &body) {
                                Err(_) if !status.is_success() && body.is_null() => {
                                    Err(format!("answered {status}"))
                                }
                                Err(_) if !status.is_success() => {
                                    Err(format!("answered {status}: {body}"))
                                }
                                other => other,
                            }
                        }
                        Err(e) if e.is_timeout() => Err("timed out".to_string()),
                        Err(e) => Err(format!("unreachable ({e})")),
                    };
                    if let Err(e) = verdict {
                        let m = match call.method {
                            HttpMethod::Get => "GET",
                            HttpMethod::Post => "POST",
                        };
                        return (i, Some(format!("engine {i} {m} {target} {e}")));
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
}

impl EngineLane {
    /// Starts the lane's task; it ends when the pair is dropped.
    pub(crate) fn spawn(
        pair: Weak<PairEntry>,
        control: &'static dyn EngineControl,
        urls: Vec<String>,
        client: EngineClient,
    ) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<EngineCmd>();
        tokio::spawn(async move {
            while let Some(cmd) = rx.recv().await {
                match cmd {
                    EngineCmd::Pause { version, attempt } => {
                        let errors = client
                            .call_all(control, &urls, |f| control.before_update(f, version))
                            .await;
                        match pair.upgrade() {
                            Some(p) => p.engines_paused(version, attempt, errors),
                            None => {
                                // The pair is gone: do not leave its engines paused.
                                client.call_all(control, &urls, |f| control.resume(f)).await;
                                break;
                            }
                        }
                    }
                    EngineCmd::Continue { version, attempt } => {
                        let errors = client.call_all(control, &urls, |f| control.resume(f)).await;
                        if let Some(p) = pair.upgrade() {
                            p.engines_resumed(version, attempt, errors);
                        }
                    }
                }
            }
        });
        EngineLane { tx }
    }

    /// Queues a call.
    pub(crate) fn send(&self, cmd: EngineCmd) {
        // The receiver lives as long as the pair; a send can fail only while it is being dropped.
        let _ = self.tx.send(cmd);
    }
}
