//! SGLang's engine control: the HTTP calls around an update, as data for the gateway.
//!
//! Routes and bodies follow SGLang 0.5.23's HTTP server
//! (`python/sglang/srt/entrypoints/http_server.py`; request types in
//! `python/sglang/srt/managers/io_struct.py`):
//!
//! - `POST /pause_generation {"mode": "retract"}` (`PauseGenerationReqInput`; `retract` sends
//!   running requests back to the queue, so the cache flush after the update succeeds);
//! - `POST /begin_weight_update {"selector": "target"}` and `POST /end_weight_update {}`
//!   (`BeginWeightUpdateReqInput` / `EndWeightUpdateReqInput`, since 0.5.21; `selector`
//!   defaults to `all`, target and draft model; 400 with `{"success": false, "message"}` on
//!   failure; one session at a time, so a failed attempt's session is ended before a retry);
//! - `POST /update_weights_from_tensor` (`UpdateWeightsFromTensorReqInput`): one base64
//!   payload per TP rank, `load_format` the custom loader's dotted path, `weight_version`,
//!   `flush_cache`, and inside a session `selector: "target"` (its default is `all`); every TP
//!   scheduler calls the loader with `(model, named_tensors)`;
//! - `POST /continue_generation {}`.
//!
//! The session (begin, the trigger into the loader, end) is used only when the server allows
//! awex's loader (`custom_weight_loader` in `/server_info`, the resolved server arguments);
//! otherwise the gateway only pauses and resumes and the ranks receive on their own.

use crate::detect::{SERVER_INFO_PATHS, ServerInfo};
use awex_core::backend::{EngineCall, EngineControl, EngineExpect, EngineFacts, TriggerWork};
use serde_json::{Value, json};

/// The custom weight loader SGLang calls in every TP scheduler (`awex-py`'s Python package).
pub const LOADER: &str = "awex.sglang.receive";

/// SGLang's `MultiprocessingSerializer` encoding of an empty list (`ForkingPickler` protocol 4,
/// base64): each TP rank's payload of the warm-up trigger (join the pair, no work yet).
pub const EMPTY_PAYLOAD: &str = "gARdlC4=";

/// The name of the one entry of an update trigger's payload: `awex.work/<version>/<attempt>/<phase>`
/// (read by the loader, `awex.sglang.work_of`).
pub const WORK_PREFIX: &str = "awex.work/";

/// Each TP rank's payload of an update trigger: SGLang's `MultiprocessingSerializer` encoding
/// (a pickle, base64) of `[("awex.work/<version>/<attempt>/<phase>", torch.LongTensor([]))]`.
///
/// The loader learns from it which attempt runs, without asking the gateway. SGLang 0.5.23
/// reads the payload with its `SafeUnpickler` (`utils/common.py`), which admits
/// `torch.LongTensor` among a fixed set of globals, and moves each entry's tensor to the
/// device before it calls the loader (`weight_updater.py`, `_unwrap_tensor`), so the entry's
/// value is an (empty) tensor; the name carries the work. Pickle protocol 2, written out here:
/// `PROTO 2`, `EMPTY_LIST`, `BINUNICODE name`, `GLOBAL torch LongTensor`, `EMPTY_LIST`,
/// `TUPLE1`, `REDUCE`, `TUPLE2`, `APPEND`, `STOP`.
pub fn work_payload(work: &TriggerWork) -> String {
    let name = format!(
        "{WORK_PREFIX}{}/{}/{}",
        work.version,
        work.attempt,
        work.phase.as_str()
    );
    let mut p = vec![0x80, 2, b']', b'X'];
    p.extend_from_slice(&(name.len() as u32).to_le_bytes());
    p.extend_from_slice(name.as_bytes());
    p.extend_from_slice(b"ctorch\nLongTensor\n");
    p.extend_from_slice(&[b']', 0x85, b'R', 0x86, b'a', b'.']);
    base64(&p)
}

