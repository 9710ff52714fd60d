//! Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, transformers `models/qwen3_5_moe/modeling_qwen3_5_moe.py`,
//! the text model of Qwen3.5's MoE checkpoints): Qwen3.5's hybrid attention ([`super::qwen3_5`])
//! with Qwen3-Next's MoE block on every layer (`Qwen3_5MoeSparseMoeBlock`: router `mlp.gate`,
//! routed experts, the shared expert `mlp.shared_expert.*` and its gate
//! `mlp.shared_expert_gate`). Its config has no dense intermediate size, no
//! `decoder_sparse_step` and no `mlp_only_layers` (`Qwen3_5MoeTextConfig`).
//!
//! The catalogue names the experts one by one (`mlp.experts.{e}.{gate,up,down}_proj.weight`),
//! the names SGLang's and vLLM's loaders map expert by expert; transformers 5 holds them fused
//! (`mlp.experts.gate_up_proj` `[experts, 2 * moe_intermediate, hidden]`, `down_proj`).

use super::qwen3_next::{
    InProj, NAMES, check_linear, hybrid, hybrid_attention, linear, parse_hybrid, parse_qwen_moe,
    qwen_shared_moe, with_shared_expert,
};
use super::{Family, Preset, Sink, dense};
use crate::model::{ModelError, ModelSpec};
use serde_json::Value;

/// The Qwen3.5-MoE family.
pub const FAMILY: Family = Family {
    name: "qwen3.5-moe",
    hf_class: "Qwen3_5MoeForCausalLM",
    names: &NAMES,
    parse,
    layer,
    check: |s| check_linear(s).and_then(|()| super::needs_moe(s)),
    presets: &[
        Preset {
            name: "qwen3.5-moe-tiny",
            about: "4 layers (3 Gated DeltaNet, 1 gated full attention), 8 experts + a gated shared expert on every layer",
            spec: |n| {
                hybrid(
                    with_shared_expert(
                        dense(&FAMILY, n, 64, 4, 4, 2, 16, 0, 1000, false),
                        (8, 2, 32, 32),
                    ),
                    linear(4, 8, 16, 16, 4, 4),
                )
            },
        },
        Preset {
            name: "qwen3.5-35b-a3b",
            about: "Qwen/Qwen3.5-35B-A3B's text model: 40 layers (every 4th full attention), 256 experts + 1 shared",
            spec: |n| {
                hybrid(
                    with_shared_expert(
                        dense(&FAMILY, n, 2048, 40, 16, 2, 256, 0, 248320, false),
                        (256, 8, 512, 512),
                    ),
                    linear(16, 32, 128, 128, 4, 40),
                )
            },
        },
        Preset {
            name: "qwen3.5-397b-a17b",
            about: "Qwen/Qwen3.5-397B-A17B's text model: 60 layers (every 4th full attention), 512 experts + 1 shared, 16 key / 64 value linear heads",
            spec: |n| {
                hybrid(
                    with_shared_expert(
                        dense(&FAMILY, n, 4096, 60, 32, 2, 256, 0, 248320, false),
                        (512, 10, 1024, 1024),
                    ),
                    linear(16, 64, 128, 128, 4, 60),
                )
            },
        },
    ],
};

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    parse_hybrid(cfg, spec)?;
    spec.moe = Some(parse_qwen_moe(cfg)?);
    Ok(())
}

fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    hybrid_attention(spec, l, InProj::Split, sink);
    qwen_shared_moe(spec, l, sink);
}
