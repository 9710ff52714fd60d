//! awex backend for PyTorch FSDP2: the training jobs awex reads weights from.
//!
//! Parameters keep their HF module names; each is a DTensor sharded `Shard(0)` over the DP mesh
//! with `torch.chunk` semantics, optionally replicated over HSDP groups and split over a TP mesh
//! first ([`layout`]). [`detect`] recognises FSDP from Accelerate's and torchrun's environment
//! and from torch distributed checkpoints. The backend registers itself under the name `fsdp`.

#![warn(missing_docs)]

pub mod detect;
pub mod layout;
pub mod transformers;

pub use layout::{FsdpConfigError, FsdpLayout, TpSplit, chunk, options_from_names};

use awex_core::DType;
use awex_core::backend::{
    Backend, Detection, ParallelConfig, ParallelKey, Probe, SpecError, TrainingBackend,
    TrainingRegistration,
};
use awex_core::layout::{LayoutError, SideLayout};
use awex_core::model::ModelSpec;
use std::sync::Arc;

/// The crate's name; referencing it links the crate (and its backend registration) into a binary.
pub const CRATE: &str = env!("CARGO_PKG_NAME");

/// The FSDP2 / HSDP training backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct FsdpBackend;

/// Parallel keys of an FSDP job: the `(replicate, dp, tp)` device mesh.
const KEYS: &[ParallelKey] = &[
    ParallelKey {
        name: "dp",
        default: Some(1),
        help: "FSDP shard group size (ranks that shard each parameter's dim 0)",
    },
    ParallelKey {
        name: "replicate",
        default: Some(1),
        help: "HSDP replicate groups (identical copies of the sharded model)",
    },
    ParallelKey {
        name: "tp",
        default: Some(1),
        help: "tensor-parallel size of a 2-D (FSDP + TP) mesh; tp is the fastest mesh dim",
    },
    ParallelKey {
        name: "fused_experts",
        default: Some(0),
        help: "1 for transformers 5's fused MoE experts (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I], sharded on the expert dim); 0 for transformers 4's per-expert mlp.experts.{e}.gate_proj.weight",
    },
    ParallelKey {
        name: "transformers",
        default: Some(transformers::PINNED),
        help: "the transformers release the trainer runs, as major * 100 + minor (519 for 5.19): its rules decide which parameters of a bf16/fp16 model are fp32; from 524 (5.24) DeepSeek-V2/V3, Kimi-K2 and GLM-4.5 keep their routers (mlp.gate.weight) in fp32 (the sender converts where the engine holds another dtype); default 519, the release awex's engine tests pin",
    },
];

impl FsdpBackend {
    /// The layout as its concrete type (`dp`, `replicate`, `tp` from `parallel`, defaults filled in).
    pub fn fsdp_layout(
        &self,
        model: &ModelSpec,
        parallel: &ParallelConfig,
    ) -> Result<FsdpLayout, LayoutError> {
        let p = parallel
            .checked(KEYS, "fsdp")
            .map_err(|e| LayoutError::Config(e.to_string()))?;
        let fused = match p.get_or("fused_experts", 0) {
            0 => false,
            1 => true,
            v => {
                return Err(LayoutError::Config(format!(
                    "fsdp fused_experts={v}; use fused_experts=1 for transformers 5's fused expert tensors or fused_experts=0 for per-expert names"
                )));
            }
        };
        Ok(FsdpLayout::new(
            model,
            p.get_or("dp", 1),
            p.get_or("replicate", 1),
            p.get_or("tp", 1),
        )?
        .with_fused_experts(fused)?
        .with_transformers(p.get_or("transformers", transformers::PINNED))?)
    }
}

impl Backend for FsdpBackend {
    fn name(&self) -> &'static str {
        "fsdp"
    }

    fn description(&self) -> &'static str {
        "PyTorch FSDP2 / HSDP (+ TP): HF names, each parameter Shard(0) over dp with torch.chunk semantics, replicated over replicate groups, colwise/rowwise split over tp first"
    }

    fn parallel_keys(&self) -> &'static [ParallelKey] {
        KEYS
    }

    fn resolved_parallel(&self, parallel: &ParallelConfig) -> Result<ParallelConfig, SpecError> {
        let mut p = parallel.checked(KEYS, "fsdp")?;
        // releases with the same dtype rules lay out the same ranks (a value that names no
        // release is left for the layout to refuse)
        if let Some(v) = p.0.get_mut("transformers")
            && let Ok(rules) = transformers::Rules::of_release(*v)
        {
            *v = rules.release();
        }
        Ok(p)
    }

    fn python_packages(&self) -> &'static [&'static str] {
        &["torch"]
    }

    fn layout(
        &self,
        model: &ModelSpec,
        parallel: &ParallelConfig,
    ) -> Result<Arc<dyn SideLayout>, LayoutError> {
        Ok(Arc::new(self.fsdp_layout(model, parallel)?))
    }

    fn detect(&self, probe: &Probe) -> Detection {
        detect::detect(probe)
    }
}

impl TrainingBackend for FsdpBackend {
    fn options_from_names(&self, names: &[&str]) -> Vec<(&'static str, u64)> {
        layout::options_from_names(names)
    }

    fn options_from_tensors(&self, tensors: &[(&str, DType)]) -> Vec<(&'static str, u64)> {
        let names: Vec<&str> = tensors.iter().map(|t| t.0).collect();
        let mut out = layout::options_from_names(&names);
        out.extend(transformers::options_from_tensors(tensors));
        out
    }
}

awex_core::inventory::submit! {
    TrainingRegistration(&FsdpBackend)
}
