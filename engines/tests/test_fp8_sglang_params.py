"""SGLang 0.5.23's own block-FP8 parameters on CPU: what awex's FP8 inference layout must hold.

For every case, an FP8 checkpoint (the ``vllm`` reference quantiser of ``engines/fp8_refs.py``
applied to a tiny bf16 checkpoint, ``quantization_config`` with 16 x 16 blocks) is built and
loaded by SGLang's real model classes, one process per TP rank (``sglang_cpu``: nothing on the
weight path replaced). Every rank's parameters (name, shape, dtype: the e4m3 weights created
by ``Fp8LinearMethod`` / ``Fp8MoEMethod.create_weights`` and their ``*_scale_inv``) must equal
``tests/tests/fixtures/fp8_sglang_params.json``, which ``tests/tests/fp8.rs`` compares with
awex's own FP8 layout of the same pair. ``AWEX_WRITE_FP8_FIXTURE=1`` rewrites the fixture.
"""

from __future__ import annotations

import json
import os
import traceback
from typing import Any

import pytest

import checkpoints
import sglang_cpu
from conftest import free_port, rank_context, sglang_infer

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "..", "tests", "tests", "fixtures", "fp8_sglang_params.json")
BLOCK = (16, 16)

# arch, tp, ep
CASES = [
    ("Qwen3ForCausalLM", 1, 1),
    ("Qwen3ForCausalLM", 2, 1),
    ("Qwen3MoeForCausalLM", 2, 1),
    ("Qwen3MoeForCausalLM", 2, 2),
    # MLA: the fused q/kv down projection (32 + 24 rows: the last block row is half a block),
    # q_b / kv_b over tp, the shared expert apart (as SGLang on CPU), the router and its bias
    ("DeepseekV3ForCausalLM", 1, 1),
    ("DeepseekV3ForCausalLM", 2, 1),
    ("DeepseekV3ForCausalLM", 2, 2),
    # MLA without q_lora_rank: q_proj over tp, kv_a_proj_with_mqa replicated
    ("DeepseekV3ForCausalLM-no-q-lora", 2, 1),
]


def fp8_checkpoint(src: str, dst: str) -> str:
    """``src`` with every linear weight (``checkpoints.fp8_linear``: experts and MLA's
    projections included; not the embedding, the norms, ``lm_head`` or the router ``mlp.gate``)
    quantised by the ``vllm`` reference into e4m3 plus ``*_scale_inv``, the rest bf16, and a
    ``quantization_config``."""
    import torch
    from safetensors.torch import load_file, save_file

    import fp8_refs

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(BLOCK),
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    out = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        t = t.to(torch.bfloat16)
        if checkpoints.fp8_linear(name):
            q, s = fp8_refs.ref_vllm(t, block=BLOCK)
            out[name] = q
            out[name + "_scale_inv"] = s.contiguous()
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"))
    return dst


def params_job(rank: int, q: Any, tp: int, ep: int, port: int, ckpt: str) -> None:
    try:
        sa = sglang_cpu.init_rank(ckpt, tp=tp, ep=ep, rank=rank, port=port, dtype="bfloat16")
        model = sglang_cpu.load_model(sa)
        params = list(model.named_parameters())
        q.put((rank, {"params": [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in params],
                      # not model weights (SGLang's FP8 KV-cache scales): awex.sglang registers none
                      "skip_weight_check": [n for n, p in params if getattr(p, "_skip_weight_check", False)]}))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def sglang_params(arch: str, tp: int, ep: int, tmp: str) -> list[dict]:
    src = checkpoints.write(os.path.join(tmp, "bf16"), arch, tied=False, seed=7)
    ckpt = fp8_checkpoint(src, os.path.join(tmp, "fp8"))
    ctx = rank_context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=params_job, args=(r, q, tp, ep, port, ckpt)) for r in range(tp)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for r, v in got.items():
        assert not isinstance(v, str), f"rank {r}:\n{v}"
    return [got[r] for r in range(tp)]


def test_sglang_fp8_parameters_are_the_fixture_awex_lays_out(tmp_path) -> None:
    cases = []
    for i, (arch, tp, ep) in enumerate(CASES):
        d = tmp_path / f"case{i}"
        d.mkdir()
        ranks = sglang_params(arch, tp, ep, str(d))
        with open(os.path.join(str(d), "fp8", "config.json")) as f:
            config = json.load(f)
        cases.append({"arch": arch, "tp": tp, "ep": ep, "infer": sglang_infer(arch, tp, ep), "config": config,
                      "ranks": ranks})
        # what SGLang holds FP8: exactly the linear weights, each with its block scales
        for rank in ranks:
            names = {n: (s, d) for n, s, d in rank["params"]}
            # what awex leaves out: scalar fp32 KV-cache scales of attention layers
            for n in rank["skip_weight_check"]:
                assert n.endswith((".k_scale", ".v_scale")) and names[n] == ([], "float32"), (n, names[n])
            for n, (shape, dtype) in names.items():
                if dtype == "float8_e4m3fn":
                    s_shape, s_dtype = names[n + "_scale_inv"]
                    assert s_dtype == "float32"
                    assert s_shape[-2:] == [-(-shape[-2] // BLOCK[0]), -(-shape[-1] // BLOCK[1])]
    fixture = {"block": list(BLOCK), "cases": cases}
    if os.environ.get("AWEX_WRITE_FP8_FIXTURE") == "1":
        os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
        with open(FIXTURE, "w") as f:
            json.dump(fixture, f, indent=1)
            f.write("\n")
    with open(FIXTURE) as f:
        want = json.load(f)
    assert fixture == want, "SGLang's FP8 parameters changed: rerun with AWEX_WRITE_FP8_FIXTURE=1 and check tests/tests/fp8.rs"


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
