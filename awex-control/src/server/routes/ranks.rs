//! Ranks: `POST /v1/pairs/{name}/ranks`, a rank joins with its rendezvous info and long-polls
//! until every rank of both sides joined (200 with the roster), its poll window ends (202, join
//! again: a re-join replaces the rank's own entry), or the join deadline passes (408).

use crate::server::error::ApiError;
use crate::server::extract::{JsonBody, PathParams, QueryParams, wait_ms};
use crate::server::state::Pair;
use crate::server::state::{AppState, PairEntry};
use crate::server::store::disk::Op;
use crate::server::store::roster::rank_name;
use crate::server::validate;
use crate::wire::{ApplyMode, CAP_ATOMIC_APPLY, MAX_INFO_BYTES, ReleaseSlot, SlotReleased};
use crate::wire::{JoinPending, JoinRequest, JoinResponse, PairState, RosterEntry, UpdateState};
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use std::time::Duration;
use tokio::time::Instant;

fn roster_bytes(entry: &PairEntry, p: &mut Pair) -> Bytes {
    if let Some(b) = &p.roster.cached {
        return b.clone();
    }
    let response = JoinResponse {
        pair: entry.name.clone(),
        id: entry.id,
        roster: p
            .roster
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref().map(|j| {
                    let (side, rank) = entry.slots.rank(i);
                    RosterEntry {
                        side,
                        rank,
                        info: without_claim(&j.info),
                    }
                })
            })
            .collect(),
        kv: p.kv.values(),
        training_world_size: entry.training.world_size,
        inference_world_size: entry.inference.world_size,
        engines: entry.inference.engines,
        transport: entry.request.transport,
        options: entry.request.options.clone(),
        last_event_seq: p.events.last_seq(),
        uid: entry.uid.clone(),
        // the join route is behind the bearer token: only ranks that presented it get this
        secret: Some(crate::wire::PairSecretHex(entry.secret.clone())),
    };
    let bytes = Bytes::from(serde_json::to_vec(&response).unwrap_or_default());
    p.roster.cached = Some(bytes.clone());
    bytes
}

/// A rank's info as the other ranks see it: without its claim id (`incarnation`), which binds
/// the holder's reports and rendezvous writes and is never handed out.
fn without_claim(info: &serde_json::Value) -> serde_json::Value {
    let mut v = info.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("incarnation");
    }
    v
}

fn join_failed(entry: &PairEntry, p: &Pair, status: StatusCode) -> ApiError {
    let why = p.join_error.clone().unwrap_or_default();
    let msg = format!(
        "pair `{}` failed to join: {why}; disconnect it and connect again",
        entry.name
    );
    if status == StatusCode::REQUEST_TIMEOUT {
        ApiError::JoinTimeout(msg)
    } else {
        ApiError::Conflict(msg)
    }
}

/// `POST /v1/pairs/{name}/ranks`.
pub(crate) async fn join(
    State(gw): State<AppState>,
    PathParams(name): PathParams<String>,
    QueryParams(q): QueryParams<JoinQuery>,
    JsonBody(req): JsonBody<JoinRequest>,
) -> Result<Response, ApiError> {
    let wait = wait_ms(q.timeout_ms)?;
    let entry = gw.pair(&name)?;
    let slot = entry.slots.index(req.side, req.rank)?;
    // refused before the rank is put in the roster: a refused join changes nothing
    let _permit = gw.long_poll(&entry, wait)?;
    let info_bytes = validate::json_size(&req.info);
    if info_bytes > MAX_INFO_BYTES {
        return Err(ApiError::TooLarge(format!(
            "{} sent {info_bytes} bytes of info; at most {MAX_INFO_BYTES} are accepted",
            rank_name(req.side, req.rank)
        )));
    }
    if entry.request.options.apply == ApplyMode::Atomic
        && !req.capabilities.iter().any(|c| c == CAP_ATOMIC_APPLY)
    {
        // it would write received bytes into its live tensors, and cannot read `apply` events
        return Err(ApiError::Unprocessable(format!(
            "pair `{name}` applies updates atomically (options.apply = atomic), but {} did not list the capability `{CAP_ATOMIC_APPLY}` when joining; run an awex that supports atomic apply on every rank, or connect the pair with apply = in_place",
            rank_name(req.side, req.rank)
        )));
    }
    entry.enforce_join_deadline();
    let mut rx = entry.roster_tx.subscribe();
    {
        let mut p = entry.lock();
        match p.state {
            PairState::Disconnected => return Err(ApiError::disconnected(&name)),
            PairState::JoinFailed => return Err(join_failed(&entry, &p, StatusCode::CONFLICT)),
            PairState::Joining | PairState::Ready => {}
        }
        // a second claimant of a slot whose holder is not known gone (nor released) is
        // refused before it changes anything
        entry.check_slot_taken(&p, slot)?;
        let pid = req.info.get("pid").and_then(serde_json::Value::as_u64);
        let takeover = p.roster.check_claim(
            &entry.slots,
            slot,
            crate::server::store::roster::incarnation_of(&req.info),
            pid,
        )?;
        p.roster.put(slot, req.info, info_bytes)?;
        p.changed(Op::Roster(slot));
        if let Some(t) = takeover {
            took_over(&entry, &mut p, slot, t, pid);
        }
        if p.state == PairState::Joining && entry.members_joined(&p) {
            p.state = PairState::Ready;
            p.changed(Op::State);
            drop(p);
            tracing::info!(
                pair = %entry.name,
                ranks = entry.slots.total(),
                "pair ready: every rank joined"
            );
            entry.roster_tx.send_replace(());
        }
    }
    entry.metrics.rank_joined();
    let poll_end = Instant::now() + Duration::from_millis(wait);
    loop {
        {
            let mut p = entry.lock();
            match p.state {
                PairState::Ready => {
                    let body = roster_bytes(&entry, &mut p);
                    return Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response());
                }
                PairState::JoinFailed => {
                    return Err(join_failed(&entry, &p, StatusCode::REQUEST_TIMEOUT));
                }
                PairState::Disconnected => return Err(ApiError::disconnected(&name)),
                PairState::Joining => {}
            }
            let now = Instant::now();
            if now >= entry.join_deadline {
                drop(p);
                entry.enforce_join_deadline();
                continue;
            }
            if now >= poll_end {
                let pending = JoinPending {
                    joined: p.roster.joined() as u32,
                    world_size: entry.slots.total() as u32,
                    deadline_in_ms: crate::wire::ms(entry.join_deadline - now),
                };
                return Ok((StatusCode::ACCEPTED, Json(pending)).into_response());
            }
        }
        let until = poll_end.min(entry.join_deadline);
        if let Ok(Err(_)) = tokio::time::timeout_at(until, rx.changed()).await {
            return Err(ApiError::disconnected(&name));
        }
    }
}

