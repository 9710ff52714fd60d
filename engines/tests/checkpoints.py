"""Tiny canonical HF checkpoints written by transformers, every tensor filled with seeded values."""

from __future__ import annotations

import json
import os
from typing import Any

#: Shared sizes: GQA 4 query heads over 2 KV heads (so tp=4 replicates KV heads), vocab 1000
#: (SGLang pads it to a multiple of 64 per rank), 2 layers.
BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
}

ARCHS = {
    "Qwen3ForCausalLM": ("Qwen3Config", {}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        {
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        },
    ),
    # GLM-4.5 MoE: q/k/v biases, q/k norms, layer 0 dense (first_k_dense_replace), layer 1 MoE
    # with a shared expert and the router's e_score_correction_bias (a buffer in transformers)
    "Glm4MoeForCausalLM": (
        "Glm4MoeConfig",
        {
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "attention_bias": True,
            "use_qk_norm": True,
            "partial_rotary_factor": 0.5,
            "num_nextn_predict_layers": 0,
        },
    ),
}

# ---- hybrid Qwen (Gated DeltaNet + gated full attention) ----
#: Layer 0 Gated DeltaNet, layer 1 full attention (its q_proj with the per-head output gate);
#: 4 key heads and 8 value heads of 16 (tp 4 holds one key-head group per rank); Qwen3-Next and
#: Qwen3.5-MoE with 4 experts and a gated shared expert on every layer.
_HYBRID = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
_HYBRID_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
ARCHS["Qwen3NextForCausalLM"] = ("Qwen3NextConfig", {**_HYBRID, **_HYBRID_MOE, "decoder_sparse_step": 1,
                                                     "mlp_only_layers": []})
ARCHS["Qwen3_5ForCausalLM"] = ("Qwen3_5TextConfig", dict(_HYBRID))
ARCHS["Qwen3_5MoeForCausalLM"] = ("Qwen3_5MoeTextConfig", {**_HYBRID, **_HYBRID_MOE})
#: SGLang 0.5.23 places the full-attention layers of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE by
#: ``full_attention_interval`` (``sglang/srt/configs/qwen3_next.py``, ``layers_block_type``,
#: which its Qwen3.5 configs inherit), which transformers 5.19 drops from the config it saves
#: (it keeps ``layer_types``): written back, agreeing with layer_types.
_QWEN3_NEXT_CONFIG = {"full_attention_interval": 2}
# ---- end hybrid Qwen ----

# ---- DeepSeek-V3 (MLA) ----
#: DeepSeek-V3: MLA with q_lora_rank (and a case without: a plain q_proj), layer 0 dense
#: (first_k_dense_replace), layer 1 MoE with a shared expert and the router's fp32
#: e_score_correction_bias (a buffer in transformers; SGLang and vLLM build it only with
#: topk_method noaux_tc). 4 heads, so tp 2 holds 2 heads per rank.
_DEEPSEEK = {
    "num_key_value_heads": 4,
    "head_dim": 8,  # transformers' DeepseekV3Config: qk_rope_head_dim
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_nextn_predict_layers": 0,
}
ARCHS["DeepseekV3ForCausalLM"] = ("DeepseekV3Config", {**_DEEPSEEK, "q_lora_rank": 32})
ARCHS["DeepseekV3ForCausalLM-no-q-lora"] = ("DeepseekV3Config", {**_DEEPSEEK, "q_lora_rank": None})
#: Config fields written into config.json after transformers saved it: what SGLang and vLLM read
#: that transformers' DeepseekV3Config does not keep (it maps rope_scaling to rope_parameters and
#: has no topk_method / scoring_func / moe_layer_freq): SGLang's CPU rotary embedding asserts on
#: DeepSeek's yarn rope_scaling, DeepseekV2DecoderLayer reads moe_layer_freq, and both engines
#: build the router bias only for topk_method noaux_tc.
_DEEPSEEK_CONFIG = {
    "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.5,
}
#: A case's model class where its key is not one (a variant of a class).
CLASS_OF = {"DeepseekV3ForCausalLM-no-q-lora": "DeepseekV3ForCausalLM"}
#: Fields patched into a case's saved config.json.
CONFIG_PATCH = {"DeepseekV3ForCausalLM": _DEEPSEEK_CONFIG, "DeepseekV3ForCausalLM-no-q-lora": _DEEPSEEK_CONFIG,
                "Qwen3NextForCausalLM": _QWEN3_NEXT_CONFIG, "Qwen3_5ForCausalLM": _QWEN3_NEXT_CONFIG,
                "Qwen3_5MoeForCausalLM": _QWEN3_NEXT_CONFIG}
