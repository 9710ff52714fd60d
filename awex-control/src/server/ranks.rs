//! Ranks: `POST /v1/pairs/{name}/ranks`, a rank joins with its rendezvous info and long-polls
//! until every rank of both sides joined (200 with the roster), its poll window ends (202, join
//! again: a re-join replaces the rank's own entry), or the join deadline passes (408).

use super::error::ApiError;
use super::extract::{JsonBody, PathParams, QueryParams, wait_ms};
use super::pairs::PairEntry;
use super::{AppState, MAX_INFO_BYTES, MAX_ROSTER_INFO_BYTES, unix_ms, validate};
use crate::wire::{JoinPending, JoinRequest, JoinResponse, PairState, RosterEntry, RosterRank};
use awex_core::layout::{RankId, Side};
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::Value;
use std::time::Duration;
use tokio::time::Instant;

/// Query of a join: how long this request may wait.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct JoinQuery {
    timeout_ms: Option<u64>,
}

/// The rank slots of a pair: training ranks first, then each engine's ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slots {
    train: u32,
    engines: u32,
    per_engine: u32,
}

/// How a rank is named in messages (`training rank 3`, `inference rank 1/0`).
pub(crate) fn rank_name(side: Side, rank: RankId) -> String {
    match side {
        Side::Training => format!("training rank {}", rank.rank),
        Side::Inference => format!("inference rank {}/{}", rank.engine, rank.rank),
    }
}

impl Slots {
    /// Slots for `train` training ranks and `engines` engines of `per_engine` ranks.
    pub(crate) fn new(train: u32, engines: u32, per_engine: u32) -> Self {
        Slots {
            train,
            engines,
            per_engine,
        }
    }

    /// Ranks of both sides.
    pub(crate) fn total(&self) -> usize {
        self.train as usize + self.engines as usize * self.per_engine as usize
    }

    /// The slot of a rank, or 422 naming the valid range.
    pub(crate) fn index(&self, side: Side, rank: RankId) -> Result<usize, ApiError> {
        match side {
            Side::Training if rank.engine == 0 && rank.rank < self.train => Ok(rank.rank as usize),
            Side::Training => Err(ApiError::Unprocessable(format!(
                "training rank {{engine: {}, rank: {}}} is not in this pair: training ranks are {{engine: 0, rank: 0..{}}}",
                rank.engine, rank.rank, self.train
            ))),
            Side::Inference if rank.engine < self.engines && rank.rank < self.per_engine => {
                Ok(self.train as usize
                    + rank.engine as usize * self.per_engine as usize
                    + rank.rank as usize)
            }
            Side::Inference => Err(ApiError::Unprocessable(format!(
                "inference rank {{engine: {}, rank: {}}} is not in this pair: engines 0..{}, ranks 0..{} per engine",
                rank.engine, rank.rank, self.engines, self.per_engine
            ))),
        }
    }

    /// The rank in a slot.
    pub(crate) fn rank(&self, i: usize) -> (Side, RankId) {
        let i = i as u32;
        if i < self.train {
            (Side::Training, RankId::train(i))
        } else {
            let j = i - self.train;
            let per = self.per_engine.max(1);
            (Side::Inference, RankId::infer(j / per, j % per))
        }
    }

    /// Whether a slot is on the training side.
    pub(crate) fn is_training(&self, i: usize) -> bool {
        i < self.train as usize
    }
}

/// Lists at most 16 ranks by name, then how many more.
pub(crate) fn list_ranks(slots: &Slots, idx: impl Iterator<Item = usize>) -> String {
    let all: Vec<usize> = idx.collect();
    let mut s: Vec<String> = all
        .iter()
        .take(16)
        .map(|&i| {
            let (side, rank) = slots.rank(i);
            rank_name(side, rank)
        })
        .collect();
    if all.len() > 16 {
        s.push(format!("and {} more", all.len() - 16));
    }
    s.join(", ")
}

struct Joined {
    info: Value,
    info_bytes: usize,
    unix_ms: u64,
}

/// Who joined, with their rendezvous info, and the serialised roster once complete.
pub(crate) struct Roster {
    slots: Vec<Option<Joined>>,
    joined: usize,
    info_bytes: usize,
    cached: Option<Bytes>,
}

