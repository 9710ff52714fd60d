//! DeepSeek-V2 (`DeepseekV2ForCausalLM`, transformers `models/deepseek_v2/modeling_deepseek_v2.py`;
//! DeepSeek-V2, V2-Lite, V2.5): DeepSeek-V3's layer and checkpoint names ([`super::deepseek_v3`]:
//! MLA with or without `q_lora_rank`, dense first layers, routed and shared experts) with
//! V2's config defaults (`first_k_dense_replace` 0, `n_shared_experts` 2) and a router without
//! a score-correction bias: transformers' `DeepseekV2TopkRouter` has none, and SGLang's and
//! vLLM's `MoEGate` create `e_score_correction_bias` only for `topk_method: noaux_tc` (V3's
//! method), which a V2 config then carries.

use super::deepseek_v3::{NAMES, check_mla, layer, mla, parse_mla};
use super::{Family, Preset, SharedMoeDefaults, dense, with_shared_experts};
use crate::model::spec::opt_bool;
use crate::model::{ModelError, ModelSpec};
use serde_json::Value;

/// The DeepSeek-V2 family.
pub const FAMILY: Family = Family {
    name: "deepseek-v2",
    hf_class: "DeepseekV2ForCausalLM",
    names: &NAMES,
    parse,
    layer,
    check: check_mla,
    presets: &[Preset {
        name: "deepseek-v2-lite",
        about: "deepseek-ai/DeepSeek-V2-Lite (15.7B): 27 layers, MLA without q_lora_rank, 64 experts + 2 shared, first dense",
        spec: |n| {
            let spec = dense(&FAMILY, n, 2048, 27, 16, 16, 64, 10944, 102400, false);
            let mut spec = with_shared_experts(spec, (64, 6, 1408, 2, 1), false);
            if let Some(m) = &mut spec.moe {
                m.router_bias = false;
            }
            spec.mla = Some(mla(None, 512, 128, 64, 128));
            spec
        },
    }],
};

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    if opt_bool(cfg, "mlp_bias", false)? {
        return Err(ModelError::BadField {
            field: "mlp_bias",
            message: "awex supports DeepSeek-V2 without MLP biases (mlp_bias: false)".into(),
        });
    }
    // transformers' DeepseekV2Config: first_k_dense_replace 0, n_shared_experts 2
    parse_mla(
        cfg,
        spec,
        SharedMoeDefaults {
            first_dense: 0,
            shared: 2,
            router_fp32: false,
        },
    )?;
    let noaux = match cfg.get("topk_method") {
        None | Some(Value::Null) => false,
        Some(Value::String(m)) => m == "noaux_tc",
        Some(v) => {
            return Err(ModelError::BadField {
                field: "topk_method",
                message: format!("expected a string, found {v}"),
            });
        }
    };
    if let Some(m) = &mut spec.moe {
        m.router_bias = noaux;
    }
    Ok(())
}
