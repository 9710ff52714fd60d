//! Engine control as data: the HTTP calls an inference backend needs around an update (pause,
//! an update session, a trigger into the engine's own processes, resume), which the gateway
//! executes. The core knows no engine and speaks no HTTP.

use super::ParallelConfig;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// An HTTP method of an engine call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HttpMethod {
    /// `GET`
    Get,
    /// `POST`
    Post,
}

/// One call to an engine's server, relative to its base URL.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineCall {
    /// The method.
    pub method: HttpMethod,
    /// The path (`/pause_generation`).
    pub path: String,
    /// The JSON body (POST).
    pub body: Option<Value>,
}

impl EngineCall {
    /// `POST path` with a JSON body.
    pub fn post(path: &str, body: Value) -> Self {
        EngineCall {
            method: HttpMethod::Post,
            path: path.to_string(),
            body: Some(body),
        }
    }
}

/// What a trigger asks of an engine's processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TriggerPhase {
    /// Receive the version into the engine's live weights.
    Receive,
}

impl TriggerPhase {
    /// The phase's name as it travels to the engine (`receive`).
    pub fn as_str(self) -> &'static str {
        match self {
            TriggerPhase::Receive => "receive",
        }
    }
}

/// The work a trigger names: the engine's processes receive exactly this attempt, so they need
/// not ask the gateway which one is running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TriggerWork {
    /// The version.
    pub version: u64,
    /// Its attempt (from 1).
    pub attempt: u32,
    /// What to do with it.
    pub phase: TriggerPhase,
}

impl TriggerWork {
    /// `version`/`attempt`, received into the live weights.
    pub fn receive(version: u64, attempt: u32) -> Self {
        TriggerWork {
            version,
            attempt,
            phase: TriggerPhase::Receive,
        }
    }
}

/// What the pair declares about one engine, to be checked against its live server.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineExpect<'a> {
    /// Which engine (0-based).
    pub engine: u32,
    /// The declared parallel config of the inference side (defaults filled in).
    pub parallel: &'a ParallelConfig,
    /// The model's name or path as the pair knows it, when it knows one.
    pub model: Option<&'a str>,
    /// The model's architecture (`Qwen3ForCausalLM`).
    pub architecture: &'a str,
}

/// What the gateway learned about one engine's server at connect, kept for its updates.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineFacts {
    /// The engine's version, when its server reports one.
    pub version: Option<String>,
    /// Ranks (processes) that receive weights in this engine.
    pub ranks: u32,
    /// Backend-specific facts (e.g. whether an update session is supported).
    pub extra: Value,
}

/// How the gateway drives an engine's server around an update.
///
/// Per update: [`EngineControl::before_update`] in order (a failure fails the update, and the
/// engine is resumed since nothing was written), then the update starts on the ranks and
/// [`EngineControl::trigger`] is sent (its answer must be success, as must every rank's report),
/// then [`EngineControl::after_update`], then the commit, then [`EngineControl::resume`].
///
/// An attempt that fails after `before_update` succeeded never reaches `after_update`; before
/// the engine's next `before_update` or `resume`, the gateway sends [`EngineControl::abandon`]
/// so that whatever `before_update` opened (SGLang's update session) is closed first.
pub trait EngineControl: Send + Sync + 'static {
    /// Paths that describe a server, tried in order; the first that answers is used.
    fn info_paths(&self) -> &'static [&'static str];

    /// Paths that describe the model a server serves, tried in order after the info path;
    /// the first answer is handed to [`EngineControl::check_server`] as the info object's
    /// `model_info` field (absent when none answered). Empty: not read.
    fn model_info_paths(&self) -> &'static [&'static str] {
        &[]
    }

    /// Checks a server's info against what the pair declares; a disagreement is an error
    /// naming the field and both values.
    fn check_server(&self, info: &Value, expect: &EngineExpect<'_>) -> Result<EngineFacts, String>;

    /// Calls sent once per engine after connect, in order (e.g. to start the engine's
    /// receivers before the first update).
    fn warm_up(&self, _facts: &EngineFacts) -> Vec<EngineCall> {
        Vec::new()
    }

    /// Calls before any byte moves (pause generation, open an update session).
    fn before_update(&self, facts: &EngineFacts, version: u64) -> Vec<EngineCall>;

    /// The call that makes the engine's processes do `work`; `None` when its ranks receive by
    /// themselves.
    fn trigger(&self, _facts: &EngineFacts, _work: &TriggerWork) -> Option<EngineCall> {
        None
    }

    /// Whether the engine's receivers that [`EngineControl::trigger`] calls run an atomic
    /// pair's two phases inside that one call: receive into staging, report, wait for the
    /// gateway's `apply` event, copy into the live weights, report again, answer. The trigger
    /// then stays open across `apply`, and the gateway must announce `apply` without waiting
    /// for its answer. `false` (the default): such engines cannot be connected atomic.
    fn applies_in_trigger(&self, _facts: &EngineFacts) -> bool {
        false
    }

    /// Calls after every rank received (close the update session).
    fn after_update(&self, _facts: &EngineFacts, _version: u64) -> Vec<EngineCall> {
        Vec::new()
    }

    /// Calls that let the engine serve again (continue generation).
    fn resume(&self, facts: &EngineFacts) -> Vec<EngineCall>;

    /// Calls that close what [`EngineControl::before_update`] (or a failed warm-up) left open
    /// when an attempt ended without [`EngineControl::after_update`] succeeding, without letting
    /// the engine serve again; sent before the engine's next `before_update` or `resume`. A
    /// failure is recorded and does not stop what follows. `committed` is the pair's last
    /// committed version (`None`: none yet), for engines that must report it again after a
    /// failed trigger recorded the failed version's number (SGLang).
    fn abandon(&self, _facts: &EngineFacts, _committed: Option<u64>) -> Vec<EngineCall> {
        Vec::new()
    }

    /// Whether an answer means success; `Err` is the engine's own message when it gave one.
    fn check_answer(&self, call: &EngineCall, status: u16, body: &Value) -> Result<(), String> {
        let _ = call;
        let message = body.get("message").and_then(Value::as_str);
        match (body.get("success"), message) {
            (Some(Value::Bool(false)), Some(m)) => Err(m.to_string()),
            (Some(Value::Bool(false)), None) => Err("the engine answered success: false".into()),
            _ if (200..300).contains(&status) => Ok(()),
            _ => Err(format!("HTTP {status}: {body}")),
        }
    }
}
