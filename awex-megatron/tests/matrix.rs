//! Every rank validated, holders agreeing with the rank layouts, full coverage and a byte-exact
//! materialize -> reconstruct round trip, over a matrix of models and parallel configs.

mod common;

use awex_core::layout::LayoutError;
use awex_core::model::{Architecture, ModelSpec, MoeSpec};
use common::*;
use proptest::prelude::*;

const DENSE_CONFIGS: &[&[(&str, u64)]] = &[
    &[],
    &[("tp", 2)],
    &[("tp", 4)],
    &[("pp", 2)],
    &[("pp", 4)],
    &[("tp", 2), ("pp", 2), ("dp", 2)],
    &[("tp", 2), ("cp", 2), ("dp", 2)],
    &[("tp", 4), ("pp", 2), ("cp", 2)],
    &[("pp", 2), ("vpp", 2)],
    &[("tp", 2), ("pp", 2), ("vpp", 2), ("dp", 2)],
    &[
        ("pp", 3),
        ("first_stage_layers", 1),
        ("last_stage_layers", 1),
    ],
    &[("pp", 2), ("first_stage_layers", 3), ("tp", 2)],
    &[("tp", 2), ("fp32", 1)],
    &[("tp", 2), ("dp", 2), ("ep", 2)],
];

const MOE_CONFIGS: &[&[(&str, u64)]] = &[
    &[],
    &[("ep", 2), ("dp", 2)],
    &[("tp", 2), ("ep", 2), ("dp", 2)],
    &[("tp", 2), ("ep", 2), ("etp", 1)],
    &[("tp", 2), ("dp", 2), ("ep", 2), ("etp", 2)],
    &[("tp", 2), ("dp", 4), ("ep", 8), ("etp", 1)],
    &[("tp", 4), ("ep", 4), ("etp", 1), ("pp", 2)],
    &[("tp", 2), ("cp", 2), ("ep", 4), ("etp", 1), ("pp", 2)],
    &[
        ("tp", 2),
        ("dp", 2),
        ("ep", 4),
        ("etp", 1),
        ("pp", 2),
        ("vpp", 2),
    ],
    &[("pp", 2), ("first_stage_layers", 1), ("ep", 2), ("dp", 2)],
    &[("tp", 2), ("ep", 2), ("etp", 1), ("fp32", 1)],
];

#[test]
fn dense_models_validate_and_round_trip_over_the_config_matrix() {
    for model in [preset("qwen3-tiny"), qwen2_tiny(), tied_tiny()] {
        for pairs in DENSE_CONFIGS {
            check_everything(&model, pairs);
        }
    }
}

#[test]
fn tp_above_kv_heads_validates_and_round_trips() {
    for model in [wide_groups(), preset("qwen3-tiny")] {
        check_everything(&model, &[("tp", 4), ("dp", 2)]);
    }
    check_everything(&wide_groups(), &[("tp", 8), ("pp", 2)]);
}

#[test]
fn moe_model_validates_and_round_trips_over_the_config_matrix() {
    let model = preset("qwen3-moe-tiny");
    for pairs in MOE_CONFIGS {
        check_everything(&model, pairs);
    }
    let tied_moe = ModelSpec {
        tie_word_embeddings: true,
        ..preset("qwen3-moe-tiny")
    };
    check_everything(&tied_moe, &[("tp", 2), ("ep", 2), ("dp", 2), ("pp", 2)]);
}

/// A small random model (dense or MoE, GQA, optional biases, tied or not) with `layers` layers.
fn model_strategy(layers: u64) -> impl Strategy<Value = ModelSpec> {
    (
        (
            prop::sample::select(vec![1u64, 2, 4]),
            1u64..=3,
            prop::sample::select(vec![2u64, 4]),
        ),
        (prop::sample::select(vec![8u64, 16]), 1u64..=400),
        (
            prop::sample::select(vec![4u64, 8, 12]),
            any::<bool>(),
            any::<bool>(),
        ),
        prop::option::of((
            prop::sample::select(vec![2u64, 4, 8]),
            prop::sample::select(vec![4u64, 8]),
            1u64..=2,
            any::<bool>(),
        )),
    )
        .prop_map(
            move |((ng, qpg, hd), (hidden, vocab), (inter, bias, tied), moe)| {
                let moe = moe.map(|(e, mi, step, dense0)| MoeSpec {
                    num_experts: e,
                    experts_per_token: 1,
                    moe_intermediate_size: mi,
                    decoder_sparse_step: step,
                    mlp_only_layers: if dense0 { vec![0] } else { vec![] },
                    shared_intermediate_size: 0,
                    router_bias: false,
                    router_fp32: false,
                });
                ModelSpec {
                    name: "random".into(),
                    architecture: match (&moe, bias) {
                        (Some(_), _) => Architecture::Qwen3Moe,
                        (None, true) => Architecture::Qwen2,
                        (None, false) => Architecture::Qwen3,
                    },
                    hidden_size: hidden,
                    num_layers: layers,
                    num_heads: ng * qpg,
                    num_kv_heads: ng,
                    head_dim: hd,
                    intermediate_size: inter,
                    vocab_size: vocab,
                    tie_word_embeddings: tied,
                    attention_bias: bias,
                    use_qk_norm: false,
                    dtype: awex_core::DType::Bf16,
                    moe,
                    mla: None,
                    mtp_layers: 0,
                    linear: None,
                }
            },
        )
}

/// A parallel config and a model whose layer count mostly fits it (sometimes not, to exercise refusals).
fn case_strategy() -> impl Strategy<Value = (ModelSpec, Vec<(&'static str, u64)>)> {
    (
        prop::sample::select(vec![1u64, 2, 4]),
        1u64..=3,
        prop::sample::select(vec![1u64, 2, 4]),
        1u64..=2,
        prop::sample::select(vec![1u64, 2, 4]),
        prop::option::of(Just(1u64)),
        1u64..=2,
        (any::<bool>(), 1u64..=2, 0u64..=1),
    )
        .prop_flat_map(|(tp, pp, dp, cp, ep, etp, vpp, (fp32, per_chunk, extra))| {
            let vpp = if pp == 1 { 1 } else { vpp };
            let mut v = vec![
                ("tp", tp),
                ("pp", pp),
                ("dp", dp),
                ("cp", cp),
                ("ep", ep),
                ("vpp", vpp),
            ];
            if let Some(etp) = etp {
                v.push(("etp", etp));
            }
            if fp32 {
                v.push(("fp32", 1));
            }
            (model_strategy(pp * vpp * per_chunk + extra), Just(v))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any config either is refused with a Config error or yields a layout whose two directions agree and round trip.
    #[test]
    fn random_models_and_configs_are_refused_or_consistent((model, pairs) in case_strategy()) {
        match layout(&model, &pairs) {
            Err(e) => prop_assert!(matches!(e, LayoutError::Config(_)), "{e:?}"),
            Ok(_) => check_everything(&model, &pairs),
        }
    }
}
