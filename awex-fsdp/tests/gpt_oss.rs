//! gpt-oss under FSDP2 at tp 1: transformers 5.19 holds exactly the checkpoint's tensors
//! (experts fused and transposed per layer, sinks, the router's bias a parameter), each
//! sharded on dim 0 over dp; every whole-side check; TP refused by name.

mod common;

use awex_core::backend::{Backend, ParallelConfig};
use awex_core::layout::{Dims, RankId, Region, SideLayout};
use awex_core::model::Catalogue;
use awex_core::model::presets::preset;
use awex_fsdp::FsdpBackend;
use std::sync::Arc;

fn side(pairs: &[(&str, u64)]) -> Arc<dyn SideLayout> {
    FsdpBackend
        .layout(
            &preset("gpt-oss-tiny").expect("preset"),
            &ParallelConfig::from_pairs(pairs.iter().copied()),
        )
        .unwrap_or_else(|e| panic!("{pairs:?}: {e}"))
}

#[test]
fn gpt_oss_round_trips_on_every_tp1_mesh() {
    let cat = Catalogue::of(&preset("gpt-oss-tiny").expect("preset"));
    for pairs in [
        &[("dp", 1)][..],
        &[("dp", 3)],
        &[("dp", 2), ("replicate", 2)],
        // the names are transformers' either way: the key changes nothing for gpt-oss
        &[("dp", 3), ("fused_experts", 1)],
    ] {
        common::check_side(side(pairs).as_ref(), &cat);
    }
    assert_eq!(
        side(&[("dp", 3), ("fused_experts", 1)])
            .rank_layout(RankId::train(1))
            .expect("rank"),
        side(&[("dp", 3)])
            .rank_layout(RankId::train(1))
            .expect("rank")
    );
}

/// The order and shapes `GptOssForCausalLM.named_parameters()` gives on one rank of dp 1
/// (transformers 5.19.0, the tiny config: `sinks` first, the module's own parameter), and
/// the expert tensors chunked by experts over dp 3 (8 experts: 3, 3, 2).
#[test]
fn parameters_come_in_transformers_order_and_experts_shard_over_dp() {
    let rl = side(&[("dp", 1)])
        .rank_layout(RankId::train(0))
        .expect("rank");
    let layer1: Vec<(&str, Vec<u64>)> = rl
        .tensors
        .iter()
        .filter(|t| t.name.starts_with("model.layers.1."))
        .map(|t| (&*t.name, t.shape.as_slice().to_vec()))
        .collect();
    let want: Vec<(&str, Vec<u64>)> = vec![
        ("model.layers.1.self_attn.sinks", vec![4]),
        ("model.layers.1.self_attn.q_proj.weight", vec![64, 64]),
        ("model.layers.1.self_attn.q_proj.bias", vec![64]),
        ("model.layers.1.self_attn.k_proj.weight", vec![32, 64]),
        ("model.layers.1.self_attn.k_proj.bias", vec![32]),
        ("model.layers.1.self_attn.v_proj.weight", vec![32, 64]),
        ("model.layers.1.self_attn.v_proj.bias", vec![32]),
        ("model.layers.1.self_attn.o_proj.weight", vec![64, 64]),
        ("model.layers.1.self_attn.o_proj.bias", vec![64]),
        ("model.layers.1.mlp.router.weight", vec![8, 64]),
        ("model.layers.1.mlp.router.bias", vec![8]),
        ("model.layers.1.mlp.experts.gate_up_proj", vec![8, 64, 96]),
        ("model.layers.1.mlp.experts.gate_up_proj_bias", vec![8, 96]),
        ("model.layers.1.mlp.experts.down_proj", vec![8, 48, 64]),
        ("model.layers.1.mlp.experts.down_proj_bias", vec![8, 64]),
        ("model.layers.1.input_layernorm.weight", vec![64]),
        ("model.layers.1.post_attention_layernorm.weight", vec![64]),
    ];
    assert_eq!(layer1, want);
    let s = side(&[("dp", 3)]);
    for (rank, e0, n) in [(0u32, 0u64, 3u64), (1, 3, 3), (2, 6, 2)] {
        let rl = s.rank_layout(RankId::train(rank)).expect("rank");
        let t = rl
            .tensor("model.layers.0.mlp.experts.gate_up_proj")
            .expect("gate_up_proj");
        assert_eq!(t.shape, Dims::new(&[n, 64, 96]), "rank {rank}");
        assert_eq!(t.placements.len(), 1);
        assert_eq!(
            t.placements[0].region,
            Region::new([e0, 0, 0], [n, 64, 96]),
            "rank {rank}"
        );
        // the router's bias is a parameter (sharded), not a buffer held whole
        let b = rl.tensor("model.layers.0.mlp.router.bias").expect("bias");
        assert_eq!(b.shape, Dims::new(&[n]), "rank {rank}");
    }
}

#[test]
fn tensor_parallel_gpt_oss_is_refused_by_name() {
    let e = FsdpBackend
        .layout(
            &preset("gpt-oss-tiny").expect("preset"),
            &ParallelConfig::from_pairs([("dp", 1), ("tp", 2)]),
        )
        .err()
        .expect("tp=2 accepted");
    let e = e.to_string();
    assert!(
        e.contains("fsdp tp=2: GptOssForCausalLM holds each layer's experts in one tensor"),
        "{e}"
    );
}
