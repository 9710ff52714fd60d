//! Every model x config: valid ranks, holders agreeing with the rank view, full coverage per
//! engine, and materialize -> reconstruct giving back the canonical bytes.

mod common;

use awex_core::DType;
use awex_core::backend::Backend;
use awex_core::backend::ParallelConfig;
use awex_core::model::presets::preset;
use awex_core::model::{Architecture, Catalogue, ModelSpec, MoeSpec};
use awex_sglang::layout::Compared;
use awex_sglang::{SglangBackend, SglangConfigError, SglangLayout};
use proptest::prelude::*;

fn qwen2_bias() -> ModelSpec {
    ModelSpec {
        name: "qwen2-bias-tiny".into(),
        architecture: Architecture::Qwen2,
        attention_bias: true,
        ..preset("qwen3-tiny").expect("preset")
    }
}

fn tied() -> ModelSpec {
    ModelSpec {
        tie_word_embeddings: true,
        ..preset("qwen3-tiny").expect("preset")
    }
}

/// qwen3-moe-tiny with every layer MoE, as SGLang builds a Qwen3-MoE model.
fn moe_tiny() -> ModelSpec {
    let mut spec = preset("qwen3-moe-tiny").expect("preset");
    if let Some(m) = &mut spec.moe {
        m.mlp_only_layers.clear();
    }
    spec
}

fn tied_moe() -> ModelSpec {
    ModelSpec {
        tie_word_embeddings: true,
        ..moe_tiny()
    }
}

fn check(spec: &ModelSpec, tp: u64, ep: u64, engines: u64) {
    let cat = Catalogue::of(spec);
    let side = SglangBackend
        .layout(
            spec,
            &ParallelConfig::from_pairs([("tp", tp), ("ep", ep), ("engines", engines)]),
        )
        .unwrap_or_else(|e| panic!("{} tp={tp} ep={ep} engines={engines}: {e}", spec.name));
    common::check_side(side.as_ref(), &cat);
}

const DENSE_CONFIGS: &[(u64, u64, u64)] = &[
    (1, 1, 1),
    (2, 1, 1),
    (4, 1, 1),
    (2, 1, 2),
    (4, 2, 2),
    (4, 4, 1),
];
const MOE_CONFIGS: &[(u64, u64, u64)] = &[
    (1, 1, 1),
    (2, 1, 1),
    (2, 2, 2),
    (4, 1, 1),
    (4, 2, 1),
    (4, 4, 2),
];

#[test]
fn qwen3_tiny_round_trips_in_every_config() {
    for &(tp, ep, engines) in DENSE_CONFIGS {
        check(&preset("qwen3-tiny").expect("preset"), tp, ep, engines);
    }
}

#[test]
fn qwen3_moe_tiny_with_every_layer_moe_round_trips_in_every_config() {
    for &(tp, ep, engines) in MOE_CONFIGS {
        check(&moe_tiny(), tp, ep, engines);
    }
}

#[test]
fn qwen2_with_attention_bias_round_trips_in_every_config() {
    for &(tp, ep, engines) in DENSE_CONFIGS {
        check(&qwen2_bias(), tp, ep, engines);
    }
}

#[test]
fn tied_models_round_trip_in_every_config() {
    for &(tp, ep, engines) in DENSE_CONFIGS {
        check(&tied(), tp, ep, engines);
    }
    for &(tp, ep, engines) in MOE_CONFIGS {
        check(&tied_moe(), tp, ep, engines);
    }
}

/// An SGLang MoE deployment: tp, ep, engines and whether the shared experts are fused.
fn moe_config(tp: u64, ep: u64, engines: u64, fused: u64) -> ParallelConfig {
    ParallelConfig::from_pairs([
        ("tp", tp),
        ("ep", ep),
        ("engines", engines),
        ("fused_shared_experts", fused),
    ])
}

