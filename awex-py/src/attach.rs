//! `options_from_names`: what `Writer.attach` reads from a live model's parameter names (the
//! Megatron layer spec and expert module, FSDP's fused experts), answered by the backend that
//! spells those names, so that Python restates none of them.

use crate::errors::Fail;
use awex_core::backend::{ParallelConfig, training_backend};
use pyo3::prelude::*;
use std::collections::BTreeMap;

/// The parallel keys that the parameter names of a live `backend` rank decide, as
/// `[(key, value)]` in the backend's key order (keys the names say nothing about are left out).
#[pyfunction]
pub(crate) fn options_from_names(
    backend: &str,
    names: Vec<String>,
) -> PyResult<Vec<(&'static str, u64)>> {
    let b = training_backend(backend).map_err(Fail::from)?;
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    Ok(b.options_from_names(&names))
}

/// The parallel keys that the names and dtypes of a live `backend` rank's tensors decide (FSDP's
/// fused experts from the names, its `transformers` release from the dtype the routers are
/// kept in), as `[(key, value)]`; a dtype awex does not know (`torch.float8_e4m3fn`) says
/// nothing.
#[pyfunction]
pub(crate) fn options_from_tensors(
    backend: &str,
    tensors: Vec<(String, String)>,
) -> PyResult<Vec<(&'static str, u64)>> {
    let b = training_backend(backend).map_err(Fail::from)?;
    let named: Vec<(&str, Option<awex_core::DType>)> = tensors
        .iter()
        .map(|(n, d)| (n.as_str(), d.parse().ok()))
        .collect();
    let known: Vec<(&str, awex_core::DType)> = named
        .iter()
        .filter_map(|(n, d)| Some((*n, (*d)?)))
        .collect();
    let mut out = b.options_from_tensors(&known);
    if known.len() < named.len() {
        // the names still decide what they decide
        let names: Vec<&str> = named.iter().map(|t| t.0).collect();
        for kv in b.options_from_names(&names) {
            if !out.iter().any(|o| o.0 == kv.0) {
                out.push(kv);
            }
        }
    }
    Ok(out)
}

/// A training `backend`'s parallel config with every default filled in, those that follow from
/// other keys included (`Backend::resolved_parallel`), so that Python compares a live job's
/// config with a pair's without restating the defaults.
#[pyfunction]
pub(crate) fn resolved_parallel(
    backend: &str,
    parallel: BTreeMap<String, u64>,
) -> PyResult<BTreeMap<String, u64>> {
    let b = training_backend(backend).map_err(Fail::from)?;
    Ok(b.resolved_parallel(&ParallelConfig(parallel))
        .map_err(Fail::from)?
        .0)
}
