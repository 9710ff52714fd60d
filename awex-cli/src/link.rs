//! Makes sure every enabled backend crate is linked, so `inventory` sees its registrations.
//!
//! A crate that nothing references is dropped by the linker together with its `inventory::submit!`
//! statics; touching one public item of each keeps it in.

/// Names of the backend crates compiled into this binary (one per enabled cargo feature).
#[allow(clippy::vec_init_then_push)] // pushes depend on cargo features
pub fn link_backends() -> Vec<&'static str> {
    let mut linked = Vec::new();
    #[cfg(feature = "megatron")]
    linked.push(awex_megatron::CRATE);
    #[cfg(feature = "fsdp")]
    linked.push(awex_fsdp::CRATE);
    #[cfg(feature = "sglang")]
    linked.push(awex_sglang::CRATE);
    #[cfg(feature = "vllm")]
    linked.push(awex_vllm::CRATE);
    std::hint::black_box(&linked);
    linked
}
