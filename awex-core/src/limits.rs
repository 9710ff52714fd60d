//! The largest sizes awex accepts, in one table, checked before anything is allocated.
//!
//! Every entry point (`ModelSpec` parsing and validation, each backend's parallel config, the
//! gateway's connect, the Python bindings) checks its input against these maxima first, so a
//! hostile or mistyped size (`num_hidden_layers: 1000000000`, `dp=1000000000`) is refused at
//! once with the field, its value and the limit, instead of allocating without bound or
//! wrapping 64-bit arithmetic.
//!
//! Each maximum is generous: several times the largest real model or job known (December
//! 2026), so no real checkpoint or cluster comes near it.
//!
//! | limit | value | the largest real one |
//! | --- | --- | --- |
//! | [`MAX_LAYERS`] | 1,024 | 126 (Llama-3.1-405B) |
//! | [`MAX_HIDDEN`] | 65,536 | 25,600 (Megatron's 1T GPT config), 16,384 (Llama-3.1-405B) |
//! | [`MAX_HEADS`] (query and KV heads, linear-attention key and value heads) | 1,024 | 160 (Megatron's 1T GPT config), 128 (DeepSeek-V3) |
//! | [`MAX_HEAD_DIM`] (also linear-attention heads) | 1,024 | 256 (Gemma) |
//! | [`MAX_CONV_KERNEL`] (`linear_conv_kernel_dim`) | 64 | 4 (Qwen3-Next, Qwen3.5) |
//! | [`MAX_VOCAB`] | 4,194,304 | 262,144 (Gemma 3) |
//! | [`MAX_INTERMEDIATE`] (dense and per expert) | 1,048,576 | 73,728 (PaLM-540B) |
//! | [`MAX_EXPERTS`] | 4,096 | 512 (Qwen3-Next) |
//! | [`MAX_TENSORS`] (canonical tensors) | 1,048,576 | about 74,000 (the `moe-1t` preset, Kimi-K2 sizes) |
//! | [`MAX_MODEL_BYTES`] (checkpoint dtype) | 16 TiB | about 8 TB (2T parameters in fp32) |
//! | [`MAX_TENSOR_PARALLEL`] (`tp`, `etp`) | 1,024 | 72 (one NVL72 domain); tp divides the heads |
//! | [`MAX_PIPELINE`] (`pp`, `vpp`, stage layer counts) | 1,024 | 64 (Megatron's 1T run); every stage holds a layer |
//! | [`MAX_CONTEXT_PARALLEL`] (`cp`) | 1,024 | 32 (long-context training) |
//! | [`MAX_EXPERT_PARALLEL`] (`ep`) | 4,096 | 256 (DeepSeek-V3 inference); ep divides the experts |
//! | [`MAX_WORLD_SIZE`] (ranks of one side, and `dp`, `replicate`, `engines`) | 65,536 | 16,384 GPUs (Llama-3 training) |
//! | [`MAX_MODEL_NAME_BYTES`] (a model's display name, `_name_or_path`) | 1,024 bytes | 96 (an HF model id); a local path rarely 256 |
//! | [`MAX_JSON_BYTES`] (`config.json`, the safetensors index) | 64 MiB | about 6 MB (a 1T model's index) |
//! | [`MAX_SAFETENSORS_HEADER_BYTES`] | 100,000,000 | the safetensors crate's own limit |
//!
//! What the bounds guarantee downstream, so that code without checked arithmetic (the planner)
//! cannot overflow: a side holds at most `MAX_WORLD_SIZE` (2^16) ranks; each rank holds at most
//! one copy of each canonical element (padding adds less than `128 * MAX_TENSOR_PARALLEL` rows
//! per tensor) at no more than 4x the checkpoint dtype's width (bf16 to f64, the widest
//! conversion), so one rank holds below `4 * MAX_MODEL_BYTES` = 2^46 bytes plus padding, and
//! a whole side below 2^62 bytes. Every byte count, element offset or sum of bytes over the
//! ranks of a side therefore fits in a `u64` with a factor 4 to spare.

use std::fmt;

