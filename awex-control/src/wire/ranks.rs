//! Ranks joining a pair: the join request, the roster and the join answer.

use super::options::PairOptions;
use awex_core::Transport;
use awex_core::layout::{RankId, Side};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// `POST /v1/pairs/{name}/ranks` body.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinRequest {
    /// The rank's side.
    pub side: Side,
    /// The rank: `{engine: 0, rank: r}` in training, `{engine: e, rank: r}` in inference.
    pub rank: RankId,
    /// Rendezvous info the other ranks need (address, port, device, ...); at most 64 KiB of JSON.
    #[serde(default)]
    pub info: Value,
    /// What this rank supports beyond the base protocol (e.g. [`CAP_ATOMIC_APPLY`]); a pair
    /// that needs a capability refuses ranks that do not list it. Sent only when not empty, so
    /// gateways that predate the field accept ranks of in-place pairs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
}

/// The capability of a rank that takes part in atomic apply (`options.apply = "atomic"`):
/// it receives into staging, waits for the `apply` event and reports again once applied.
pub const CAP_ATOMIC_APPLY: &str = "apply.atomic";

/// The header in which a rank names its claim id (`info.incarnation`) when it polls for
/// events: never in the URL, which proxies log and retry lines print.
pub const CLAIM_HEADER: &str = "awex-claim";

/// `POST /v1/pairs/{name}/ranks/release` body: the operator says the holder of this slot is
/// gone, so that the next process that joins it takes it over.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseSlot {
    /// The slot's side.
    pub side: Side,
    /// The slot's rank.
    pub rank: RankId,
}

/// 200 answer of a release.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotReleased {
    /// The slot's side.
    pub side: Side,
    /// The slot's rank.
    pub rank: RankId,
    /// The pid of the process that held it (as it said when it joined), if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_pid: Option<u64>,
}

/// One rank of the roster, with its rendezvous info.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RosterEntry {
    /// Side.
    pub side: Side,
    /// Rank.
    pub rank: RankId,
    /// What the rank sent when it joined.
    pub info: Value,
}

/// A joined rank as status lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RosterRank {
    /// Side.
    pub side: Side,
    /// Rank.
    pub rank: RankId,
    /// When it (last) joined, ms since the Unix epoch.
    pub joined_unix_ms: u64,
}

/// 200 answer of a join: every rank joined.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JoinResponse {
    /// Pair name.
    pub pair: String,
    /// Pair incarnation id.
    pub id: u64,
    /// Every rank, training first (by rank), then inference (by engine, rank).
    pub roster: Vec<RosterEntry>,
    /// Rendezvous values set so far.
    pub kv: BTreeMap<String, Value>,
    /// Training ranks.
    pub training_world_size: u32,
    /// Inference ranks, all engines.
    pub inference_world_size: u32,
    /// Inference engines.
    pub engines: u32,
    /// Transport.
    pub transport: Transport,
    /// Options.
    pub options: PairOptions,
    /// Seq of the last event: poll `events?after=` this for work.
    pub last_event_seq: u64,
    /// Unique id of this connect of the pair (random; also in status): names its shared-memory
    /// segments, so that no two connects, gateways or hosts collide.
    #[serde(default)]
    pub uid: String,
    /// The pair's data-plane secret (32 random bytes, hex), issued at connect; peers prove they
    /// hold it before any byte moves. Only in this answer, never in status, metrics or logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<PairSecretHex>,
}

/// A pair secret in hex; its `Debug` prints no byte of it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PairSecretHex(pub String);

impl std::fmt::Debug for PairSecretHex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PairSecretHex(<redacted>)")
    }
}

/// 202 answer of a join: the poll window ended before every rank joined; join again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinPending {
    /// Ranks joined so far.
    pub joined: u32,
    /// Ranks of the pair.
    pub world_size: u32,
    /// Time left until the join deadline, ms.
    pub deadline_in_ms: u64,
}