/// `POST /v1/pairs/{name}/ranks/release`: the operator says the holder of a slot is gone (a
/// process the gateway cannot see go: stopped, or lost while the gateway was down), so the
/// next process that joins the slot takes it over. The holder itself, re-joining with its
/// claim id, keeps it.
pub(crate) async fn release(
    State(gw): State<AppState>,
    PathParams(name): PathParams<String>,
    JsonBody(req): JsonBody<ReleaseSlot>,
) -> Result<Json<SlotReleased>, ApiError> {
    let entry = gw.pair(&name)?;
    let slot = entry.slots.index(req.side, req.rank)?;
    let mut p = entry.lock();
    if p.state == PairState::Disconnected {
        return Err(ApiError::disconnected(&name));
    }
    let who = rank_name(req.side, req.rank);
    let Some(holder_pid) = p.roster.release(slot) else {
        return Err(ApiError::Conflict(format!(
            "{who} of pair `{name}` has not joined: there is no holder to release; start the rank"
        )));
    };
    drop(p);
    tracing::warn!(
        pair = %name,
        slot = %who,
        holder_pid = holder_pid.map_or("unknown".to_string(), |p| p.to_string()),
        "rank slot released by the operator: the next process that joins it takes it over"
    );
    Ok(Json(SlotReleased {
        side: req.side,
        rank: req.rank,
        holder_pid,
    }))
}

/// Slot `slot` changed hands: logged naming both processes (by pid: claim ids are never
/// logged), and a version announced to the replaced holder fails now, since the process that
/// was told to run it is not the one holding the slot any more.
fn took_over(
    entry: &PairEntry,
    p: &mut Pair,
    slot: usize,
    t: crate::server::store::roster::Takeover,
    pid: Option<u64>,
) {
    let (side, rank) = entry.slots.rank(slot);
    let who = rank_name(side, rank);
    let pid_of = |p: Option<u64>| p.map_or("unknown".to_string(), |p| p.to_string());
    tracing::warn!(
        pair = %entry.name,
        slot = %who,
        replaced_pid = %pid_of(t.pid),
        new_pid = %pid_of(pid),
        why = t.why,
        "rank slot taken over"
    );
    // the same process took its own slot over after it reported this version received, in
    // place (an engine's loader that recreates its rank for storage the engine rebound, as
    // `awex.sglang.receive` does, having copied the bytes into it): the version stands
    let same_process_after_its_report = pid.is_some()
        && t.pid == pid
        && entry.request.options.apply == ApplyMode::InPlace
        && p.updates
            .latest()
            .is_some_and(|u| u.ranks.get(slot).is_some_and(|r| r.state == Some(true)));
    let announced = !same_process_after_its_report
        && p.updates.latest().is_some_and(|u| {
            u.state == UpdateState::Running
                && u.ranks
                    .get(slot)
                    .and_then(|r| r.claim.as_deref())
                    .is_some_and(|c| c == t.claim)
        });
    if announced {
        entry.fail(
            p,
            format!(
                "{who} changed hands while it ran: the process it was announced to (pid {}) was replaced by pid {} ({}), which never received this version; retry the version",
                pid_of(t.pid),
                pid_of(pid),
                t.why
            ),
        );
    }
}

/// Query of a join: how long this request may wait.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct JoinQuery {
    timeout_ms: Option<u64>,
}