/// Most decoder layers.
pub const MAX_LAYERS: u64 = 1024;
/// Largest hidden size.
pub const MAX_HIDDEN: u64 = 65_536;
/// Most attention heads (query heads; KV heads are at most as many).
pub const MAX_HEADS: u64 = 1024;
/// Largest head dimension.
pub const MAX_HEAD_DIM: u64 = 1024;
/// Largest kernel of a linear-attention layer's causal convolution (`linear_conv_kernel_dim`).
pub const MAX_CONV_KERNEL: u64 = 64;
/// Largest vocabulary (unpadded).
pub const MAX_VOCAB: u64 = 1 << 22;
/// Largest MLP intermediate size (dense, or one expert's).
pub const MAX_INTERMEDIATE: u64 = 1 << 20;
/// Most routed experts per MoE layer.
pub const MAX_EXPERTS: u64 = 4096;
/// Most canonical tensors in one model.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Largest model, in bytes of its checkpoint dtype (16 TiB).
pub const MAX_MODEL_BYTES: u64 = 1 << 44;
/// Largest tensor-parallel size (`tp`, `etp`).
pub const MAX_TENSOR_PARALLEL: u64 = 1024;
/// Largest pipeline size (`pp`, `vpp`) and explicit stage layer count.
pub const MAX_PIPELINE: u64 = 1024;
/// Largest context-parallel size (`cp`).
pub const MAX_CONTEXT_PARALLEL: u64 = 1024;
/// Largest expert-parallel size (`ep`).
pub const MAX_EXPERT_PARALLEL: u64 = 4096;
/// Most ranks on one side of a pair (also bounds `dp`, `replicate`, `engines`).
pub const MAX_WORLD_SIZE: u64 = 65_536;
/// Longest model display name (`ModelSpec::name`, a config's `_name_or_path`), in bytes.
pub const MAX_MODEL_NAME_BYTES: u64 = 1024;
/// Largest JSON file awex reads from a model directory (`config.json`, the index).
pub const MAX_JSON_BYTES: u64 = 64 << 20;
/// Largest safetensors header (the JSON after the 8-byte length), as the safetensors crate allows.
pub const MAX_SAFETENSORS_HEADER_BYTES: u64 = 100_000_000;

/// A maximum and why it is where it is: each bound's reason is said once, here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The largest accepted value.
    pub max: u64,
    /// Why the limit is where it is (ends the error message, in parentheses).
    pub why: &'static str,
}

impl Limit {
    /// Checks `value` of `field` against this limit.
    pub fn check(&self, field: impl Into<String>, value: u128) -> Result<(), LimitError> {
        check(field, value, self.max, self.why)
    }
}

/// [`MAX_LAYERS`], for decoder layers (and MTP layers).
pub const LAYERS: Limit = Limit {
    max: MAX_LAYERS,
    why: "8x the most layers of a real model, 126",
};
/// [`MAX_LAYERS`], for a list with at most one entry per layer (`mlp_only_layers`, `layer_types`).
pub const PER_LAYER_LIST: Limit = Limit {
    max: MAX_LAYERS,
    why: "it lists at most one entry per layer",
};
/// [`MAX_HIDDEN`], also for MLA's ranks and head dimensions.
pub const HIDDEN: Limit = Limit {
    max: MAX_HIDDEN,
    why: "2.5x the largest real hidden size, 25600",
};
/// [`MAX_HEADS`], for query, KV and linear-attention heads.
pub const HEADS: Limit = Limit {
    max: MAX_HEADS,
    why: "6x the most heads of a real model, 160",
};
/// [`MAX_HEAD_DIM`], also for linear-attention heads.
pub const HEAD_DIM: Limit = Limit {
    max: MAX_HEAD_DIM,
    why: "4x the largest real head_dim, 256",
};
/// [`MAX_CONV_KERNEL`].
pub const CONV_KERNEL: Limit = Limit {
    max: MAX_CONV_KERNEL,
    why: "16x the largest real convolution kernel, 4",
};
/// [`MAX_VOCAB`].
pub const VOCAB: Limit = Limit {
    max: MAX_VOCAB,
    why: "16x the largest real vocabulary, 262144",
};
/// [`MAX_INTERMEDIATE`], dense, per expert and shared.
pub const INTERMEDIATE: Limit = Limit {
    max: MAX_INTERMEDIATE,
    why: "14x the largest real intermediate size, 73728",
};
/// [`MAX_EXPERTS`], also for the experts per token.
pub const EXPERTS: Limit = Limit {
    max: MAX_EXPERTS,
    why: "8x the most experts of a real model, 512",
};
/// [`MAX_TENSORS`].
pub const TENSORS: Limit = Limit {
    max: MAX_TENSORS,
    why: "14x the tensors of the largest real MoE checkpoints, about 74000",
};
/// [`MAX_MODEL_BYTES`].
pub const MODEL_BYTES: Limit = Limit {
    max: MAX_MODEL_BYTES,
    why: "16 TiB, 2x a 2T-parameter model in fp32",
};
/// [`MAX_MODEL_NAME_BYTES`].
pub const MODEL_NAME_BYTES: Limit = Limit {
    max: MAX_MODEL_NAME_BYTES,
    why: "an HF model id has at most 96 characters, a local path rarely 256",
};
/// [`MAX_WORLD_SIZE`]: the ranks of one side and any parallel key without a limit of its own.
pub const WORLD_SIZE: Limit = Limit {
    max: MAX_WORLD_SIZE,
    why: "one side of a pair has at most 65536 ranks",
};

