//! Qwen3.5, dense (`Qwen3_5ForCausalLM`, transformers `models/qwen3_5/modeling_qwen3_5.py`, the
//! text model of Qwen3.5): Qwen3-Next's hybrid of Gated DeltaNet and gated full attention
//! ([`super::qwen3_next`]) with the linear-attention input projections apart, each over all
//! heads: `linear_attn.in_proj_qkv` (`[q | k | v]` rows), `in_proj_z`, `in_proj_b`,
//! `in_proj_a` (`Qwen3_5GatedDeltaNet.__init__`); a dense gated MLP on every layer.
//!
//! The published Qwen3.5 checkpoints are the vision-language `Qwen3_5ForConditionalGeneration`
//! (`model.language_model.*`, a `text_config`); awex reads the text class's config and names
//! (`model.layers.*`), which transformers' `Qwen3_5ForCausalLM` saves.

use super::qwen3_next::{InProj, NAMES, check_linear, hybrid, hybrid_attention, linear};
use super::{Family, Preset, Sink, dense, dense_mlp};
use crate::model::{ModelError, ModelSpec};
use serde_json::Value;

/// The Qwen3.5 (dense) family.
pub const FAMILY: Family = Family {
    name: "qwen3.5",
    hf_class: "Qwen3_5ForCausalLM",
    names: &NAMES,
    parse,
    layer,
    check: |s| check_linear(s).and_then(|()| super::no_moe(s)),
    presets: &[
        Preset {
            name: "qwen3.5-tiny",
            about: "4 layers (3 Gated DeltaNet, 1 gated full attention), 4 key / 8 value linear heads, dense MLP",
            spec: |n| {
                hybrid(
                    dense(&FAMILY, n, 64, 4, 4, 2, 16, 128, 1000, false),
                    linear(4, 8, 16, 16, 4, 4),
                )
            },
        },
        Preset {
            name: "qwen3.5-9b",
            about: "Qwen3.5-9B's text model (transformers' Qwen3_5TextConfig defaults): 32 layers, every 4th full attention",
            spec: |n| {
                hybrid(
                    dense(&FAMILY, n, 4096, 32, 16, 4, 256, 12288, 248320, false),
                    linear(16, 32, 128, 128, 4, 32),
                )
            },
        },
    ],
};

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    super::qwen3_next::parse_hybrid(cfg, spec)
}

fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    hybrid_attention(spec, l, InProj::Split, sink);
    dense_mlp(spec, l, sink);
}
