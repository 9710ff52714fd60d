//! Calls to the inference engines around an update: SGLang's own `POST /pause_generation`
//! before the ranks move bytes and `POST /continue_generation` after a commit or a failure.
//!
//! Each pair with engine URLs has one lane: a task that runs the calls in the order they were
//! queued, so that a retry's pause can never overtake the previous attempt's resume.

use super::pairs::PairEntry;
use std::sync::Weak;
use std::time::Duration;
use tokio::sync::mpsc;

/// A call to every engine of a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EngineCmd {
    /// `pause_generation` before `version`/`attempt` runs.
    Pause { version: u64, attempt: u32 },
    /// `continue_generation` after `version`/`attempt` committed or failed.
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

    /// Calls `POST {url}/{endpoint}` on every engine at once; returns one message per failure.
    async fn call_all(&self, urls: &[String], endpoint: &str) -> Vec<String> {
        let mut set = tokio::task::JoinSet::new();
        for (i, url) in urls.iter().enumerate() {
            let http = self.http.clone();
            let target = format!("{}/{endpoint}", url.trim_end_matches('/'));
            set.spawn(async move {
                let result = http.post(&target).json(&serde_json::json!({})).send().await;
                let err = match result {
                    Ok(r) if r.status().is_success() => return (i, None),
                    Ok(r) => format!("answered {}", r.status()),
                    Err(e) if e.is_timeout() => "timed out".to_string(),
                    Err(e) => format!("unreachable ({e})"),
                };
                (i, Some(format!("engine {i} POST {target} {err}")))
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
    pub(crate) fn spawn(pair: Weak<PairEntry>, urls: Vec<String>, client: EngineClient) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<EngineCmd>();
        tokio::spawn(async move {
            while let Some(cmd) = rx.recv().await {
                match cmd {
                    EngineCmd::Pause { version, attempt } => {
                        let errors = client.call_all(&urls, "pause_generation").await;
                        match pair.upgrade() {
                            Some(p) => p.engines_paused(version, attempt, errors),
                            None => {
                                // The pair is gone: do not leave its engines paused.
                                client.call_all(&urls, "continue_generation").await;
                                break;
                            }
                        }
                    }
                    EngineCmd::Continue { version, attempt } => {
                        let errors = client.call_all(&urls, "continue_generation").await;
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
