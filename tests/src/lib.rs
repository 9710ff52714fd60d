//! Workspace-level tests: conformance of every registered backend, end-to-end runs.
//!
//! A Cargo dependency alone does not link a crate that nothing references, and an unlinked crate's
//! `inventory::submit!` registrations are invisible. Tests call [`link_backends`] first.

/// References one item of every backend crate so that the linker keeps their registrations.
pub fn link_backends() -> [&'static str; 4] {
    std::hint::black_box([
        awex_megatron::CRATE,
        awex_fsdp::CRATE,
        awex_sglang::CRATE,
        awex_vllm::CRATE,
    ])
}
