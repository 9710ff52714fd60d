//! Detecting PyTorch FSDP: Accelerate's FSDP environment, torchrun's world, and torch
//! distributed checkpoints (`.metadata` plus `__{rank}_{n}.distcp` files).

use awex_core::backend::{Detection, ParallelConfig, Probe};
use std::collections::BTreeSet;
use std::path::Path;

/// Weight of `ACCELERATE_USE_FSDP` set to a true value.
const ACCELERATE_WEIGHT: f64 = 0.5;
/// Weight of an `FSDP_SHARDING_STRATEGY` variable.
const STRATEGY_WEIGHT: f64 = 0.3;
/// Weight of `FSDP_VERSION` (Accelerate's FSDP1 / FSDP2 switch).
const VERSION_WEIGHT: f64 = 0.1;
/// Weight of a torch distributed checkpoint directory.
const CHECKPOINT_WEIGHT: f64 = 0.4;
/// Weight of each of torchrun's `WORLD_SIZE` / `LOCAL_WORLD_SIZE` (any torch.distributed job sets them).
const TORCHRUN_WEIGHT: f64 = 0.05;
/// Weight of an importable `torch`, counted only next to other signs.
const TORCH_WEIGHT: f64 = 0.05;

/// FSDP's sharding strategies, as `FSDP_SHARDING_STRATEGY` spells them (by name or 1-based number).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardingStrategy {
    /// Parameters sharded over every rank.
    FullShard,
    /// Parameters sharded at rest, gathered between forward and backward (ZeRO-2).
    ShardGradOp,
    /// Every rank holds all parameters (DDP-like).
    NoShard,
    /// Sharded within a node, replicated across nodes (HSDP).
    HybridShard,
    /// HSDP with ZeRO-2 inside the node.
    HybridShardZero2,
}

impl ShardingStrategy {
    /// Parses `FULL_SHARD` (any case) or Accelerate's numeric form `1`..`5`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim().to_ascii_uppercase().as_str() {
            "1" | "FULL_SHARD" => ShardingStrategy::FullShard,
            "2" | "SHARD_GRAD_OP" => ShardingStrategy::ShardGradOp,
            "3" | "NO_SHARD" => ShardingStrategy::NoShard,
            "4" | "HYBRID_SHARD" => ShardingStrategy::HybridShard,
            "5" | "_HYBRID_SHARD_ZERO2" | "HYBRID_SHARD_ZERO2" => {
                ShardingStrategy::HybridShardZero2
            }
            _ => return None,
        })
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            ShardingStrategy::FullShard => "FULL_SHARD",
            ShardingStrategy::ShardGradOp => "SHARD_GRAD_OP",
            ShardingStrategy::NoShard => "NO_SHARD",
            ShardingStrategy::HybridShard => "HYBRID_SHARD",
            ShardingStrategy::HybridShardZero2 => "HYBRID_SHARD_ZERO2",
        }
    }

    /// `(dp, replicate)` for a world of `world` ranks with `local` ranks per node.
    fn mesh(self, world: u64, local: Option<u64>) -> (u64, u64) {
        match self {
            ShardingStrategy::NoShard => (1, world),
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => match local {
                Some(l) if l > 0 && world % l == 0 => (l, world / l),
                _ => (world, 1),
            },
            ShardingStrategy::FullShard | ShardingStrategy::ShardGradOp => (world, 1),
        }
    }
}

/// What a torch distributed checkpoint directory holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistCheckpoint {
    /// Number of `.distcp` data files.
    pub files: usize,
    /// Number of distinct writer ranks in the file names.
    pub ranks: usize,
}

/// Inspects `dir` for a torch distributed checkpoint; `Err` says what is missing.
pub fn inspect_checkpoint(dir: &Path) -> Result<DistCheckpoint, String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut has_metadata = false;
    let mut files = 0;
    let mut ranks = BTreeSet::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name == ".metadata" {
            has_metadata = entry.file_type().is_ok_and(|t| t.is_file());
        } else if let Some(rank) = distcp_rank(name) {
            files += 1;
            ranks.insert(rank);
        }
    }
    match (has_metadata, files) {
        (true, n) if n > 0 => Ok(DistCheckpoint {
            files,
            ranks: ranks.len(),
        }),
        (false, 0) => {
            Err("it has neither a `.metadata` file nor `__<rank>_<n>.distcp` files".into())
        }
        (false, _) => Err(format!(
            "it has {files} `.distcp` files but no `.metadata` file"
        )),
        (true, _) => Err("it has a `.metadata` file but no `__<rank>_<n>.distcp` files".into()),
    }
}

/// The writer rank of a `__{rank}_{n}.distcp` file name.
fn distcp_rank(name: &str) -> Option<u64> {
    let stem = name.strip_prefix("__")?.strip_suffix(".distcp")?;
    let (rank, n) = stem.split_once('_')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(rank) || !digits(n) {
        return None;
    }
    rank.parse().ok()
}

fn truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

fn positive(probe: &Probe, key: &str) -> Option<u64> {
    probe.env(key)?.trim().parse().ok().filter(|&n| n > 0)
}

/// Looks for FSDP in the environment and the checkpoint directory.
pub fn detect(probe: &Probe) -> Detection {
    let mut d = Detection::default();
    let mut fsdp_signs = false;
    let mut strategy = None;
    if probe.env("ACCELERATE_USE_FSDP").is_none() {
        d.absent("ACCELERATE_USE_FSDP (Accelerate running FSDP): unset");
    }
    if probe.env("FSDP_SHARDING_STRATEGY").is_none() {
        d.absent("FSDP_SHARDING_STRATEGY: unset");
    }
    if probe.env("FSDP_VERSION").is_none() {
        d.absent("FSDP_VERSION: unset");
    }
    if probe.checkpoint.is_none() {
        d.absent(
            "a torch distributed checkpoint (`.metadata` and `*.distcp` files): no --checkpoint given",
        );
    }
    if let Some(v) = probe.env("ACCELERATE_USE_FSDP") {
        if truthy(v) {
            d.add(
                ACCELERATE_WEIGHT,
                format!("ACCELERATE_USE_FSDP={v}: Accelerate runs FSDP"),
            );
            fsdp_signs = true;
        } else {
            d.evidence.push(format!(
                "ACCELERATE_USE_FSDP={v}: Accelerate does not run FSDP"
            ));
        }
    }
    if let Some(v) = probe.env("FSDP_SHARDING_STRATEGY") {
        fsdp_signs = true;
        match ShardingStrategy::parse(v) {
            Some(s) => {
                strategy = Some(s);
                d.add(STRATEGY_WEIGHT, format!("FSDP_SHARDING_STRATEGY={v} ({})", s.name()));
            }
            None => d.add(
                STRATEGY_WEIGHT,
                format!("FSDP_SHARDING_STRATEGY={v} is set (not a strategy awex knows; assuming FULL_SHARD)"),
            ),
        }
    }
    if let Some(v) = probe.env("FSDP_VERSION") {
        fsdp_signs = true;
        d.add(VERSION_WEIGHT, format!("FSDP_VERSION={v}"));
    }
    if let Some(dir) = &probe.checkpoint {
        match inspect_checkpoint(dir) {
            Ok(c) => {
                fsdp_signs = true;
                d.add(
                    CHECKPOINT_WEIGHT,
                    format!(
                        "{} is a torch distributed checkpoint: `.metadata` and {} `.distcp` files written by {} ranks",
                        dir.display(),
                        c.files,
                        c.ranks
                    ),
                );
            }
            Err(why) => d.evidence.push(format!(
                "{} is not a torch distributed checkpoint: {why}",
                dir.display()
            )),
        }
    }
    let world = positive(probe, "WORLD_SIZE");
    let local = positive(probe, "LOCAL_WORLD_SIZE");
    if let Some(w) = world {
        d.add(
            TORCHRUN_WEIGHT,
            format!("WORLD_SIZE={w} (torchrun; weak: any torch.distributed job sets it)"),
        );
    }
    if let Some(l) = local {
        d.add(
            TORCHRUN_WEIGHT,
            format!("LOCAL_WORLD_SIZE={l} (torchrun; weak: any torch.distributed job sets it)"),
        );
    }
    if world.is_none() {
        d.absent("WORLD_SIZE (torchrun): unset or not a positive number");
    }
    if !probe.has_package("torch") {
        d.absent_package(probe, "torch");
    }
    if probe.has_package("torch") {
        if fsdp_signs || world.is_some() || local.is_some() {
            d.add(TORCH_WEIGHT, "python package `torch` is importable");
        } else {
            d.evidence.push(
                "python package `torch` is importable (no weight alone: every PyTorch job has it)"
                    .into(),
            );
        }
    }
    if let (true, Some(w)) = (fsdp_signs, world) {
        let s = strategy.unwrap_or(ShardingStrategy::FullShard);
        let (dp, replicate) = s.mesh(w, local);
        d.parallel = Some(ParallelConfig::from_pairs([
            ("dp", dp),
            ("replicate", replicate),
            ("tp", 1),
        ]));
        d.evidence.push(format!(
            "{} over WORLD_SIZE={w}: dp={dp}, replicate={replicate}, tp=1 (tensor parallelism is not visible in the environment)",
            s.name()
        ));
    }
    d
}
