//! awex backend for SGLang: the inference engines awex writes weights into.
//!
//! It knows SGLang's parameter names (`named_parameters()` of its model classes), how SGLang
//! shards them over tensor and expert parallelism ([`layout`]), and how to recognise a running
//! SGLang server and read its parallel config ([`detect`]). Several engines are replicas of one
//! layout. The backend registers itself with awex-core's inventory under the name `sglang`.

#![warn(missing_docs)]

pub mod control;
pub mod detect;
pub mod layout;

pub use detect::ServerInfo;
pub use layout::{SglangConfigError, SglangLayout, padded_vocab};

use awex_core::backend::{
    Backend, Detection, InferenceBackend, InferenceRegistration, ParallelConfig, ParallelKey, Probe,
};
use awex_core::layout::{LayoutError, SideLayout};
use awex_core::model::ModelSpec;
use std::sync::Arc;

/// The crate's name; referencing it links the crate (and its backend registration) into a binary.
pub const CRATE: &str = env!("CARGO_PKG_NAME");

/// The SGLang inference backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct SglangBackend;

/// Parallel keys of an SGLang deployment.
const KEYS: &[ParallelKey] = &[
    ParallelKey {
        name: "tp",
        default: Some(1),
        help: "tensor-parallel size of each engine (--tp-size)",
    },
    ParallelKey {
        name: "ep",
        default: Some(1),
        help: "expert-parallel size inside the TP group (--ep-size); must divide tp",
    },
    ParallelKey {
        name: "engines",
        default: Some(1),
        help: "number of SGLang engines, each a full replica of the model",
    },
    ParallelKey {
        name: "fused_shared_experts",
        default: None,
        help: "1: the engine holds shared experts as one more routed expert (SGLang's default at ep=1 on NVIDIA compute capability >= 8.0; for DeepSeek-V3 only with 256 routed experts and 1 shared; Qwen3-Next on any CUDA GPU, at any ep: one copy on every EP rank), 0: apart (CPU, older GPUs, --disable-shared-experts-fusion, Kimi-K2 in bf16; Qwen3.5-MoE always on NVIDIA, where 1 is refused; DeepSeek-V3 / GLM-4.5 / Kimi-K2 at ep > 1, where 1 is refused); needed for a model with shared experts at ep=1 (not Qwen3.5-MoE), and for Qwen3-Next at any ep",
    },
];

impl SglangBackend {
    /// The layout as its concrete type (`tp`, `ep`, `engines` from `parallel`, defaults filled in).
    pub fn sglang_layout(
        &self,
        model: &ModelSpec,
        parallel: &ParallelConfig,
    ) -> Result<SglangLayout, LayoutError> {
        let p = parallel
            .checked(KEYS, "sglang")
            .map_err(|e| LayoutError::Config(e.to_string()))?;
        let fused = match p.get("fused_shared_experts") {
            None => None,
            Some(0) => Some(false),
            Some(1) => Some(true),
            Some(v) => {
                return Err(LayoutError::Config(format!(
                    "sglang fused_shared_experts={v}: use 1 (shared experts fused into the routed experts) or 0 (apart)"
                )));
            }
        };
        Ok(SglangLayout::with_shared_experts(
            model,
            p.get_or("tp", 1),
            p.get_or("ep", 1),
            p.get_or("engines", 1),
            fused,
        )?)
    }
}

impl Backend for SglangBackend {
    fn name(&self) -> &'static str {
        "sglang"
    }

    fn description(&self) -> &'static str {
        "SGLang engines: fused qkv_proj / gate_up_proj split over TP (KV heads replicated when tp > KV heads), vocab padded to 64 (64*tp), FusedMoE w13/w2 split over EP x moe_tp; engines are replicas"
    }

    fn parallel_keys(&self) -> &'static [ParallelKey] {
        KEYS
    }

    fn python_packages(&self) -> &'static [&'static str] {
        &["sglang"]
    }

    fn server_info_paths(&self) -> &'static [&'static str] {
        &detect::SERVER_INFO_PATHS
    }

    fn layout(
        &self,
        model: &ModelSpec,
        parallel: &ParallelConfig,
    ) -> Result<Arc<dyn SideLayout>, LayoutError> {
        Ok(Arc::new(self.sglang_layout(model, parallel)?))
    }

    fn detect(&self, probe: &Probe) -> Detection {
        detect::detect(probe)
    }
}

impl InferenceBackend for SglangBackend {
    fn engine_control(&self) -> Option<&'static dyn awex_core::backend::EngineControl> {
        Some(&control::SglangControl)
    }
}

awex_core::inventory::submit! {
    InferenceRegistration(&SglangBackend)
}
