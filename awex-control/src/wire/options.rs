//! Per-pair options (deadlines, buckets, checksums, apply mode, deltas, commit policy).

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
    /// When a version commits across engines (`all`, the default, `quorum:K` or `available`;
    /// docs/gateway.md, "Engines and commit policies"); absent from the JSON when `all`.
    #[serde(skip_serializing_if = "CommitPolicy::is_all")]
    pub commit: CommitPolicy,
    /// Training ranks read every tensor they send for infinity and NaN before an update moves
    /// anything, and fail it naming the tensor and element (one read of each rank's shard per
    /// update; shm and tcp). FP8 pairs check their quantised tensors whatever this says. Off by
    /// default; absent from the JSON when off.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub check_finite: bool,
}

/// When a version commits across a pair's engines (inside one engine: all or nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CommitPolicy {
    /// Every rank of both sides succeeded: one failed engine fails the version for all.
    #[default]
    All,
    /// Every training rank succeeded and at least K engines applied the version; the others
    /// are left out of it (behind).
    Quorum(u32),
    /// Every training rank succeeded and at least one engine applied the version; the others
    /// are left out of it (behind).
    Available,
}

impl CommitPolicy {
    /// Whether this is the default, `all`.
    pub fn is_all(&self) -> bool {
        *self == CommitPolicy::All
    }

    /// How many engines of `engines` must apply a version for it to commit.
    pub fn needs(self, engines: u32) -> u32 {
        match self {
            CommitPolicy::All => engines,
            CommitPolicy::Quorum(k) => k,
            CommitPolicy::Available => 1,
        }
    }

    /// Reads `all`, `available` or `quorum:K` (K a positive integer); the error says what is
    /// wrong and what is accepted.
    pub fn parse(s: &str) -> Result<CommitPolicy, String> {
        match s {
            "all" => Ok(CommitPolicy::All),
            "available" => Ok(CommitPolicy::Available),
            _ => {
                let k = s.strip_prefix("quorum:").ok_or_else(|| {
                    format!(
                        "`{s}` is not a commit policy: use `all`, `available` or `quorum:K` (K engines, at least 1)"
                    )
                })?;
                match k.parse::<u32>() {
                    Ok(k) if k >= 1 => Ok(CommitPolicy::Quorum(k)),
                    _ => Err(format!(
                        "`{s}`: the quorum K in `quorum:K` must be a whole number of engines, at least 1"
                    )),
                }
            }
        }
    }
}

impl std::fmt::Display for CommitPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CommitPolicy::All => f.write_str("all"),
            CommitPolicy::Quorum(k) => write!(f, "quorum:{k}"),
            CommitPolicy::Available => f.write_str("available"),
        }
    }
}

impl std::str::FromStr for CommitPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        CommitPolicy::parse(s)
    }
}

impl Serialize for CommitPolicy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for CommitPolicy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        CommitPolicy::parse(&s).map_err(serde::de::Error::custom)
    }
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
            check_finite: false,
            commit: CommitPolicy::All,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_policies_read_and_write_as_their_wire_names() {
        for (text, policy) in [
            ("all", CommitPolicy::All),
            ("available", CommitPolicy::Available),
            ("quorum:2", CommitPolicy::Quorum(2)),
        ] {
            assert_eq!(CommitPolicy::parse(text), Ok(policy));
            assert_eq!(policy.to_string(), text);
        }
        for bad in ["quorum:0", "quorum:", "quorum:-1", "most", "Quorum:2"] {
            let e = CommitPolicy::parse(bad).expect_err(bad);
            assert!(e.contains(bad), "{e}");
        }
        // `all` is omitted from the JSON, so ranks that predate policies read such pairs
        let json = serde_json::to_value(PairOptions::default()).expect("serialises");
        assert!(json.get("commit").is_none(), "{json}");
        let o: PairOptions =
            serde_json::from_str(r#"{"commit": "quorum:3"}"#).expect("a quorum reads");
        assert_eq!(o.commit, CommitPolicy::Quorum(3));
        let e = serde_json::from_str::<PairOptions>(r#"{"commit": "some"}"#)
            .expect_err("an unknown policy is refused");
        assert!(e.to_string().contains("is not a commit policy"), "{e}");
    }
}
