//! Qwen3-Next (`Qwen3NextForCausalLM`, transformers `models/qwen3_next/modeling_qwen3_next.py`):
//! a hybrid of Gated DeltaNet linear attention and gated full attention. `layer_types` (or,
//! without it, `full_attention_interval`, default 4: layer `l` is full when
//! `(l + 1) % interval == 0`) says which layers keep full attention.
//!
//! - A linear-attention layer (`Qwen3NextGatedDeltaNet`) holds `linear_attn.in_proj_qkvz`
//!   (`[2 * key_dim + 2 * value_dim, hidden]`, rows grouped by key head:
//!   `fix_query_key_value_ordering` views them as `[key heads, q | k | v | z]`),
//!   `linear_attn.in_proj_ba` (`[2 * value_heads, hidden]`, grouped by key head `[b | a]`),
//!   `linear_attn.conv1d.weight` (`[2 * key_dim + value_dim, 1, kernel]`, channels
//!   `[q | k | v]`, each over all heads), per-value-head `dt_bias` and `A_log`,
//!   `linear_attn.norm.weight` (`[value_head_dim]`) and `linear_attn.out_proj`.
//! - A full-attention layer (`Qwen3NextAttention`) holds `q_proj` of
//!   `[heads * 2 * head_dim, hidden]` (`[query | gate]` per head: `forward` chunks
//!   `view(..., -1, head_dim * 2)` in two), `k_proj`, `v_proj`, `o_proj`, `q_norm`, `k_norm`.
//! - The MLP (`Qwen3NextSparseMoeBlock`) is MoE when the layer is not in `mlp_only_layers` and
//!   `(l + 1) % decoder_sparse_step == 0`: a router `mlp.gate`, routed experts, one shared
//!   expert `mlp.shared_expert.{gate,up,down}_proj` of `shared_expert_intermediate_size` rows
//!   and its sigmoid gate `mlp.shared_expert_gate` (`[1, hidden]`); dense otherwise.
//!
//! The catalogue names the experts one by one (`mlp.experts.{e}.{gate,up,down}_proj.weight`),
//! as the published checkpoints do; transformers 5 fuses them in memory
//! (`conversion_mapping.py`, `qwen3_next` -> `qwen2_moe`: `mlp.experts.gate_up_proj`).
//!
//! `A_log` is fp32 in the catalogue: SGLang 0.5.23 (`models/qwen3_next.py`,
//! `Qwen3GatedDeltaNet.__init__`) and vLLM 0.33 (`layers/mamba/gdn/qwen_gdn_linear_attn.py`,
//! `QwenGatedDeltaNetAttention.__init__`) both create it `dtype=torch.float32`; `dt_bias` is
//! in the model's dtype there (the default dtype at construction).

use super::{Family, Preset, Sink, dense, dense_mlp, layer_list};
use crate::dims::Dims;
use crate::dtype::DType;
use crate::model::names::{Canon, HfNames};
use crate::model::part::Part;
use crate::model::spec::{LinearAttnSpec, opt_bool, opt_uint, uint};
use crate::model::{ModelError, ModelSpec, MoeSpec};
use serde_json::Value;

/// Qwen3-Next's checkpoint names.
pub(crate) const NAMES: HfNames = HfNames {
    layer: &[
        (Part::InputNorm, "input_layernorm.weight"),
        (Part::Q, "self_attn.q_proj.weight"),
        (Part::K, "self_attn.k_proj.weight"),
        (Part::V, "self_attn.v_proj.weight"),
        (Part::O, "self_attn.o_proj.weight"),
        (Part::QNorm, "self_attn.q_norm.weight"),
        (Part::KNorm, "self_attn.k_norm.weight"),
        (Part::LinQkvz, "linear_attn.in_proj_qkvz.weight"),
        (Part::LinBa, "linear_attn.in_proj_ba.weight"),
        (Part::LinQkv, "linear_attn.in_proj_qkv.weight"),
        (Part::LinZ, "linear_attn.in_proj_z.weight"),
        (Part::LinB, "linear_attn.in_proj_b.weight"),
        (Part::LinA, "linear_attn.in_proj_a.weight"),
        (Part::LinConv, "linear_attn.conv1d.weight"),
        (Part::LinDtBias, "linear_attn.dt_bias"),
        (Part::LinALog, "linear_attn.A_log"),
        (Part::LinNorm, "linear_attn.norm.weight"),
        (Part::LinOut, "linear_attn.out_proj.weight"),
        (Part::PostNorm, "post_attention_layernorm.weight"),
        (Part::Gate, "mlp.gate_proj.weight"),
        (Part::Up, "mlp.up_proj.weight"),
        (Part::Down, "mlp.down_proj.weight"),
        (Part::Router, "mlp.gate.weight"),
        (Part::SharedGate, "mlp.shared_expert.gate_proj.weight"),
        (Part::SharedUp, "mlp.shared_expert.up_proj.weight"),
        (Part::SharedDown, "mlp.shared_expert.down_proj.weight"),
        (Part::SharedExpertGate, "mlp.shared_expert_gate.weight"),
    ],
    experts: "mlp.experts",
    expert: &[
        (Part::ExpertGate, "gate_proj.weight"),
        (Part::ExpertUp, "up_proj.weight"),
        (Part::ExpertDown, "down_proj.weight"),
    ],
};

