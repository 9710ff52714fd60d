//! DeepSeek-V3 (`DeepseekV3ForCausalLM`, transformers `models/deepseek_v3/modeling_deepseek_v3.py`;
//! Kimi-K2 uses the same class): multi-head latent attention (`q_a_proj` / `q_a_layernorm` /
//! `q_b_proj`, or a plain `q_proj` without `q_lora_rank`; `kv_a_proj_with_mqa` holding the
//! key/value down projection and the shared rotary key, `kv_a_layernorm`, `kv_b_proj`), the
//! first `first_k_dense_replace` layers dense, the others MoE with a router and its fp32
//! `e_score_correction_bias`, routed experts and shared experts (`mlp.shared_experts`, of
//! `n_shared_experts * moe_intermediate_size` rows).
//!
//! The multi-token-prediction layers a checkpoint may hold after the decoder layers
//! (`num_nextn_predict_layers`, `model.layers.{num_hidden_layers + i}.*`) are not part of the
//! model awex moves: the catalogue lists the `num_hidden_layers` decoder layers only, the spec
//! records the count (`mtp_layers`), and a checkpoint's MTP tensors are skipped by the rule
//! [`crate::model::NotMoved`] names.

use super::{Family, Preset, Sink, dense, dense_mlp, shared_moe};
use super::{SharedMoeDefaults, SharedMoeSizes, parse_shared_moe, with_shared_experts};
use crate::dims::Dims;
use crate::model::names::{Canon, HfNames};
use crate::model::part::Part;
use crate::model::spec::{MlaSpec, opt_bool, opt_uint, uint};
use crate::model::{ModelError, ModelSpec};
use serde_json::Value;

/// DeepSeek-V3's checkpoint names (DeepSeek-V2's too).
pub(crate) const NAMES: HfNames = HfNames {
    layer: &[
        (Part::InputNorm, "input_layernorm.weight"),
        (Part::Q, "self_attn.q_proj.weight"),
        (Part::QDown, "self_attn.q_a_proj.weight"),
        (Part::QDownNorm, "self_attn.q_a_layernorm.weight"),
        (Part::QUp, "self_attn.q_b_proj.weight"),
        (Part::KvDown, "self_attn.kv_a_proj_with_mqa.weight"),
        (Part::KvDownNorm, "self_attn.kv_a_layernorm.weight"),
        (Part::KvUp, "self_attn.kv_b_proj.weight"),
        (Part::O, "self_attn.o_proj.weight"),
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
    experts: "mlp.experts",
    expert: &[
        (Part::ExpertGate, "gate_proj.weight"),
        (Part::ExpertUp, "up_proj.weight"),
        (Part::ExpertDown, "down_proj.weight"),
    ],
};

/// The DeepSeek-V3 family.
pub const FAMILY: Family = Family {
    name: "deepseek-v3",
    hf_class: "DeepseekV3ForCausalLM",
    names: &NAMES,
    parse,
    layer,
    check: check_mla,
    presets: &[
        Preset {
            name: "deepseek-v3-tiny",
            about: "3 layers (layer 0 dense), MLA with q_lora_rank, 8 experts + 1 shared, router bias",
            spec: |n| {
                deepseek(
                    n,
                    (64, 3, 4, 1000, 128),
                    (8, 2, 32, 1, 1),
                    mla(Some(32), 16, 16, 8, 16),
                )
            },
        },
        Preset {
            name: "deepseek-v3",
            about: "deepseek-ai/DeepSeek-V3 (671B): 61 layers, 256 experts + 1 shared, first 3 dense",
            spec: |n| {
                ModelSpec {
                    // its checkpoint holds one MTP layer (model.layers.61); Kimi-K2's holds none
                    mtp_layers: 1,
                    ..deepseek(
                        n,
                        (7168, 61, 128, 129280, 18432),
                        (256, 8, 2048, 1, 3),
                        mla(Some(1536), 512, 128, 64, 128),
                    )
                }
            },
        },
        Preset {
            name: "mla-moe-30b",
            about: "a 30B DeepSeek-V3-shaped model (the colocated benchmark's MLA + MoE): 24 layers, 64 experts + 1 shared, first dense",
            spec: |n| {
                deepseek(
                    n,
                    (4096, 24, 32, 129280, 11008),
                    (64, 6, 1536, 1, 1),
                    mla(Some(1536), 512, 128, 64, 128),
                )
            },
        },
        Preset {
            name: "kimi-k2",
            about: "moonshotai/Kimi-K2 (1T): 61 layers, 64 heads, 384 experts + 1 shared, first dense",
            spec: |n| {
                deepseek(
                    n,
                    (7168, 61, 64, 163840, 18432),
                    (384, 8, 2048, 1, 1),
                    mla(Some(1536), 512, 128, 64, 128),
                )
            },
        },
    ],
};

pub(crate) const fn mla(
    q_lora: Option<u64>,
    kv_lora: u64,
    nope: u64,
    rope: u64,
    v: u64,
) -> MlaSpec {
    MlaSpec {
        q_lora_rank: q_lora,
        kv_lora_rank: kv_lora,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rope,
        v_head_dim: v,
    }
}

/// A preset: `(hidden, layers, heads, vocab, intermediate)`, `(experts, per token,
/// moe_intermediate, shared experts, dense first layers)`, the MLA sizes.
fn deepseek(
    name: &str,
    (hidden, layers, heads, vocab, inter): (u64, u64, u64, u64, u64),
    moe: SharedMoeSizes,
    mla: MlaSpec,
) -> ModelSpec {
    let head_dim = mla.qk_rope_head_dim;
    let spec = dense(
        &FAMILY, name, hidden, layers, heads, heads, head_dim, inter, vocab, false,
    );
    let mut spec = with_shared_experts(spec, moe, false);
    spec.mla = Some(mla);
    spec
}

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    // transformers' DeepseekV3Config: first_k_dense_replace 3, n_shared_experts 1; the router
    // runs in the model's dtype and always has its score-correction bias
    parse_mla(
        cfg,
        spec,
        SharedMoeDefaults {
            first_dense: 3,
            shared: 1,
            router_fp32: false,
        },
    )
}

