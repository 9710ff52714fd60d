//! Detection of Megatron launches and checkpoints, and the parallel config a legacy checkpoint reveals.

use awex_core::backend::Backend;
use awex_core::backend::{Detection, ParallelConfig, Probe};
use awex_megatron::MegatronBackend;
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

fn probe(env: &[(&str, &str)], packages: &[(&str, bool)], checkpoint: Option<&Path>) -> Probe {
    Probe {
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        python_packages: packages
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect::<BTreeMap<_, _>>(),
        checkpoint: checkpoint.map(Path::to_path_buf),
        ..Probe::default()
    }
}

fn detect(p: &Probe) -> Detection {
    MegatronBackend.detect(p)
}

fn assert_score(d: &Detection, want: f64) {
    assert!(
        (d.score - want).abs() < 1e-9,
        "score {} != {want}: {:?}",
        d.score,
        d.evidence
    );
}

fn mkdirs(root: &Path, dirs: &[&str]) {
    for d in dirs {
        fs::create_dir_all(root.join(d)).unwrap();
    }
}

#[test]
fn nothing_megatron_scores_zero() {
    let dir = tempfile::tempdir().unwrap();
    let d = detect(&probe(
        &[("HOME", "/root")],
        &[("megatron.core", false)],
        Some(dir.path()),
    ));
    assert_eq!((d.score, d.evidence.len(), d.parallel), (0.0, 0, None));
    // a score of 0 says what was looked for
    assert_eq!(
        d.not_found,
        vec![
            "python package `megatron.core`: not importable".to_string(),
            "CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's launch setting): unset".into(),
            "Transformer Engine settings (NVTE_*): none set".into(),
            "WORLD_SIZE (a torchrun launch): unset".into(),
            format!(
                "a Megatron checkpoint in {}: no latest_checkpointed_iteration.txt, iter_*/mp_rank_* shard directories or torch_dist metadata.json",
                dir.path().display()
            ),
        ]
    );
    let d = detect(&probe(&[], &[], None));
    assert_eq!(
        d.not_found[0],
        "python package `megatron.core`: not checked (no python3 found on PATH)"
    );
    assert!(
        d.not_found
            .last()
            .unwrap()
            .ends_with("no --checkpoint given")
    );
}

#[test]
fn python_package_and_launch_variables_are_evidence() {
    let d = detect(&probe(
        &[],
        &[("megatron.core", true), ("megatron", true)],
        None,
    ));
    assert_score(&d, 0.5);
    assert_eq!(
        d.evidence,
        vec!["python package `megatron.core` is importable"]
    );
    let d = detect(&probe(&[], &[("megatron", true)], None));
    assert_score(&d, 0.3);
    let d = detect(&probe(
        &[("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("WORLD_SIZE", "8")],
        &[],
        None,
    ));
    assert_score(&d, 0.25);
    assert_eq!(
        d.evidence,
        vec![
            "CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron sets it to overlap tensor-parallel communication)",
            "WORLD_SIZE=8 (a torchrun launch)",
        ]
    );
    // other values of the variable are not Megatron's
    let d = detect(&probe(&[("CUDA_DEVICE_MAX_CONNECTIONS", "8")], &[], None));
    assert_score(&d, 0.0);
    assert_eq!(d.parallel, None);
}

#[test]
fn legacy_checkpoint_reveals_tp_and_pp() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("latest_checkpointed_iteration.txt"),
        "200\n",
    )
    .unwrap();
    let mut shards = Vec::new();
    for tp in 0..2 {
        for pp in 0..4 {
            shards.push(format!("iter_0000200/mp_rank_{tp:02}_{pp:03}"));
        }
    }
    // an older iteration with another layout must not be read
    shards.push("iter_0000100/mp_rank_00".to_string());
    mkdirs(
        dir.path(),
        &shards.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let d = detect(&probe(&[], &[], Some(dir.path())));
    assert_score(&d, 0.8);
    assert_eq!(
        d.parallel,
        Some(ParallelConfig::from_pairs([("tp", 2), ("pp", 4)]))
    );
    assert!(
        d.evidence[0].ends_with("latest_checkpointed_iteration.txt names iteration `200`"),
        "{:?}",
        d.evidence
    );
    assert!(
        d.evidence[1]
            .ends_with("holds 8 legacy Megatron shard directories (mp_rank_*): tp=2, pp=4"),
        "{:?}",
        d.evidence
    );
}

#[test]
fn legacy_checkpoint_without_pp_field_is_pp_one() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("latest_checkpointed_iteration.txt"),
        "release",
    )
    .unwrap();
    mkdirs(
        dir.path(),
        &[
            "release/mp_rank_00",
            "release/mp_rank_01",
            "release/mp_rank_02",
            "release/mp_rank_03",
        ],
    );
    let d = detect(&probe(&[], &[], Some(dir.path())));
    assert_score(&d, 0.8);
    assert_eq!(
        d.parallel,
        Some(ParallelConfig::from_pairs([("tp", 4), ("pp", 1)]))
    );
}

