//! Qwen2 (`Qwen2ForCausalLM`, transformers `models/qwen2/modeling_qwen2.py`): q/k/v
//! projections always carry a bias, `o_proj` never does; a gated dense MLP.

use super::{Biases, Family, Sink, dense_mlp, gqa_attention};
use crate::model::names::LLAMA_NAMES;
use crate::model::{ModelError, ModelSpec};
use serde_json::Value;

/// The Qwen2 family.
pub const FAMILY: Family = Family {
    name: "qwen2",
    hf_class: "Qwen2ForCausalLM",
    names: &LLAMA_NAMES,
    parse,
    layer,
    check: super::dense_standard,
    presets: &[],
};

fn parse(_cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    // `bias=True` on q/k/v whatever the config says (the saved config has no `attention_bias`)
    spec.attention_bias = true;
    Ok(())
}

fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    gqa_attention(spec, l, Biases::Qkv, false, sink);
    dense_mlp(spec, l, sink);
}
