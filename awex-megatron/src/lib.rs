//! awex backend for Megatron-Core training jobs (GPT models, Transformer Engine or local layer spec).
//!
//! It names every parameter the way Megatron's `named_parameters()` does on each rank
//! (`decoder.layers.{i}.self_attention.linear_qkv.weight`, `mlp.experts.linear_fc1.weight{j}`,
//! `model{v}.` prefixes with virtual pipeline chunks) and places the canonical (HF) boxes
//! inside them for any TP / PP / VPP / DP / CP / EP / ETP configuration, computed lazily per
//! rank and per canonical tensor. It also recognises Megatron launches and checkpoints.

#![warn(missing_docs)]

mod config;
mod detect;
mod layout;
mod names;
mod receive;

pub use config::{Config, Coord, ExpertLayout, KEYS, VOCAB_DIVISIBLE_BY};
pub use detect::TRACKER_FILE;
pub use layout::MegatronLayout;
pub use names::options_from_names;
pub use receive::MegatronReceiver;

use awex_core::backend::{
    Backend, Detection, ParallelConfig, ParallelKey, Probe, SpecError, TrainingBackend,
};
use awex_core::layout::{LayoutError, SideLayout};
use awex_core::model::ModelSpec;
use std::sync::Arc;

/// The crate's name; referencing it links the crate (and its backend registration) into a binary.
pub const CRATE: &str = env!("CARGO_PKG_NAME");

/// The Megatron-Core training backend (`megatron:tp=..,pp=..,...`).
#[derive(Clone, Copy, Debug, Default)]
pub struct MegatronBackend;

impl Backend for MegatronBackend {
    fn name(&self) -> &'static str {
        "megatron"
    }

    fn description(&self) -> &'static str {
        "Megatron-Core GPT (Transformer Engine spec, or the local spec with local_spec=1): TP/PP/VPP/DP/CP/EP/ETP, Q/K/V interleaved per query group, vocab padded to 128*tp"
    }

    fn parallel_keys(&self) -> &'static [ParallelKey] {
        KEYS
    }

    fn resolved_parallel(&self, parallel: &ParallelConfig) -> Result<ParallelConfig, SpecError> {
        let mut p = parallel.checked(KEYS, "megatron")?;
        // the defaults that follow other keys, as `Config::resolve` applies them
        let tp = p.get_or("tp", 1);
        let grouped = u64::from(p.get_or("local_spec", 0) == 0);
        p.0.entry("etp".to_string()).or_insert(tp);
        p.0.entry("grouped_gemm".to_string()).or_insert(grouped);
        Ok(p)
    }

    fn python_packages(&self) -> &'static [&'static str] {
        &["megatron.core", "megatron"]
    }

    fn layout(
        &self,
        model: &ModelSpec,
        parallel: &ParallelConfig,
    ) -> Result<Arc<dyn SideLayout>, LayoutError> {
        Ok(Arc::new(MegatronLayout::new(model, parallel)?))
    }

    fn detect(&self, probe: &Probe) -> Detection {
        detect::detect(probe)
    }
}

impl TrainingBackend for MegatronBackend {
    fn options_from_names(&self, names: &[&str]) -> Vec<(&'static str, u64)> {
        names::options_from_names(names)
    }
}

awex_core::inventory::submit! { awex_core::backend::TrainingRegistration(&MegatronBackend) }

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn spec(s: &str) -> ParallelConfig {
        s.parse::<awex_core::BackendSpec>().unwrap().parallel
    }

    #[test]
    fn resolved_parallel_fills_the_defaults_that_follow_other_keys_as_the_layout_does() {
        let b = MegatronBackend;
        let r = |s: &str| b.resolved_parallel(&spec(s)).unwrap();
        assert_eq!(
            r("megatron:tp=2"),
            r("megatron:tp=2,etp=2,grouped_gemm=1,pp=1")
        );
        assert_ne!(r("megatron:tp=2"), r("megatron:tp=2,etp=1"));
        assert_eq!(r("megatron:tp=2,local_spec=1").get("grouped_gemm"), Some(0));
        assert_eq!(r("megatron:tp=4").get("etp"), Some(4));
        for s in [
            "megatron:tp=2",
            "megatron:tp=2,ep=2",
            "megatron:tp=4,etp=1,ep=2,pp=2",
            "megatron:tp=2,local_spec=1",
            "megatron:tp=2,grouped_gemm=1,single_grouped_weight=1",
        ] {
            // the layout reads the resolved config exactly as it reads the given one
            assert_eq!(
                Config::resolve(&r(s)).unwrap(),
                Config::resolve(&spec(s)).unwrap(),
                "{s}"
            );
        }
        let e = b.resolved_parallel(&spec("megatron:tq=2")).unwrap_err();
        assert!(e.to_string().contains("no parallel key `tq`"), "{e}");
    }
}