#[test]
fn iteration_directory_without_tracker_is_read_directly() {
    let dir = tempfile::tempdir().unwrap();
    let iter = dir.path().join("iter_0000007");
    mkdirs(
        &iter,
        &[
            "mp_rank_00_000_000",
            "mp_rank_00_000_001",
            "mp_rank_00_001_000",
            "mp_rank_00_001_001",
        ],
    );
    // given the iteration directory itself
    let d = detect(&probe(&[], &[], Some(&iter)));
    assert_score(&d, 0.4);
    assert_eq!(
        d.parallel,
        Some(ParallelConfig::from_pairs([
            ("tp", 1),
            ("pp", 2),
            ("ep", 2)
        ]))
    );
    // given the root without a tracker: the latest iter_* directory is used
    let d = detect(&probe(&[], &[], Some(dir.path())));
    assert_eq!(
        d.parallel,
        Some(ParallelConfig::from_pairs([
            ("tp", 1),
            ("pp", 2),
            ("ep", 2)
        ]))
    );
}

#[test]
fn incomplete_shard_grid_gives_no_parallel_config() {
    let dir = tempfile::tempdir().unwrap();
    mkdirs(dir.path(), &["mp_rank_00_000", "mp_rank_01_001"]);
    let d = detect(&probe(&[], &[], Some(dir.path())));
    assert_score(&d, 0.3);
    assert_eq!(d.parallel, None);
    assert!(d.evidence[0].ends_with("holds 2 legacy Megatron shard directories (mp_rank_*), but tp=2, pp=2 needs 4; parallel config not inferred"), "{:?}", d.evidence);
}

#[test]
fn torch_dist_checkpoint_is_recognised_by_its_metadata() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("latest_checkpointed_iteration.txt"), "50").unwrap();
    mkdirs(dir.path(), &["iter_0000050"]);
    fs::write(
        dir.path().join("iter_0000050/metadata.json"),
        r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#,
    )
    .unwrap();
    let d = detect(&probe(
        &[("CUDA_DEVICE_MAX_CONNECTIONS", "1")],
        &[("megatron.core", true)],
        Some(dir.path()),
    ));
    assert_score(&d, 1.0);
    assert_eq!(d.parallel, None);
    assert!(d.evidence.iter().any(|e| e.ends_with(
        "metadata.json is a Megatron distributed checkpoint (sharded_backend=torch_dist); it does not record the training parallel config"
    )), "{:?}", d.evidence);
    // a metadata.json without sharded_backend is not Megatron's
    let other = tempfile::tempdir().unwrap();
    fs::write(
        other.path().join("metadata.json"),
        r#"{"format": "something"}"#,
    )
    .unwrap();
    assert_score(&detect(&probe(&[], &[], Some(other.path()))), 0.0);
}