/// DeepSeek-V3's MLA (with and without `q_lora_rank`), shared experts apart and fused, in
/// every MoE config SGLang accepts for it.
#[test]
fn deepseek_v3_mla_round_trips_in_every_config() {
    let mut no_q_lora = preset("deepseek-v3-tiny").expect("preset");
    no_q_lora.mla.as_mut().expect("mla").q_lora_rank = None;
    let mut checked = 0;
    for spec in [preset("deepseek-v3-tiny").expect("preset"), no_q_lora] {
        let cat = Catalogue::of(&spec);
        for &(tp, ep, engines) in MOE_CONFIGS {
            for fused in [0, 1] {
                let p = moe_config(tp, ep, engines, fused);
                match SglangBackend.layout(&spec, &p) {
                    Ok(side) => {
                        common::check_side(side.as_ref(), &cat);
                        checked += 1;
                    }
                    // SGLang fuses the shared experts at ep=1 only
                    Err(e) => assert!(fused == 1 && ep > 1, "{} {p}: {e}", spec.name),
                }
            }
        }
    }
    assert_eq!(checked, 2 * (6 + 3));
}

/// Qwen3-Next's shared expert apart and fused in every MoE config SGLang accepts for it: fused,
/// SGLang 0.5.23 on a GPU holds it at ep > 1 too, one copy as every EP rank's last local expert
/// (`FusedMoE.__init__`, `_map_global_expert_id_to_local_expert_id`), so every rank layout,
/// the holders derived without them, and the bytes of every engine must agree.
#[test]
fn qwen3_next_shared_expert_round_trips_apart_and_fused_at_every_ep() {
    let spec = preset("qwen3-next-tiny").expect("preset");
    let cat = Catalogue::of(&spec);
    let mut checked = 0;
    for &(tp, ep, engines) in MOE_CONFIGS {
        for fused in [0, 1] {
            let p = moe_config(tp, ep, engines, fused);
            let side = SglangBackend
                .layout(&spec, &p)
                .unwrap_or_else(|e| panic!("{p}: {e}"));
            common::check_side(side.as_ref(), &cat);
            // fused, the shared expert is the last local expert of every rank, MoE-TP share
            // `rank % moe_tp`; apart, it is its own MLP
            let (moe_tp, local) = (tp / ep, 8 / ep);
            for h in side.holders("model.layers.0.mlp.shared_expert.up_proj.weight") {
                if fused == 1 {
                    assert_eq!(h.tensor.as_ref(), "model.layers.0.mlp.experts.w13_weight");
                    assert_eq!(h.tensor_shape.as_slice(), &[local + 1, 2 * 32 / moe_tp, 64]);
                    assert_eq!(h.local_offset.as_slice(), &[local, 32 / moe_tp, 0]);
                    let m = h.region.offset.as_slice()[0] / (32 / moe_tp);
                    let want: Vec<u32> = (0..ep).map(|e| (e * moe_tp + m) as u32).collect();
                    for engine in 0..engines as u32 {
                        let got: Vec<u32> = h
                            .ranks
                            .iter()
                            .filter(|r| r.engine == engine)
                            .map(|r| r.rank)
                            .collect();
                        assert_eq!(got, want, "{p}: share {m}");
                    }
                } else {
                    assert_eq!(
                        h.tensor.as_ref(),
                        "model.layers.0.mlp.shared_expert.gate_up_proj.weight"
                    );
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 2 * MOE_CONFIGS.len());
}

#[test]
fn uneven_vocab_padding_round_trips_at_tp3() {
    let spec = ModelSpec {
        num_heads: 6,
        num_kv_heads: 3,
        intermediate_size: 96,
        ..preset("qwen3-tiny").expect("preset")
    };
    check(&spec, 3, 1, 2);
    check(&spec, 6, 1, 1);
}

/// The error SGLang's rules predict for a config, checked in the same order as the layout.
fn predicted_error(spec: &ModelSpec, tp: u64, ep: u64) -> Option<SglangConfigError> {
    let kv = spec.num_kv_heads;
    let moe = spec.moe.as_ref();
    if tp % ep != 0 {
        return Some(SglangConfigError::EpNotDividingTp { tp, ep });
    }
    if spec.num_heads % tp != 0 {
        return Some(SglangConfigError::Heads {
            heads: spec.num_heads,
            tp,
        });
    }
    let kv_ok = if tp <= kv { kv % tp == 0 } else { tp % kv == 0 };
    if !kv_ok {
        return Some(SglangConfigError::KvHeads { kv_heads: kv, tp });
    }
    let dense = (0..spec.num_layers).find(|&l| !spec.is_moe_layer(l));
    // SGLang's Qwen3-MoE class builds every layer as MoE
    if let (Some(m), Some(layer)) = (moe, dense) {
        return Some(SglangConfigError::DenseLayerEveryLayerMoe {
            class: "Qwen3MoeForCausalLM",
            field: if m.mlp_only_layers.contains(&layer) {
                "mlp_only_layers"
            } else {
                "decoder_sparse_step"
            },
            layer,
        });
    }
    if dense.is_some() && spec.intermediate_size % tp != 0 {
        return Some(SglangConfigError::Intermediate {
            size: spec.intermediate_size,
            tp,
        });
    }
    if let Some(m) = moe.filter(|_| (0..spec.num_layers).any(|l| spec.is_moe_layer(l))) {
        if m.num_experts % ep != 0 {
            return Some(SglangConfigError::Experts {
                experts: m.num_experts,
                ep,
            });
        }
        // Qwen3MoeSparseMoeBlock: "Tensor parallel size {moe_tp} is greater than the number
        // of experts {n}."
        if tp / ep > m.num_experts {
            return Some(SglangConfigError::TpAboveExperts {
                class: "Qwen3MoeForCausalLM",
                module: "Qwen3MoeSparseMoeBlock",
                field: "num_experts",
                compared: Compared::MoeTp,
                size: tp / ep,
                experts: m.num_experts,
                tp,
                ep,
            });
        }
        if m.moe_intermediate_size % (tp / ep) != 0 {
            return Some(SglangConfigError::MoeIntermediate {
                size: m.moe_intermediate_size,
                moe_tp: tp / ep,
                tp,
                ep,
            });
        }
    }
    None
}

prop_compose! {
    fn small_spec()(
        kv in prop::sample::select(vec![1u64, 2, 3, 4]),
        group in 1u64..=3,
        head_dim in prop::sample::select(vec![2u64, 4]),
        hidden in prop::sample::select(vec![4u64, 8]),
        inter in prop::sample::select(vec![4u64, 6, 8, 12]),
        vocab in 1u64..200,
        layers in 1u64..=3,
        tied in any::<bool>(),
        bias in any::<bool>(),
        moe in prop::option::of((prop::sample::select(vec![2u64, 3, 4, 8]), prop::sample::select(vec![2u64, 4, 6]), 1u64..=2, any::<bool>())),
        f32 in any::<bool>(),
    ) -> ModelSpec {
        let arch = match (moe.is_some(), bias) {
            (true, _) => Architecture::Qwen3Moe,
            (false, true) => Architecture::Qwen2,
            (false, false) => Architecture::Llama,
        };
        ModelSpec {
            name: "prop".into(),
            architecture: arch,
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
            moe: moe.map(|(experts, mi, step, dense0)| MoeSpec {
                num_experts: experts,
                experts_per_token: 1,
                moe_intermediate_size: mi,
                decoder_sparse_step: step,
                mlp_only_layers: if dense0 { vec![0] } else { vec![] },
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
    #![proptest_config(ProptestConfig { cases: 768, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_accepted_config_round_trips_and_any_refused_one_says_why(
        spec in small_spec(),
        tp in prop::sample::select(vec![1u64, 2, 3, 4, 6, 8]),
        ep in prop::sample::select(vec![1u64, 2, 4]),
        engines in 1u64..=2,
    ) {
        match (SglangLayout::new(&spec, tp, ep, engines), predicted_error(&spec, tp, ep)) {
            (Ok(side), None) => common::check_side(&side, &Catalogue::of(&spec)),
            (Err(got), Some(want)) => prop_assert_eq!(got, want),
            (Ok(_), Some(want)) => prop_assert!(false, "accepted, but the rules say: {}", want),
            (Err(got), None) => prop_assert!(false, "refused: {}", got),
        }
    }
}