/// The Qwen3-Next family.
pub const FAMILY: Family = Family {
    name: "qwen3-next",
    hf_class: "Qwen3NextForCausalLM",
    names: &NAMES,
    parse,
    layer,
    check: |s| check_linear(s).and_then(|()| super::needs_moe(s)),
    presets: &[
        Preset {
            name: "qwen3-next-tiny",
            about: "4 layers (3 Gated DeltaNet, 1 gated full attention), 4 key / 8 value linear heads, 8 experts + a shared expert",
            spec: |n| {
                hybrid(
                    with_shared_expert(
                        dense(&FAMILY, n, 64, 4, 4, 2, 16, 128, 1000, false),
                        (8, 2, 32, 32),
                    ),
                    linear(4, 8, 16, 16, 4, 4),
                )
            },
        },
        Preset {
            name: "qwen3-next-80b-a3b",
            about: "Qwen/Qwen3-Next-80B-A3B: 48 layers (every 4th full attention), 512 experts + 1 shared",
            spec: |n| {
                hybrid(
                    with_shared_expert(
                        dense(&FAMILY, n, 2048, 48, 16, 2, 256, 5120, 151936, false),
                        (512, 10, 512, 512),
                    ),
                    linear(16, 32, 128, 128, 4, 48),
                )
            },
        },
    ],
};

/// Linear-attention sizes `(key heads, value heads, key head dim, value head dim, kernel)` with
/// every 4th of `layers` layers full attention (transformers' default `full_attention_interval`).
pub(crate) fn linear(
    key_heads: u64,
    value_heads: u64,
    key_dim: u64,
    value_dim: u64,
    kernel: u64,
    layers: u64,
) -> LinearAttnSpec {
    LinearAttnSpec {
        num_key_heads: key_heads,
        num_value_heads: value_heads,
        key_head_dim: key_dim,
        value_head_dim: value_dim,
        conv_kernel: kernel,
        full_attention_layers: (0..layers).filter(|l| (l + 1) % 4 == 0).collect(),
        attn_output_gate: true,
    }
}

/// `spec` with Gated DeltaNet layers.
pub(crate) fn hybrid(spec: ModelSpec, linear: LinearAttnSpec) -> ModelSpec {
    ModelSpec {
        linear: Some(linear),
        use_qk_norm: true,
        ..spec
    }
}

/// `spec` with routed experts on every layer and one gated shared expert: `(experts, per
/// token, moe_intermediate, shared_expert_intermediate)`.
pub(crate) fn with_shared_expert(
    spec: ModelSpec,
    (experts, per_token, moe_inter, shared): (u64, u64, u64, u64),
) -> ModelSpec {
    let mut spec = super::with_experts(spec, experts, per_token, moe_inter, vec![]);
    if let Some(m) = &mut spec.moe {
        m.shared_intermediate_size = shared;
    }
    spec
}

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    parse_hybrid(cfg, spec)?;
    spec.moe = Some(MoeSpec {
        decoder_sparse_step: opt_uint(cfg, "decoder_sparse_step")?.unwrap_or(1),
        mlp_only_layers: layer_list(cfg, "mlp_only_layers")?,
        ..parse_qwen_moe(cfg)?
    });
    Ok(())
}

