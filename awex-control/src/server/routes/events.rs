//! Events: `GET /v1/pairs/{name}/events?after=N&timeout_ms=T`, the per-pair sequence ranks
//! long-poll to learn of work (`update`), of failures (`abort`) and of the end (`disconnect`).
//! It answers every event with `seq > N`, or an empty list after `T`; it never hangs a rank.
//! A rank names its claim id in the `awex-claim` header (never in the URL): its slot then
//! counts as held while the poll is open, and a poll whose connection closes unanswered says
//! the process is gone.

use crate::server::error::ApiError;
use crate::server::extract::{PathParams, QueryParams, wait_ms};
use crate::server::state::AppState;
use crate::server::store::roster::rank_name;
use crate::wire::CLAIM_HEADER;
use crate::wire::{EventsResponse, PairState, UpdateState};
use awex_core::layout::Side;
use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use serde::Deserialize;
use std::time::Duration;
use tokio::time::Instant;

/// `GET /v1/pairs/{name}/events`.
pub(crate) async fn poll(
    State(gw): State<AppState>,
    PathParams(name): PathParams<String>,
    QueryParams(q): QueryParams<EventsQuery>,
    headers: HeaderMap,
) -> Result<Json<EventsResponse>, ApiError> {
    let wait = wait_ms(q.timeout_ms)?;
    if q.incarnation.is_some() {
        // a URL is logged by proxies and printed in retry lines: a claim id never goes there
        return Err(ApiError::BadRequest(format!(
            "`incarnation` does not belong in the URL, where it would be logged: send the rank's claim id in the `{CLAIM_HEADER}` header"
        )));
    }
    let claim = match headers.get(CLAIM_HEADER) {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| {
            ApiError::BadRequest(format!(
                "the `{CLAIM_HEADER}` header must be visible ASCII (the claim id the rank joined with)"
            ))
        })?),
    };
    let entry = gw.pair(&name)?;
    // a rank's live holder naming its claim id polls in its own pool (a flood of other
    // requests does not cut it off its work)
    let holder = claim.and_then(|c| entry.lock().roster.holder_slot(c));
    let _permit = match holder {
        Some(slot) => gw.rank_event_poll(&entry, wait, slot)?,
        None => gw.long_poll(&entry, wait)?,
    };
    // a rank that names its claim id is seen live while its poll is open
    let mut seen = claim.and_then(|c| {
        let slot = entry.lock().roster.begin_poll(c)?;
        Some(PollSeen {
            entry: entry.clone(),
            slot,
            incarnation: c.to_string(),
            answered: false,
        })
    });
    let answer = if q.presence {
        hold(&entry, wait).await
    } else {
        wait_for_events(&entry, &name, q.after, wait).await
    };
    if let Some(s) = seen.as_mut() {
        s.answered = true;
    }
    answer
}

/// A rank's presence poll: open for the whole `wait` (events do not end it; the disconnect
/// does), so that the holder's process has a poll open whatever it is doing, and its death
/// closes it. Answers no events.
async fn hold(
    entry: &crate::server::state::PairEntry,
    wait: u64,
) -> Result<Json<EventsResponse>, ApiError> {
    let mut rx = entry.events_tx.subscribe();
    let end = Instant::now() + Duration::from_millis(wait);
    loop {
        let last = {
            let p = entry.lock();
            if p.state == PairState::Disconnected {
                return Err(ApiError::disconnected(&entry.name));
            }
            p.events.last_seq()
        };
        match tokio::time::timeout_at(end, rx.changed()).await {
            Ok(Ok(())) => continue,
            _ => {
                return Ok(Json(EventsResponse {
                    events: Vec::new(),
                    last_seq: last,
                }));
            }
        }
    }
}

