//! Every model x mesh: valid ranks, holders agreeing with the rank view, full coverage, and
//! materialize -> reconstruct giving back the canonical bytes.

mod common;

use awex_core::DType;
use awex_core::backend::Backend;
use awex_core::backend::ParallelConfig;
use awex_core::model::presets::preset;
use awex_core::model::{Architecture, Catalogue, ModelSpec, MoeSpec};
use awex_fsdp::{FsdpBackend, FsdpLayout};
use proptest::prelude::*;

fn models() -> Vec<ModelSpec> {
    let tiny = preset("qwen3-tiny").expect("preset");
    let moe = preset("qwen3-moe-tiny").expect("preset");
    vec![
        tiny.clone(),
        moe.clone(),
        ModelSpec {
            name: "qwen2-bias-tiny".into(),
            architecture: Architecture::Qwen2,
            attention_bias: true,
            ..tiny.clone()
        },
        ModelSpec {
            tie_word_embeddings: true,
            ..tiny
        },
        ModelSpec {
            tie_word_embeddings: true,
            ..moe
        },
        // 12 query and KV heads: tp=3 and tp=4 split heads evenly, vocab and MLP unevenly
        ModelSpec {
            name: "qwen3-12-heads".into(),
            num_heads: 12,
            num_kv_heads: 12,
            ..preset("qwen3-tiny").expect("preset")
        },
    ]
}

/// Whether FSDP + TP can split the model's heads over `tp` (else the layout is refused).
fn heads_split(spec: &ModelSpec, tp: u64) -> bool {
    spec.num_heads % tp == 0 && spec.num_kv_heads % tp == 0
}

/// (dp, replicate, tp)
const MESHES: &[(u64, u64, u64)] = &[
    (1, 1, 1),
    (3, 1, 1),
    (4, 1, 1),
    (7, 1, 1),
    (2, 2, 1),
    (2, 1, 2),
    (3, 2, 2),
    (1, 1, 3),
    (2, 1, 4),
];

#[test]
fn every_model_round_trips_on_every_mesh() {
    for spec in models() {
        let cat = Catalogue::of(&spec);
        for &(dp, replicate, tp) in MESHES {
            let side = FsdpBackend.layout(
                &spec,
                &ParallelConfig::from_pairs([("dp", dp), ("replicate", replicate), ("tp", tp)]),
            );
            if !heads_split(&spec, tp) {
                assert!(side.is_err(), "{} tp={tp} was accepted", spec.name);
                continue;
            }
            let side = side.unwrap_or_else(|e| panic!("{}: {e}", spec.name));
            common::check_side(side.as_ref(), &cat);
        }
    }
}

prop_compose! {
    fn small_spec()(
        kv in 1u64..=3,
        group in 1u64..=2,
        head_dim in 1u64..=3,
        hidden in 1u64..=9,
        inter in 1u64..=9,
        vocab in 1u64..40,
        layers in 1u64..=2,
        tied in any::<bool>(),
        bias in any::<bool>(),
        moe in prop::option::of((1u64..=3, 1u64..=5)),
        f32 in any::<bool>(),
    ) -> ModelSpec {
        ModelSpec {
            name: "prop".into(),
            architecture: if moe.is_some() { Architecture::Qwen3Moe } else { Architecture::Qwen3 },
            hidden_size: hidden,
            num_layers: layers,
            num_heads: kv * group,
            num_kv_heads: kv,
            head_dim,
            intermediate_size: inter,
            vocab_size: vocab,
            tie_word_embeddings: tied,
            attention_bias: bias,
            use_qk_norm: false,
            dtype: if f32 { DType::F32 } else { DType::Bf16 },
            moe: moe.map(|(experts, mi)| MoeSpec {
                num_experts: experts,
                experts_per_token: 1,
                moe_intermediate_size: mi,
                decoder_sparse_step: 1,
                mlp_only_layers: vec![0],
                shared_intermediate_size: 0,
                router_bias: false,
                router_fp32: false,
            }),
            mla: None,
            mtp_layers: 0,
            linear: None,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_mesh_partitions_every_parameter_exactly(
        spec in small_spec(),
        dp in 1u64..=6,
        replicate in 1u64..=2,
        tp in 1u64..=4,
    ) {
        let side = FsdpLayout::new(&spec, dp, replicate, tp);
        prop_assert_eq!(side.is_ok(), heads_split(&spec, tp));
        if let Ok(side) = side {
            common::check_side(&side, &Catalogue::of(&spec));
        }
    }
}