/// Standard base64 with padding (RFC 4648), what SGLang's `b64decode(validate=True)` reads.
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The first version with `begin_weight_update` / `end_weight_update`.
pub const SESSION_SINCE: (u64, u64, u64) = (0, 5, 21);

/// `major.minor.patch` of a version string (`0.5.23`, `0.5.21.post1`, `v0.5.22rc0`).
pub fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let v = v.trim().trim_start_matches('v');
    let mut it = v.split('.');
    let num = |s: Option<&str>| -> Option<u64> {
        let s = s?;
        let digits: String = s.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    };
    Some((
        num(it.next())?,
        num(it.next())?,
        num(it.next()).unwrap_or(0),
    ))
}

/// How generation is paused: `retract` (requests go back to the queue and are re-run; the
/// default) or `abort`. `in_place` would make the cache flush after the update fail.
pub const DEFAULT_PAUSE_MODE: &str = "retract";

/// SGLang's servers, driven around an update.
pub struct SglangControl;

/// Model-info paths, newest first (`GET /model_info`, `/get_model_info` before its rename;
/// `entrypoints/http_server.py`, `model_info`): `model_path`, `model_type` and `architectures`
/// (the served model's `hf_config.architectures`), which `/server_info` does not carry.
pub const MODEL_INFO_PATHS: [&str; 2] = ["/model_info", "/get_model_info"];

/// The served model's architectures from a model-info answer (`None` when not reported).
pub fn served_architectures(model_info: &Value) -> Option<Vec<String>> {
    let list = model_info.get("architectures")?.as_array()?;
    let names: Vec<String> = list
        .iter()
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect();
    (!names.is_empty()).then_some(names)
}

/// Checks the model a server serves against the pair's: the architecture must be one of the
/// server's `architectures` when the server reports them. The model path is not compared:
/// trainers and servers routinely name the same weights differently (a hub id and a local
/// copy, a step checkpoint directory), and the parameters' shapes are checked when the loader
/// registers them.
fn check_model(raw: &Value, expect: &EngineExpect<'_>) -> Result<Option<Vec<String>>, String> {
    let Some(served) = raw.get("model_info").and_then(served_architectures) else {
        return Ok(None);
    };
    if !served.iter().any(|a| a == expect.architecture) {
        let path = raw
            .get("model_path")
            .and_then(Value::as_str)
            .map(|p| format!(" (model_path {p})"))
            .unwrap_or_default();
        return Err(format!(
            "the pair's model is {} but the server reports architectures={}{path}",
            expect.architecture,
            serde_json::to_string(&served).unwrap_or_default()
        ));
    }
    Ok(Some(served))
}