/// The config of a DeepSeek-V2 or V3 model: MLA's sizes, the MoE block with `defaults` for
/// what the config leaves out, no attention biases, `moe_layer_freq` 1.
pub(crate) fn parse_mla(
    cfg: &Value,
    spec: &mut ModelSpec,
    defaults: SharedMoeDefaults,
) -> Result<(), ModelError> {
    if opt_bool(cfg, "attention_bias", false)? {
        return Err(ModelError::BadField {
            field: "attention_bias",
            message:
                "awex supports DeepSeek models without attention biases (attention_bias: false)"
                    .into(),
        });
    }
    // SGLang and DeepSeek's own code make layer l MoE when l >= first_k_dense_replace and
    // l % moe_layer_freq == 0; transformers ignores the frequency. Every published checkpoint
    // has 1, where they agree.
    if let Some(f) = opt_uint(cfg, "moe_layer_freq")?
        && f != 1
    {
        return Err(ModelError::BadField {
            field: "moe_layer_freq",
            message: format!(
                "awex supports moe_layer_freq 1 (every layer from first_k_dense_replace on is MoE), found {f}"
            ),
        });
    }
    parse_shared_moe(cfg, spec, defaults)?;
    let rope = uint(cfg, "qk_rope_head_dim")?;
    spec.mla = Some(MlaSpec {
        q_lora_rank: opt_uint(cfg, "q_lora_rank")?,
        kv_lora_rank: uint(cfg, "kv_lora_rank")?,
        qk_nope_head_dim: uint(cfg, "qk_nope_head_dim")?,
        qk_rope_head_dim: rope,
        v_head_dim: uint(cfg, "v_head_dim")?,
    });
    // transformers sets head_dim = qk_rope_head_dim; MLA's shapes come from `mla`
    spec.head_dim = rope;
    Ok(())
}

/// Checks MLA's sizes: present, each at least 1 (`q_lora_rank` may be absent: a plain
/// `q_proj`), and `head_dim` the rotary size as the parser sets it. Every one of them is a
/// dimension of some tensor of the layer; a zero would make that tensor empty.
pub(crate) fn check_mla(spec: &ModelSpec) -> Result<(), ModelError> {
    super::no_linear(spec)?;
    super::needs_moe(spec)?;
    let Some(a) = &spec.mla else {
        return Err(ModelError::Inconsistent(format!(
            "{} has multi-head latent attention, but the model gives no MLA sizes (`mla`: kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank)",
            spec.architecture.hf_name()
        )));
    };
    if a.q_lora_rank == Some(0) {
        return Err(ModelError::BadField {
            field: "q_lora_rank",
            message: "must be at least 1 (DeepSeek-V3 has 1536), or null for a plain q_proj (DeepSeek-V2-Lite)".into(),
        });
    }
    let sizes = [
        ("kv_lora_rank", a.kv_lora_rank, "DeepSeek-V3 has 512"),
        (
            "qk_nope_head_dim",
            a.qk_nope_head_dim,
            "DeepSeek-V3 has 128",
        ),
        ("qk_rope_head_dim", a.qk_rope_head_dim, "DeepSeek-V3 has 64"),
        ("v_head_dim", a.v_head_dim, "DeepSeek-V3 has 128"),
    ];
    for (field, v, example) in sizes {
        if v == 0 {
            return Err(ModelError::BadField {
                field,
                message: format!("must be at least 1 ({example})"),
            });
        }
    }
    if spec.head_dim != a.qk_rope_head_dim {
        return Err(ModelError::Inconsistent(format!(
            "head_dim={} must equal qk_rope_head_dim={} in a model with multi-head latent attention",
            spec.head_dim, a.qk_rope_head_dim
        )));
    }
    Ok(())
}

pub(crate) fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    let h = spec.hidden_size;
    let heads = spec.num_heads;
    let part =
        |sink: &mut dyn Sink, p: Part, shape: &[u64]| sink.part(Canon::at(p, l), Dims::new(shape));
    part(sink, Part::InputNorm, &[h]);
    if let Some(a) = &spec.mla {
        let qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
        match a.q_lora_rank {
            Some(r) => {
                part(sink, Part::QDown, &[r, h]);
                part(sink, Part::QDownNorm, &[r]);
                part(sink, Part::QUp, &[heads * qk, r]);
            }
            None => part(sink, Part::Q, &[heads * qk, h]),
        }
        let kv = a.kv_lora_rank;
        part(sink, Part::KvDown, &[kv + a.qk_rope_head_dim, h]);
        part(sink, Part::KvDownNorm, &[kv]);
        part(
            sink,
            Part::KvUp,
            &[heads * (a.qk_nope_head_dim + a.v_head_dim), kv],
        );
        part(sink, Part::O, &[h, heads * a.v_head_dim]);
    }
    part(sink, Part::PostNorm, &[h]);
    if spec.is_moe_layer(l) {
        shared_moe(spec, l, sink);
    } else {
        dense_mlp(spec, l, sink);
    }
}
