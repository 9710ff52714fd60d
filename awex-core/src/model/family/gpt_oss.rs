//! gpt-oss (`GptOssForCausalLM`, transformers `models/gpt_oss/modeling_gpt_oss.py`): grouped
//! query attention with q/k/v/o biases (`attention_bias`, default true) and one learned sink
//! logit per query head (`GptOssAttention.sinks`, `[heads]`), layers alternating sliding-window
//! and full attention (`layer_types`; the weights are the same for both), and every layer a MoE
//! block (`GptOssMLP`):
//!
//! - the router `mlp.router` (`GptOssTopKRouter`): `weight` `[experts, hidden]` and `bias`
//!   `[experts]`, both in the model's dtype;
//! - the routed experts (`GptOssExperts`) fused over all experts **and transposed** against
//!   the `[out, in]` of a linear layer: `mlp.experts.gate_up_proj` `[experts, hidden,
//!   2 * intermediate]` (`forward`: `x @ gate_up_proj[e] + gate_up_proj_bias[e]`; `_apply_gate`
//!   takes gate as `[..., ::2]` and up as `[..., 1::2]`: gate and up **interleaved** along the
//!   last dim), `mlp.experts.gate_up_proj_bias` `[experts, 2 * intermediate]` (interleaved
//!   likewise), `mlp.experts.down_proj` `[experts, intermediate, hidden]` and
//!   `mlp.experts.down_proj_bias` `[experts, hidden]`. Each expert is an MLP of
//!   `intermediate_size` rows; there is no dense MLP and no shared expert.
//!
//! The catalogue names these tensors as transformers holds them and as its `save_pretrained`
//! writes a bf16 checkpoint (transformers 5.19.0: `tests/fixtures/hf/gpt-oss.json`), so the
//! expert parts are per-layer tensors over all experts ([`Part::ExpertsGateUp`] etc., role
//! [`crate::model::Role::StackedExperts`]),
//! not per-expert ones. The published `openai/gpt-oss-*` checkpoints store the expert weights
//! in MXFP4 (`gate_up_proj_blocks` / `_scales`, `quantization_config.quant_method: "mxfp4"`),
//! which awex does not encode: such a config is refused by name (see `docs/models.md`).
//!
//! The activation (`_apply_gate`: gate clamped above at `swiglu_limit`, up clamped to
//! `[-swiglu_limit, swiglu_limit]`, `(up + 1) * gate * sigmoid(swiglu_alpha * gate)`) has no
//! weights; its constants are checked to be finite and positive when present.

use super::{Family, Preset, Sink};
use crate::dims::Dims;
use crate::model::names::{Canon, HfNames};
use crate::model::part::Part;
use crate::model::spec::{opt_bool, opt_uint, uint};
use crate::model::{ModelError, ModelSpec, MoeSpec};
use serde_json::Value;

/// gpt-oss's checkpoint names (transformers 5.19.0 `GptOssForCausalLM.state_dict()`, which
/// `save_pretrained` writes unchanged).
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
        (Part::OBias, "self_attn.o_proj.bias"),
        (Part::Sinks, "self_attn.sinks"),
        (Part::PostNorm, "post_attention_layernorm.weight"),
        (Part::Router, "mlp.router.weight"),
        (Part::RouterBias, "mlp.router.bias"),
        (Part::ExpertsGateUp, "mlp.experts.gate_up_proj"),
        (Part::ExpertsGateUpBias, "mlp.experts.gate_up_proj_bias"),
        (Part::ExpertsDown, "mlp.experts.down_proj"),
        (Part::ExpertsDownBias, "mlp.experts.down_proj_bias"),
    ],
    // no per-expert tensors: the experts are fused per layer (above)
    experts: "mlp.experts",
    expert: &[],
};