impl EngineControl for SglangControl {
    fn info_paths(&self) -> &'static [&'static str] {
        &SERVER_INFO_PATHS
    }

    fn model_info_paths(&self) -> &'static [&'static str] {
        &MODEL_INFO_PATHS
    }

    fn check_server(&self, raw: &Value, expect: &EngineExpect<'_>) -> Result<EngineFacts, String> {
        let info = ServerInfo::from_json(raw)?;
        if info.dp_size > 1 {
            return Err(format!(
                "the server runs dp_size={}: awex drives one server per engine (start one server per replica, each an awex engine)",
                info.dp_size
            ));
        }
        if info.enable_dp_attention || info.attn_dp_size > 1 {
            let what = if info.attn_dp_size > 1 {
                format!("attn_dp_size={}", info.attn_dp_size)
            } else {
                "enable_dp_attention=true".to_string()
            };
            return Err(format!(
                "the server runs attention data parallelism ({what}, --attn-dp-size / --enable-dp-attention): \
                 it splits attention (MLA's q_b_proj, kv_b_proj, o_proj) over attn_tp = tp / attn_dp_size ranks and \
                 replicates it across the groups, which awex does not lay out; start the server without it"
            ));
        }
        if let Some(dense) = info.moe_dense_tp_size
            && dense != info.tp_size
        {
            return Err(format!(
                "the server runs moe_dense_tp_size={dense} with tp_size={}: SGLang then holds the dense MLP \
                 layers of an MoE model over {dense} rank(s) instead of tp, which awex does not lay out; \
                 start the server without --moe-dense-tp-size",
                info.tp_size
            ));
        }
        for (key, live) in [("tp", info.tp_size), ("ep", info.ep_size)] {
            let declared = expect.parallel.get_or(key, 1);
            if declared != live {
                return Err(format!(
                    "the pair declares sglang {key}={declared} but the server reports {key}_size={live}"
                ));
            }
        }
        let architectures = check_model(raw, expect)?;
        let loader = raw
            .get("custom_weight_loader")
            .and_then(Value::as_array)
            .is_some_and(|l| l.iter().any(|x| x.as_str() == Some(LOADER)));
        let session = info
            .version
            .as_deref()
            .and_then(parse_version)
            .is_some_and(|v| v >= SESSION_SINCE);
        // the version the server reports at connect (`/model_info`'s `weight_version`; its
        // launch argument `--weight-version`, "default" unless given, or an earlier update's)
        let weight_version = raw
            .get("model_info")
            .and_then(|m| m.get("weight_version"))
            .or_else(|| raw.get("weight_version"))
            .and_then(Value::as_str);
        Ok(EngineFacts {
            version: info.version.clone(),
            ranks: u32::try_from(info.tp_size).unwrap_or(u32::MAX),
            extra: json!({
                "model_path": info.model_path,
                "architectures": architectures,
                "loader": loader,
                "session": session,
                "weight_version": weight_version,
            }),
        })
    }

    fn warm_up(&self, facts: &EngineFacts) -> Vec<EngineCall> {
        if !uses_loader(facts) {
            return Vec::new();
        }
        let mut body = json!({
            "serialized_named_tensors": payloads(facts),
            "load_format": LOADER,
            "flush_cache": false,
        });
        target_only(facts, &mut body);
        let trigger = EngineCall::post("/update_weights_from_tensor", body);
        if uses_session(facts) {
            vec![begin(), trigger, end()]
        } else {
            vec![trigger]
        }
    }

    fn before_update(&self, facts: &EngineFacts, _version: u64) -> Vec<EngineCall> {
        let mut calls = vec![EngineCall::post(
            "/pause_generation",
            json!({ "mode": DEFAULT_PAUSE_MODE }),
        )];
        if uses_loader(facts) && uses_session(facts) {
            calls.push(begin());
        }
        calls
    }

    fn trigger(&self, facts: &EngineFacts, work: &TriggerWork) -> Option<EngineCall> {
        uses_loader(facts).then(|| {
            let payload = work_payload(work);
            let mut body = json!({
                "serialized_named_tensors": vec![payload; facts.ranks.max(1) as usize],
                "load_format": LOADER,
                "weight_version": work.version.to_string(),
                "flush_cache": true,
            });
            target_only(facts, &mut body);
            EngineCall::post("/update_weights_from_tensor", body)
        })
    }

    /// awex's loader receives through `awex.Reader.update`, which in an atomic pair receives
    /// into staging, reports, waits for `apply`, copies into SGLang's parameters and reports
    /// again before it returns: the trigger answers after the apply.
    fn applies_in_trigger(&self, facts: &EngineFacts) -> bool {
        uses_loader(facts)
    }

    fn after_update(&self, facts: &EngineFacts, _version: u64) -> Vec<EngineCall> {
        if uses_loader(facts) && uses_session(facts) {
            vec![end()]
        } else {
            Vec::new()
        }
    }

    fn resume(&self, _facts: &EngineFacts) -> Vec<EngineCall> {
        vec![EngineCall::post("/continue_generation", json!({}))]
    }

    /// `end_weight_update` when the server has sessions: SGLang keeps one session open per
    /// server and refuses the next `begin_weight_update` with 400 "a weight-update session is
    /// already open; call end_weight_update() first"
    /// (`managers/scheduler_components/weight_updater.py`, `begin_weight_update`), so a retry
    /// after a failed trigger must close the failed attempt's session first. `end` runs
    /// `process_weights_after_loading` on the runners; generation stays paused.
    ///
    /// Then the version the server reports is set back ([`restore_version`]): SGLang records
    /// the trigger's `weight_version` once the loader returned
    /// (`managers/tokenizer_control_mixin.py`, `update_weights_from_tensor`), and
    /// awex's loader returns also when the version failed, so the server would report the
    /// failed version's number while it serves the previous weights. The version set is the
    /// pair's last committed one, or, before any commit, the one the server reported at
    /// connect; when it reported none, nothing is sent.
    fn abandon(&self, facts: &EngineFacts, committed: Option<u64>) -> Vec<EngineCall> {
        if !uses_loader(facts) {
            // no trigger, so no `weight_version` was sent
            return Vec::new();
        }
        let mut calls = Vec::new();
        if uses_session(facts) {
            calls.push(end());
        }
        let version = committed
            .map(|v| v.to_string())
            .or_else(|| connect_version(facts).map(str::to_string));
        calls.extend(version.map(|v| restore_version(&v)));
        calls
    }
}

