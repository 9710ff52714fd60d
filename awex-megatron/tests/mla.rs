//! DeepSeek-V3's multi-latent attention (MLA) in Megatron-Core 0.19's names and shards
//! (`MLASelfAttention`, megatron/core/transformer/multi_latent_attention.py; the layer specs in
//! megatron/core/models/gpt/gpt_layer_specs.py):
//!
//! - both specs: `input_layernorm` is a module (`TENorm` with Transformer Engine), `linear_proj`
//!   row-parallel, `linear_q_up_proj` / `linear_kv_up_proj` column-parallel over whole heads;
//!   MLA without `q_lora_rank` is refused (see its test);
//! - local spec: `linear_q_down_proj` / `linear_kv_down_proj` are `ColumnParallelLinear`s
//!   (`gather_output=False`, the output gathered after), the latent norms are modules
//!   `q_layernorm` / `kv_layernorm`;
//! - Transformer Engine: the down projections are `TELinear(parallel_mode='duplicated')`,
//!   whole on every TP rank; the latent norms are fused into the up projections as
//!   `layer_norm_weight`.

mod common;

use awex_core::layout::{Dims, LayoutError, Placement, RankId, Region, SideLayout};
use awex_core::model::{MlaSpec, ModelSpec};
use awex_megatron::options_from_names;
use common::*;
use std::sync::Arc;

fn deepseek() -> ModelSpec {
    preset("deepseek-v3-tiny")
}

/// deepseek-v3-tiny with a plain `q_proj` (no `q_lora_rank`), as DeepSeek-V2-Lite.
fn deepseek_no_q_lora() -> ModelSpec {
    let mut m = deepseek();
    m.name = "deepseek-v3-tiny-no-q-lora".into();
    if let Some(a) = &mut m.mla {
        a.q_lora_rank = None;
    }
    m
}

fn p(canonical: &str, offset: &[u64], extent: &[u64]) -> Placement {
    Placement {
        canonical: Arc::from(canonical),
        region: Region::new(Dims::new(offset), Dims::new(extent)),
        local_offset: Dims::zeros(offset.len()),
        transposed: false,
    }
}

/// One layer's names on rank 0 (after `decoder.layers.{l}.`), in the layout's order.
fn layer_names(side: &dyn SideLayout, l: u64) -> Vec<String> {
    let prefix = format!("decoder.layers.{l}.");
    rank(side, 0)
        .tensors
        .iter()
        .filter_map(|t| t.name.strip_prefix(prefix.as_str()).map(str::to_string))
        .collect()
}

const CONFIGS: &[&[(&str, u64)]] = &[
    &[],
    &[("tp", 2)],
    &[("tp", 4)],
    &[("tp", 2), ("dp", 2), ("ep", 2)],
    &[("tp", 2), ("ep", 2), ("etp", 1)],
    &[("tp", 2), ("dp", 4), ("ep", 8), ("etp", 1)],
    &[("pp", 3)],
    &[("pp", 2), ("first_stage_layers", 1), ("tp", 2)],
    &[("pp", 2), ("last_stage_layers", 1), ("ep", 2), ("dp", 2)],
    &[("tp", 2), ("cp", 2), ("ep", 4), ("etp", 1), ("pp", 3)],
    &[("tp", 2), ("fp32", 1)],
];

#[test]
fn mla_models_validate_and_round_trip_over_the_config_matrix_in_both_specs() {
    for model in [deepseek()] {
        for pairs in CONFIGS {
            for spec in [
                &[("local_spec", 1)][..],
                &[("local_spec", 0), ("grouped_gemm", 1)],
            ] {
                let mut all = pairs.to_vec();
                all.extend_from_slice(spec);
                check_everything(&model, &all);
            }
        }
    }
    // the interleaved schedule over 4 layers (2 stages x 2 chunks)
    let four = ModelSpec {
        num_layers: 4,
        ..deepseek()
    };
    check_everything(
        &four,
        &[("pp", 2), ("vpp", 2), ("tp", 2), ("local_spec", 1)],
    );
    check_everything(&four, &[("pp", 2), ("vpp", 2), ("ep", 2), ("dp", 2)]);
}