/// The gpt-oss family.
pub const FAMILY: Family = Family {
    name: "gpt-oss",
    hf_class: "GptOssForCausalLM",
    names: &NAMES,
    parse,
    layer,
    check,
    presets: &[
        Preset {
            name: "gpt-oss-tiny",
            about: "2 layers (sliding, full), 4 heads over 2 KV heads with sinks and q/k/v/o biases, 8 fused experts of 48 rows with biases",
            spec: |n| gpt_oss(n, 64, 2, 4, 2, 16, 48, 1000, 8, 2),
        },
        Preset {
            name: "gpt-oss-20b",
            about: "openai/gpt-oss-20b in bf16: 24 layers, 32 experts (4 per token), ~20.9e9 parameters",
            spec: |n| gpt_oss(n, 2880, 24, 64, 8, 64, 2880, 201088, 32, 4),
        },
        Preset {
            name: "gpt-oss-120b",
            about: "openai/gpt-oss-120b in bf16: 36 layers, 128 experts (4 per token), ~116.8e9 parameters",
            spec: |n| gpt_oss(n, 2880, 36, 64, 8, 64, 2880, 201088, 128, 4),
        },
    ],
};

/// A gpt-oss spec: `(hidden, layers, heads, kv heads, head_dim, expert intermediate, vocab,
/// experts, experts per token)`, untied, with attention biases, every layer MoE.
///
/// The published sizes (the `config.json` of `openai/gpt-oss-20b` and `openai/gpt-oss-120b`
/// on the Hub, and transformers 5.19.0 `GptOssConfig`'s defaults, which are 120b's):
/// hidden_size 2880, intermediate_size 2880, head_dim 64, num_attention_heads 64,
/// num_key_value_heads 8, vocab_size 201088, num_experts_per_tok 4, tie_word_embeddings false;
/// num_hidden_layers 24 / 36 and num_local_experts 32 / 128. The model card gives 20.91B / 116.83B
/// parameters in total (the test `presets_have_the_published_parameter_counts` checks them).
#[allow(clippy::too_many_arguments)]
fn gpt_oss(
    name: &str,
    hidden: u64,
    layers: u64,
    heads: u64,
    kv: u64,
    head_dim: u64,
    inter: u64,
    vocab: u64,
    experts: u64,
    per_token: u64,
) -> ModelSpec {
    let spec = super::dense(
        &FAMILY, name, hidden, layers, heads, kv, head_dim, inter, vocab, false,
    );
    ModelSpec {
        attention_bias: true,
        moe: Some(moe(experts, per_token, inter)),
        ..spec
    }
}

/// gpt-oss's MoE block: every layer, `experts` of `inter` rows, the router with its bias (in
/// the model's dtype), no shared expert.
fn moe(experts: u64, per_token: u64, inter: u64) -> MoeSpec {
    MoeSpec {
        num_experts: experts,
        experts_per_token: per_token,
        moe_intermediate_size: inter,
        decoder_sparse_step: 1,
        mlp_only_layers: Vec::new(),
        shared_intermediate_size: 0,
        router_bias: true,
        router_fp32: false,
    }
}

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    mxfp4(cfg)?;
    // transformers' GptOssConfig default is true (every published gpt-oss has the biases)
    spec.attention_bias = opt_bool(cfg, "attention_bias", true)?;
    // `num_experts` is transformers' alias of `num_local_experts` (`attribute_map`)
    let experts = match opt_uint(cfg, "num_local_experts")? {
        Some(n) => n,
        None => {
            opt_uint(cfg, "num_experts")?.ok_or(ModelError::MissingField("num_local_experts"))?
        }
    };
    let per_token = uint(cfg, "num_experts_per_tok")?;
    // the original configs also write `experts_per_token`; two different values would leave
    // it open which one the engines read
    if let Some(other) = opt_uint(cfg, "experts_per_token")?
        && other != per_token
    {
        return Err(ModelError::Inconsistent(format!(
            "experts_per_token={other} differs from num_experts_per_tok={per_token}; gpt-oss configs give the same value in both"
        )));
    }
    if spec.intermediate_size == 0 {
        return Err(ModelError::BadField {
            field: "intermediate_size",
            message:
                "must be at least 1: it is each expert's intermediate size (gpt-oss-20b has 2880)"
                    .into(),
        });
    }
    spec.moe = Some(moe(experts, per_token, spec.intermediate_size));
    layer_types(cfg, spec.num_layers)?;
    for field in ["swiglu_limit", "swiglu_alpha"] {
        positive_number(cfg, field)?;
    }
    Ok(())
}

