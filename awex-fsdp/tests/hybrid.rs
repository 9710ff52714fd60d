//! The hybrid Qwen models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) under FSDP2 at tp 1: every
//! whole-side check, transformers 5's parameter order and dtypes, TP refused by name.

mod common;

use awex_core::DType;
use awex_core::backend::{Backend, ParallelConfig};
use awex_core::layout::{RankId, SideLayout};
use awex_core::model::presets::preset;
use awex_core::model::{Catalogue, ModelSpec};
use awex_fsdp::FsdpBackend;
use std::sync::Arc;

const MODELS: &[&str] = &["qwen3-next-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny"];

fn side(model: &str, pairs: &[(&str, u64)]) -> Arc<dyn SideLayout> {
    FsdpBackend
        .layout(
            &preset(model).expect("preset"),
            &ParallelConfig::from_pairs(pairs.iter().copied()),
        )
        .unwrap_or_else(|e| panic!("{model} {pairs:?}: {e}"))
}

/// Every whole-side check, the byte round trip included, in fp32 (in bf16 the trainer's
/// `A_log` is bf16 where the catalogue's is fp32, which a round trip of bytes cannot compare:
/// the transfer widens it, see below).
#[test]
fn hybrid_models_round_trip_on_every_tp1_mesh() {
    for model in MODELS {
        let spec = ModelSpec {
            dtype: DType::F32,
            ..preset(model).expect("preset")
        };
        let cat = Catalogue::of(&spec);
        for pairs in [
            &[("dp", 1)][..],
            &[("dp", 3)],
            &[("dp", 2), ("replicate", 2)],
            &[("dp", 3), ("fused_experts", 1)],
        ] {
            let side = FsdpBackend
                .layout(&spec, &ParallelConfig::from_pairs(pairs.iter().copied()))
                .unwrap_or_else(|e| panic!("{model} {pairs:?}: {e}"));
            common::check_side(side.as_ref(), &cat);
        }
    }
}

/// transformers 5.19 holds `A_log` in the model's dtype (the catalogue's, the engines' and
/// the checkpoints' are fp32: the transfer widens it), and lists a Gated DeltaNet layer's
/// parameters `dt_bias`, `A_log`, `conv1d`, then its projections.
#[test]
fn a_log_is_in_the_model_dtype_and_parameters_come_in_transformers_order() {
    let s = side("qwen3-next-tiny", &[("dp", 1), ("fused_experts", 1)]);
    let rl = s.rank_layout(RankId::train(0)).expect("rank");
    let layer0: Vec<&str> = rl
        .tensors
        .iter()
        .map(|t| &*t.name)
        .filter(|n| n.starts_with("model.layers.0."))
        .collect();
    assert_eq!(
        layer0,
        [
            "model.layers.0.linear_attn.dt_bias",
            "model.layers.0.linear_attn.A_log",
            "model.layers.0.linear_attn.conv1d.weight",
            "model.layers.0.linear_attn.in_proj_qkvz.weight",
            "model.layers.0.linear_attn.in_proj_ba.weight",
            "model.layers.0.linear_attn.norm.weight",
            "model.layers.0.linear_attn.out_proj.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.shared_expert.gate_proj.weight",
            "model.layers.0.mlp.shared_expert.up_proj.weight",
            "model.layers.0.mlp.shared_expert.down_proj.weight",
            "model.layers.0.mlp.shared_expert_gate.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
        ]
    );
    let a_log = rl
        .tensors
        .iter()
        .find(|t| &*t.name == "model.layers.0.linear_attn.A_log")
        .expect("A_log");
    assert_eq!(a_log.dtype, DType::Bf16);
}

#[test]
fn tensor_parallel_hybrid_models_are_refused_by_name() {
    for model in MODELS {
        let e = FsdpBackend
            .layout(
                &preset(model).expect("preset"),
                &ParallelConfig::from_pairs([("dp", 1), ("tp", 2)]),
            )
            .err()
            .unwrap_or_else(|| panic!("{model} tp=2 accepted"));
        assert!(e.to_string().contains("Gated DeltaNet"), "{e}");
    }
}
