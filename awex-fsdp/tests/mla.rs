//! DeepSeek-V3 (multi-latent attention, dense first layer, shared experts, the router's fp32
//! `e_score_correction_bias` buffer) under FSDP2, in transformers 5's `DeepseekV3ForCausalLM`
//! names and `named_parameters()` order (models/deepseek_v3/modeling_deepseek_v3.py).

mod common;

use awex_core::DType;
use awex_core::backend::{Backend, ParallelConfig};
use awex_core::layout::{LayoutError, RankId, SideLayout};
use awex_core::model::presets::preset;
use awex_core::model::{Catalogue, ModelSpec};
use awex_fsdp::FsdpBackend;
use std::sync::Arc;

fn deepseek() -> ModelSpec {
    preset("deepseek-v3-tiny").expect("preset")
}

fn deepseek_no_q_lora() -> ModelSpec {
    let mut m = deepseek();
    m.name = "deepseek-v3-tiny-no-q-lora".into();
    if let Some(a) = &mut m.mla {
        a.q_lora_rank = None;
    }
    m
}

fn layout(model: &ModelSpec, pairs: &[(&str, u64)]) -> Result<Arc<dyn SideLayout>, LayoutError> {
    FsdpBackend.layout(model, &ParallelConfig::from_pairs(pairs.iter().copied()))
}

/// Rank `r`'s (name, shape, dtype) of layer `l` (after `model.layers.{l}.`), in order.
fn layer(side: &dyn SideLayout, r: u32, l: u64) -> Vec<(String, Vec<u64>, DType)> {
    let prefix = format!("model.layers.{l}.");
    side.rank_layout(RankId::train(r))
        .expect("rank")
        .tensors
        .iter()
        .filter_map(|t| {
            let n = t.name.strip_prefix(prefix.as_str())?;
            Some((n.to_string(), t.shape.as_slice().to_vec(), t.dtype))
        })
        .collect()
}

fn names(v: &[(String, Vec<u64>, DType)]) -> Vec<&str> {
    v.iter().map(|x| x.0.as_str()).collect()
}

#[test]
fn deepseek_layouts_validate_and_round_trip_over_dp_and_replicate() {
    for model in [deepseek(), deepseek_no_q_lora()] {
        let cat = Catalogue::of(&model);
        for pairs in [
            &[][..],
            &[("dp", 2)],
            &[("dp", 3)],
            &[("dp", 4), ("replicate", 2)],
            &[("dp", 2), ("fused_experts", 1)],
            &[("dp", 7), ("fused_experts", 1)],
        ] {
            let side = layout(&model, pairs).unwrap_or_else(|e| panic!("{pairs:?}: {e}"));
            common::check_side(side.as_ref(), &cat);
            common::check_holders_partition(side.as_ref(), &cat);
        }
    }
}

