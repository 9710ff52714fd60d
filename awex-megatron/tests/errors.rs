//! Every configuration Megatron cannot lay out is refused with a message naming the values.

mod common;

use awex_core::layout::LayoutError;
use awex_core::model::ModelSpec;
use common::*;

fn err(model: &ModelSpec, pairs: &[(&str, u64)]) -> String {
    match layout(model, pairs) {
        Ok(_) => panic!("{pairs:?} was accepted"),
        Err(LayoutError::Config(m)) => m,
        Err(e) => panic!("{pairs:?}: not a config error: {e:?}"),
    }
}

#[test]
fn query_groups_must_divide_tp_or_be_divided_by_it() {
    let model = ModelSpec {
        num_heads: 6,
        num_kv_heads: 2,
        ..preset("qwen3-tiny")
    };
    assert_eq!(
        err(&model, &[("tp", 3)]),
        "model has 2 KV heads; megatron tp=3 needs num_query_groups divisible by tp (or tp a multiple of it)"
    );
}

#[test]
fn qkv_rows_must_split_evenly_when_tp_exceeds_groups() {
    // 8 heads, 1 group, head_dim 1: 10 rows of linear_qkv cannot split over 8 ranks
    let model = ModelSpec {
        num_heads: 8,
        num_kv_heads: 1,
        head_dim: 1,
        ..preset("qwen3-tiny")
    };
    assert_eq!(
        err(&model, &[("tp", 8)]),
        "model has 1 KV heads and 8 query heads of head_dim 1: the 10 rows of linear_qkv do not split evenly over megatron tp=8"
    );
}

#[test]
fn heads_must_divide_by_tp() {
    assert_eq!(
        err(&preset("qwen3-tiny"), &[("tp", 8)]),
        "model has 4 attention heads; megatron tp=8 needs num_attention_heads divisible by tp"
    );
}

#[test]
fn intermediate_sizes_must_divide_by_tp_and_etp() {
    let model = ModelSpec {
        intermediate_size: 130,
        ..preset("qwen3-tiny")
    };
    assert_eq!(
        err(&model, &[("tp", 4)]),
        "model has intermediate_size 130; megatron tp=4 needs it divisible by tp (and non-zero)"
    );
    let mut moe = preset("qwen3-moe-tiny");
    if let Some(m) = moe.moe.as_mut() {
        m.moe_intermediate_size = 30;
    }
    assert_eq!(
        err(&moe, &[("tp", 4), ("ep", 1)]),
        "model has moe_intermediate_size 30; megatron etp=4 needs it divisible by etp (and non-zero)"
    );
}

#[test]
fn layers_must_divide_by_pp_without_explicit_stage_sizes() {
    assert_eq!(
        err(&preset("qwen3-tiny"), &[("pp", 3)]),
        "model has 4 layers; megatron pp=3 needs num_layers divisible by pp (or first_stage_layers / last_stage_layers)"
    );
}

#[test]
fn explicit_stage_sizes_that_do_not_fit_are_refused() {
    assert_eq!(
        err(
            &preset("qwen3-tiny"),
            &[("pp", 3), ("first_stage_layers", 1)]
        ),
        "model has 4 layers; megatron pp=3 with first_stage_layers=1 leaves 3 layers for the 2 other stages, which must split evenly with at least 1 layer each"
    );
    assert_eq!(
        err(
            &preset("qwen3-tiny"),
            &[
                ("pp", 2),
                ("first_stage_layers", 3),
                ("last_stage_layers", 2)
            ]
        ),
        "model has 4 layers; megatron pp=2 with first_stage_layers=3 and last_stage_layers=2 leaves -1 layers for the 0 other stages, which must split evenly with at least 1 layer each"
    );
    assert_eq!(
        err(&preset("qwen3-tiny"), &[("first_stage_layers", 2)]),
        "megatron first_stage_layers=2 need pp > 1 (pp=1 puts every layer on one stage)"
    );
}