fn uses_loader(facts: &EngineFacts) -> bool {
    facts.extra.get("loader").and_then(Value::as_bool) == Some(true)
}

/// The version the server reported at connect (`None` when it reported none).
fn connect_version(facts: &EngineFacts) -> Option<&str> {
    facts.extra.get("weight_version").and_then(Value::as_str)
}

/// `POST /update_weight_version {"new_version", "abort_all_requests": false}`
/// (`entrypoints/http_server.py`, `update_weight_version`; `UpdateWeightVersionReqInput` in
/// `managers/io_struct.py`, whose `abort_all_requests` defaults to `true`): sets the version the
/// server reports (`/model_info`, `/server_info`) and every scheduler's (`scheduler.py`,
/// `handle_update_weight_version`) without touching the weights; `false` keeps the requests
/// that the pause retracted.
pub fn restore_version(version: &str) -> EngineCall {
    EngineCall::post(
        "/update_weight_version",
        json!({ "new_version": version, "abort_all_requests": false }),
    )
}

fn uses_session(facts: &EngineFacts) -> bool {
    facts.extra.get("session").and_then(Value::as_bool) == Some(true)
}

/// Names the target model on a trigger inside a session: `update_weights_from_tensor`'s
/// `selector` defaults to `all` (`managers/io_struct.py`, `UpdateWeightsFromTensorReqInput`),
/// which would also call the loader on a speculative-decoding draft model, while the session
/// was opened for `target` only.
fn target_only(facts: &EngineFacts, body: &mut Value) {
    if uses_session(facts)
        && let Some(o) = body.as_object_mut()
    {
        o.insert("selector".into(), json!("target"));
    }
}

fn payloads(facts: &EngineFacts) -> Vec<&'static str> {
    vec![EMPTY_PAYLOAD; facts.ranks.max(1) as usize]
}

fn begin() -> EngineCall {
    EngineCall::post("/begin_weight_update", json!({ "selector": "target" }))
}

fn end() -> EngineCall {
    EngineCall::post("/end_weight_update", json!({}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc_4648_and_the_empty_payload() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        // pickle protocol 4 of [] (PROTO 4, EMPTY_LIST, MEMOIZE, STOP)
        assert_eq!(base64(&[0x80, 4, b']', 0x94, b'.']), EMPTY_PAYLOAD);
    }

    #[test]
    fn the_work_payload_names_version_attempt_and_phase() {
        let w = TriggerWork::receive(u64::MAX, 3);
        let p = work_payload(&w);
        // decoded by hand: the name sits after PROTO, EMPTY_LIST, BINUNICODE and its length
        let name = format!("awex.work/{}/3/receive", u64::MAX);
        let mut want = vec![0x80, 2, b']', b'X'];
        want.extend_from_slice(&(name.len() as u32).to_le_bytes());
        want.extend_from_slice(name.as_bytes());
        want.extend_from_slice(b"ctorch\nLongTensor\n]\x85R\x86a.");
        assert_eq!(p, base64(&want));
    }
}
