//! GLM-4.5 MoE (`Glm4MoeForCausalLM`, transformers `models/glm4_moe/modeling_glm4_moe.py`;
//! GLM-4.5-Air and GLM-4.6 use the same class): grouped-query attention whose q/k/v projections
//! carry biases with `attention_bias` (`o_proj` never has one), per-head q/k norms with
//! `use_qk_norm`; the first `first_k_dense_replace` layers dense (`mlp.{gate,up,down}_proj` of
//! `intermediate_size` rows), the others MoE: the router `mlp.gate.weight` and its
//! `mlp.gate.e_score_correction_bias` (fp32), routed experts `mlp.experts.{e}.{gate,up,down}_proj`
//! and shared experts `mlp.shared_experts.{gate,up,down}_proj` of
//! `n_shared_experts * moe_intermediate_size` rows.
//!
//! `partial_rotary_factor` (rotary embedding on part of each head) changes no weight's shape: the
//! rotary frequencies are computed, not stored. The router computes in fp32 (transformers'
//! `Glm4MoeTopkRouter` casts its weight): the spec says so (`router_fp32`) for the engines that
//! hold it in fp32.
//!
//! The multi-token-prediction layers a checkpoint may hold after the decoder layers
//! (`num_nextn_predict_layers`, `model.layers.{num_hidden_layers + i}.*`) are not part of the
//! model awex moves: the catalogue lists the `num_hidden_layers` decoder layers only (as for
//! DeepSeek-V3; transformers' class ignores them on load too), the spec records the count
//! (`mtp_layers`), and a checkpoint's MTP tensors are skipped by [`crate::model::NotMoved`].

use super::{Biases, Family, Preset, Sink, dense, dense_mlp, gqa_attention, shared_moe};
use super::{SharedMoeDefaults, SharedMoeSizes, parse_shared_moe, with_shared_experts};
use crate::model::names::{HfNames, LLAMA_NAMES};
use crate::model::part::Part;
use crate::model::spec::opt_bool;
use crate::model::{ModelError, ModelSpec};
use serde_json::Value;

/// GLM-4.5's checkpoint names: Llama's attention and MLP, the router bias and shared experts.
const NAMES: HfNames = HfNames {
    layer: &[
        (Part::InputNorm, "input_layernorm.weight"),
        (Part::Q, "self_attn.q_proj.weight"),
        (Part::K, "self_attn.k_proj.weight"),
        (Part::V, "self_attn.v_proj.weight"),
        (Part::QBias, "self_attn.q_proj.bias"),
        (Part::KBias, "self_attn.k_proj.bias"),
        (Part::VBias, "self_attn.v_proj.bias"),
        (Part::O, "self_attn.o_proj.weight"),
        (Part::QNorm, "self_attn.q_norm.weight"),
        (Part::KNorm, "self_attn.k_norm.weight"),
        (Part::PostNorm, "post_attention_layernorm.weight"),
        (Part::Gate, "mlp.gate_proj.weight"),
        (Part::Up, "mlp.up_proj.weight"),
        (Part::Down, "mlp.down_proj.weight"),
        (Part::Router, "mlp.gate.weight"),
        (Part::RouterBias, "mlp.gate.e_score_correction_bias"),
        (Part::SharedGate, "mlp.shared_experts.gate_proj.weight"),
        (Part::SharedUp, "mlp.shared_experts.up_proj.weight"),
        (Part::SharedDown, "mlp.shared_experts.down_proj.weight"),
    ],
    experts: LLAMA_NAMES.experts,
    expert: LLAMA_NAMES.expert,
};

/// The GLM-4.5 MoE family.
pub const FAMILY: Family = Family {
    name: "glm4-moe",
    hf_class: "Glm4MoeForCausalLM",
    names: &NAMES,
    parse,
    layer,
    check: super::moe_standard,
    presets: &[
        Preset {
            name: "glm-4.5-tiny",
            about: "3 layers (layer 0 dense), q/k/v biases, q/k norms, 8 experts + 1 shared, router bias",
            spec: |n| glm(n, (64, 3, 4, 2, 16, 128, 1000), (8, 2, 32, 1, 1), true),
        },
        Preset {
            name: "glm-4.5",
            about: "zai-org/GLM-4.5 (355B): 92 layers, first 3 dense, 160 experts + 1 shared, q/k norms",
            spec: |n| {
                ModelSpec {
                    // its checkpoint holds one MTP layer after the decoder layers
                    mtp_layers: 1,
                    ..glm(
                        n,
                        (5120, 92, 96, 8, 128, 12288, 151552),
                        (160, 8, 1536, 1, 3),
                        true,
                    )
                }
            },
        },
        Preset {
            name: "glm-4.5-air",
            about: "zai-org/GLM-4.5-Air (106B): 46 layers, first dense, 128 experts + 1 shared, no q/k norms",
            spec: |n| {
                ModelSpec {
                    // its checkpoint holds one MTP layer after the decoder layers
                    mtp_layers: 1,
                    ..glm(
                        n,
                        (4096, 46, 96, 8, 128, 10944, 151552),
                        (128, 8, 1408, 1, 1),
                        false,
                    )
                }
            },
        },
    ],
};

/// A preset: `(hidden, layers, heads, KV heads, head_dim, intermediate, vocab)`, `(experts, per
/// token, moe_intermediate, shared experts, dense first layers)`, q/k norms. Every published
/// GLM-4.5 MoE has q/k/v biases and an untied head.
fn glm(
    name: &str,
    (hidden, layers, heads, kv, head_dim, inter, vocab): (u64, u64, u64, u64, u64, u64, u64),
    moe: SharedMoeSizes,
    qk_norm: bool,
) -> ModelSpec {
    let spec = dense(
        &FAMILY, name, hidden, layers, heads, kv, head_dim, inter, vocab, false,
    );
    let mut spec = with_shared_experts(spec, moe, true);
    spec.attention_bias = true;
    spec.use_qk_norm = qk_norm;
    spec
}

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    spec.attention_bias = opt_bool(cfg, "attention_bias", false)?;
    spec.use_qk_norm = opt_bool(cfg, "use_qk_norm", false)?;
    // transformers' Glm4MoeConfig: first_k_dense_replace 1, n_shared_experts 1; transformers,
    // SGLang and vLLM build layer l MoE when l >= first_k_dense_replace (no `mlp_only_layers`
    // or frequency in this class), and compute the router in fp32
    parse_shared_moe(
        cfg,
        spec,
        SharedMoeDefaults {
            first_dense: 1,
            shared: 1,
            router_fp32: true,
        },
    )
}

fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    let biases = if spec.attention_bias {
        Biases::Qkv
    } else {
        Biases::None
    };
    gqa_attention(spec, l, biases, spec.use_qk_norm, sink);
    if spec.is_moe_layer(l) {
        shared_moe(spec, l, sink);
    } else {
        dense_mlp(spec, l, sink);
    }
}