#[test]
fn mla_attention_comes_in_deepseek_v3_attention_declaration_order() {
    let side = layout(&deepseek(), &[("dp", 2), ("fused_experts", 1)]).unwrap();
    let l0 = layer(side.as_ref(), 0, 0);
    assert_eq!(
        names(&l0),
        [
            "self_attn.q_a_proj.weight",
            "self_attn.q_a_layernorm.weight",
            "self_attn.q_b_proj.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.kv_a_layernorm.weight",
            "self_attn.kv_b_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ]
    );
    // Shard(0) over dp 2: q_a_proj [32, 64] -> 16 rows, kv_a_proj_with_mqa [24, 64] -> 12 rows
    assert_eq!(l0[0].1, vec![16, 64]);
    assert_eq!(l0[3].1, vec![12, 64]);
    // DeepseekV3MoE declares experts, gate, shared_experts; the bias buffer follows the gate
    let l1 = layer(side.as_ref(), 1, 1);
    assert_eq!(
        &names(&l1)[7..],
        [
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias",
            "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.up_proj.weight",
            "mlp.shared_experts.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ]
    );
    // the buffer is whole and fp32 on every rank (`_keep_in_fp32_modules_strict`); fully_shard
    // shards parameters only
    assert_eq!(l1[10].1, vec![8]);
    assert_eq!(l1[10].2, DType::F32);
    assert_eq!(l1[7].1, vec![4, 64, 64]);
}

#[test]
fn without_q_lora_rank_the_query_is_one_q_proj() {
    let side = layout(&deepseek_no_q_lora(), &[]).unwrap();
    let l = layer(side.as_ref(), 0, 2);
    assert_eq!(l[0].0, "self_attn.q_proj.weight");
    assert_eq!(l[0].1, vec![4 * 24, 64]);
    assert_eq!(l[1].0, "self_attn.kv_a_proj_with_mqa.weight");
}

#[test]
fn tensor_parallel_mla_is_refused_naming_transformers_tp_plan() {
    match layout(&deepseek(), &[("tp", 2)]) {
        Err(e) => assert_eq!(
            e.to_string(),
            "fsdp tp=2 with DeepseekV3ForCausalLM's multi-latent attention: transformers' tensor-parallel plan for it (`base_model_tp_plan`) splits the MLP only and leaves q_a_proj/q_b_proj/kv_a_proj_with_mqa/kv_b_proj/o_proj whole, which awex does not describe; use tp=1 (FSDP over dp, HSDP with replicate)"
        ),
        Ok(_) => panic!("fsdp tp=2 accepted DeepSeek-V3"),
    }
}

#[test]
fn the_router_is_fp32_from_transformers_5_24_and_in_the_model_dtype_before() {
    // DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict: ["e_score_correction_bias"] up to
    // 5.23, ["e_score_correction_bias", "gate.weight"] from 5.24
    for (pairs, router) in [
        (&[][..], DType::Bf16),
        (&[("transformers", 519)][..], DType::Bf16),
        (&[("transformers", 524)][..], DType::F32),
        (&[("transformers", 600)][..], DType::F32),
    ] {
        for model in [deepseek(), deepseek_no_q_lora()] {
            let mut all = vec![("dp", 2), ("fused_experts", 1)];
            all.extend_from_slice(pairs);
            let side = layout(&model, &all).unwrap();
            let l1 = layer(side.as_ref(), 1, 1);
            let find = |n: &str| l1.iter().find(|x| x.0 == n).unwrap().clone();
            assert_eq!(find("mlp.gate.weight").2, router, "{pairs:?}");
            assert_eq!(find("mlp.gate.weight").1, vec![4, 64]);
            assert_eq!(find("mlp.gate.e_score_correction_bias").2, DType::F32);
            assert_eq!(find("mlp.experts.gate_up_proj").2, DType::Bf16);
            let cat = Catalogue::of(&model);
            common::check_side(side.as_ref(), &cat);
            common::check_holders_partition(side.as_ref(), &cat);
        }
    }
    match layout(&deepseek(), &[("transformers", 5)]) {
        Err(e) => assert_eq!(
            e.to_string(),
            "fsdp transformers=5: write the transformers release the trainer runs as major * 100 + minor (519 for 5.19, 524 for 5.24), at least 400 (4.0)"
        ),
        Ok(_) => panic!("fsdp transformers=5 accepted"),
    }
}

#[test]
fn releases_with_the_same_rules_resolve_equal() {
    let b = FsdpBackend;
    let resolved = |pairs: &[(&str, u64)]| {
        b.resolved_parallel(&ParallelConfig::from_pairs(pairs.iter().copied()))
            .unwrap()
            .get("transformers")
    };
    assert_eq!(resolved(&[]), Some(519));
    assert_eq!(resolved(&[("transformers", 457)]), Some(519));
    assert_eq!(resolved(&[("transformers", 524)]), Some(524));
    assert_eq!(resolved(&[("transformers", 525)]), Some(524));
    // a value that names no release is left for the layout to refuse
    assert_eq!(resolved(&[("transformers", 5)]), Some(5));
}
