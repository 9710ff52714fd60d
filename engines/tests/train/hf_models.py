"""Small HF models (Qwen2, Qwen3, Qwen3-MoE, GLM-4.5 MoE, DeepSeek-V2/V3, Kimi-K2) with random weights, written as HF checkpoints
(config.json + model.safetensors with the checkpoint's per-expert names), and their logits."""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any

import torch

import convert

BASE = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
    vocab_size=300, num_hidden_layers=4, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
    tie_word_embeddings=False, hidden_act="silu",
)


def config(kind: str, **over: Any) -> Any:
    """A transformers config of `kind` (qwen2, qwen3, qwen3_moe, glm4_moe, deepseek_v3, kimi_k2,
    deepseek_v2), float32."""
    import transformers

    kw = dict(BASE)
    kw.update(over)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(attention_bias=False, **kw)
    elif kind == "glm4_moe":
        # q/k/v biases, q/k norms, layer 0 dense, then MoE with a shared expert and the router's
        # e_score_correction_bias (a persistent buffer)
        cfg = transformers.Glm4MoeConfig(
            attention_bias=True, use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            norm_topk_prob=True, num_nextn_predict_layers=0, **kw)
    elif kind == "deepseek_v2":
        # DeepSeek-V2-Lite's shape: MLA without q_lora_rank, layer 0 dense, two shared experts, a
        # greedy router without a score-correction bias
        kw.pop("head_dim")
        kw["num_key_value_heads"] = kw["num_attention_heads"]
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
        cfg = transformers.DeepseekV2Config(
            q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
            first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
            routed_scaling_factor=1.0, **kw)
    elif kind == "kimi_k2":
        # Kimi-K2's shape (a DeepseekV3ForCausalLM): MLA with q_lora_rank, twice DeepSeek-V3's
        # heads per hidden size here, one dense layer, one shared expert, routed_scaling_factor 2.827
        kw.pop("head_dim")
        kw["num_attention_heads"] = kw["num_key_value_heads"] = 8
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
        cfg = transformers.DeepseekV3Config(**{**dict(
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=2.827, num_mtp_layers=0), **kw})
    elif kind == "deepseek_v3":
        # DeepSeek-V3 (MLA: q down/up, kv down with the rope part, kv up),
        # layer 0 dense, then MoE with a shared expert and the router's e_score_correction_bias
        # (a persistent buffer); plain rope (no yarn) and no MTP layer
        kw.pop("head_dim")  # transformers sets it to qk_rope_head_dim
        kw["num_key_value_heads"] = kw["num_attention_heads"]  # one latent for all heads
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
        cfg = transformers.DeepseekV3Config(**{**dict(
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, num_mtp_layers=0), **kw})
    else:
        kw.setdefault("num_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        kw.setdefault("moe_intermediate_size", 32)
        cfg = transformers.Qwen3MoeConfig(attention_bias=False, norm_topk_prob=True, decoder_sparse_step=1,
                                          mlp_only_layers=[], output_router_logits=False, **kw)
    cfg.dtype = torch.float32
    return cfg


def _random(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The value of canonical tensor `name`: seeded by the name alone, so that transformers 4
    and 5 (different module trees, different parameter order) build the same weights; norms
    around 1, so that a misplaced norm shows."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g)
    return 1.0 + 0.1 * t if name.endswith("norm.weight") else 0.08 * t


def build(cfg: Any) -> torch.nn.Module:
    """The HF model with every canonical tensor drawn by `_random` (fused experts filled from
    their per-expert tensors: gate rows then up rows, as transformers 5's Qwen3MoeExperts reads them;
    the persistent buffers a checkpoint stores too)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
            if m is None:
                p.copy_(_random(name, tuple(p.shape)))
                continue
            base, which = m.groups()
            for e in range(p.shape[0]):
                if which == "down_proj":
                    p[e] = _random(f"{base}.{e}.down_proj.weight", tuple(p.shape[1:]))
                else:
                    i = p.shape[1] // 2
                    p[e, :i] = _random(f"{base}.{e}.gate_proj.weight", (i, p.shape[2]))
                    p[e, i:] = _random(f"{base}.{e}.up_proj.weight", (i, p.shape[2]))
        saved = set(model.state_dict())
        for name, b in model.named_buffers():
            if name in saved:
                b.copy_(_random(name, tuple(b.shape)))
    return model


def save_bf16(model: torch.nn.Module, path: str) -> str:
    """A bf16 checkpoint as users write one: ``model.to(torch.bfloat16).save_pretrained(path)``
    (every tensor BF16, a router's ``e_score_correction_bias`` included). Called outside the
    ranks' process group (``save_pretrained`` writes on the main process only)."""
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def load_auto(path: str) -> torch.nn.Module:
    """The model as users load a checkpoint: ``from_pretrained(path, dtype="auto")``, which
    applies the release's own dtype rules (``_keep_in_fp32_modules_strict``: the router bias fp32,
    and from transformers 5.24 DeepSeek-V2/V3's and GLM-4.5's ``mlp.gate.weight`` fp32 too)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()


def write_checkpoint(model: torch.nn.Module, path: str) -> dict[str, torch.Tensor]:
    """config.json + model.safetensors; returns the canonical tensors written."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    canon = convert.hf_canonical(model)
    save_file(canon, os.path.join(path, "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = "float32"
    cfg["architectures"] = [type(model).__name__]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1, default=str)
    return canon


def logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits
