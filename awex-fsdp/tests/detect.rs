//! Detection from Accelerate / torchrun environment variables and torch distributed checkpoints.

use awex_core::backend::Backend;
use awex_core::backend::{ParallelConfig, Probe};
use awex_fsdp::FsdpBackend;
use awex_fsdp::detect::{DistCheckpoint, ShardingStrategy, inspect_checkpoint};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn probe(env: &[(&str, &str)], torch: bool, checkpoint: Option<PathBuf>) -> Probe {
    Probe {
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        python_packages: if torch {
            BTreeMap::from([("torch".to_string(), true)])
        } else {
            BTreeMap::new()
        },
        checkpoint,
        ..Probe::default()
    }
}

fn mesh(dp: u64, replicate: u64) -> Option<ParallelConfig> {
    Some(ParallelConfig::from_pairs([
        ("dp", dp),
        ("replicate", replicate),
        ("tp", 1),
    ]))
}

/// A directory laid out like `torch.distributed.checkpoint.save` output from `ranks` ranks.
fn dcp_dir(ranks: u32, metadata: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    if metadata {
        std::fs::write(dir.path().join(".metadata"), b"\x80\x04metadata").expect("write");
    }
    for r in 0..ranks {
        std::fs::write(dir.path().join(format!("__{r}_0.distcp")), b"shard").expect("write");
    }
    std::fs::write(dir.path().join("notes.txt"), b"not a shard").expect("write");
    dir
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn distributed_checkpoint_is_recognised_by_metadata_and_distcp_files() {
    let dir = dcp_dir(4, true);
    std::fs::write(dir.path().join("__1_1.distcp"), b"second file of rank 1").expect("write");
    assert_eq!(
        inspect_checkpoint(dir.path()),
        Ok(DistCheckpoint { files: 5, ranks: 4 })
    );
    assert_eq!(
        inspect_checkpoint(dcp_dir(2, false).path()),
        Err("it has 2 `.distcp` files but no `.metadata` file".into())
    );
    assert_eq!(
        inspect_checkpoint(dcp_dir(0, true).path()),
        Err("it has a `.metadata` file but no `__<rank>_<n>.distcp` files".into())
    );
    assert_eq!(
        inspect_checkpoint(dcp_dir(0, false).path()),
        Err("it has neither a `.metadata` file nor `__<rank>_<n>.distcp` files".into())
    );
}

#[test]
fn checkpoint_directory_is_strong_evidence() {
    let dir = dcp_dir(8, true);
    let d = FsdpBackend.detect(&probe(&[], true, Some(dir.path().to_path_buf())));
    assert!(close(d.score, 0.45), "score {}", d.score);
    assert_eq!(
        d.evidence,
        vec![
            format!(
                "{} is a torch distributed checkpoint: `.metadata` and 8 `.distcp` files written by 8 ranks",
                dir.path().display()
            ),
            "python package `torch` is importable".to_string(),
        ]
    );
    // a checkpoint does not tell the mesh of the job
    assert_eq!(d.parallel, None);
}

#[test]
fn directory_without_checkpoint_adds_nothing_but_says_why() {
    let dir = dcp_dir(0, false);
    let d = FsdpBackend.detect(&probe(&[], false, Some(dir.path().to_path_buf())));
    assert_eq!(d.score, 0.0);
    assert_eq!(
        d.evidence,
        vec![format!(
            "{} is not a torch distributed checkpoint: it has neither a `.metadata` file nor `__<rank>_<n>.distcp` files",
            dir.path().display()
        )]
    );
}

#[test]
fn accelerate_fsdp_with_torchrun_world_gives_a_full_shard_mesh() {
    let env = [
        ("ACCELERATE_USE_FSDP", "true"),
        ("FSDP_SHARDING_STRATEGY", "FULL_SHARD"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_WORLD_SIZE", "8"),
    ];
    let d = FsdpBackend.detect(&probe(&env, true, None));
    assert!(
        close(d.score, 0.5 + 0.3 + 0.05 + 0.05 + 0.05),
        "score {}",
        d.score
    );
    assert_eq!(d.parallel, mesh(8, 1));
    assert_eq!(
        d.evidence,
        vec![
            "ACCELERATE_USE_FSDP=true: Accelerate runs FSDP",
            "FSDP_SHARDING_STRATEGY=FULL_SHARD (FULL_SHARD)",
            "WORLD_SIZE=8 (torchrun; weak: any torch.distributed job sets it)",
            "LOCAL_WORLD_SIZE=8 (torchrun; weak: any torch.distributed job sets it)",
            "python package `torch` is importable",
            "FULL_SHARD over WORLD_SIZE=8: dp=8, replicate=1, tp=1 (tensor parallelism is not visible in the environment)",
        ]
    );
}

#[test]
fn hybrid_shard_gives_an_hsdp_mesh_of_nodes() {
    let env = [
        ("ACCELERATE_USE_FSDP", "1"),
        ("FSDP_SHARDING_STRATEGY", "4"),
        ("WORLD_SIZE", "16"),
        ("LOCAL_WORLD_SIZE", "8"),
    ];
    let d = FsdpBackend.detect(&probe(&env, false, None));
    assert_eq!(d.parallel, mesh(8, 2));
    assert_eq!(d.evidence[1], "FSDP_SHARDING_STRATEGY=4 (HYBRID_SHARD)");
}

#[test]
fn sharding_strategies_parse_by_name_and_number() {
    assert_eq!(
        ShardingStrategy::parse("full_shard"),
        Some(ShardingStrategy::FullShard)
    );
    assert_eq!(
        ShardingStrategy::parse("2"),
        Some(ShardingStrategy::ShardGradOp)
    );
    assert_eq!(
        ShardingStrategy::parse("NO_SHARD"),
        Some(ShardingStrategy::NoShard)
    );
    assert_eq!(
        ShardingStrategy::parse("5"),
        Some(ShardingStrategy::HybridShardZero2)
    );
    assert_eq!(ShardingStrategy::parse("ZERO3"), None);
}

#[test]
fn no_shard_replicates_everything() {
    let env = [("FSDP_SHARDING_STRATEGY", "NO_SHARD"), ("WORLD_SIZE", "4")];
    let d = FsdpBackend.detect(&probe(&env, false, None));
    assert_eq!(d.parallel, mesh(1, 4));
}

#[test]
fn torchrun_alone_is_weak_and_gives_no_mesh() {
    let env = [("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "4")];
    let d = FsdpBackend.detect(&probe(&env, true, None));
    assert!(close(d.score, 0.15), "score {}", d.score);
    assert_eq!(d.parallel, None);
}

#[test]
fn torch_alone_is_no_evidence() {
    let d = FsdpBackend.detect(&probe(&[], true, None));
    assert_eq!(d.score, 0.0);
    assert_eq!(d.parallel, None);
    assert_eq!(
        d.evidence,
        vec!["python package `torch` is importable (no weight alone: every PyTorch job has it)"]
    );
    let nothing = FsdpBackend.detect(&probe(&[], false, None));
    assert_eq!((nothing.score, nothing.evidence.len()), (0.0, 0));
    // a score of 0 says what was looked for
    assert_eq!(
        nothing.not_found,
        vec![
            "ACCELERATE_USE_FSDP (Accelerate running FSDP): unset",
            "FSDP_SHARDING_STRATEGY: unset",
            "FSDP_VERSION: unset",
            "a torch distributed checkpoint (`.metadata` and `*.distcp` files): no --checkpoint given",
            "WORLD_SIZE (torchrun): unset or not a positive number",
            "python package `torch`: not checked (no python3 found on PATH)",
        ]
    );
}

#[test]
fn accelerate_without_fsdp_is_not_evidence() {
    let env = [("ACCELERATE_USE_FSDP", "false"), ("WORLD_SIZE", "2")];
    let d = FsdpBackend.detect(&probe(&env, false, None));
    assert!(close(d.score, 0.05), "score {}", d.score);
    assert_eq!(
        d.evidence[0],
        "ACCELERATE_USE_FSDP=false: Accelerate does not run FSDP"
    );
    assert_eq!(d.parallel, None);
}
