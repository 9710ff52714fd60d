//! The gateway's wire protocol: the JSON bodies of every route, shared by the server, the
//! typed client and the ranks, and the protocol's limits. Pure data (serde), no HTTP.

mod events;
mod kv;
mod options;
mod pairs;
mod ranks;
mod updates;

pub use events::{DeltaBase, Event, EventKind, EventsResponse};
pub use kv::{KvEntry, KvPut, model_key};
pub use options::{ApplyMode, CommitPolicy, PairOptions};
pub use pairs::{
    AddEngine, ConnectRequest, EngineChanged, EngineState, EngineStatus, InferenceSpec, PairState,
    PairStatus, Resume, SideStatus, TrainingSpec, Transport,
};
pub use ranks::{
    CAP_ATOMIC_APPLY, CLAIM_HEADER, JoinPending, JoinRequest, JoinResponse, PairSecretHex,
    ReleaseSlot, RosterEntry, RosterRank, SlotReleased,
};
pub use updates::{
    DeltaTotals, EngineLeftOut, RankReportState, RankUpdate, Report, ReportAck, ReportDelta,
    SideTotals, StartUpdate, UpdateState, UpdateStatus,
};

use std::time::Duration;

/// Most ranks one pair may have, both sides together.
pub const MAX_RANKS: u32 = 65_536;
/// Largest rendezvous `info` of one rank, serialised JSON bytes.
pub const MAX_INFO_BYTES: usize = 64 * 1024;
/// Largest total of all ranks' `info` in one pair, serialised JSON bytes.
pub const MAX_ROSTER_INFO_BYTES: usize = 64 * 1024 * 1024;
/// Most rendezvous keys one pair may hold.
pub const MAX_KV_KEYS: usize = 1024;
/// Largest rendezvous value, serialised JSON bytes.
pub const MAX_KV_VALUE_BYTES: usize = 64 * 1024;
/// Longest a long-poll (`timeout_ms`) may wait, in milliseconds.
pub const MAX_WAIT_MS: u64 = 60_000;
/// How long a long-poll waits when the request names no `timeout_ms`.
pub const DEFAULT_WAIT_MS: u64 = 30_000;
/// Longest error text a rank may report, in bytes.
pub const MAX_ERROR_BYTES: usize = 4096;
/// Events kept per pair; older ones are dropped (ranks only act on the latest).
pub const EVENTS_KEPT: usize = 1024;
/// Update versions whose status a pair keeps.
pub const UPDATES_KEPT: usize = 64;

/// Milliseconds of a duration, saturating.
pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
