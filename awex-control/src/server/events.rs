//! Events: `GET /v1/pairs/{name}/events?after=N&timeout_ms=T`, the per-pair sequence ranks
//! long-poll to learn of work (`update`), of failures (`abort`) and of the end (`disconnect`).
//! It answers every event with `seq > N`, or an empty list after `T`; it never hangs a rank.

use super::error::ApiError;
use super::extract::{PathParams, QueryParams, wait_ms};
use super::{AppState, EVENTS_KEPT};
use crate::wire::{Event, EventKind, EventsResponse, PairState};
use axum::Json;
use axum::extract::State;
use serde::Deserialize;
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;

/// Query of `GET .../events`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EventsQuery {
    #[serde(default)]
    after: u64,
    timeout_ms: Option<u64>,
}

/// The last [`EVENTS_KEPT`] events of a pair.
#[derive(Default)]
pub(crate) struct EventLog {
    events: VecDeque<Event>,
    last: u64,
}

impl EventLog {
    /// Appends an event; returns its seq.
    pub(crate) fn push(
        &mut self,
        kind: EventKind,
        version: Option<u64>,
        attempt: Option<u32>,
        reason: Option<String>,
    ) -> u64 {
        self.last += 1;
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(Event {
            seq: self.last,
            kind,
            version,
            attempt,
            reason,
        });
        self.last
    }

    /// Seq of the last event (0 before any).
    pub(crate) fn last_seq(&self) -> u64 {
        self.last
    }

    /// Kept events with `seq > after`.
    pub(crate) fn since(&self, after: u64) -> Vec<Event> {
        let skip = self.events.partition_point(|e| e.seq <= after);
        self.events.iter().skip(skip).cloned().collect()
    }
}

/// `GET /v1/pairs/{name}/events`.
pub(crate) async fn poll(
    State(gw): State<AppState>,
    PathParams(name): PathParams<String>,
    QueryParams(q): QueryParams<EventsQuery>,
) -> Result<Json<EventsResponse>, ApiError> {
    let wait = wait_ms(q.timeout_ms)?;
    let entry = gw.pair(&name)?;
    let mut rx = entry.events_tx.subscribe();
    let end = Instant::now() + Duration::from_millis(wait);
    loop {
        {
            let p = entry.lock();
            let last = p.events.last_seq();
            if q.after > last {
                return Err(ApiError::Conflict(format!(
                    "after={} is beyond the last event of pair `{name}` ({last}); the pair was probably connected again: join it anew",
                    q.after
                )));
            }
            let events = p.events.since(q.after);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_keeps_the_latest_events_and_answers_after_a_seq() {
        let mut log = EventLog::default();
        for v in 0..(EVENTS_KEPT as u64 + 10) {
            log.push(EventKind::Update, Some(v), Some(1), None);
        }
        assert_eq!(log.last_seq(), EVENTS_KEPT as u64 + 10);
        let tail = log.since(EVENTS_KEPT as u64 + 8);
        assert_eq!(
            tail.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![EVENTS_KEPT as u64 + 9, EVENTS_KEPT as u64 + 10]
        );
        assert_eq!(log.since(0).len(), EVENTS_KEPT);
        assert_eq!(log.since(0)[0].seq, 11);
        assert!(log.since(log.last_seq()).is_empty());
    }
}
