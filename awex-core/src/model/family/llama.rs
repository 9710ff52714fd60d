//! Llama (`LlamaForCausalLM`, transformers `models/llama/modeling_llama.py`): grouped-query
//! attention whose q/k/v/o projections all carry a bias when `attention_bias` is set, and a
//! gated dense MLP.

use super::{Biases, Family, Sink, dense_mlp, gqa_attention};
use crate::model::names::LLAMA_NAMES;
use crate::model::spec::opt_bool;
use crate::model::{ModelError, ModelSpec};
use serde_json::Value;

/// The Llama family.
pub const FAMILY: Family = Family {
    name: "llama",
    hf_class: "LlamaForCausalLM",
    names: &LLAMA_NAMES,
    parse,
    layer,
    check: super::dense_standard,
    presets: &[],
};

fn parse(cfg: &Value, spec: &mut ModelSpec) -> Result<(), ModelError> {
    spec.attention_bias = opt_bool(cfg, "attention_bias", false)?;
    // `mlp_bias` gives gate/up/down biases, which no engine awex serves holds for Llama
    if opt_bool(cfg, "mlp_bias", false)? {
        return Err(ModelError::BadField {
            field: "mlp_bias",
            message: "awex supports Llama without MLP biases (mlp_bias: false)".into(),
        });
    }
    Ok(())
}

fn layer(spec: &ModelSpec, l: u64, sink: &mut dyn Sink) {
    let biases = if spec.attention_bias {
        Biases::QkvO
    } else {
        Biases::None
    };
    gqa_attention(spec, l, biases, false, sink);
    dense_mlp(spec, l, sink);
}
