//! What the awex-sim tests share.

/// A tiny preset of every family awex knows (a few layers of each family's shapes).
pub const TINY_FAMILIES: [&str; 9] = [
    "qwen3-tiny",
    "qwen3-moe-tiny",
    "mixtral-tiny",
    "deepseek-v3-tiny",
    "glm-4.5-tiny",
    "qwen3-next-tiny",
    "qwen3.5-tiny",
    "qwen3.5-moe-tiny",
    "gpt-oss-tiny",
];
