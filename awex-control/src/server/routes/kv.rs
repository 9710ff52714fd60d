//! Rendezvous values: `PUT /v1/pairs/{name}/kv/{key}` stores a JSON value (e.g. an NCCL unique
//! id posted by one rank), `GET` reads it, waiting up to `timeout_ms` for it to appear.

use crate::server::error::ApiError;
use crate::server::extract::{JsonBody, PathParams, QueryParams, wait_ms};
use crate::server::state::AppState;
use crate::server::store::disk::Op;
use crate::server::validate;
use crate::wire::{KvEntry, KvPut, PairState};
use crate::wire::{MAX_KV_KEYS, MAX_KV_VALUE_BYTES};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;
use std::time::Duration;
use tokio::time::Instant;

/// `PUT /v1/pairs/{name}/kv/{key}`: 201 when the key is new, 200 when replaced.
pub(crate) async fn put(
    State(gw): State<AppState>,
    PathParams((name, key)): PathParams<(String, String)>,
    JsonBody(body): JsonBody<KvPut>,
) -> Result<(StatusCode, Json<KvEntry>), ApiError> {
    let entry = gw.pair(&name)?;
    validate::name("key", &key)?;
    let size = validate::json_size(&body.value);
    if size > MAX_KV_VALUE_BYTES {
        return Err(ApiError::TooLarge(format!(
            "the value of key `{key}` is {size} bytes of JSON; at most {MAX_KV_VALUE_BYTES} are accepted"
        )));
    }
    let mut p = entry.lock();
    match p.state {
        PairState::Disconnected => return Err(ApiError::disconnected(&name)),
        PairState::JoinFailed => {
            return Err(ApiError::Conflict(format!(
                "pair `{name}` failed to join; disconnect it and connect again"
            )));
        }
        PairState::Joining | PairState::Ready => {}
    }
    // kept as compact JSON text: what the value costs in memory is its size
    let raw = serde_json::value::to_raw_value(&body.value)
        .map_err(|e| ApiError::Unprocessable(format!("the value of key `{key}`: {e}")))?;
    // a rank's rendezvous value: only the slot's live holder may replace it
    if let Some(slot) = crate::server::store::roster::rendezvous_slot(&entry.slots, &key) {
        // a free engine slot takes no rendezvous value (its engine was not added)
        entry.check_slot_taken(&p, slot)?;
        let pid = body.value.get("pid").and_then(serde_json::Value::as_u64);
        p.roster.check_claim(
            &entry.slots,
            slot,
            crate::server::store::roster::incarnation_of(&body.value),
            pid,
        )?;
    }
    let is_new = !p.kv.values.contains_key(&key);
    if is_new && p.kv.values.len() >= MAX_KV_KEYS {
        return Err(ApiError::Conflict(format!(
            "pair `{name}` already holds {MAX_KV_KEYS} keys, the limit; reuse a key"
        )));
    }
    p.kv.revision += 1;
    let revision = p.kv.revision;
    p.kv.values.insert(key.clone(), (raw, revision));
    p.roster.invalidate();
    p.changed(Op::Kv(key.clone()));
    p.changed(Op::State);
    drop(p);
    entry.kv_tx.send_replace(());
    let status = if is_new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(KvEntry {
            key,
            value: body.value,
            revision,
        }),
    ))
}

/// `GET /v1/pairs/{name}/kv/{key}?timeout_ms=T`: the value, or 404 once `T` passed without it.
pub(crate) async fn get(
    State(gw): State<AppState>,
    PathParams((name, key)): PathParams<(String, String)>,
    QueryParams(q): QueryParams<KvQuery>,
) -> Result<Json<KvEntry>, ApiError> {
    let wait = match q.timeout_ms {
        None => 0,
        t => wait_ms(t)?,
    };
    let entry = gw.pair(&name)?;
    validate::name("key", &key)?;
    let _permit = gw.long_poll(&entry, wait)?;
    let mut rx = entry.kv_tx.subscribe();
    let end = Instant::now() + Duration::from_millis(wait);
    loop {
        {
            let p = entry.lock();
            if let Some(v) = p.kv.get(&key) {
                return Ok(Json(v));
            }
            if p.state == PairState::Disconnected {
                return Err(ApiError::disconnected(&name));
            }
        }
        match tokio::time::timeout_at(end, rx.changed()).await {
            Ok(Ok(())) => continue,
            _ => {
                return Err(ApiError::NotFound(format!(
                    "key `{key}` is not set in pair `{name}` (waited {wait} ms)"
                )));
            }
        }
    }
}

/// Query of `GET .../kv/{key}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct KvQuery {
    /// Wait this long for the key to be set (0: answer at once).
    timeout_ms: Option<u64>,
}