/// A size above its limit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct LimitError {
    /// What was too large (`num_hidden_layers`, `megatron dp`).
    pub field: String,
    /// Its value (wider than 64 bits for derived totals).
    pub value: u128,
    /// The largest accepted value.
    pub limit: u64,
    /// Why the limit is where it is.
    pub reason: &'static str,
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={} is above awex's limit of {} ({})",
            self.field, self.value, self.limit, self.reason
        )
    }
}

/// Checks one value against its limit.
pub fn check(
    field: impl Into<String>,
    value: u128,
    limit: u64,
    reason: &'static str,
) -> Result<(), LimitError> {
    if value <= u128::from(limit) {
        Ok(())
    } else {
        Err(LimitError {
            field: field.into(),
            value,
            limit,
            reason,
        })
    }
}

/// The limit of a parallel-config key and why; a key not in the table is bounded by the world size.
pub fn parallel_limit(key: &str) -> (u64, &'static str) {
    match key {
        "tp" | "etp" => (
            MAX_TENSOR_PARALLEL,
            "tensor parallelism splits attention heads, of which a model has at most 1024",
        ),
        "pp" | "vpp" => (
            MAX_PIPELINE,
            "every pipeline stage or chunk holds at least one of at most 1024 layers",
        ),
        "first_stage_layers" | "last_stage_layers" => {
            (MAX_PIPELINE, "a model has at most 1024 layers")
        }
        "cp" => (
            MAX_CONTEXT_PARALLEL,
            "32x the largest real context-parallel group, 32",
        ),
        "ep" => (
            MAX_EXPERT_PARALLEL,
            "expert parallelism splits experts, of which a model has at most 4096",
        ),
        _ => (WORLD_SIZE.max, WORLD_SIZE.why),
    }
}

/// Checks every value of a parallel config (`backend` names it in the message).
pub fn check_parallel<'a>(
    backend: &str,
    values: impl IntoIterator<Item = (&'a str, u64)>,
) -> Result<(), LimitError> {
    for (key, v) in values {
        let (limit, reason) = parallel_limit(key);
        check(format!("{backend} {key}"), u128::from(v), limit, reason)?;
    }
    Ok(())
}

/// Checks the ranks of one side, the product of `dims` (`[("tp", 2), ("dp", 4)]`), and returns it.
pub fn check_world(backend: &str, dims: &[(&str, u64)]) -> Result<u64, LimitError> {
    let world = dims
        .iter()
        .fold(1u128, |a, &(_, v)| a.saturating_mul(u128::from(v)));
    let names: Vec<&str> = dims.iter().map(|d| d.0).collect();
    WORLD_SIZE.check(format!("{backend} world size {}", names.join("*")), world)?;
    // at most MAX_WORLD_SIZE after the check
    Ok(world as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_above_its_limit_names_field_value_and_limit() {
        assert_eq!(check("x", 5, 5, "r"), Ok(()));
        assert_eq!(
            check("num_hidden_layers", 1_000_000_000, MAX_LAYERS, "why")
                .unwrap_err()
                .to_string(),
            "num_hidden_layers=1000000000 is above awex's limit of 1024 (why)"
        );
    }

    #[test]
    fn parallel_keys_have_their_own_limits_and_others_the_world_size() {
        assert_eq!(
            check_parallel("megatron", [("tp", 2), ("dp", 1_000_000_000)])
                .unwrap_err()
                .to_string(),
            "megatron dp=1000000000 is above awex's limit of 65536 (one side of a pair has at most 65536 ranks)"
        );
        assert_eq!(parallel_limit("tp").0, MAX_TENSOR_PARALLEL);
        assert_eq!(parallel_limit("some_new_key").0, MAX_WORLD_SIZE);
        assert_eq!(check_world("fsdp", &[("dp", 256), ("tp", 256)]), Ok(65_536));
        assert_eq!(
            check_world("fsdp", &[("dp", u64::MAX), ("tp", u64::MAX)])
                .unwrap_err()
                .to_string(),
            format!(
                "fsdp world size dp*tp={} is above awex's limit of 65536 (one side of a pair has at most 65536 ranks)",
                u128::from(u64::MAX) * u128::from(u64::MAX)
            )
        );
    }

    #[test]
    fn a_whole_side_at_the_limits_fits_u64_with_room() {
        // one rank: every element once at up to 4x the checkpoint width, plus vocab padding
        let padding = 2 * 128 * MAX_TENSOR_PARALLEL * MAX_HIDDEN * 8;
        let rank = 4 * u128::from(MAX_MODEL_BYTES) + u128::from(padding);
        assert!(rank * u128::from(MAX_WORLD_SIZE) < 1u128 << 63);
    }
}