/// Refuses the published checkpoints' MXFP4 experts (`quantization_config.quant_method:
/// "mxfp4"`): an engine loading such a config holds `w13_weight` / `w2_weight` as packed e2m1
/// blocks with ue8m0 scales per 32 elements, which awex neither lays out nor quantises to.
fn mxfp4(cfg: &Value) -> Result<(), ModelError> {
    let method = cfg
        .get("quantization_config")
        .and_then(|q| q.get("quant_method"))
        .and_then(Value::as_str);
    if method == Some("mxfp4") {
        return Err(ModelError::BadField {
            field: "quantization_config",
            message: "quant_method \"mxfp4\" (the experts of openai/gpt-oss-* as published: `gate_up_proj_blocks` / `_scales`) is not supported: awex moves gpt-oss in bf16 only, it has no MXFP4 encoding (e2m1 blocks with a ue8m0 scale per 32 elements) to quantise the trainer's bf16 experts into what the engine holds; serve a bf16 checkpoint (its config without `quantization_config`)".into(),
        });
    }
    Ok(())
}

/// Checks `layer_types` (each layer `sliding_attention` or `full_attention`, one per layer) and,
/// when some layer slides, `sliding_window` (at least 1). The weights do not depend on either;
/// a config that gets them wrong is refused rather than loaded into an engine that reads them.
fn layer_types(cfg: &Value, layers: u64) -> Result<(), ModelError> {
    let sliding = match cfg.get("layer_types") {
        // transformers' default: even layers slide, odd layers are full
        None | Some(Value::Null) => layers > 0,
        Some(Value::Array(types)) => {
            if types.len() as u64 != layers {
                return Err(ModelError::Inconsistent(format!(
                    "layer_types lists {} layers but num_hidden_layers is {layers}",
                    types.len()
                )));
            }
            let mut sliding = false;
            for (l, t) in types.iter().enumerate() {
                match t.as_str() {
                    Some("sliding_attention") => sliding = true,
                    Some("full_attention") => {}
                    _ => {
                        return Err(ModelError::BadField {
                            field: "layer_types",
                            message: format!(
                                "layer {l} is {t}; expected \"sliding_attention\" or \"full_attention\""
                            ),
                        });
                    }
                }
            }
            sliding
        }
        Some(v) => {
            return Err(ModelError::BadField {
                field: "layer_types",
                message: format!("expected a list of layer types, found {v}"),
            });
        }
    };
    if sliding && opt_uint(cfg, "sliding_window")? == Some(0) {
        return Err(ModelError::BadField {
            field: "sliding_window",
            message:
                "must be at least 1 when some layer is \"sliding_attention\" (gpt-oss has 128)"
                    .into(),
        });
    }
    Ok(())
}

/// A float field that, when present, must be a finite number above 0.
fn positive_number(cfg: &Value, field: &'static str) -> Result<(), ModelError> {
    match cfg.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Ok(()),
            _ => Err(ModelError::BadField {
                field,
                message: format!("expected a finite number above 0, found {v}"),
            }),
        },
    }
}

/// What a gpt-oss spec must hold (one sent as JSON included): every layer MoE with a router
/// bias and no shared expert, no q/k norms, no MLA, no linear attention.
fn check(spec: &ModelSpec) -> Result<(), ModelError> {
    super::no_mla(spec)?;
    let refuse = |what: &str| {
        Err(ModelError::Inconsistent(format!(
            "GptOssForCausalLM {what}; transformers' GptOssDecoderLayer has q/k/v/o projections (biases per `attention_bias`), per-head sinks and a MoE block on every layer: a router with a bias and fused experts with biases, no shared expert"
        )))
    };
    if spec.linear.is_some() {
        return refuse("has no linear attention, but the model gives `linear` sizes");
    }
    if spec.use_qk_norm {
        return refuse("has no q/k norms, but the model sets `use_qk_norm`");
    }
    let Some(m) = &spec.moe else {
        return refuse("is MoE on every layer, but the model gives no `moe` sizes");
    };
    if m.decoder_sparse_step != 1 || !m.mlp_only_layers.is_empty() {
        return refuse("is MoE on every layer, but the model makes some layers dense");
    }
    if m.shared_intermediate_size != 0 {
        return refuse("has no shared expert, but the model gives one");
    }
    if !m.router_bias || m.router_fp32 {
        return refuse("routes with a bias in the model's dtype, but the model says otherwise");
    }
    Ok(())
}

fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    let h = spec.hidden_size;
    let (q, kv) = (spec.q_size(), spec.kv_size());
    let mut part = |p: Part, shape: &[u64]| sink.part(Canon::at(p, l), Dims::new(shape));
    part(Part::InputNorm, &[h]);
    part(Part::Q, &[q, h]);
    part(Part::K, &[kv, h]);
    part(Part::V, &[kv, h]);
    if spec.attention_bias {
        part(Part::QBias, &[q]);
        part(Part::KBias, &[kv]);
        part(Part::VBias, &[kv]);
    }
    part(Part::O, &[h, q]);
    if spec.attention_bias {
        part(Part::OBias, &[h]);
    }
    part(Part::Sinks, &[spec.num_heads]);
    part(Part::PostNorm, &[h]);
    let Some(m) = &spec.moe else { return };
    let (e, i) = (m.num_experts, m.moe_intermediate_size);
    part(Part::Router, &[e, h]);
    part(Part::RouterBias, &[e]);
    part(Part::ExpertsGateUp, &[e, h, 2 * i]);
    part(Part::ExpertsGateUpBias, &[e, 2 * i]);
    part(Part::ExpertsDown, &[e, i, h]);
    part(Part::ExpertsDownBias, &[e, h]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;
    use serde_json::json;

    fn config() -> Value {
        json!({
            "architectures": ["GptOssForCausalLM"],
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
            "vocab_size": 1000, "num_local_experts": 8, "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
            "swiglu_limit": 7.0, "attention_bias": true, "tie_word_embeddings": false,
        })
    }

    fn parse_with(
        f: impl FnOnce(&mut serde_json::Map<String, Value>),
    ) -> Result<ModelSpec, ModelError> {
        let mut cfg = config();
        f(cfg.as_object_mut().expect("object"));
        ModelSpec::from_config_value(&cfg)
    }

    #[test]
    fn the_tiny_config_parses_into_the_tiny_preset() {
        let spec = parse_with(|_| {}).expect("parses");
        let tiny = preset("gpt-oss-tiny").expect("preset");
        let strip = |s: &ModelSpec| ModelSpec {
            name: String::new(),
            ..s.clone()
        };
        assert_eq!(strip(&spec), strip(&tiny));
        // `num_experts` (transformers' alias) is read when `num_local_experts` is absent
        let alias = parse_with(|c| {
            let n = c.remove("num_local_experts").expect("present");
            c.insert("num_experts".into(), n);
        })
        .expect("parses");
        assert_eq!(alias.num_experts(), 8);
    }

    #[test]
    fn presets_have_the_published_parameter_counts() {
        // the openai/gpt-oss model card: 20.91B parameters in total (20b), 116.83B (120b);
        // the catalogue's tensors of the published sizes sum to exactly these
        for (name, total) in [
            ("gpt-oss-20b", 20_914_757_184u128),
            ("gpt-oss-120b", 116_829_156_672),
        ] {
            let spec = preset(name).expect("preset");
            spec.validate().expect("valid");
            let (_, numel) = spec.catalogue_size();
            assert_eq!(numel, total, "{name}");
        }
    }

    /// A change to the tiny config.
    type Edit = Box<dyn FnOnce(&mut serde_json::Map<String, Value>)>;

    #[test]
    fn every_bad_field_is_named() {
        let cases: Vec<(&str, Edit)> = vec![
            (
                "num_local_experts",
                Box::new(|c| {
                    c.remove("num_local_experts");
                }),
            ),
            (
                "num_experts_per_tok",
                Box::new(|c| {
                    c.remove("num_experts_per_tok");
                }),
            ),
            (
                "num_experts_per_tok=9 must be between 1 and num_experts=8",
                Box::new(|c| {
                    c.insert("num_experts_per_tok".into(), json!(9));
                }),
            ),
            (
                "experts_per_token=3 differs",
                Box::new(|c| {
                    c.insert("experts_per_token".into(), json!(3));
                }),
            ),
            (
                "num_experts and moe_intermediate_size must be at least 1",
                Box::new(|c| {
                    c.insert("num_local_experts".into(), json!(0));
                }),
            ),
            (
                "intermediate_size",
                Box::new(|c| {
                    c.insert("intermediate_size".into(), json!(0));
                }),
            ),
            (
                "layer_types lists 1 layers",
                Box::new(|c| {
                    c.insert("layer_types".into(), json!(["full_attention"]));
                }),
            ),
            (
                "expected \"sliding_attention\" or \"full_attention\"",
                Box::new(|c| {
                    c.insert(
                        "layer_types".into(),
                        json!(["linear_attention", "full_attention"]),
                    );
                }),
            ),
            (
                "sliding_window",
                Box::new(|c| {
                    c.insert("sliding_window".into(), json!(0));
                }),
            ),
            (
                "swiglu_limit",
                Box::new(|c| {
                    c.insert("swiglu_limit".into(), json!(-1.0));
                }),
            ),
            (
                "attention_bias",
                Box::new(|c| {
                    c.insert("attention_bias".into(), json!("yes"));
                }),
            ),
            (
                "num_key_value_heads=3 must divide num_attention_heads=4",
                Box::new(|c| {
                    c.insert("num_key_value_heads".into(), json!(3));
                }),
            ),
            (
                "head_dim",
                Box::new(|c| {
                    c.insert("head_dim".into(), json!(0));
                }),
            ),
            (
                "quant_method \"mxfp4\"",
                Box::new(|c| {
                    c.insert(
                        "quantization_config".into(),
                        json!({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}),
                    );
                }),
            ),
        ];
        for (want, f) in cases {
            let err = parse_with(f).expect_err(want).to_string();
            assert!(err.contains(want), "want `{want}` in: {err}");
        }
        // a full-only model needs no sliding window
        let full = parse_with(|c| {
            c.insert(
                "layer_types".into(),
                json!(["full_attention", "full_attention"]),
            );
            c.insert("sliding_window".into(), json!(0));
        });
        assert!(full.is_ok(), "{full:?}");
    }

    #[test]
    fn a_spec_that_is_not_gpt_oss_shaped_is_refused() {
        let tiny = preset("gpt-oss-tiny").expect("preset");
        let mut dense = tiny.clone();
        dense.moe = None;
        let mut shared = tiny.clone();
        if let Some(m) = &mut shared.moe {
            m.shared_intermediate_size = 32;
        }
        let mut sparse = tiny.clone();
        if let Some(m) = &mut sparse.moe {
            m.mlp_only_layers = vec![0];
        }
        let mut norms = tiny.clone();
        norms.use_qk_norm = true;
        for (spec, want) in [
            (dense, "no `moe` sizes"),
            (shared, "no shared expert"),
            (sparse, "some layers dense"),
            (norms, "no q/k norms"),
        ] {
            let err = spec.validate().expect_err(want).to_string();
            assert!(err.contains(want), "want `{want}` in: {err}");
        }
    }

    #[test]
    fn without_attention_bias_the_layer_has_no_biases_but_keeps_its_sinks() {
        let spec = parse_with(|c| {
            c.insert("attention_bias".into(), json!(false));
        })
        .expect("parses");
        let parts = spec.parts();
        for p in [Part::QBias, Part::KBias, Part::VBias, Part::OBias] {
            assert!(!parts.contains(&p), "{p:?}");
        }
        assert!(parts.contains(&Part::Sinks));
        assert!(parts.contains(&Part::RouterBias));
    }
}
