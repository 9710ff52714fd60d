//! Detection: signs that a Megatron-Core job runs here, and the parallel config a checkpoint reveals.
//!
//! Evidence, strongest first: an importable `megatron.core`; a Megatron checkpoint directory
//! (`latest_checkpointed_iteration.txt`, legacy `iter_*/mp_rank_{tp:02}[_{pp:03}[_{ep:03}]]`
//! shard directories, or a `torch_dist` checkpoint whose `metadata.json` names its
//! `sharded_backend`); launch settings (`CUDA_DEVICE_MAX_CONNECTIONS=1`, Transformer Engine's
//! `NVTE_*` variables) and, weakly, torchrun's `WORLD_SIZE`.

use awex_core::backend::{Detection, ParallelConfig, Probe};
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The file Megatron writes beside its iteration directories.
pub const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";

/// Weighs the facts of a probe.
pub fn detect(probe: &Probe) -> Detection {
    let mut d = Detection::default();
    if probe.has_package("megatron.core") {
        d.add(0.5, "python package `megatron.core` is importable");
    } else if probe.has_package("megatron") {
        d.add(0.3, "python package `megatron` is importable");
    } else {
        d.absent_package(probe, "megatron.core");
    }
    match probe.env("CUDA_DEVICE_MAX_CONNECTIONS") {
        Some("1") => d.add(
            0.2,
            "CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron sets it to overlap tensor-parallel communication)",
        ),
        Some(v) => d.absent(format!(
            "CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's launch setting): it is {v}"
        )),
        None => d.absent("CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's launch setting): unset"),
    }
    if let Some(k) = probe.env.keys().find(|k| k.starts_with("NVTE_")) {
        d.add(0.05, format!("Transformer Engine setting `{k}` is set"));
    } else {
        d.absent("Transformer Engine settings (NVTE_*): none set");
    }
    if let Some(ws) = probe.env("WORLD_SIZE") {
        d.add(0.05, format!("WORLD_SIZE={ws} (a torchrun launch)"));
    } else {
        d.absent("WORLD_SIZE (a torchrun launch): unset");
    }
    match &probe.checkpoint {
        Some(dir) => {
            let before = d.evidence.len();
            inspect_checkpoint(dir, &mut d);
            if d.evidence.len() == before {
                d.absent(format!(
                    "a Megatron checkpoint in {}: no {TRACKER_FILE}, iter_*/mp_rank_* shard directories or torch_dist metadata.json",
                    dir.display()
                ));
            }
        }
        None => d.absent(format!(
            "a Megatron checkpoint ({TRACKER_FILE}, mp_rank_* shards, torch_dist metadata.json): no --checkpoint given"
        )),
    }
    d
}

/// Looks for Megatron's checkpoint files under `dir` (a checkpoint root or one iteration directory).
fn inspect_checkpoint(dir: &Path, d: &mut Detection) {
    let tracker = dir.join(TRACKER_FILE);
    let mut iteration_dir = None;
    // (a FIFO or a huge file in its place is passed over, not waited on)
    if let Ok(text) = awex_core::file::read_regular_text(&tracker, 4096) {
        let it = text.trim();
        d.add(0.4, format!("{} names iteration `{it}`", tracker.display()));
        iteration_dir = match it {
            "release" => Some(dir.join("release")),
            n => n
                .parse::<u64>()
                .ok()
                .map(|n| dir.join(format!("iter_{n:07}"))),
        }
        .filter(|p| p.is_dir());
    }
    let iteration_dir = iteration_dir
        .or_else(|| latest_iteration_dir(dir))
        .unwrap_or_else(|| dir.to_path_buf());
    inspect_legacy_shards(&iteration_dir, d);
    inspect_torch_dist(&iteration_dir, d);
}

/// The `iter_*` directory with the highest number.
fn latest_iteration_dir(dir: &Path) -> Option<PathBuf> {
    fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n: u64 = name.strip_prefix("iter_")?.parse().ok()?;
            e.path().is_dir().then_some((n, e.path()))
        })
        .max_by_key(|(n, _)| *n)
        .map(|(_, p)| p)
}

