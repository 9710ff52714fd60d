"""What SGLang 0.5.23 and vLLM 0.33 hold of a gpt-oss checkpoint on every rank, written down
from their code and computed here with numpy from the checkpoint alone: the tests
(``test_gpt_oss_sglang_params.py``, ``vllm/test_gpt_oss_vllm_params.py``) compare it with what
the engines' own classes load on CPU, element by element.

The checkpoint (transformers 5.19's ``GptOssForCausalLM``) holds the experts fused over all
experts and transposed against a linear layer's ``[out, in]``: ``mlp.experts.gate_up_proj``
``[E, H, 2I]`` with gate and up interleaved along the last dim (``GptOssExperts._apply_gate``:
``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), ``down_proj`` ``[E, I, H]``. Both engines hold
``w13 [E_local, 2I / moe_tp, H]`` and ``w2 [E_local, H, I / moe_tp]``, i.e. the **transpose**
of a contiguous chunk of the checkpoint's last (``gate_up``) or middle (``down``) dim, the
gate/up interleave kept:

- SGLang: ``models/gpt_oss.py`` ``_load_normal_weights`` transposes ``gate_up_proj`` /
  ``down_proj`` (``loaded_weight.transpose(-2, -1)``) and hands them to
  ``FusedMoE.weight_loader_fused`` (``layers/moe/fused_moe_triton/layer.py``), whose
  ``_load_w13`` / ``_load_w2`` narrow dim 1 (w13) or 2 (w2) to the ``moe_tp_rank``-th chunk;
  it zeroes ``w2_weight_bias`` on every MoE-TP rank but the first (the bias is added after
  the reduction). ``sinks`` are bf16 whatever the model's dtype (``GptOssAttention.__init__``:
  fp32 only for the ``trtllm_mha`` backend), split by heads (``tp_rank * numel``).
- vLLM: ``models/gpt_oss.py`` ``GptOssRoutedExperts._load_unquantized_expert`` narrows each
  expert's ``gate_up_proj[e]`` on dim 1 (``down_proj[e]`` on dim 0) to the rank's chunk and
  transposes it (``.t()``); ``_load_expert_bias`` narrows ``w13_bias`` and zeroes ``w2_bias``
  on TP ranks but 0; ``sinks`` in the model's dtype (``make_attention_sink``), split by heads
  (``load_attention_sink``). Its expert parallelism is the whole TP group (MoE tp 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: The engines' names for what a gpt-oss layer holds (`{l}` the layer).
NAMES = {
    "sglang": {
        "embed": "model.embed_tokens.weight",
        "attn": "model.layers.{l}.self_attn",
        "experts": "model.layers.{l}.mlp.experts",
        "w13_bias": "w13_weight_bias",
        "w2_bias": "w2_weight_bias",
    },
    "vllm": {
        "embed": "model.embedding.weight",
        "attn": "model.layers.{l}.attn",
        "experts": "model.layers.{l}.mlp.experts.routed_experts",
        "w13_bias": "w13_bias",
        "w2_bias": "w2_bias",
    },
}

#: Both engines pad the vocabulary to a multiple of 64 (``DEFAULT_VOCAB_PADDING_SIZE``) and
#: split the padded rows evenly over tp.
VOCAB_PAD = 64


def _bf16(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).float().numpy()


def _vocab(t: np.ndarray, tp: int, r: int) -> np.ndarray:
    v, h = t.shape
    per = -(-v // VOCAB_PAD) * VOCAB_PAD // tp
    out = np.zeros((per, h), dtype=t.dtype)
    rows = t[r * per:(r + 1) * per]
    out[: len(rows)] = rows
    return out


def expected(engine: str, ck: dict[str, np.ndarray], config: dict[str, Any], tp: int, ep: int,
             r: int) -> dict[str, np.ndarray]:
    """Every parameter TP rank ``r`` of ``engine`` (``sglang`` / ``vllm``) holds at tp ``tp``,
    ep ``ep``, in float32."""
    n = NAMES[engine]
    heads, kv_heads, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    experts, inter = config["num_local_experts"], config["intermediate_size"]
    # SGLang: ep ranks over the tp group, moe_tp = tp / ep; vLLM: expert parallelism is the
    # whole tp group when enabled
    moe_tp = tp // ep if engine == "sglang" else (1 if ep > 1 else tp)
    moe_r, ep_r = r % moe_tp, r // moe_tp
    local = experts // (tp // moe_tp)
    es = slice(ep_r * local, (ep_r + 1) * local)
    out = {
        n["embed"]: _vocab(ck["model.embed_tokens.weight"], tp, r),
        "lm_head.weight": _vocab(ck["lm_head.weight"], tp, r),
        "model.norm.weight": ck["model.norm.weight"],
    }
    q_per = heads // tp
    kv_per = max(kv_heads // tp, 1)
    kv_first = r * kv_heads // tp if tp <= kv_heads else r // (tp // kv_heads)
    for l in range(config["num_hidden_layers"]):
        src, attn, ex = f"model.layers.{l}", n["attn"].format(l=l), n["experts"].format(l=l)
        sa = f"{src}.self_attn"
        qs = slice(r * q_per * hd, (r + 1) * q_per * hd)
        ks = slice(kv_first * hd, (kv_first + kv_per) * hd)
        for what in ("weight", "bias"):
            out[f"{attn}.qkv_proj.{what}"] = np.concatenate(
                [ck[f"{sa}.q_proj.{what}"][qs], ck[f"{sa}.k_proj.{what}"][ks], ck[f"{sa}.v_proj.{what}"][ks]])
        out[f"{attn}.o_proj.weight"] = ck[f"{sa}.o_proj.weight"][:, qs]
        out[f"{attn}.o_proj.bias"] = ck[f"{sa}.o_proj.bias"]
        sinks = ck[f"{sa}.sinks"][r * q_per:(r + 1) * q_per]
        out[f"{attn}.sinks"] = _bf16(sinks) if engine == "sglang" else sinks
        for what in ("weight", "bias"):
            out[f"{src}.mlp.router.{what}"] = ck[f"{src}.mlp.router.{what}"]
        gu, c = ck[f"{src}.mlp.experts.gate_up_proj"], 2 * inter // moe_tp
        out[f"{ex}.w13_weight"] = np.swapaxes(gu[es, :, moe_r * c:(moe_r + 1) * c], 1, 2)
        out[f"{ex}.{n['w13_bias']}"] = ck[f"{src}.mlp.experts.gate_up_proj_bias"][es, moe_r * c:(moe_r + 1) * c]
        dn, ci = ck[f"{src}.mlp.experts.down_proj"], inter // moe_tp
        out[f"{ex}.w2_weight"] = np.swapaxes(dn[es, moe_r * ci:(moe_r + 1) * ci, :], 1, 2)
        b = ck[f"{src}.mlp.experts.down_proj_bias"][es]
        out[f"{ex}.{n['w2_bias']}"] = b if moe_r == 0 else np.zeros_like(b)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{src}.{norm}.weight"] = ck[f"{src}.{norm}.weight"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def compare(engine: str, got: dict[str, np.ndarray], dtypes: dict[str, str], want: dict[str, np.ndarray],
            rank: int) -> None:
    """Asserts the rank holds exactly ``want``: the same names, shapes and every element."""
    assert sorted(got) == sorted(want), (engine, rank, sorted(set(got) ^ set(want)))
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, (engine, rank, name, g.shape, w.shape)
        bad = np.flatnonzero(g.reshape(-1) != w.reshape(-1))
        assert bad.size == 0, (engine, rank, name, f"{bad.size} elements differ, first at {bad[0]}: "
                               f"{g.reshape(-1)[bad[0]]} != {w.reshape(-1)[bad[0]]}")
    sinks = [d for n, d in dtypes.items() if n.endswith(".sinks")]
    assert sinks and set(sinks) == {"bfloat16" if engine == "sglang" else "float32"}, (engine, sinks)