#[test]
fn local_spec_names_an_mla_layer_in_named_parameters_order() {
    let side = layout(&deepseek(), &[("local_spec", 1)]).unwrap();
    let attention = [
        "input_layernorm.weight",
        "self_attention.linear_proj.weight",
        "self_attention.linear_q_down_proj.weight",
        "self_attention.linear_q_up_proj.weight",
        "self_attention.linear_kv_down_proj.weight",
        "self_attention.linear_kv_up_proj.weight",
        "self_attention.q_layernorm.weight",
        "self_attention.kv_layernorm.weight",
    ];
    // layer 0 is dense (first_k_dense_replace = 1)
    let mut dense: Vec<&str> = attention.to_vec();
    dense.extend([
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
    ]);
    assert_eq!(layer_names(side.as_ref(), 0), dense);
    let mut moe: Vec<String> = attention.iter().map(|s| s.to_string()).collect();
    moe.extend(
        [
            "pre_mlp_layernorm.weight",
            "mlp.router.weight",
            "mlp.router.expert_bias",
        ]
        .map(String::from),
    );
    moe.extend((0..8).flat_map(|j| {
        [
            format!("mlp.experts.local_experts.{j}.linear_fc1.weight"),
            format!("mlp.experts.local_experts.{j}.linear_fc2.weight"),
        ]
    }));
    moe.extend(
        [
            "mlp.shared_experts.linear_fc1.weight",
            "mlp.shared_experts.linear_fc2.weight",
        ]
        .map(String::from),
    );
    assert_eq!(layer_names(side.as_ref(), 1), moe);
}

#[test]
fn transformer_engine_spec_fuses_the_latent_norms_into_the_up_projections() {
    let side = layout(&deepseek(), &[]).unwrap();
    let n = layer_names(side.as_ref(), 0);
    assert_eq!(
        &n[..8],
        &[
            "input_layernorm.weight",
            "self_attention.linear_proj.weight",
            "self_attention.linear_q_down_proj.weight",
            "self_attention.linear_q_up_proj.layer_norm_weight",
            "self_attention.linear_q_up_proj.weight",
            "self_attention.linear_kv_down_proj.weight",
            "self_attention.linear_kv_up_proj.layer_norm_weight",
            "self_attention.linear_kv_up_proj.weight",
        ]
    );
    // the dense layer's pre-MLP norm is fused into linear_fc1 with Transformer Engine
    assert_eq!(
        &n[8..],
        &[
            "mlp.linear_fc1.layer_norm_weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight"
        ]
    );
    let rl = rank(side.as_ref(), 0);
    assert_eq!(
        tensor(
            &rl,
            "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight"
        )
        .placements,
        vec![p(
            "model.layers.0.self_attn.q_a_layernorm.weight",
            &[0],
            &[32]
        )]
    );
    assert_eq!(
        tensor(
            &rl,
            "decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight"
        )
        .placements,
        vec![p(
            "model.layers.2.self_attn.kv_a_layernorm.weight",
            &[0],
            &[16]
        )]
    );
}

#[test]
fn without_q_lora_rank_mla_is_refused_naming_megatrons_norm_resolver() {
    // megatron/core/transformer/mla_qk_norm_config.py: with qk_layernorm (the kv norm) and no
    // q_lora_rank, `linear_q_proj` must be a fused norm + linear: an extra `layer_norm_weight`
    // with Transformer Engine, no module at all with the local spec
    for local in [0, 1] {
        match layout(&deepseek_no_q_lora(), &[("tp", 2), ("local_spec", local)]) {
            Err(LayoutError::Config(e)) => assert!(
                e.starts_with(
                    "model has multi-latent attention without q_lora_rank (a plain q_proj); Megatron-Core 0.19 cannot build it as the HF model"
                ) && e.contains("QKNormConfigResolver"),
                "{e}"
            ),
            Err(e) => panic!("not a config error: {e:?}"),
            Ok(_) => panic!("accepted MLA without q_lora_rank"),
        }
    }
}

#[test]
fn up_projections_split_by_heads_and_linear_proj_by_value_columns_over_tp() {
    // 4 heads; q head nope 16 + rope 8 = 24 rows, kv head nope 16 + v 16 = 32 rows
    for local in [0, 1] {
        let side = layout(&deepseek(), &[("tp", 2), ("local_spec", local)]).unwrap();
        for r in 0..2u64 {
            let rl = rank(side.as_ref(), r as u32);
            let t = tensor(
                &rl,
                "decoder.layers.2.self_attention.linear_q_up_proj.weight",
            );
            assert_eq!(t.shape, Dims::new(&[48, 32]));
            assert_eq!(
                t.placements,
                vec![p(
                    "model.layers.2.self_attn.q_b_proj.weight",
                    &[48 * r, 0],
                    &[48, 32]
                )]
            );
            let t = tensor(
                &rl,
                "decoder.layers.2.self_attention.linear_kv_up_proj.weight",
            );
            assert_eq!(t.shape, Dims::new(&[64, 16]));
            assert_eq!(
                t.placements,
                vec![p(
                    "model.layers.2.self_attn.kv_b_proj.weight",
                    &[64 * r, 0],
                    &[64, 16]
                )]
            );
            let t = tensor(&rl, "decoder.layers.2.self_attention.linear_proj.weight");
            assert_eq!(t.shape, Dims::new(&[64, 32]));
            assert_eq!(
                t.placements,
                vec![p(
                    "model.layers.2.self_attn.o_proj.weight",
                    &[0, 32 * r],
                    &[64, 32]
                )]
            );
        }
    }
}

