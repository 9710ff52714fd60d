//! A Megatron-Core job as the receiving side: the same layout as the training side, seen as
//! one inference engine, so that awex can write canonical weights (an HF checkpoint, another
//! job's shards) straight into live Megatron parameters.
//!
//! [`MegatronReceiver`] is not registered here: a binary that wants Megatron receivers (the
//! Python package does) registers it with `inventory::submit!`, so the default inference
//! registry stays the serving engines.

use crate::layout::MegatronLayout;
use awex_core::backend::{
    Backend, Detection, InferenceBackend, ParallelConfig, ParallelKey, Probe,
};
use awex_core::layout::{Holder, LayoutError, RankId, RankLayout, Side, SideLayout};
use awex_core::model::ModelSpec;
use std::sync::Arc;

/// The Megatron layout as one inference engine (`megatron:...` on the inference side).
#[derive(Clone, Copy, Debug, Default)]
pub struct MegatronReceiver;

/// A training-side layout presented as the inference side: the same ranks (engine 0), tensors and holders.
struct Receiving(MegatronLayout);

impl SideLayout for Receiving {
    fn side(&self) -> Side {
        Side::Inference
    }

    fn ranks(&self) -> Vec<RankId> {
        self.0.ranks()
    }

    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    fn engines(&self) -> u32 {
        1
    }

    fn rank_layout(&self, rank: RankId) -> Option<RankLayout> {
        self.0.rank_layout(rank)
    }

    fn holders(&self, canonical: &str) -> Vec<Holder> {
        self.0.holders(canonical)
    }
}

impl Backend for MegatronReceiver {
    fn name(&self) -> &'static str {
        "megatron"
    }

    fn description(&self) -> &'static str {
        "Megatron-Core parameters receiving canonical weights (one engine; the training layout's names and shards)"
    }

    fn parallel_keys(&self) -> &'static [ParallelKey] {
        crate::KEYS
    }

    fn layout(
        &self,
        model: &ModelSpec,
        parallel: &ParallelConfig,
    ) -> Result<Arc<dyn SideLayout>, LayoutError> {
        Ok(Arc::new(Receiving(MegatronLayout::new(model, parallel)?)))
    }

    fn detect(&self, _probe: &Probe) -> Detection {
        Detection::default()
    }
}

impl InferenceBackend for MegatronReceiver {}

#[cfg(test)]
mod tests {
    use super::*;
    use awex_core::model::presets::preset;

    #[test]
    fn receiving_layout_is_the_training_layout_on_the_inference_side() {
        let model = preset("qwen3-tiny").expect("preset");
        let p = ParallelConfig::from_pairs([("tp", 2), ("pp", 2)]);
        let recv = MegatronReceiver.layout(&model, &p).expect("layout");
        let train = MegatronLayout::new(&model, &p).expect("layout");
        assert_eq!(recv.side(), Side::Inference);
        assert_eq!((recv.world_size(), recv.engines()), (4, 1));
        for r in 0..4 {
            let (a, b) = (
                recv.rank_layout(RankId::infer(0, r)),
                train.rank_layout(RankId::train(r)),
            );
            assert_eq!(format!("{a:?}"), format!("{b:?}"));
        }
        let name = "model.layers.3.self_attn.q_proj.weight";
        assert_eq!(
            format!("{:?}", recv.holders(name)),
            format!("{:?}", train.holders(name))
        );
    }
}
