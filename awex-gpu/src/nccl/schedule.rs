//! The order of NCCL operations: which buckets go in which `ncclGroupStart..End` group.
//!
//! Each peer pair's transfers are cut into buckets ([`make_buckets`]) of a size both ends
//! compute alike ([`pair_bucket_bytes`]), so both ends hold the same bucket list for the pair.
//! Step `k` of a rank is one group holding bucket `k` of every peer that has one: sends on a
//! training rank, receives on an inference rank. Bucket `k` of a pair is in step `k` on both
//! ends, which is what makes the schedule deadlock-free:
//!
//! - per pair, both ends issue the pair's operations in the same order (bucket 0, 1, 2, ...),
//!   with equal byte counts, so NCCL matches each send with its receive;
//! - by induction on `k`: once every group of steps `< k` has completed everywhere, every rank
//!   with work in step `k` is at step `k`, and each of its operations is at the head of its
//!   pair's queue on both ends (the pair's earlier operations are in earlier steps); a group's
//!   operations to different peers progress independently, so every step-`k` group completes.
//!
//! A rank holds at most two steps' staging at once (double buffering). A pair's bucket is the
//! rank's budget divided by its peer count, but not below [`PAIR_BUCKET_FLOOR`] when the budget
//! is at least that, on both ends; one step's buckets together stay within the larger of the
//! budget and the floor times the peer count (a single row larger than a bucket travels alone). The floor
//! keeps a rank with hundreds of peers from cutting its pairs into buckets of a few hundred KB,
//! whose per-step latency would dominate (`docs/simulate.md`: the 1T case's inference ranks
//! have 376-406 peers).

use super::NcclError;
use awex_core::layout::{RankId, Side};
use awex_core::plan::RankPlan;
use awex_core::plan::bucket::{Bucket, make_buckets};

/// The smallest pair bucket a budget of at least this size is split into
/// ([`pair_bucket_bytes`]; a smaller budget is split as it is): 4 MiB, with which the simulated 1T update over 376-406 peers per
/// inference rank comes within 1.10 x its bound (`docs/simulate.md`); pairs of up to 16 peers
/// under the default 64 MiB budget are not affected.
pub const PAIR_BUCKET_FLOOR: u64 = 4 << 20;

/// Wire bytes of a bucket of the pair `(a, b)`: each end's budget split over its peers, but at
/// least [`PAIR_BUCKET_FLOOR`] when the budget is at least that; the smaller of the two ends, at
/// least 1. Symmetric, so both ends cut the pair alike.
pub fn pair_bucket_bytes(budget_a: u64, peers_a: usize, budget_b: u64, peers_b: usize) -> u64 {
    let share = |budget: u64, peers: usize| {
        let split = budget / (peers.max(1) as u64);
        if budget >= PAIR_BUCKET_FLOOR {
            split.max(PAIR_BUCKET_FLOOR)
        } else {
            split
        }
    };
    share(budget_a, peers_a)
        .min(share(budget_b, peers_b))
        .max(1)
}

/// Each peer's buckets, with `pair_bytes(peer)` the pair's bucket size.
pub fn peer_buckets(
    plan: &RankPlan,
    mut pair_bytes: impl FnMut(RankId) -> u64,
) -> Vec<Vec<Bucket>> {
    plan.peers
        .iter()
        .map(|p| make_buckets(&p.transfers, pair_bytes(p.peer)))
        .collect()
}

/// Whether a rank sends or receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `ncclSend` (training ranks).
    Send,
    /// `ncclRecv` (inference ranks).
    Recv,
}

impl OpKind {
    /// What a rank of `side` does.
    pub fn of(side: Side) -> OpKind {
        match side {
            Side::Training => OpKind::Send,
            Side::Inference => OpKind::Recv,
        }
    }
}

/// One NCCL operation: one bucket to or from one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Op {
    /// Send or receive.
    pub kind: OpKind,
    /// The peer.
    pub peer: RankId,
    /// Index of the peer in the rank's plan.
    pub peer_index: usize,
    /// Index of the bucket in the pair's bucket list.
    pub bucket: usize,
    /// Wire bytes.
    pub bytes: u64,
}

/// One `ncclGroupStart..End` group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The step's number: the bucket index of every op in it.
    pub index: usize,
    /// The ops, in peer order.
    pub ops: Vec<Op>,
}

impl Step {
    /// Wire bytes of the whole step.
    pub fn bytes(&self) -> u64 {
        self.ops.iter().map(|o| o.bytes).sum()
    }
}

/// The rank's groups, in the order it issues them; `buckets[i]` are the buckets of the plan's
/// peer `i`.
pub fn schedule(plan: &RankPlan, buckets: &[Vec<Bucket>]) -> Result<Vec<Step>, NcclError> {
    if buckets.len() != plan.peers.len() {
        return Err(NcclError::Plan(format!(
            "{} rank {} has {} peers but {} bucket lists were given",
            plan.side,
            plan.rank,
            plan.peers.len(),
            buckets.len()
        )));
    }
    let kind = OpKind::of(plan.side);
    let steps = buckets.iter().map(Vec::len).max().unwrap_or(0);
    Ok((0..steps)
        .map(|k| Step {
            index: k,
            ops: plan
                .peers
                .iter()
                .zip(buckets)
                .enumerate()
                .filter_map(|(i, (p, bs))| {
                    bs.get(k).map(|b| Op {
                        kind,
                        peer: p.peer,
                        peer_index: i,
                        bucket: k,
                        bytes: b.bytes,
                    })
                })
                .collect(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_bucket_size_is_the_smaller_share_and_symmetric() {
        // 64 MiB over 4 peers on one end, 64 MiB over 1 peer on the other
        assert_eq!(pair_bucket_bytes(64 << 20, 4, 64 << 20, 1), 16 << 20);
        assert_eq!(pair_bucket_bytes(64 << 20, 1, 64 << 20, 4), 16 << 20);
        assert_eq!(pair_bucket_bytes(100, 3, 1000, 2), 33);
        assert_eq!(pair_bucket_bytes(1, 8, 1, 8), 1);
        assert_eq!(pair_bucket_bytes(10, 0, 10, 0), 10);
    }

    #[test]
    fn many_peers_split_a_budget_down_to_the_floor_only() {
        // 64 MiB over 400 peers would be 167,772 bytes; the floor keeps 4 MiB
        assert_eq!(
            pair_bucket_bytes(64 << 20, 400, 64 << 20, 2),
            PAIR_BUCKET_FLOOR
        );
        // up to 16 peers a 64 MiB budget is split as before
        assert_eq!(pair_bucket_bytes(64 << 20, 16, 64 << 20, 1), 4 << 20);
        assert_eq!(pair_bucket_bytes(64 << 20, 8, 64 << 20, 1), 8 << 20);
        // a budget below the floor is split as it is: it bounds the rank's staging
        assert_eq!(
            pair_bucket_bytes(1 << 20, 400, 64 << 20, 1),
            (1 << 20) / 400
        );
        // a larger budget still grows the bucket
        assert_eq!(pair_bucket_bytes(1 << 30, 64, 1 << 30, 64), 16 << 20);
    }
}