/// The MoE block of Qwen3-Next and Qwen3.5-MoE: `num_experts`, `num_experts_per_tok`,
/// `moe_intermediate_size` and `shared_expert_intermediate_size` (the gated shared expert
/// every token also goes through: transformers builds it whatever its size, so it must be at
/// least 1); every layer MoE (the caller sets the sparse step and dense layers).
pub(crate) fn parse_qwen_moe(cfg: &Value) -> Result<MoeSpec, ModelError> {
    let shared = uint(cfg, "shared_expert_intermediate_size")?;
    if shared == 0 {
        return Err(ModelError::BadField {
            field: "shared_expert_intermediate_size",
            message: "must be at least 1: the model's MoE block always holds a shared expert and its gate (Qwen3-Next-80B-A3B has 512)".into(),
        });
    }
    Ok(MoeSpec {
        num_experts: uint(cfg, "num_experts")?,
        experts_per_token: uint(cfg, "num_experts_per_tok")?,
        moe_intermediate_size: uint(cfg, "moe_intermediate_size")?,
        decoder_sparse_step: 1,
        mlp_only_layers: Vec::new(),
        shared_intermediate_size: shared,
        router_bias: false,
        router_fp32: false,
    })
}

/// The hybrid attention of Qwen3-Next and Qwen3.5: the linear-attention sizes, which layers
/// keep full attention, per-head q/k norms, no attention biases, a gated `q_proj`.
pub(crate) fn parse_hybrid(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    if opt_bool(cfg, "attention_bias", false)? {
        return Err(ModelError::BadField {
            field: "attention_bias",
            message: "awex supports hybrid Qwen models without attention biases (attention_bias: false; SGLang 0.5.23's qkv_proj of these classes has no bias)".into(),
        });
    }
    // transformers' Qwen3NextAttention / Qwen3_5Attention always build the gated q_proj; the
    // engines read `attn_output_gate` (default true): a config saying false would load into
    // a different model on each side
    if !opt_bool(cfg, "attn_output_gate", true)? {
        return Err(ModelError::BadField {
            field: "attn_output_gate",
            message: "must be true (or absent): transformers builds every full-attention q_proj with its output gate".into(),
        });
    }
    spec.use_qk_norm = true;
    let layers = spec.num_layers;
    let full = match cfg.get("layer_types") {
        None | Some(Value::Null) => {
            let interval = opt_uint(cfg, "full_attention_interval")?.unwrap_or(4);
            if interval == 0 {
                return Err(ModelError::BadField {
                    field: "full_attention_interval",
                    message: "must be at least 1".into(),
                });
            }
            (0..layers).filter(|l| (l + 1) % interval == 0).collect()
        }
        Some(Value::Array(types)) => {
            if types.len() as u64 != layers {
                return Err(ModelError::Inconsistent(format!(
                    "layer_types lists {} layers but num_hidden_layers is {layers}",
                    types.len()
                )));
            }
            let mut full = Vec::new();
            for (l, t) in types.iter().enumerate() {
                match t.as_str() {
                    Some("full_attention") => full.push(l as u64),
                    Some("linear_attention") => {}
                    _ => {
                        return Err(ModelError::BadField {
                            field: "layer_types",
                            message: format!(
                                "layer {l} is {t}; expected \"linear_attention\" or \"full_attention\""
                            ),
                        });
                    }
                }
            }
            full
        }
        Some(v) => {
            return Err(ModelError::BadField {
                field: "layer_types",
                message: format!("expected a list of layer types, found {v}"),
            });
        }
    };
    spec.linear = Some(LinearAttnSpec {
        num_key_heads: uint(cfg, "linear_num_key_heads")?,
        num_value_heads: uint(cfg, "linear_num_value_heads")?,
        key_head_dim: uint(cfg, "linear_key_head_dim")?,
        value_head_dim: uint(cfg, "linear_value_head_dim")?,
        conv_kernel: uint(cfg, "linear_conv_kernel_dim")?,
        full_attention_layers: full,
        attn_output_gate: true,
    });
    Ok(())
}

