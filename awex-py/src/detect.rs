//! `awex.detect()`: which training and inference engines run here, scored by every registered
//! backend from this process's environment, its importable packages, and an optional checkpoint
//! directory and SGLang server.

use crate::endpoint::{runtime, to_py, wait};
use awex_core::backend::{Detection, inference_backends, training_backends};
use pyo3::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// One backend's verdict.
#[derive(Serialize)]
struct Verdict {
    backend: &'static str,
    score: f64,
    evidence: Vec<String>,
    not_found: Vec<String>,
    parallel: Option<awex_core::ParallelConfig>,
}

fn verdict(backend: &'static str, d: Detection) -> Verdict {
    Verdict {
        backend,
        score: d.score,
        evidence: d.evidence,
        not_found: d.not_found,
        parallel: d.parallel,
    }
}

/// The Python packages any registered backend looks for.
#[pyfunction]
pub(crate) fn detect_packages() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = training_backends()
        .iter()
        .flat_map(|b| b.python_packages().iter().copied())
        .chain(
            inference_backends()
                .iter()
                .flat_map(|b| b.python_packages().iter().copied()),
        )
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Scores every registered backend; `packages` says which of `detect_packages()` import here.
#[pyfunction]
#[pyo3(signature = (packages, checkpoint=None, sglang_url=None))]
pub(crate) fn detect<'py>(
    py: Python<'py>,
    packages: BTreeMap<String, bool>,
    checkpoint: Option<PathBuf>,
    sglang_url: Option<String>,
) -> PyResult<Bound<'py, PyAny>> {
    let rt = runtime("awex-detect")?;
    let report = wait(
        py,
        &rt,
        "detecting engines",
        Some(Duration::from_secs(60)),
        async move {
            let (_, paths) = awex_control::probe::wanted();
            let mut probe = awex_control::probe::gather(
                &[],
                &paths,
                checkpoint,
                sglang_url,
                awex_control::probe::HTTP_TIMEOUT,
            )
            .await;
            probe.python_packages = packages;
            let mut training = Vec::new();
            for b in training_backends() {
                training.push(verdict(b.name(), b.detect(&probe)));
            }
            let mut inference = Vec::new();
            for b in inference_backends() {
                inference.push(verdict(b.name(), b.detect(&probe)));
            }
            let by_score = |a: &Verdict, b: &Verdict| {
                b.score.total_cmp(&a.score).then(a.backend.cmp(b.backend))
            };
            training.sort_by(by_score);
            inference.sort_by(by_score);
            let mut out = BTreeMap::new();
            out.insert("training", training);
            out.insert("inference", inference);
            out
        },
    )?;
    Ok(to_py(py, &report)?)
}
