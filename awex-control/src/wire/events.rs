//! Events the ranks long-poll for (`update`, `apply`, `abort`, `disconnect`, `left_out`).

use awex_core::layout::RankId;
use serde::{Deserialize, Serialize};

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// Start executing `version` (attempt `attempt`).
    Update,
    /// Atomic pairs: every rank of both sides received attempt `attempt` of `version`;
    /// inference ranks copy it from staging into their live tensors and report again.
    Apply,
    /// `version` failed: stop working on it (`reason` says why).
    Abort,
    /// The pair was disconnected: tear down transports and stop polling.
    Disconnect,
    /// Commit policies `quorum:K` and `available`: the `engines` failed attempt `attempt` of
    /// `version` and are left out of it (`reason` says why); training ranks stop sending to
    /// them and no longer wait for them, the version goes on for the others.
    LeftOut,
    /// The `engines` were removed from the pair: their ranks stop (their slots are free), the
    /// other ranks forget them as peers.
    EngineRemoved,
}

/// One event of a pair.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Sequence number, 1, 2, ... per pair.
    pub seq: u64,
    /// What happened.
    pub kind: EventKind,
    /// The update version (`update`, `apply`, `abort`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    /// The attempt of that version, 1 for the first (`update`, `apply`, `abort`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Why (`abort`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Pairs with deltas on (`update`): the version the inference ranks provably hold, which
    /// deltas may be taken against; absent when none does (the update moves every byte).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<DeltaBase>,
    /// The engines left out (`left_out`); the engines removed (`engine_removed`); on `update`,
    /// the engine slots out of the version from its start (free, or waiting for an added
    /// engine's ranks, or whose pause failed): training ranks send them nothing and wait for
    /// none of their ranks; on `apply` (commit policies `quorum:K`, `available`), the engines
    /// left out of the version, whose ranks leave their live tensors as they are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<u32>,
}

/// The version the inference ranks of a pair hold as an update starts: every inference rank
/// holds `version` except those in `except`. A rank holds a version when it reported that it
/// applied it whole and keeps its bytes as received (`Report::holds`), as the same process that
/// holds its slot now; a rank that failed, was torn, restarted or is new holds none.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaBase {
    /// The version.
    pub version: u64,
    /// Inference ranks that do not hold it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub except: Vec<RankId>,
}

/// Answer of `GET .../events`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventsResponse {
    /// Every kept event with `seq > after`, oldest first (empty on timeout).
    pub events: Vec<Event>,
    /// Seq of the pair's last event: pass it as `after` next time.
    pub last_seq: u64,
}
