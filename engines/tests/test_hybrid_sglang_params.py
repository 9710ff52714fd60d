"""SGLang 0.5.23's own hybrid linear-attention models on CPU (Qwen3-Next, Qwen3.5, Qwen3.5-MoE),
element by element: what awex's SGLang layout must hold on every rank.

For every case, a tiny transformers checkpoint whose every element holds its own identity
(``(tensor + 1) * 2**16 + flat index``, exact in float32) is loaded by SGLang's real model
classes, one process per TP rank (``sglang_cpu``: their own ``load_weights`` and every layer's
own ``weight_loader``; the Gated DeltaNet layers built on CPU by
``sglang_cpu.cpu_device_module_at_construction``, the only change, outside the weight path).
Every parameter of every rank is then read back as runs of canonical elements
``[local start, canonical tensor (index in the case's sorted ``tensors``), canonical start,
length]`` (zeros: padding), which must equal
``awex-sglang/tests/fixtures/hybrid_sglang_params.json``; ``awex-sglang/tests/hybrid.rs``
checks that awex's SGLang layout of the same model places exactly those runs, rank by rank.
``AWEX_WRITE_HYBRID_FIXTURE=1`` rewrites the fixture.
"""

from __future__ import annotations

import json
import os
import traceback
from typing import Any

import pytest

import checkpoints
import sglang_cpu
from identity import SPAN, identity_checkpoint, runs_of
from conftest import free_port, rank_context

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "..", "awex-sglang", "tests", "fixtures", "hybrid_sglang_params.json")

# arch, tp, ep: tp 4 holds one of the 4 linear-attention key-head groups per rank and
# replicates each of the 2 KV heads of the full-attention layer over 2 ranks
CASES = [
    ("Qwen3_5ForCausalLM", 1, 1),
    ("Qwen3NextForCausalLM", 1, 1),
    ("Qwen3NextForCausalLM", 2, 1),
    ("Qwen3NextForCausalLM", 4, 1),
    ("Qwen3NextForCausalLM", 2, 2),
    ("Qwen3_5ForCausalLM", 2, 1),
    ("Qwen3_5ForCausalLM", 4, 1),
    ("Qwen3_5MoeForCausalLM", 2, 2),
]


def params_job(rank: int, q: Any, tp: int, ep: int, port: int, ckpt: str) -> None:
    try:
        sglang_cpu.cpu_device_module_at_construction()
        # the default `extra_buffer` Mamba cache asserts GPU support for state snapshots; the
        # cache strategy shapes the cache, not the weights
        sa = sglang_cpu.init_rank(ckpt, tp=tp, ep=ep, rank=rank, port=port,
                                  mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True)
        model = sglang_cpu.load_model(sa)
        params = []
        for n, p in model.named_parameters():
            v = p.detach().float().numpy()
            params.append([n, list(p.shape), str(p.dtype).removeprefix("torch."), runs_of(v)])
        q.put((rank, params))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def sglang_ranks(arch: str, tp: int, ep: int, tmp: str) -> tuple[dict, list[str], list]:
    names = identity_checkpoint(arch, tmp)
    ctx = rank_context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=params_job, args=(r, q, tp, ep, port, tmp)) for r in range(tp)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for r, v in got.items():
        assert not isinstance(v, str), f"rank {r}:\n{v}"
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    return config, names, [got[r] for r in range(tp)]


@pytest.mark.timeout(900)  # eighteen SGLang rank processes, case after case
def test_sglang_hybrid_parameters_are_the_fixture_awex_lays_out(tmp_path) -> None:
    cases = []
    for i, (arch, tp, ep) in enumerate(CASES):
        d = tmp_path / f"case{i}"
        d.mkdir()
        config, names, ranks = sglang_ranks(arch, tp, ep, str(d))
        # every canonical tensor is somewhere in the engine
        held = {run[1] for rank in ranks for _, _, _, runs in rank for run in runs}
        assert held == set(range(len(names))), (arch, sorted(set(names) - {names[i] for i in held}))
        cases.append({"arch": arch, "tp": tp, "ep": ep, "config": config, "tensors": names, "ranks": ranks})
    fixture = {"span": SPAN, "cases": cases}
    if os.environ.get("AWEX_WRITE_HYBRID_FIXTURE") == "1":
        os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
        with open(FIXTURE, "w") as f:
            json.dump(fixture, f, separators=(",", ":"))
            f.write("\n")
    with open(FIXTURE) as f:
        want = json.load(f)
    assert fixture == want, (
        "SGLang's hybrid-model parameters changed: rerun with AWEX_WRITE_HYBRID_FIXTURE=1 and check "
        "awex-sglang/tests/hybrid.rs")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