#: DeepSeek-V2 (V2-Lite's shape): DeepSeek-V3's layer without q_lora_rank, two shared experts and
#: a router without a score-correction bias (topk_method greedy: SGLang's and vLLM's MoEGate
#: build no e_score_correction_bias then).
ARCHS["DeepseekV2ForCausalLM"] = (
    "DeepseekV2Config", {**_DEEPSEEK, "q_lora_rank": None, "n_shared_experts": 2, "topk_method": "greedy"})
CONFIG_PATCH["DeepseekV2ForCausalLM"] = {
    **_DEEPSEEK_CONFIG, "topk_method": "greedy", "scoring_func": "softmax", "routed_scaling_factor": 1.0}
# ---- end DeepSeek-V3 ----

# ---- gpt-oss ----
#: gpt-oss: q/k/v/o biases, per-head sinks, layer 0 sliding (window 8), layer 1 full, every layer
#: MoE with a router bias and 4 experts of 48 rows fused and transposed as transformers holds
#: and saves them (``mlp.experts.gate_up_proj`` [4, 64, 96], gate/up interleaved along the last
#: dim; ``down_proj`` [4, 48, 64]; their biases). 48 rows so that no expert dim equals hidden.
ARCHS["GptOssForCausalLM"] = ("GptOssConfig", {"intermediate_size": 48, "num_local_experts": 4,
                                               "num_experts_per_tok": 2, "sliding_window": 8})
# ---- end gpt-oss ----


def write(path: str, arch: str, *, tied: bool, seed: int, config_of: str | None = None,
          config_dtype: str | None = None) -> str:
    """Writes a checkpoint of ``arch`` to ``path``: ``config.json`` + ``model.safetensors`` with
    every tensor drawn from N(0, 1) by a generator seeded with ``seed`` (norm weights too, so
    that no tensor is uniform), the persistent buffers a checkpoint stores too (GLM-4.5's
    ``e_score_correction_bias``). ``config_of`` reuses another checkpoint's config.
    ``config_dtype`` (``"bfloat16"``) is the model dtype config.json names while the tensors stay
    float32: what a bf16 trainer that keeps some tensors in fp32 saves of them, and what an
    engine's own load narrows into its bf16 parameters."""
    import torch
    import transformers

    cls_name, extra = ARCHS[arch]
    if config_of is not None:
        with open(os.path.join(config_of, "config.json")) as f:
            cfg = getattr(transformers, cls_name).from_dict(json.load(f))
    else:
        cfg = getattr(transformers, cls_name)(**{**BASE, **extra}, tie_word_embeddings=tied, torch_dtype="float32")
    with torch.device("cpu"):
        model = getattr(transformers, CLASS_OF.get(arch, arch))(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32))
        saved = set(model.state_dict())
        for _, b in sorted((n, b) for n, b in model.named_buffers() if n in saved):
            b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float32))
    model.save_pretrained(path, safe_serialization=True)
    patch = dict(CONFIG_PATCH.get(arch, {}))
    if config_dtype is not None:
        patch.update(dtype=config_dtype, torch_dtype=config_dtype)
    if patch:
        with open(os.path.join(path, "config.json")) as f:
            saved_cfg = json.load(f)
        saved_cfg.update(patch)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(saved_cfg, f, indent=2)
    return path


def fp8_linear(name: str) -> bool:
    """Whether a block-FP8 checkpoint stores tensor ``name`` quantised (with a
    ``<name>_scale_inv``): every linear weight of attention, the dense MLP, the routed and the
    shared experts, DeepSeek-V3's MLA projections included (``q_a_proj``, ``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``: its FP8 checkpoint holds
    ``kv_a_proj_with_mqa.weight`` as F8_E4M3 [576, 7168] with ``weight_scale_inv`` [5, 56]); not
    the router (``mlp.gate.weight``), its bias, the embedding, ``lm_head`` or the norms."""
    return name.endswith(("_proj.weight", ".kv_a_proj_with_mqa.weight"))


def tensors(path: str) -> dict[str, Any]:
    """The checkpoint's tensors as float32 numpy arrays (canonical names)."""
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))
