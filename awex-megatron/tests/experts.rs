//! The MoE expert modules Megatron-Core 0.19.2 builds, each with its own parameter names:
//! `TEGroupedMLP` (`mlp.experts.linear_fc1.weight{j}`), `SequentialMLP`
//! (`mlp.experts.local_experts.{j}.linear_fc1.weight`, the only one the local spec builds) and
//! `TEGroupedMLP` with `moe_single_grouped_weight` (one stacked `mlp.experts.linear_fc1.weight`).

mod common;

use awex_core::layout::{Dims, Placement, Region};
use common::*;
use std::sync::Arc;

fn p(canonical: &str, offset: &[u64], extent: &[u64], local: &[u64]) -> Placement {
    Placement {
        canonical: Arc::from(canonical),
        region: Region::new(Dims::new(offset), Dims::new(extent)),
        local_offset: Dims::new(local),
        transposed: false,
    }
}

/// The names of `decoder.layers.1.` on a rank, without that prefix.
fn layer1(pairs: &[(&str, u64)], r: u32) -> Vec<String> {
    let side = layout(&preset("qwen3-moe-tiny"), pairs).unwrap();
    rank(side.as_ref(), r)
        .tensors
        .iter()
        .filter_map(|t| t.name.strip_prefix("decoder.layers.1.").map(str::to_string))
        .collect()
}

#[test]
fn local_spec_moe_layer_names_match_sequential_mlp_in_named_parameters_order() {
    // what Megatron-Core 0.19.2's GPTModel(get_gpt_layer_local_spec(num_experts=8)) lists on
    // every rank of a world of 2 with ep=2 (dp=2, 4 local experts), printed from the real model on CPU
    let mut want: Vec<String> = [
        "input_layernorm.weight",
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
        "pre_mlp_layernorm.weight",
        "mlp.router.weight",
    ]
    .map(str::to_string)
    .to_vec();
    for j in 0..4 {
        want.push(format!("mlp.experts.local_experts.{j}.linear_fc1.weight"));
        want.push(format!("mlp.experts.local_experts.{j}.linear_fc2.weight"));
    }
    assert_eq!(layer1(&[("ep", 2), ("dp", 2), ("local_spec", 1)], 1), want);
    // grouped_gemm=0 spelled out is the same layout
    assert_eq!(
        layer1(
            &[("ep", 2), ("dp", 2), ("local_spec", 1), ("grouped_gemm", 0)],
            1
        ),
        want
    );
}

#[test]
fn sequential_expert_holds_its_global_expert_split_over_etp() {
    let side = layout(
        &preset("qwen3-moe-tiny"),
        &[
            ("tp", 2),
            ("dp", 2),
            ("ep", 2),
            ("etp", 2),
            ("local_spec", 1),
        ],
    )
    .unwrap();
    // rank 3: etp 1, ep 1; local expert 1 is global expert 4 + 1 = 5; 32 / etp = 16 rows each
    let r = rank(side.as_ref(), 3);
    let fc1 = tensor(
        &r,
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight",
    );
    assert_eq!(fc1.shape, Dims::new(&[32, 64]));
    assert_eq!(
        fc1.placements,
        vec![
            p(
                "model.layers.1.mlp.experts.5.gate_proj.weight",
                &[16, 0],
                &[16, 64],
                &[0, 0]
            ),
            p(
                "model.layers.1.mlp.experts.5.up_proj.weight",
                &[16, 0],
                &[16, 64],
                &[16, 0]
            ),
        ]
    );
    let fc2 = tensor(
        &r,
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight",
    );
    assert_eq!(fc2.shape, Dims::new(&[64, 16]));
    assert_eq!(
        fc2.placements,
        vec![p(
            "model.layers.1.mlp.experts.5.down_proj.weight",
            &[0, 16],
            &[64, 16],
            &[0, 0]
        )]
    );
}

#[test]
fn transformer_engine_defaults_to_grouped_gemm_names() {
    let n = layer1(&[("ep", 2), ("dp", 2)], 0);
    let experts: Vec<&str> = n
        .iter()
        .filter(|s| s.starts_with("mlp.experts."))
        .map(String::as_str)
        .collect();
    assert_eq!(
        experts,
        [
            "mlp.experts.linear_fc1.weight0",
            "mlp.experts.linear_fc1.weight1",
            "mlp.experts.linear_fc1.weight2",
            "mlp.experts.linear_fc1.weight3",
            "mlp.experts.linear_fc2.weight0",
            "mlp.experts.linear_fc2.weight1",
            "mlp.experts.linear_fc2.weight2",
            "mlp.experts.linear_fc2.weight3",
        ]
    );
    assert_eq!(layer1(&[("ep", 2), ("dp", 2), ("grouped_gemm", 1)], 0), n);
}

