//! Per-pair options (deadlines, buckets, checksums, apply mode, deltas).

use serde::{Deserialize, Serialize};

/// Per-pair options; every field has a default.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PairOptions {
    /// Time from connect until every rank must have joined (1 ms ..= 1 h).
    pub join_deadline_ms: u64,
    /// Time from starting an update until every rank must have reported (1 ms ..= 24 h).
    pub update_deadline_ms: u64,
    /// Staging bucket size in MiB (1 ..= 65536).
    pub bucket_mib: u64,
    /// Staging buckets per rank (1 ..= 64).
    pub buckets: u32,
    /// Whether ranks report checksums and the gateway compares the two sides' sums.
    pub checksums: bool,
    /// How inference ranks write a version into their live tensors (`in_place`, the default,
    /// or `atomic`); absent from the JSON when `in_place`, so ranks and gateways that predate
    /// it still read in-place pairs.
    #[serde(skip_serializing_if = "ApplyMode::is_in_place")]
    pub apply: ApplyMode,
    /// Delta updates: the gateway tells the training ranks, with each update, which version
    /// every inference rank provably holds, and a training rank that kept a copy of what it last
    /// sent moves only the changed elements to those ranks (docs/deltas.md). Off by default;
    /// absent from the JSON when off.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub deltas: bool,
}

/// How an update reaches the inference ranks' live tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApplyMode {
    /// Received bytes land in the live tensors directly: no extra memory, but a failed update
    /// leaves them partly written (the pair's `torn_version`).
    #[default]
    InPlace,
    /// Inference ranks receive into staging buffers (one copy of their shard), verify, and
    /// copy into the live tensors only once every rank of both sides received: the gateway's
    /// `apply` event. A failure before it leaves the live tensors untouched.
    Atomic,
}

impl ApplyMode {
    /// Whether this is the default, `in_place`.
    pub fn is_in_place(&self) -> bool {
        *self == ApplyMode::InPlace
    }

    /// The wire name (`atomic`).
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyMode::InPlace => "in_place",
            ApplyMode::Atomic => "atomic",
        }
    }
}

impl std::fmt::Display for ApplyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Default for PairOptions {
    fn default() -> Self {
        PairOptions {
            join_deadline_ms: 60_000,
            update_deadline_ms: 120_000,
            bucket_mib: 64,
            buckets: 2,
            checksums: false,
            apply: ApplyMode::InPlace,
            deltas: false,
        }
    }
}