/// Waits up to `wait` ms for events of `entry` after `after`.
async fn wait_for_events(
    entry: &crate::server::state::PairEntry,
    name: &str,
    after: u64,
    wait: u64,
) -> Result<Json<EventsResponse>, ApiError> {
    let mut rx = entry.events_tx.subscribe();
    let end = Instant::now() + Duration::from_millis(wait);
    loop {
        {
            let p = entry.lock();
            let last = p.events.last_seq();
            if after > last {
                return Err(ApiError::Conflict(format!(
                    "after={after} is beyond the last event of pair `{name}` ({last}); the pair was probably connected again: join it anew"
                )));
            }
            let events = p.events.since(after);
            if !events.is_empty() || p.state == PairState::Disconnected {
                return Ok(Json(EventsResponse {
                    events,
                    last_seq: last,
                }));
            }
        }
        match tokio::time::timeout_at(end, rx.changed()).await {
            Ok(Ok(())) => continue,
            _ => {
                let last = entry.lock().events.last_seq();
                return Ok(Json(EventsResponse {
                    events: Vec::new(),
                    last_seq: last,
                }));
            }
        }
    }
}

/// Query of `GET .../events`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EventsQuery {
    #[serde(default)]
    after: u64,
    timeout_ms: Option<u64>,
    /// Refused: older ranks sent their claim id here; it goes in [`CLAIM_HEADER`] now.
    incarnation: Option<String>,
    /// A presence poll: held for the whole `timeout_ms`, answering no events ([`hold`]).
    #[serde(default)]
    presence: bool,
}

/// Ends a rank's open poll; a poll dropped before it was answered (the rank's connection
/// closed: the process died, or gave up on the poll) no longer vouches for the holder.
struct PollSeen {
    entry: std::sync::Arc<crate::server::state::PairEntry>,
    slot: usize,
    incarnation: String,
    answered: bool,
}

impl Drop for PollSeen {
    fn drop(&mut self) {
        let gone = {
            let mut p = self.entry.lock();
            p.roster
                .end_poll(self.slot, &self.incarnation, self.answered);
            !self.answered && p.roster.is_gone(self.slot)
        };
        if !gone {
            return;
        }
        // acted on from a task of its own: a gateway shutting down drops every poll (its
        // runtime then runs no new task), which says nothing about the ranks
        let (entry, slot, claim) = (self.entry.clone(), self.slot, self.incarnation.clone());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { fail_unfinished_part(&entry, slot, &claim) });
        }
    }
}

/// The holder `claim` of `slot` is gone: a running version it was told to run and has not
/// finished cannot commit on its engine, so it fails now instead of at its deadline (with
/// commit policies `quorum:K` and `available`, only its engine is left out).
fn fail_unfinished_part(entry: &crate::server::state::PairEntry, slot: usize, claim: &str) {
    let mut p = entry.lock();
    if !p.roster.is_gone(slot) {
        return;
    }
    let unfinished = p.updates.latest().is_some_and(|u| {
        u.state == UpdateState::Running
            && u.ranks.get(slot).is_some_and(|r| {
                r.claim.as_deref() == Some(claim)
                    && if u.applying {
                        !entry.slots.is_training(slot) && r.applied.is_none()
                    } else {
                        r.state.is_none()
                    }
            })
    });
    if unfinished {
        let (side, rank) = entry.slots.rank(slot);
        let pid = p
            .roster
            .slots
            .get(slot)
            .and_then(Option::as_ref)
            .and_then(|j| j.pid)
            .map_or("unknown".to_string(), |p| p.to_string());
        let consequence = if entry.request.options.commit.is_all() || side == Side::Training {
            "so this version cannot commit; start the rank again and retry the version"
        } else {
            "so its engine is left out of this version; start the rank again: its engine catches up in the next update"
        };
        let reason = format!(
            "{} is gone without reporting: its event poll's connection closed (the process, pid {pid}, died or was cut off), {consequence}",
            rank_name(side, rank)
        );
        entry.rank_failed(&mut p, slot, reason);
    }
}
