//! Qwen3-MoE (`Qwen3MoeForCausalLM`, transformers `models/qwen3_moe/modeling_qwen3_moe.py`):
//! Qwen3's attention; a layer is MoE (router `mlp.gate`, experts `mlp.experts.{e}.{gate,up,down}_proj`)
//! when it is not in `mlp_only_layers` and `(l + 1) % decoder_sparse_step == 0`, dense otherwise.

use super::{Biases, Family, Preset, Sink, dense, dense_mlp, gqa_attention, layer_list};
use super::{routed_experts, with_experts};
use crate::model::names::LLAMA_NAMES;
use crate::model::part::Part;
use crate::model::spec::{opt_bool, opt_uint, uint};
use crate::model::{ModelError, ModelSpec, MoeSpec};
use serde_json::Value;

/// The Qwen3-MoE family.
pub const FAMILY: Family = Family {
    name: "qwen3-moe",
    hf_class: "Qwen3MoeForCausalLM",
    names: &LLAMA_NAMES,
    parse,
    layer,
    check: super::moe_standard,
    presets: &[
        Preset {
            name: "qwen3-moe-tiny",
            about: "qwen3-tiny with 8 experts; layer 0 dense through mlp_only_layers (vLLM, Megatron, FSDP; SGLang builds every Qwen3-MoE layer MoE and refuses it)",
            spec: |n| {
                with_experts(
                    dense(&FAMILY, n, 64, 4, 4, 2, 16, 128, 1000, false),
                    8,
                    2,
                    32,
                    vec![0],
                )
            },
        },
        Preset {
            name: "qwen3-30b-a3b",
            about: "Qwen/Qwen3-30B-A3B",
            spec: |n| {
                with_experts(
                    dense(&FAMILY, n, 2048, 48, 32, 4, 128, 6144, 151936, false),
                    128,
                    8,
                    768,
                    vec![],
                )
            },
        },
        Preset {
            name: "qwen3-235b-a22b",
            about: "Qwen/Qwen3-235B-A22B",
            spec: |n| {
                with_experts(
                    dense(&FAMILY, n, 4096, 94, 64, 4, 128, 12288, 151936, false),
                    128,
                    8,
                    1536,
                    vec![],
                )
            },
        },
        Preset {
            name: "moe-1t",
            about: "a 1T-parameter Qwen3-MoE-shaped model: 64 layers, every one MoE, 384 experts",
            // every layer MoE, as SGLang builds a Qwen3-MoE model (kimi-k2 is the real 1T)
            spec: |n| {
                with_experts(
                    dense(&FAMILY, n, 7168, 64, 64, 8, 128, 18432, 163840, false),
                    384,
                    8,
                    2048,
                    vec![],
                )
            },
        },
    ],
};

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    spec.attention_bias = opt_bool(cfg, "attention_bias", false)?;
    spec.moe = Some(MoeSpec {
        // Published Qwen3-MoE checkpoints write `num_experts`; transformers 5 writes
        // `num_local_experts` when it saves a Qwen3-MoE model.
        num_experts: match opt_uint(cfg, "num_experts")? {
            Some(n) => n,
            None => opt_uint(cfg, "num_local_experts")?
                .ok_or(ModelError::MissingField("num_experts"))?,
        },
        experts_per_token: uint(cfg, "num_experts_per_tok")?,
        moe_intermediate_size: uint(cfg, "moe_intermediate_size")?,
        decoder_sparse_step: opt_uint(cfg, "decoder_sparse_step")?.unwrap_or(1),
        mlp_only_layers: layer_list(cfg, "mlp_only_layers")?,
        shared_intermediate_size: 0,
        router_bias: false,
        router_fp32: false,
    });
    Ok(())
}

fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    let biases = if spec.attention_bias {
        Biases::QkvO
    } else {
        Biases::None
    };
    gqa_attention(spec, l, biases, true, sink);
    if spec.is_moe_layer(l) {
        routed_experts(
            spec,
            l,
            [Part::ExpertGate, Part::ExpertUp, Part::ExpertDown],
            sink,
        );
    } else {
        dense_mlp(spec, l, sink);
    }
}
