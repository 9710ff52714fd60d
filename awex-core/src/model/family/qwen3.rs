//! Qwen3 (`Qwen3ForCausalLM`, transformers `models/qwen3/modeling_qwen3.py`): per-head q/k
//! norms; with `attention_bias` the q/k/v *and* o projections carry a bias; a gated dense MLP.
//!
//! This file is the model for a new family: a `FAMILY` constant naming the HF class and its
//! names, `parse` for the config fields beyond the common sizes, `layer` listing one layer's
//! parts from the shared building blocks, and the presets.

use super::{Biases, Family, Preset, Sink, dense, dense_mlp, gqa_attention};
use crate::model::names::LLAMA_NAMES;
use crate::model::spec::opt_bool;
use crate::model::{ModelError, ModelSpec};
use serde_json::Value;

/// The Qwen3 family.
pub const FAMILY: Family = Family {
    name: "qwen3",
    hf_class: "Qwen3ForCausalLM",
    names: &LLAMA_NAMES,
    parse,
    layer,
    check: super::dense_standard,
    presets: &[
        Preset {
            name: "qwen3-tiny",
            about: "4 layers, GQA 4 heads over 2 KV heads, vocab 1000 (not a multiple of 64)",
            spec: |n| dense(&FAMILY, n, 64, 4, 4, 2, 16, 128, 1000, false),
        },
        Preset {
            name: "qwen3-0.6b",
            about: "Qwen/Qwen3-0.6B (tied embeddings)",
            spec: |n| dense(&FAMILY, n, 1024, 28, 16, 8, 128, 3072, 151936, true),
        },
        Preset {
            name: "qwen3-8b",
            about: "Qwen/Qwen3-8B",
            spec: |n| dense(&FAMILY, n, 4096, 36, 32, 8, 128, 12288, 151936, false),
        },
    ],
};

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    spec.attention_bias = opt_bool(cfg, "attention_bias", false)?;
    Ok(())
}

fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    let biases = if spec.attention_bias {
        Biases::QkvO
    } else {
        Biases::None
    };
    gqa_attention(spec, l, biases, true, sink);
    dense_mlp(spec, l, sink);
}
