//! awex backend for vLLM: the inference engines awex writes weights into.
//!
//! It knows vLLM's parameter names (`named_parameters()` of its model classes), how vLLM
//! shards them over tensor and expert parallelism ([`layout`]), and how to recognise a running
//! vLLM server and read its parallel config ([`detect`]). Several engines are replicas of one
//! layout. The backend registers itself with awex-core's inventory under the name `vllm`.

#![warn(missing_docs)]

pub mod control;
pub mod detect;
pub mod layout;

pub use detect::ServerInfo;
pub use layout::{VllmConfigError, VllmLayout, expert_range, padded_vocab};

use awex_core::backend::{
    Backend, Detection, InferenceBackend, InferenceRegistration, ParallelConfig, ParallelKey, Probe,
};
use awex_core::layout::{LayoutError, SideLayout};
use awex_core::model::ModelSpec;
use std::sync::Arc;

/// The crate's name; referencing it links the crate (and its backend registration) into a binary.
pub const CRATE: &str = env!("CARGO_PKG_NAME");

/// The vLLM inference backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct VllmBackend;

/// Parallel keys of an vLLM deployment.
const KEYS: &[ParallelKey] = &[
    ParallelKey {
        name: "tp",
        default: Some(1),
        help: "tensor-parallel size of each engine (--tensor-parallel-size)",
    },
    ParallelKey {
        name: "ep",
        default: Some(1),
        help: "1, or tp with --enable-expert-parallel (vLLM spreads the experts over the whole TP group)",
    },
    ParallelKey {
        name: "engines",
        default: Some(1),
        help: "number of vLLM engines, each a full replica of the model",
    },
];

impl VllmBackend {
    /// The layout as its concrete type (`tp`, `ep`, `engines` from `parallel`, defaults filled in).
    pub fn vllm_layout(
        &self,
        model: &ModelSpec,
        parallel: &ParallelConfig,
    ) -> Result<VllmLayout, LayoutError> {
        let p = parallel
            .checked(KEYS, "vllm")
            .map_err(|e| LayoutError::Config(e.to_string()))?;
        Ok(VllmLayout::new(
            model,
            p.get_or("tp", 1),
            p.get_or("ep", 1),
            p.get_or("engines", 1),
        )?)
    }
}

impl Backend for VllmBackend {
    fn name(&self) -> &'static str {
        "vllm"
    }

    fn description(&self) -> &'static str {
        "vLLM engines (0.32, 0.33): fused qkv_proj / gate_up_proj split over TP (KV heads replicated when tp > KV heads), vocab padded to 64 then split over TP, tied lm_head shares embed_tokens, FusedMoE routed_experts.w13/w2 split over TP or (--enable-expert-parallel) over ep=tp; engines are replicas"
    }

    fn parallel_keys(&self) -> &'static [ParallelKey] {
        KEYS
    }

    fn python_packages(&self) -> &'static [&'static str] {
        &["vllm"]
    }

    fn server_info_paths(&self) -> &'static [&'static str] {
        &detect::SERVER_INFO_PATHS
    }

    fn layout(
        &self,
        model: &ModelSpec,
        parallel: &ParallelConfig,
    ) -> Result<Arc<dyn SideLayout>, LayoutError> {
        Ok(Arc::new(self.vllm_layout(model, parallel)?))
    }

    fn detect(&self, probe: &Probe) -> Detection {
        detect::detect(probe)
    }
}

impl InferenceBackend for VllmBackend {
    fn engine_control(&self) -> Option<&'static dyn awex_core::backend::EngineControl> {
        Some(&control::VllmControl)
    }
}

awex_core::inventory::submit! {
    InferenceRegistration(&VllmBackend)
}
