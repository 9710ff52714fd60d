//! `--dump-dir`: the canonical weights of the last version, and what the ranks wrote.

use super::report::Check;
use crate::cmd::plan::{Resolved, plural};
use std::path::Path;

/// Writes `canonical.safetensors`: every tensor of version `version` in the HF layout.
pub fn write_canonical(
    dir: &Path,
    model: &str,
    lr: Option<f64>,
    r: &Resolved,
    version: u64,
) -> anyhow::Result<()> {
    let weights =
        crate::cmd::worker::demo_weights(model, &r.catalogue, r.spec.infer_fp8.is_some(), lr)?;
    let tensors: Vec<(String, awex_core::DType, Vec<u64>, Vec<u8>)> = r
        .catalogue
        .tensors()
        .iter()
        .map(|c| {
            (
                c.name.clone(),
                c.dtype,
                c.shape.as_slice().to_vec(),
                weights
                    .tensor(&r.catalogue, &c.name, version)
                    .unwrap_or_default(),
            )
        })
        .collect();
    let items: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), *d, s.clone(), b.as_slice()))
        .collect();
    crate::safetensors::write(&dir.join("canonical.safetensors"), &items)
}

/// The files every rank writes under `dir`, relative to it.
pub fn expected_files(r: &Resolved) -> (Vec<String>, Vec<String>) {
    let train = r
        .training
        .ranks()
        .iter()
        .map(|k| format!("train/rank-{}.safetensors", k.rank))
        .collect();
    let infer = r
        .inference
        .ranks()
        .iter()
        .map(|k| format!("infer/engine-{}/rank-{}.safetensors", k.engine, k.rank))
        .collect();
    (train, infer)
}

/// Says what `--dump-dir` holds after the ranks exited: every file there, of version `version`.
pub fn check(dir: &Path, r: &Resolved, version: u64) -> Check {
    let (train, infer) = expected_files(r);
    let missing: Vec<String> = std::iter::once("canonical.safetensors".to_string())
        .chain(train.iter().cloned())
        .chain(infer.iter().cloned())
        .filter(|f| !dir.join(f).is_file())
        .collect();
    let detail = format!(
        "{} holds version {version}: canonical.safetensors (HF layout), train/rank-N.safetensors ({}), infer/engine-E/rank-N.safetensors ({}), each rank's tensors in its engine's layout",
        dir.display(),
        plural(train.len() as u64, "file"),
        plural(infer.len() as u64, "file"),
    );
    if missing.is_empty() {
        Check::new(true, detail)
    } else {
        Check::new(false, format!("{detail}; MISSING: {}", missing.join(", ")))
    }
}
