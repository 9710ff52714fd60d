//! SGLang's engine control: the HTTP calls around an update, as data for the gateway.
//!
//! Routes and bodies follow SGLang's HTTP server (`python/sglang/srt/entrypoints/http_server.py`:
//! `pause_generation` takes `{"mode": ...}`, `continue_generation` takes `{}`); see
//! `/work/shared/ENGINES.md` for the order around one update.

use crate::detect::{SERVER_INFO_PATHS, ServerInfo};
use awex_core::backend::{EngineCall, EngineControl, EngineExpect, EngineFacts};
use serde_json::{Value, json};

/// How generation is paused: `retract` (requests go back to the queue and are re-run; the
/// default) or `abort`. `in_place` would make the cache flush after the update fail.
pub const DEFAULT_PAUSE_MODE: &str = "retract";

/// SGLang's servers, driven around an update.
pub struct SglangControl;

impl EngineControl for SglangControl {
    fn info_paths(&self) -> &'static [&'static str] {
        &SERVER_INFO_PATHS
    }

    fn check_server(&self, info: &Value, expect: &EngineExpect<'_>) -> Result<EngineFacts, String> {
        let info = ServerInfo::from_json(info)?;
        let e = expect.engine;
        if info.dp_size > 1 {
            return Err(format!(
                "engine {e} runs dp_size={}: awex drives one server per engine (start one server per replica, each an awex engine)",
                info.dp_size
            ));
        }
        for (key, live) in [("tp", info.tp_size), ("ep", info.ep_size)] {
            let declared = expect.parallel.get_or(key, 1);
            if declared != live {
                return Err(format!(
                    "engine {e}: the pair declares sglang {key}={declared} but the server reports {key}_size={live}"
                ));
            }
        }
        Ok(EngineFacts {
            version: info.version.clone(),
            ranks: u32::try_from(info.tp_size).unwrap_or(u32::MAX),
            extra: json!({ "model_path": info.model_path }),
        })
    }

    fn before_update(&self, _facts: &EngineFacts, _version: u64) -> Vec<EngineCall> {
        vec![EngineCall::post(
            "/pause_generation",
            json!({ "mode": DEFAULT_PAUSE_MODE }),
        )]
    }

    fn resume(&self, _facts: &EngineFacts) -> Vec<EngineCall> {
        vec![EngineCall::post("/continue_generation", json!({}))]
    }
}