#[test]
fn transformer_engine_without_grouped_gemm_builds_sequential_mlp() {
    // TESpecProvider.grouped_mlp_modules(False): SequentialMLP of TE linears; norms stay fused
    let n = layer1(&[("ep", 2), ("dp", 2), ("grouped_gemm", 0)], 0);
    assert!(n.contains(&"self_attention.linear_qkv.layer_norm_weight".to_string()));
    assert!(n.contains(&"mlp.experts.local_experts.3.linear_fc2.weight".to_string()));
    assert!(!n.iter().any(|s| s.starts_with("mlp.experts.linear_fc1")));
}

#[test]
fn single_grouped_weight_stacks_local_experts_on_dim_0() {
    let side = layout(
        &preset("qwen3-moe-tiny"),
        &[("ep", 2), ("dp", 2), ("single_grouped_weight", 1)],
    )
    .unwrap();
    let r = rank(side.as_ref(), 1);
    let fc1 = tensor(&r, "decoder.layers.1.mlp.experts.linear_fc1.weight");
    assert_eq!(fc1.shape, Dims::new(&[4, 64, 64]));
    assert_eq!(fc1.placements.len(), 8);
    assert_eq!(
        fc1.placements[2..4],
        [
            p(
                "model.layers.1.mlp.experts.5.gate_proj.weight",
                &[0, 0],
                &[32, 64],
                &[1, 0, 0]
            ),
            p(
                "model.layers.1.mlp.experts.5.up_proj.weight",
                &[0, 0],
                &[32, 64],
                &[1, 32, 0]
            ),
        ]
    );
    let fc2 = tensor(&r, "decoder.layers.1.mlp.experts.linear_fc2.weight");
    assert_eq!(fc2.shape, Dims::new(&[4, 64, 32]));
    assert_eq!(
        fc2.placements[3],
        p(
            "model.layers.1.mlp.experts.7.down_proj.weight",
            &[0, 0],
            &[64, 32],
            &[3, 0, 0]
        )
    );
}

#[test]
fn every_expert_layout_validates_and_round_trips() {
    for extra in [
        &[("grouped_gemm", 1)][..],
        &[("grouped_gemm", 0)][..],
        &[("local_spec", 1)][..],
        &[("single_grouped_weight", 1)][..],
    ] {
        for base in [
            &[("ep", 2), ("dp", 2)][..],
            &[("tp", 2), ("ep", 2), ("etp", 1)][..],
            &[("tp", 2), ("dp", 2), ("ep", 2), ("etp", 2)][..],
            &[("tp", 2), ("dp", 2), ("ep", 2), ("etp", 2), ("pp", 2)][..],
        ] {
            let pairs: Vec<(&str, u64)> = base.iter().chain(extra).copied().collect();
            check_everything(&preset("qwen3-moe-tiny"), &pairs);
        }
    }
}

#[test]
fn impossible_expert_layouts_are_refused() {
    let err = |pairs: &[(&str, u64)]| match layout(&preset("qwen3-moe-tiny"), pairs) {
        Ok(_) => panic!("{pairs:?} was accepted"),
        Err(e) => e.to_string(),
    };
    let text = |m: &str| awex_core::layout::LayoutError::Config(m.to_string()).to_string();
    assert_eq!(
        err(&[("local_spec", 1), ("grouped_gemm", 1)]),
        text(
            "megatron grouped_gemm=1 with local_spec=1: the local layer spec always builds SequentialMLP experts (LocalSpecProvider.grouped_mlp_modules); use grouped_gemm=0"
        )
    );
    assert_eq!(
        err(&[("grouped_gemm", 0), ("single_grouped_weight", 1)]),
        text(
            "megatron single_grouped_weight=1 needs grouped_gemm=1 (Megatron-Core requires moe_grouped_gemm for moe_single_grouped_weight)"
        )
    );
    assert_eq!(
        err(&[("grouped_gemm", 2)]),
        text(
            "megatron grouped_gemm=2; use grouped_gemm=1 for TEGroupedMLP experts or grouped_gemm=0 for not"
        )
    );
}