/// Checks the linear-attention sizes: present, each at least 1, value heads a multiple of
/// key heads (each key head serves `value_heads / key_heads` value heads), the full-attention
/// layers within the model; and no MLA.
pub(crate) fn check_linear(spec: &ModelSpec) -> Result<(), ModelError> {
    super::no_mla(spec)?;
    let Some(a) = &spec.linear else {
        return Err(ModelError::Inconsistent(format!(
            "{} mixes Gated DeltaNet linear attention with full attention, but the model gives no linear-attention sizes (`linear`: num_key_heads, num_value_heads, key_head_dim, value_head_dim, conv_kernel, full_attention_layers)",
            spec.architecture.hf_name()
        )));
    };
    for (field, v) in [
        ("linear_num_key_heads", a.num_key_heads),
        ("linear_num_value_heads", a.num_value_heads),
        ("linear_key_head_dim", a.key_head_dim),
        ("linear_value_head_dim", a.value_head_dim),
        ("linear_conv_kernel_dim", a.conv_kernel),
    ] {
        if v == 0 {
            return Err(ModelError::BadField {
                field,
                message: "must be at least 1".into(),
            });
        }
    }
    if a.num_value_heads % a.num_key_heads != 0 {
        return Err(ModelError::Inconsistent(format!(
            "linear_num_value_heads={} must be a multiple of linear_num_key_heads={} (each key head serves the same number of value heads)",
            a.num_value_heads, a.num_key_heads
        )));
    }
    if let Some(&l) = a
        .full_attention_layers
        .iter()
        .find(|&&l| l >= spec.num_layers)
    {
        return Err(ModelError::Inconsistent(format!(
            "full-attention layer {l} but the model has {} layers",
            spec.num_layers
        )));
    }
    if !a.attn_output_gate {
        return Err(ModelError::BadField {
            field: "attn_output_gate",
            message:
                "must be true: transformers builds every full-attention q_proj with its output gate"
                    .into(),
        });
    }
    Ok(())
}

/// How a family's linear-attention layer spells its input projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum InProj {
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped by key head.
    Grouped,
    /// Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, each over all heads.
    Split,
}

/// The attention half of hybrid layer `l` (input norm to post-attention norm).
pub(crate) fn hybrid_attention(spec: &ModelSpec, l: u64, proj: InProj, sink: &mut dyn Sink) {
    let h = spec.hidden_size;
    let part =
        |sink: &mut dyn Sink, p: Part, shape: &[u64]| sink.part(Canon::at(p, l), Dims::new(shape));
    part(sink, Part::InputNorm, &[h]);
    match &spec.linear {
        Some(a) if spec.is_linear_layer(l) => {
            let (key, value, nv) = (a.key_dim(), a.value_dim(), a.num_value_heads);
            match proj {
                InProj::Grouped => {
                    part(sink, Part::LinQkvz, &[2 * key + 2 * value, h]);
                    part(sink, Part::LinBa, &[2 * nv, h]);
                }
                InProj::Split => {
                    part(sink, Part::LinQkv, &[2 * key + value, h]);
                    part(sink, Part::LinZ, &[value, h]);
                    part(sink, Part::LinB, &[nv, h]);
                    part(sink, Part::LinA, &[nv, h]);
                }
            }
            part(sink, Part::LinConv, &[a.conv_dim(), 1, a.conv_kernel]);
            part(sink, Part::LinDtBias, &[nv]);
            sink.part_as(Canon::at(Part::LinALog, l), Dims::new(&[nv]), DType::F32);
            part(sink, Part::LinNorm, &[a.value_head_dim]);
            part(sink, Part::LinOut, &[h, value]);
        }
        _ => {
            let (q, kv) = (spec.q_size(), spec.kv_size());
            let gate = if spec.gated_q() { 2 } else { 1 };
            part(sink, Part::Q, &[gate * q, h]);
            part(sink, Part::K, &[kv, h]);
            part(sink, Part::V, &[kv, h]);
            part(sink, Part::O, &[h, q]);
            part(sink, Part::QNorm, &[spec.head_dim]);
            part(sink, Part::KNorm, &[spec.head_dim]);
        }
    }
    part(sink, Part::PostNorm, &[h]);
}

/// A Qwen MoE block with its gated shared expert: router, routed experts (gate, up, down),
/// the shared expert's gated MLP and its gate.
pub(crate) fn qwen_shared_moe(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    let Some(m) = &spec.moe else { return };
    let h = spec.hidden_size;
    super::routed_experts(
        spec,
        l,
        [Part::ExpertGate, Part::ExpertUp, Part::ExpertDown],
        sink,
    );
    let s = m.shared_intermediate_size;
    sink.part(Canon::at(Part::SharedGate, l), Dims::new(&[s, h]));
    sink.part(Canon::at(Part::SharedUp, l), Dims::new(&[s, h]));
    sink.part(Canon::at(Part::SharedDown, l), Dims::new(&[h, s]));
    sink.part(Canon::at(Part::SharedExpertGate, l), Dims::new(&[1, h]));
}

fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    hybrid_attention(spec, l, InProj::Grouped, sink);
    if spec.is_moe_layer(l) {
        qwen_shared_moe(spec, l, sink);
    } else {
        dense_mlp(spec, l, sink);
    }
}
