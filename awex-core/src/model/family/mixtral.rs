//! Mixtral (`MixtralForCausalLM`, transformers `models/mixtral/modeling_mixtral.py`): Llama's
//! attention without biases; every layer is MoE, the router `block_sparse_moe.gate` and experts
//! `block_sparse_moe.experts.{e}.w1` (gate), `w2` (down), `w3` (up), each of
//! `intermediate_size` rows, over `num_local_experts`.

use super::{Biases, Family, Preset, Sink, dense, gqa_attention, routed_experts, with_experts};
use crate::model::names::HfNames;
use crate::model::part::Part;
use crate::model::spec::uint;
use crate::model::{ModelError, ModelSpec, MoeSpec};
use serde_json::Value;

/// Mixtral's checkpoint names (`block_sparse_moe` where Llama-shaped MoE models say `mlp`).
const NAMES: HfNames = HfNames {
    layer: &[
        (Part::InputNorm, "input_layernorm.weight"),
        (Part::Q, "self_attn.q_proj.weight"),
        (Part::K, "self_attn.k_proj.weight"),
        (Part::V, "self_attn.v_proj.weight"),
        (Part::O, "self_attn.o_proj.weight"),
        (Part::PostNorm, "post_attention_layernorm.weight"),
        (Part::Router, "block_sparse_moe.gate.weight"),
    ],
    experts: "block_sparse_moe.experts",
    expert: &[
        (Part::ExpertGate, "w1.weight"),
        (Part::ExpertDown, "w2.weight"),
        (Part::ExpertUp, "w3.weight"),
    ],
};

/// The Mixtral family.
pub const FAMILY: Family = Family {
    name: "mixtral",
    hf_class: "MixtralForCausalLM",
    names: &NAMES,
    parse,
    layer,
    check: super::moe_standard,
    presets: &[
        Preset {
            name: "mixtral-tiny",
            about: "4 layers, GQA 4 heads over 2 KV heads, 8 experts of 32 rows, vocab 1000",
            spec: |n| {
                with_experts(
                    dense(&FAMILY, n, 64, 4, 4, 2, 16, 32, 1000, false),
                    8,
                    2,
                    32,
                    vec![],
                )
            },
        },
        Preset {
            name: "mixtral-8x7b",
            about: "mistralai/Mixtral-8x7B-v0.1",
            spec: |n| {
                with_experts(
                    dense(&FAMILY, n, 4096, 32, 32, 8, 128, 14336, 32000, false),
                    8,
                    2,
                    14336,
                    vec![],
                )
            },
        },
    ],
};

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    spec.moe = Some(MoeSpec {
        num_experts: uint(cfg, "num_local_experts")?,
        experts_per_token: uint(cfg, "num_experts_per_tok")?,
        // each expert is an MLP of `intermediate_size` rows; there is no dense MLP
        moe_intermediate_size: spec.intermediate_size,
        decoder_sparse_step: 1,
        mlp_only_layers: Vec::new(),
        shared_intermediate_size: 0,
        router_bias: false,
        router_fp32: false,
    });
    Ok(())
}

fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    gqa_attention(spec, l, Biases::None, false, sink);
    routed_experts(
        spec,
        l,
        [Part::ExpertGate, Part::ExpertDown, Part::ExpertUp],
        sink,
    );
}
