//! vLLM's engine control: the HTTP calls around an update, as data for the gateway.
//!
//! Routes and bodies follow vLLM 0.33.0's RL routes, `vllm/entrypoints/rl/online/api_router.py`
//! (served with `VLLM_SERVER_DEV_MODE=1`):
//!
//! - `POST /pause?mode=keep`: `mode` and `clear_cache` are *query* parameters
//!   (`Annotated[PauseMode, Query()]`), no body; `keep` freezes the queued and running requests,
//!   which go on at `/resume` (`abort`, the default, would drop them); `{"status": "paused"}`,
//!   400 `{"error"}` on a bad mode;
//! - `POST /start_weight_update` (no body) -> `engine_client.start_weight_update()`, i.e.
//!   `WeightTransferEngine.start_weight_update` in every worker;
//! - `POST /update_weights {"update_info": {...}}` (`Body(embed=True)`, a
//!   `WeightTransferUpdatePayload`): every worker's engine runs `parse_update_info` then
//!   `receive_weights` -- the trigger; awex's engine (`awex.vllm.AwexWeightTransferEngine`)
//!   receives `{"version": N}`;
//! - `POST /finish_weight_update {"weight_version": "N"}` (`Body(embed=True)`, `str | None`);
//! - `POST /resume` (no body), `{"status": "resumed"}`;
//! - after an attempt that failed while it ran: `POST /finish_weight_update {}` (no version: the
//!   one the server reports stays) ends the workers' update session before the next pause or
//!   resume ([`VllmControl`]'s `abandon`).
//!
//! The update routes have no `try`: an exception in a worker reaches the API server's exception
//! handler and comes back as a non-2xx answer with an `{"error": {"message"}}` body
//! (`ErrorResponse`) or FastAPI's `{"detail"}`; [`VllmControl`] reports that message.

use crate::detect::{SERVER_INFO_PATHS, ServerInfo};
use awex_core::backend::{EngineCall, EngineControl, EngineExpect, EngineFacts, TriggerWork};
use serde_json::{Value, json};

/// The weight-transfer backend name awex's Python package registers with vLLM.
pub const TRANSFER_BACKEND: &str = "awex";

/// How generation is paused (`PauseMode`, `vllm/v1/engine/__init__.py`).
pub const PAUSE_MODE: &str = "keep";

/// vLLM's servers, driven around an update.
pub struct VllmControl;

impl EngineControl for VllmControl {
    fn info_paths(&self) -> &'static [&'static str] {
        &SERVER_INFO_PATHS
    }

    fn check_server(&self, raw: &Value, expect: &EngineExpect<'_>) -> Result<EngineFacts, String> {
        let info = ServerInfo::from_json(raw)?;
        if info.dp_size > 1 {
            return Err(format!(
                "the server runs data_parallel_size={}: awex drives one server per engine (start one server per replica, each an awex engine)",
                info.dp_size
            ));
        }
        if info.pp_size > 1 {
            return Err(format!(
                "the server runs pipeline_parallel_size={}: awex lays out vLLM engines with tensor (and expert) parallelism only",
                info.pp_size
            ));
        }
        for (key, live, field) in [
            ("tp", info.tp_size, "tensor_parallel_size"),
            ("ep", info.ep(), "ep (enable_expert_parallel)"),
        ] {
            let declared = expect.parallel.get_or(key, 1);
            if declared != live {
                return Err(format!(
                    "the pair declares vllm {key}={declared} but the server reports {field}={live}"
                ));
            }
        }
        match info.weight_transfer_backend.as_deref() {
            Some(TRANSFER_BACKEND) => {}
            other => {
                return Err(format!(
                    "the server's weight transfer backend is {}: start it with --weight-transfer-config '{{\"backend\": \"awex\"}}' (and the awex wheel installed, which registers it)",
                    other.map_or_else(|| "not set".to_string(), |b| format!("`{b}`"))
                ));
            }
        }
        Ok(EngineFacts {
            version: None,
            ranks: u32::try_from(info.tp_size).unwrap_or(u32::MAX),
            extra: json!({ "model": info.model }),
        })
    }

    fn warm_up(&self, _facts: &EngineFacts) -> Vec<EngineCall> {
        // `init_transfer_engine` in every worker: builds and joins its awex.Reader.
        vec![EngineCall::post(
            "/init_weight_transfer_engine",
            json!({ "init_info": {} }),
        )]
    }

    fn before_update(&self, _facts: &EngineFacts, _version: u64) -> Vec<EngineCall> {
        vec![
            EngineCall::post(&format!("/pause?mode={PAUSE_MODE}"), json!({})),
            EngineCall::post("/start_weight_update", json!({})),
        ]
    }

    fn trigger(&self, _facts: &EngineFacts, work: &TriggerWork) -> Option<EngineCall> {
        Some(EngineCall::post(
            "/update_weights",
            json!({ "update_info": { "version": work.version } }),
        ))
    }

    /// awex's weight-transfer engine (`awex.vllm`, `receive_weights`) receives through
    /// `awex.Reader.update`, which in an atomic pair stages, reports, waits for `apply`,
    /// applies and reports again before it returns: `/update_weights` answers after the apply.
    fn applies_in_trigger(&self, _facts: &EngineFacts) -> bool {
        true
    }

    fn after_update(&self, _facts: &EngineFacts, version: u64) -> Vec<EngineCall> {
        vec![EngineCall::post(
            "/finish_weight_update",
            json!({ "weight_version": version.to_string() }),
        )]
    }

    fn resume(&self, _facts: &EngineFacts) -> Vec<EngineCall> {
        vec![EngineCall::post("/resume", json!({}))]
    }

    /// An attempt that failed while it ran leaves every worker's update session open: awex's
    /// engine answers `/update_weights` without raising when the version failed before the model
    /// was touched (an exception in one worker of several leaves vLLM's executor reading the
    /// others' answers one call late), so vLLM's `Worker.update_weights` does not end the
    /// session. `/finish_weight_update` without a `weight_version` ends it and keeps the version
    /// the server reports: vLLM sets it only in `finish_weight_update` with a `weight_version`
    /// (`vllm/v1/engine/async_llm.py`), sent after an attempt's ranks all received, so
    /// `committed` is not needed.
    fn abandon(&self, _facts: &EngineFacts, _committed: Option<u64>) -> Vec<EngineCall> {
        vec![EngineCall::post("/finish_weight_update", json!({}))]
    }

    fn check_answer(&self, _call: &EngineCall, status: u16, body: &Value) -> Result<(), String> {
        let message = match body.get("error") {
            Some(Value::String(m)) => Some(m.clone()),
            Some(e) => e.get("message").and_then(Value::as_str).map(str::to_string),
            None => None,
        }
        .or_else(|| {
            body.get("detail").map(|d| match d {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
        });
        match message {
            Some(m) => Err(m),
            None if (200..300).contains(&status) => Ok(()),
            None => Err(format!("HTTP {status}: {body}")),
        }
    }
}
