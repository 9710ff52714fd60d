//! Per-pair options (deadlines, buckets, checksums).

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
}

impl Default for PairOptions {
    fn default() -> Self {
        PairOptions {
            join_deadline_ms: 60_000,
            update_deadline_ms: 120_000,
            bucket_mib: 64,
            buckets: 2,
            checksums: false,
        }
    }
}
