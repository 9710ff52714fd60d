//! awex-py: the Python extension module `awex._awex`, so that the PyTorch processes of
//! Megatron-Core, FSDP and SGLang can hand their tensors to awex.
//!
//! The Python package `awex` (in `python/awex/`) is the public face: `Writer`, `Reader`,
//! `Controller`, `detect()`, the error classes, and the engine helpers. This module holds the
//! machinery they drive: [`endpoint`] (a rank: register, join, update, close), [`memory`]
//! (zero-copy access to numpy / torch / DLPack memory), [`spec`] (the pair's description from the
//! gateway), [`controller`], [`detect`], [`attach`] (the options a live model's parameter names
//! decide, answered by the backend crates), [`logs`] (a stderr subscriber, only when `AWEX_LOG`
//! asks) and [`testing`] (an in-process gateway for tests).

mod attach;
mod controller;
mod detect;
mod endpoint;
mod errors;
mod logs;
mod memory;
mod spec;
mod testing;

use pyo3::prelude::*;

/// The backend crates linked into the module; naming them links their registrations.
const BACKENDS: [&str; 4] = [
    awex_megatron::CRATE,
    awex_fsdp::CRATE,
    awex_sglang::CRATE,
    awex_vllm::CRATE,
];

// Megatron parameters as receivers (`Reader(..., backend="megatron")`): loading canonical weights
// into a live Megatron job. Registered here only, so the CLI's inference backends stay the serving engines.
awex_core::inventory::submit! { awex_core::backend::InferenceRegistration(&awex_megatron::MegatronReceiver) }

/// The `awex._awex` module.
#[pymodule]
fn _awex(m: &Bound<'_, PyModule>) -> PyResult<()> {
    logs::init_from_env()?;
    m.add_class::<endpoint::Endpoint>()?;
    m.add_class::<controller::Controller>()?;
    m.add_function(wrap_pyfunction!(detect::detect, m)?)?;
    m.add_function(wrap_pyfunction!(detect::detect_packages, m)?)?;
    m.add_function(wrap_pyfunction!(attach::options_from_names, m)?)?;
    m.add_function(wrap_pyfunction!(attach::options_from_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(attach::resolved_parallel, m)?)?;
    m.add_function(wrap_pyfunction!(spec::read_config, m)?)?;
    m.add_function(wrap_pyfunction!(testing::start_gateway, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("LINKED_BACKEND_CRATES", BACKENDS.to_vec())?;
    // whether this build registers GPU tensors (the `cuda` feature: cuda-ipc transport)
    m.add("CUDA", memory::CUDA_BUILT)?;
    Ok(())
}
