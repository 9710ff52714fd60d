//! Updates: start, per-rank reports, and the update status document.

use awex_core::layout::{RankId, Side};
use serde::{Deserialize, Serialize};

/// `POST /v1/pairs/{name}/updates` body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartUpdate {
    /// The version to install; greater than every earlier one, or equal to a failed one to retry.
    pub version: u64,
}

/// `POST /v1/pairs/{name}/updates/{version}/report` body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// The reporting rank's side.
    pub side: Side,
    /// The reporting rank.
    pub rank: RankId,
    /// Whether the rank finished its part of the update.
    pub ok: bool,
    /// Bytes sent (training) or received (inference).
    #[serde(default)]
    pub bytes: u64,
    /// Wrapping sum of the xxh3 digests of the buckets sent or received (needed with checksums on).
    #[serde(default)]
    pub checksum: Option<u64>,
    /// What went wrong (when `ok` is false); at most 4 KiB.
    #[serde(default)]
    pub error: Option<String>,
    /// The attempt the rank worked on (from its `update` event); a stale attempt is refused.
    #[serde(default)]
    pub attempt: Option<u32>,
    /// The reporting process's claim id (what it joined with as `info.incarnation`): the gateway
    /// refuses a report that does not carry the claim of the slot's holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<String>,
    /// Delta figures of a successful part (pairs with deltas on): what a dense update would have
    /// moved, how many elements it covered and changed, and whether this inference rank now
    /// holds the version's bytes exactly as sent, so the next update may be a delta against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<ReportDelta>,
    /// Training ranks of pairs whose commit policy is `quorum:K` or `available`: engines this
    /// rank could not reach (their ranks died or were cut off while it sent); the rest of its
    /// part succeeded. Those engines are left out of the version (with `all`, the version
    /// fails). Absent when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreached: Vec<u32>,
}

/// A rank's delta figures for one update ([`Report::delta`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportDelta {
    /// Bytes a dense update would have moved (`Report::bytes` is what did move).
    pub dense_bytes: u64,
    /// Elements the update covered.
    pub elements: u64,
    /// Elements whose bytes changed.
    pub changed: u64,
    /// Inference ranks: the tensors now hold the version exactly as sent (a delta against it
    /// applies). An engine that rewrites its weights after loading says false.
    #[serde(default)]
    pub holds: bool,
}

/// State of an update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpdateState {
    /// Started; the inference engines are being paused.
    Pending,
    /// Ranks were told (`update` event) and are moving bytes.
    Running,
    /// Every rank succeeded: the inference side now serves this version.
    Committed,
    /// A rank failed, checksums disagreed, the deadline passed, or the pair was disconnected.
    Failed,
}

impl UpdateState {
    /// Whether the update is over.
    pub fn is_final(self) -> bool {
        matches!(self, UpdateState::Committed | UpdateState::Failed)
    }

    /// The wire name (`committed`).
    pub fn as_str(self) -> &'static str {
        match self {
            UpdateState::Pending => "pending",
            UpdateState::Running => "running",
            UpdateState::Committed => "committed",
            UpdateState::Failed => "failed",
        }
    }
}

/// Where one rank is in an update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RankReportState {
    /// Not reported yet.
    Waiting,
    /// Reported success.
    Ok,
    /// Reported failure.
    Failed,
    /// Did not report before the deadline.
    Missing,
}

impl RankReportState {
    /// The wire name (`missing`).
    pub fn as_str(self) -> &'static str {
        match self {
            RankReportState::Waiting => "waiting",
            RankReportState::Ok => "ok",
            RankReportState::Failed => "failed",
            RankReportState::Missing => "missing",
        }
    }
}

/// One rank's part of an update.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankUpdate {
    /// Side.
    pub side: Side,
    /// Rank.
    pub rank: RankId,
    /// Where it is.
    pub state: RankReportState,
    /// Bytes it reported.
    pub bytes: u64,
    /// Checksum it reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<u64>,
    /// Error it reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Time from the start of the attempt to its report, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reported_after_ms: Option<u64>,
    /// Atomic pairs, inference ranks: whether the rank copied the version from staging into
    /// its live tensors (absent until it reported that second phase).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied: Option<bool>,
}

/// A value per side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SideTotals {
    /// Training side.
    pub training: u64,
    /// Inference side.
    pub inference: u64,
}

/// `GET /v1/pairs/{name}/updates/{version}`: the state of an update.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateStatus {
    /// Pair name.
    pub pair: String,
    /// Version.
    pub version: u64,
    /// Attempt, 1 for the first.
    pub attempt: u32,
    /// State.
    pub state: UpdateState,
    /// Start of this attempt, ms since the Unix epoch.
    pub started_unix_ms: u64,
    /// Time spent pausing the inference engines, ms (when the pair names engine URLs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_ms: Option<u64>,
    /// Time from start to commit or failure (or until now, while it runs), ms.
    pub elapsed_ms: u64,
    /// The deadline of the attempt, ms after its start.
    pub deadline_ms: u64,
    /// Ranks of the pair.
    pub world_size: u32,
    /// Ranks that reported success.
    pub succeeded: u32,
    /// Bytes reported per side.
    pub bytes: SideTotals,
    /// Pairs with deltas on: the figures the ranks reported, per side (bytes a dense update
    /// would have moved, elements covered, elements changed); absent when none reported any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<DeltaTotals>,
    /// Pairs with deltas on: the version this update's deltas were taken against, and the
    /// inference ranks that did not hold it (they got every byte).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<crate::wire::DeltaBase>,
    /// Wrapping sums of the checksums reported per side (with checksums on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksums: Option<SideTotals>,
    /// Per-rank state (see the `ranks` query parameter).
    pub ranks: Vec<RankUpdate>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Errors of `pause_generation` / `continue_generation` calls to the engines.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub engine_errors: Vec<String>,
    /// Atomic pairs: every rank received and the `apply` event went out; the inference ranks
    /// are copying staging into their live tensors (a failure from here on tears them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub applying: bool,
    /// Atomic pairs: inference ranks that reported their live tensors applied.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub applied: u32,
    /// The engines are being resumed after this committed or failed attempt
    /// (`continue_generation`); a wait for the update answers once they were.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resuming: bool,
    /// Pairs whose commit policy is `quorum:K` or `available`: the engines that failed this
    /// attempt and are left out of it, each with why (a committed version is not served by
    /// them: they are behind).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub left_out: Vec<EngineLeftOut>,
}

/// An engine left out of an update ([`UpdateStatus::left_out`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineLeftOut {
    /// The engine index.
    pub engine: u32,
    /// Why: its rank's failure, its rank gone, or the deadline.
    pub error: String,
}

/// Delta figures summed per side ([`UpdateStatus::delta`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaTotals {
    /// Bytes a dense update would have moved.
    pub dense_bytes: SideTotals,
    /// Elements covered.
    pub elements: SideTotals,
    /// Elements whose bytes changed.
    pub changed: SideTotals,
}

impl DeltaTotals {
    /// The fraction of the inference side's elements that changed.
    pub fn density(&self) -> f64 {
        if self.elements.inference == 0 {
            0.0
        } else {
            self.changed.inference as f64 / self.elements.inference as f64
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Report answer: the report was recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportAck {
    /// Version.
    pub version: u64,
    /// Attempt.
    pub attempt: u32,
    /// State of the update after this report.
    pub state: UpdateState,
    /// Ranks that reported success so far.
    pub succeeded: u32,
    /// Ranks of the pair.
    pub world_size: u32,
}
