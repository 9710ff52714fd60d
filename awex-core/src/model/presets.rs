//! Built-in model presets: tiny models for tests and the published Qwen3 configs.

use super::{Architecture, ModelSpec, MoeSpec};
use crate::dtype::DType;

/// Names of every built-in preset.
pub const PRESET_NAMES: &[&str] = &[
    "qwen3-tiny",
    "qwen3-moe-tiny",
    "qwen3-0.6b",
    "qwen3-8b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "moe-1t",
];

#[allow(clippy::too_many_arguments)]
fn qwen3(
    name: &str,
    hidden: u64,
    layers: u64,
    heads: u64,
    kv: u64,
    head_dim: u64,
    inter: u64,
    vocab: u64,
    tied: bool,
) -> ModelSpec {
    ModelSpec {
        name: name.to_string(),
        architecture: Architecture::Qwen3,
        hidden_size: hidden,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim,
        intermediate_size: inter,
        vocab_size: vocab,
        tie_word_embeddings: tied,
        attention_bias: false,
        dtype: DType::Bf16,
        moe: None,
    }
}

fn moe(
    spec: ModelSpec,
    experts: u64,
    per_token: u64,
    moe_inter: u64,
    dense: Vec<u64>,
) -> ModelSpec {
    ModelSpec {
        architecture: Architecture::Qwen3Moe,
        moe: Some(MoeSpec {
            num_experts: experts,
            experts_per_token: per_token,
            moe_intermediate_size: moe_inter,
            decoder_sparse_step: 1,
            mlp_only_layers: dense,
        }),
        ..spec
    }
}

/// A built-in preset by name.
pub fn preset(name: &str) -> Option<ModelSpec> {
    Some(match name {
        // GQA (4 heads over 2 KV heads), vocab 1000 is not a multiple of 64.
        "qwen3-tiny" => qwen3(name, 64, 4, 4, 2, 16, 128, 1000, false),
        // 8 experts; layer 0 dense through mlp_only_layers.
        "qwen3-moe-tiny" => moe(
            qwen3(name, 64, 4, 4, 2, 16, 128, 1000, false),
            8,
            2,
            32,
            vec![0],
        ),
        "qwen3-0.6b" => qwen3(name, 1024, 28, 16, 8, 128, 3072, 151936, true),
        "qwen3-8b" => qwen3(name, 4096, 36, 32, 8, 128, 12288, 151936, false),
        "qwen3-30b-a3b" => moe(
            qwen3(name, 2048, 48, 32, 4, 128, 6144, 151936, false),
            128,
            8,
            768,
            vec![],
        ),
        "qwen3-235b-a22b" => moe(
            qwen3(name, 4096, 94, 64, 4, 128, 12288, 151936, false),
            128,
            8,
            1536,
            vec![],
        ),
        "moe-1t" => moe(
            qwen3(name, 7168, 64, 64, 8, 128, 18432, 163840, false),
            384,
            8,
            2048,
            vec![0],
        ),
        _ => return None,
    })
}
