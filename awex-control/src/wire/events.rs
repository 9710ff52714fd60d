//! Events the ranks long-poll for (`update`, `apply`, `abort`, `disconnect`).

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
}

/// Answer of `GET .../events`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventsResponse {
    /// Every kept event with `seq > after`, oldest first (empty on timeout).
    pub events: Vec<Event>,
    /// Seq of the pair's last event: pass it as `after` next time.
    pub last_seq: u64,
}