/// Parses `mp_rank_{tp:02}`, `mp_rank_{tp:02}_{pp:03}` or `mp_rank_{tp:02}_{pp:03}_{ep:03}`.
///
/// Two fields are read as (tp, pp): Megatron also writes `mp_rank_{tp:02}_{ep:03}` when pp = 1
/// and ep > 1, which the names alone cannot tell apart from a pipeline split.
fn parse_shard_dir(name: &str) -> Option<Vec<u64>> {
    let fields: Vec<&str> = name.strip_prefix("mp_rank_")?.split('_').collect();
    let widths = [2, 3, 3];
    if fields.is_empty() || fields.len() > widths.len() {
        return None;
    }
    fields
        .iter()
        .zip(widths)
        .map(|(f, w)| {
            (f.len() == w && f.bytes().all(|b| b.is_ascii_digit()))
                .then(|| f.parse().ok())
                .flatten()
        })
        .collect()
}

/// Reads tp and pp (and ep) from the legacy per-rank shard directories of one iteration.
fn inspect_legacy_shards(dir: &Path, d: &mut Detection) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let shards: BTreeSet<Vec<u64>> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .filter_map(|e| parse_shard_dir(&e.file_name().into_string().ok()?))
        .collect();
    let Some(first) = shards.iter().next() else {
        return;
    };
    let fields = first.len();
    if shards.iter().any(|s| s.len() != fields) {
        d.add(
            0.2,
            format!(
                "{} holds mp_rank_* shard directories of mixed formats",
                dir.display()
            ),
        );
        return;
    }
    let size = |i: usize| shards.iter().map(|s| s[i] + 1).max().unwrap_or(1);
    let sizes: Vec<(&str, u64)> = ["tp", "pp", "ep"]
        .into_iter()
        .enumerate()
        .take(fields)
        .map(|(i, k)| (k, size(i)))
        .collect();
    let expected: u64 = sizes.iter().map(|(_, v)| v).product();
    let described = sizes
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ");
    if expected != shards.len() as u64 {
        d.add(
            0.3,
            format!(
                "{} holds {} legacy Megatron shard directories (mp_rank_*), but {described} needs {expected}; parallel config not inferred",
                dir.display(),
                shards.len()
            ),
        );
        return;
    }
    let mut parallel = ParallelConfig::from_pairs(sizes.iter().copied());
    if fields == 1 {
        parallel.0.insert("pp".to_string(), 1);
    }
    d.add(
        0.4,
        format!(
            "{} holds {} legacy Megatron shard directories (mp_rank_*): {described}",
            dir.display(),
            shards.len()
        ),
    );
    d.parallel = Some(parallel);
}

/// Recognises a distributed (`torch_dist` / `zarr`) checkpoint by its `metadata.json`.
fn inspect_torch_dist(dir: &Path, d: &mut Detection) {
    let path = dir.join("metadata.json");
    let Ok(text) = awex_core::file::read_regular_text(&path, awex_core::limits::MAX_JSON_BYTES)
    else {
        return;
    };
    let Ok(meta) = serde_json::from_str::<serde_json::Value>(&text) else {
        return;
    };
    if let Some(backend) = meta.get("sharded_backend") {
        let backend = backend.as_str().unwrap_or("?");
        d.add(
            0.4,
            format!(
                "{} is a Megatron distributed checkpoint (sharded_backend={backend}); it does not record the training parallel config",
                path.display()
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_directory_names_parse_with_their_widths() {
        assert_eq!(parse_shard_dir("mp_rank_01"), Some(vec![1]));
        assert_eq!(parse_shard_dir("mp_rank_03_002"), Some(vec![3, 2]));
        assert_eq!(parse_shard_dir("mp_rank_00_001_007"), Some(vec![0, 1, 7]));
        assert_eq!(parse_shard_dir("mp_rank_1"), None);
        assert_eq!(parse_shard_dir("mp_rank_01_02"), None);
        assert_eq!(parse_shard_dir("mp_rank_01_002_003_004"), None);
        assert_eq!(parse_shard_dir("rank_01"), None);
    }
}