impl Roster {
    /// An empty roster of `n` slots.
    pub(crate) fn new(n: usize) -> Self {
        Roster {
            slots: (0..n).map(|_| None).collect(),
            joined: 0,
            info_bytes: 0,
            cached: None,
        }
    }

    /// Ranks joined.
    pub(crate) fn joined(&self) -> usize {
        self.joined
    }

    /// Ranks joined per side.
    pub(crate) fn joined_per_side(&self, slots: &Slots) -> (u32, u32) {
        let t = self.slots[..slots.train as usize]
            .iter()
            .filter(|s| s.is_some())
            .count();
        (t as u32, (self.joined - t) as u32)
    }

    /// Forgets the serialised roster (a rank re-joined or a rendezvous value changed).
    pub(crate) fn invalidate(&mut self) {
        self.cached = None;
    }

    /// The missing ranks, for messages.
    pub(crate) fn describe_missing(&self, slots: &Slots) -> String {
        list_ranks(
            slots,
            self.slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.is_none())
                .map(|(i, _)| i),
        )
    }

    /// Joined ranks, for status.
    pub(crate) fn ranks(&self, slots: &Slots) -> Vec<RosterRank> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref().map(|j| {
                    let (side, rank) = slots.rank(i);
                    RosterRank {
                        side,
                        rank,
                        joined_unix_ms: j.unix_ms,
                    }
                })
            })
            .collect()
    }

    /// Records (or replaces) a rank's entry.
    fn put(&mut self, i: usize, info: Value, info_bytes: usize) -> Result<(), ApiError> {
        let old = self.slots[i].as_ref().map_or(0, |j| j.info_bytes);
        let total = self.info_bytes - old + info_bytes;
        if total > MAX_ROSTER_INFO_BYTES {
            return Err(ApiError::TooLarge(format!(
                "the ranks' info of this pair would total {total} bytes; at most {MAX_ROSTER_INFO_BYTES} are accepted"
            )));
        }
        if self.slots[i].is_none() {
            self.joined += 1;
        }
        self.info_bytes = total;
        self.slots[i] = Some(Joined {
            info,
            info_bytes,
            unix_ms: unix_ms(),
        });
        self.cached = None;
        Ok(())
    }
}

fn roster_bytes(entry: &PairEntry, p: &mut super::pairs::Pair) -> Bytes {
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
                        info: j.info.clone(),
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

fn join_failed(entry: &PairEntry, p: &super::pairs::Pair, status: StatusCode) -> ApiError {
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
    let info_bytes = validate::json_size(&req.info);
    if info_bytes > MAX_INFO_BYTES {
        return Err(ApiError::TooLarge(format!(
            "{} sent {info_bytes} bytes of info; at most {MAX_INFO_BYTES} are accepted",
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
        p.roster.put(slot, req.info, info_bytes)?;
        if p.state == PairState::Joining && p.roster.joined() == entry.slots.total() {
            p.state = PairState::Ready;
            drop(p);
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
                    deadline_in_ms: super::ms(entry.join_deadline - now),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_number_training_then_engines_and_reject_outsiders() {
        let s = Slots::new(2, 2, 3);
        assert_eq!(s.total(), 8);
        assert_eq!(s.index(Side::Training, RankId::train(1)).unwrap(), 1);
        assert_eq!(s.index(Side::Inference, RankId::infer(1, 2)).unwrap(), 7);
        assert_eq!(s.rank(7), (Side::Inference, RankId::infer(1, 2)));
        assert_eq!(s.rank(1), (Side::Training, RankId::train(1)));
        assert_eq!(
            s.index(Side::Training, RankId::infer(1, 0))
                .unwrap_err()
                .to_string(),
            "training rank {engine: 1, rank: 0} is not in this pair: training ranks are {engine: 0, rank: 0..2}"
        );
        assert_eq!(
            s.index(Side::Inference, RankId::infer(2, 0))
                .unwrap_err()
                .to_string(),
            "inference rank {engine: 2, rank: 0} is not in this pair: engines 0..2, ranks 0..3 per engine"
        );
    }

    #[test]
    fn missing_ranks_are_listed_up_to_sixteen() {
        let s = Slots::new(20, 1, 1);
        let r = Roster::new(s.total());
        let text = r.describe_missing(&s);
        assert!(text.starts_with("training rank 0, training rank 1, "));
        assert!(text.ends_with("training rank 15, and 5 more"));
    }
}
