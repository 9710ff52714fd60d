//! The local (non-Transformer-Engine) layer spec, `local_spec=1`: norms are modules of their own
//! (`input_layernorm`, `pre_mlp_layernorm`) and the linears carry no fused norm weight.

mod common;

use awex_core::layout::{Dims, Placement, RankId, Region, SideLayout};
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

fn names(side: &dyn SideLayout, r: u32) -> Vec<String> {
    rank(side, r)
        .tensors
        .iter()
        .map(|t| t.name.to_string())
        .collect()
}

#[test]
fn local_spec_names_one_layer_in_named_parameters_order() {
    let side = layout(&preset("qwen3-tiny"), &[("local_spec", 1)]).unwrap();
    let n = names(side.as_ref(), 0);
    assert_eq!(n.len(), 1 + 4 * 8 + 2);
    assert_eq!(
        &n[..10],
        &[
            "embedding.word_embeddings.weight",
            "decoder.layers.0.input_layernorm.weight",
            "decoder.layers.0.self_attention.linear_proj.weight",
            "decoder.layers.0.self_attention.linear_qkv.weight",
            "decoder.layers.0.self_attention.q_layernorm.weight",
            "decoder.layers.0.self_attention.k_layernorm.weight",
            "decoder.layers.0.pre_mlp_layernorm.weight",
            "decoder.layers.0.mlp.linear_fc1.weight",
            "decoder.layers.0.mlp.linear_fc2.weight",
            "decoder.layers.1.input_layernorm.weight",
        ]
    );
    assert!(
        !n.iter().any(|x| x.ends_with("layer_norm_weight")),
        "no fused norm weights with the local spec: {n:?}"
    );
}

#[test]
fn local_spec_norms_hold_the_same_canonical_tensors_replicated_over_tp() {
    let side = layout(&preset("qwen3-tiny"), &[("tp", 2), ("local_spec", 1)]).unwrap();
    for r in 0..2 {
        let rl = rank(side.as_ref(), r);
        for (local, canonical) in [
            (
                "decoder.layers.3.input_layernorm.weight",
                "model.layers.3.input_layernorm.weight",
            ),
            (
                "decoder.layers.3.pre_mlp_layernorm.weight",
                "model.layers.3.post_attention_layernorm.weight",
            ),
        ] {
            let t = tensor(&rl, local);
            assert_eq!(t.shape, Dims::new(&[64]), "{local}");
            assert_eq!(
                t.placements,
                vec![p(canonical, &[0], &[64], &[0])],
                "{local}"
            );
        }
    }
    let h = side.holders("model.layers.3.post_attention_layernorm.weight");
    assert_eq!(h.len(), 1);
    assert_eq!(&*h[0].tensor, "decoder.layers.3.pre_mlp_layernorm.weight");
    assert_eq!(h[0].ranks, vec![RankId::train(0), RankId::train(1)]);
    let h = side.holders("model.layers.3.input_layernorm.weight");
    assert_eq!(&*h[0].tensor, "decoder.layers.3.input_layernorm.weight");
}

#[test]
fn local_spec_linears_are_placed_exactly_like_transformer_engine() {
    let model = preset("qwen3-tiny");
    let te = layout(&model, &[("tp", 2), ("pp", 2)]).unwrap();
    let local = layout(&model, &[("tp", 2), ("pp", 2), ("local_spec", 1)]).unwrap();
    for r in 0..4 {
        let (a, b) = (rank(te.as_ref(), r), rank(local.as_ref(), r));
        assert_eq!(a.tensors.len(), b.tensors.len());
        for t in &a.tensors {
            let renamed = t
                .name
                .replace(
                    "self_attention.linear_qkv.layer_norm_weight",
                    "input_layernorm.weight",
                )
                .replace(
                    "mlp.linear_fc1.layer_norm_weight",
                    "pre_mlp_layernorm.weight",
                );
            let u = tensor(&b, &renamed);
            assert_eq!((u.shape, u.dtype), (t.shape, t.dtype), "{renamed}");
            assert_eq!(u.placements, t.placements, "{renamed}");
        }
    }
}

#[test]
fn local_spec_keeps_pre_mlp_layernorm_on_moe_layers_and_prefixes_vpp_chunks() {
    let side = layout(
        &preset("qwen3-moe-tiny"),
        &[("pp", 2), ("vpp", 2), ("local_spec", 1)],
    )
    .unwrap();
    let n = names(side.as_ref(), 0);
    // stage 0 holds chunk 0 (layer 0, dense) and chunk 1 (layer 2, MoE)
    assert_eq!(n[1], "model0.decoder.layers.0.input_layernorm.weight");
    assert!(n.contains(&"model0.decoder.layers.0.pre_mlp_layernorm.weight".to_string()));
    assert!(n.contains(&"model1.decoder.layers.0.input_layernorm.weight".to_string()));
    assert!(n.contains(&"model1.decoder.layers.0.pre_mlp_layernorm.weight".to_string()));
    assert!(n.contains(&"model1.decoder.layers.0.mlp.router.weight".to_string()));
}

#[test]
fn local_spec_validates_and_round_trips() {
    for pairs in [
        vec![("local_spec", 1)],
        vec![("tp", 2), ("pp", 2), ("local_spec", 1)],
        vec![("tp", 4), ("dp", 2), ("local_spec", 1)],
    ] {
        check_everything(&preset("qwen3-tiny"), &pairs);
        check_everything(&qwen2_tiny(), &pairs);
    }
    check_everything(
        &preset("qwen3-moe-tiny"),
        &[
            ("tp", 2),
            ("dp", 2),
            ("ep", 2),
            ("etp", 1),
            ("local_spec", 1),
        ],
    );
}

#[test]
fn local_spec_accepts_only_zero_or_one() {
    let Err(e) = layout(&preset("qwen3-tiny"), &[("local_spec", 2)]) else {
        panic!("local_spec=2 was accepted");
    };
    assert_eq!(
        e.to_string(),
        layout_error_text(
            "megatron local_spec=2; use local_spec=1 for the local layer spec or local_spec=0 for Transformer Engine"
        )
    );
}

/// How a `LayoutError::Config` message displays.
fn layout_error_text(message: &str) -> String {
    awex_core::layout::LayoutError::Config(message.to_string()).to_string()
}