#[test]
fn down_projections_are_column_parallel_with_the_local_spec_and_whole_with_transformer_engine() {
    let local = layout(&deepseek(), &[("tp", 2), ("local_spec", 1)]).unwrap();
    for r in 0..2u64 {
        let rl = rank(local.as_ref(), r as u32);
        let t = tensor(
            &rl,
            "decoder.layers.1.self_attention.linear_q_down_proj.weight",
        );
        assert_eq!(t.shape, Dims::new(&[16, 64]));
        assert_eq!(
            t.placements,
            vec![p(
                "model.layers.1.self_attn.q_a_proj.weight",
                &[16 * r, 0],
                &[16, 64]
            )]
        );
        // kv_lora_rank 16 + rope 8 = 24 rows, [latent | rope], 12 per rank
        let t = tensor(
            &rl,
            "decoder.layers.1.self_attention.linear_kv_down_proj.weight",
        );
        assert_eq!(t.shape, Dims::new(&[12, 64]));
        assert_eq!(
            t.placements,
            vec![p(
                "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                &[12 * r, 0],
                &[12, 64]
            )]
        );
        // the latent norms are whole on every rank
        let t = tensor(&rl, "decoder.layers.1.self_attention.kv_layernorm.weight");
        assert_eq!(
            t.placements,
            vec![p(
                "model.layers.1.self_attn.kv_a_layernorm.weight",
                &[0],
                &[16]
            )]
        );
    }
    let h = local.holders("model.layers.1.self_attn.kv_a_proj_with_mqa.weight");
    assert_eq!(h.len(), 2);
    assert_eq!(h[1].ranks, vec![RankId::train(1)]);

    let te = layout(&deepseek(), &[("tp", 2), ("dp", 2)]).unwrap();
    for r in 0..4 {
        let rl = rank(te.as_ref(), r);
        let t = tensor(
            &rl,
            "decoder.layers.1.self_attention.linear_kv_down_proj.weight",
        );
        assert_eq!(t.shape, Dims::new(&[24, 64]));
        assert_eq!(
            t.placements,
            vec![p(
                "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                &[0, 0],
                &[24, 64]
            )]
        );
    }
    let h = te.holders("model.layers.1.self_attn.q_a_proj.weight");
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].ranks, (0..4).map(RankId::train).collect::<Vec<_>>());
}

#[test]
fn local_spec_refuses_down_projections_that_do_not_split_over_tp() {
    let mut m = deepseek();
    m.mla = Some(MlaSpec {
        kv_lora_rank: 14,
        ..m.mla.unwrap()
    });
    // 14 + 8 = 22 rows do not split over 4 ranks with the local spec; Transformer Engine keeps them whole
    match layout(&m, &[("tp", 4), ("local_spec", 1)]) {
        Err(LayoutError::Config(e)) => assert_eq!(
            e,
            "model has kv_lora_rank + qk_rope_head_dim = 22; megatron tp=4 with local_spec=1 splits linear_kv_down_proj (a ColumnParallelLinear) over tp, which needs it divisible by tp (Transformer Engine's spec keeps it whole: local_spec=0)"
        ),
        Err(e) => panic!("not a config error: {e:?}"),
        Ok(_) => panic!("accepted"),
    }
    check_everything(&m, &[("tp", 4)]);
}

#[test]
fn options_from_names_tell_the_mla_local_spec_by_its_kv_layernorm() {
    for local in [0, 1] {
        let side = layout(&deepseek(), &[("tp", 2), ("local_spec", local)]).unwrap();
        let rl = rank(side.as_ref(), 0);
        let names: Vec<&str> = rl.tensors.iter().map(|t| &*t.name).collect();
        // MLA's input_layernorm is a module under Transformer Engine too: not the local marker
        assert!(names.contains(&"decoder.layers.0.input_layernorm.weight"));
        let got = options_from_names(&names);
        assert_eq!(got[0], ("local_spec", local), "{names:?}");
        assert_eq!(got[1], ("grouped_gemm", u64::from(local == 0)));
    }
}