#[test]
fn vpp_needs_divisible_layers_and_no_explicit_stage_sizes() {
    assert_eq!(
        err(&preset("qwen3-tiny"), &[("pp", 2), ("vpp", 3)]),
        "model has 4 layers; megatron pp=2 vpp=3 needs num_layers divisible by pp*vpp = 6"
    );
    assert_eq!(
        err(
            &preset("qwen3-tiny"),
            &[("pp", 2), ("vpp", 2), ("last_stage_layers", 1)]
        ),
        "megatron vpp=2 cannot be combined with last_stage_layers=1; use an even split"
    );
    assert_eq!(
        err(&preset("qwen3-tiny"), &[("vpp", 2)]),
        "megatron vpp=2 needs pp > 1 (the interleaved schedule splits pipeline stages)"
    );
}

#[test]
fn experts_must_divide_by_ep() {
    assert_eq!(
        err(&preset("qwen3-moe-tiny"), &[("ep", 3), ("dp", 3)]),
        "model has 8 experts; megatron ep=3 needs num_experts divisible by ep (and non-zero)"
    );
}

#[test]
fn stage_world_must_divide_by_etp_times_ep() {
    assert_eq!(
        err(&preset("qwen3-moe-tiny"), &[("tp", 2), ("ep", 4)]),
        "megatron tp*cp*dp = 2*1*1 = 2 ranks per pipeline stage is not divisible by etp*ep = 2*4 = 8"
    );
}

#[test]
fn zero_sizes_are_refused() {
    for key in ["tp", "pp", "dp", "cp", "ep", "etp", "vpp"] {
        assert_eq!(
            err(&preset("qwen3-tiny"), &[(key, 0)]),
            format!("megatron {key}=0; every parallel size must be at least 1")
        );
    }
    assert_eq!(
        err(
            &preset("qwen3-tiny"),
            &[("pp", 2), ("first_stage_layers", 0)]
        ),
        "megatron first_stage_layers=0; a pipeline stage needs at least 1 layer"
    );
}

#[test]
fn unknown_keys_and_bad_fp32_values_are_refused() {
    assert_eq!(
        err(&preset("qwen3-tiny"), &[("tp_size", 2)]),
        "backend `megatron` has no parallel key `tp_size`; keys: tp, pp, dp, cp, ep, etp, vpp, first_stage_layers, last_stage_layers, fp32, local_spec, grouped_gemm, single_grouped_weight"
    );
    assert_eq!(
        err(&preset("qwen3-tiny"), &[("fp32", 2)]),
        "megatron fp32=2; use fp32=1 for fp32 parameters or fp32=0 for the model dtype"
    );
}

#[test]
fn hybrid_linear_attention_models_are_refused_naming_what_megatron_builds() {
    for name in ["qwen3-next-tiny", "qwen3.5-tiny", "qwen3.5-moe-tiny"] {
        let m = err(&preset(name), &[("tp", 1)]);
        assert!(m.contains("Gated DeltaNet"), "{m}");
        // what keeps it off the CPU, where in Megatron-Core 0.19.2
        assert!(m.contains("transformer_impl=\"transformer_engine\""), "{m}");
        assert!(m.contains("`_get_backend_spec_provider`"), "{m}");
        assert!(m.contains("ImportError without FLA"), "{m}");
        assert!(
            m.contains("gated_delta_net/common.py `_GDNBase.__init__`"),
            "{m}"
        );
        // and what a copy could not express
        assert!(m.contains("layernorm_zero_centered_gamma"), "{m}");
        assert!(
            m.contains("train them with FSDP2 (fsdp:dp=N at tp 1)"),
            "{m}"
        );
    }
    // refused whatever the parallel config and spec
    for pairs in [
        &[("tp", 2)][..],
        &[("local_spec", 1)],
        &[("ep", 2), ("dp", 2)],
    ] {
        let m = err(&preset("qwen3-next-tiny"), pairs);
        assert!(
            m.starts_with("megatron: Qwen3NextForCausalLM (qwen3-next) mixes Gated DeltaNet"),
            "{m}"
        );
    }
}

#[test]
fn gpt_oss_is_refused_naming_what_megatron_builds_and_the_transpose() {
    for pairs in [
        &[("tp", 1)][..],
        &[("tp", 2), ("ep", 2)],
        &[("local_spec", 1)],
    ] {
        let m = err(&preset("gpt-oss-tiny"), pairs);
        assert!(m.starts_with("megatron: GptOssForCausalLM (gpt-oss) holds each layer's experts in one tensor transposed"), "{m}");
        assert!(m.contains("softmax_type=\"learnable\""), "{m}");
        assert!(m.contains("Train gpt-oss with FSDP2"), "{m}");
    }
}
