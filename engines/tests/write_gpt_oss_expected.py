"""Writes what SGLang 0.5.23 and vLLM 0.33 hold of awex's ``gpt-oss-tiny`` preset on every rank,
from ``gpt_oss_layout.expected`` (the function ``test_gpt_oss_sglang_params.py`` and
``vllm/test_gpt_oss_vllm_params.py`` pin against the engines' own loads), as fixtures the Rust
layout tests compare awex's ranks with: ``awex-sglang/tests/fixtures/gpt_oss_expected.json``
(tp 1, 2, 4) and ``awex-vllm/tests/fixtures/gpt_oss_expected.json`` (tp 1, 2, 4; tp 2 / ep 2).

The checkpoint labels element ``i`` of the ``t``-th tensor in name order ``(t + 1) * 2**17 + i``
(exact in float32); each parameter is recorded as its shape, its dtype and
``sum((bf16(value) as uint64) * (index + 1))`` over its flattened elements (the model is bf16;
an engine's zeros count 0). Run with the engines venv's python (numpy and torch):
``python engines/tests/write_gpt_oss_expected.py``.
"""

from __future__ import annotations

import json
import os

import numpy as np

import gpt_oss_layout

#: awex's `gpt-oss-tiny` preset (`awex-core/src/model/family/gpt_oss.rs`).
CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 48,
    "vocab_size": 1000,
    "num_local_experts": 8,
}


def shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, hd, e, i = c["hidden_size"], c["head_dim"], c["num_local_experts"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (c["vocab_size"], h), "lm_head.weight": (c["vocab_size"], h),
           "model.norm.weight": (h,)}
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}"
        out.update({
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.q_proj.bias": (q,),
            f"{p}.self_attn.k_proj.weight": (kv, h), f"{p}.self_attn.k_proj.bias": (kv,),
            f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.v_proj.bias": (kv,),
            f"{p}.self_attn.o_proj.weight": (h, q), f"{p}.self_attn.o_proj.bias": (h,),
            f"{p}.self_attn.sinks": (c["num_attention_heads"],),
            f"{p}.mlp.router.weight": (e, h), f"{p}.mlp.router.bias": (e,),
            f"{p}.mlp.experts.gate_up_proj": (e, h, 2 * i), f"{p}.mlp.experts.gate_up_proj_bias": (e, 2 * i),
            f"{p}.mlp.experts.down_proj": (e, i, h), f"{p}.mlp.experts.down_proj_bias": (e, h),
        })
    return out


def checksum(v: np.ndarray) -> int:
    x = gpt_oss_layout._bf16(v).reshape(-1).astype(np.uint64)
    return int(np.sum(x * np.arange(1, x.size + 1, dtype=np.uint64), dtype=np.uint64))


def main() -> None:
    ck = {}
    for t, (name, shape) in enumerate(sorted(shapes(CONFIG).items())):
        n = int(np.prod(shape))
        ck[name] = ((t + 1) * (1 << 17) + np.arange(n, dtype=np.float64)).astype(np.float32).reshape(shape)
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    for engine, crate, configs in [("sglang", "awex-sglang", [(1, 1), (2, 1), (4, 1)]),
                                   ("vllm", "awex-vllm", [(1, 1), (2, 1), (4, 1), (2, 2)])]:
        cases = []
        for tp, ep in configs:
            for r in range(tp):
                want = gpt_oss_layout.expected(engine, ck, CONFIG, tp, ep, r)
                cases.append({"tp": tp, "ep": ep, "rank": r, "tensors": {
                    name: [list(v.shape), checksum(v)] for name, v in sorted(want.items())}})
        path = os.path.join(root, crate, "tests", "fixtures", "gpt_oss_expected.json")
        with open(path, "w") as f:
            json.dump({"written_by": "engines/tests/write_gpt_oss_expected.py", "engine": engine,
                       "config": CONFIG, "cases": cases}, f, indent=None, separators=(",", ":"))
            f.write("\n")
        print(path, len(cases), "ranks")


if __name__ == "__main__":
    main()
