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

The cases marked ``"cuda"`` build the MoE block (``models/qwen2_moe.py``
``Qwen2MoeSparseMoeBlock``) deciding as on an NVIDIA GPU whether to fuse the shared expert into
the routed experts (``sglang_cpu.qwen2_moe_block_as_on_cuda``: its module's ``_is_cuda`` flag,
nothing else); the fixture records SGLang's own decision (``num_fused_shared_experts`` of every
block of every rank), which ``hybrid.rs`` passes to awex's layout as the deployment's
``fused_shared_experts``.
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
    # Qwen2MoeSparseMoeBlock deciding as on an NVIDIA GPU (`sglang_cpu.qwen2_moe_block_as_on_cuda`):
    # SGLang fuses Qwen3-Next's shared expert into the routed experts (one more expert) and keeps
    # Qwen3.5-MoE's apart (its layers build the block without `enable_cuda_shared_expert_fusion`)
    ("Qwen3NextForCausalLM", 1, 1, "cuda"),
    ("Qwen3NextForCausalLM", 2, 1, "cuda"),
    ("Qwen3_5MoeForCausalLM", 1, 1, "cuda"),
    ("Qwen3_5MoeForCausalLM", 2, 1, "cuda"),
    # under expert parallelism with the default all-to-all backend SGLang fuses Qwen3-Next's shared
    # expert too: `FusedMoE.__init__` holds one copy as every EP rank's last local expert, its
    # MoE-TP share at moe_tp = tp / ep = 2 (tp 4, ep 2)
    ("Qwen3NextForCausalLM", 2, 2, "cuda"),
    ("Qwen3NextForCausalLM", 4, 2, "cuda"),
]


def params_job(rank: int, q: Any, tp: int, ep: int, port: int, ckpt: str, as_on_cuda: bool) -> None:
    try:
        sglang_cpu.cpu_device_module_at_construction()
        if as_on_cuda:
            sglang_cpu.qwen2_moe_block_as_on_cuda()
        # the default `extra_buffer` Mamba cache asserts GPU support for state snapshots; the
        # cache strategy shapes the cache, not the weights
        sa = sglang_cpu.init_rank(ckpt, tp=tp, ep=ep, rank=rank, port=port,
                                  mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True)
        model = sglang_cpu.load_model(sa)
        from sglang.srt.models.qwen2_moe import Qwen2MoeSparseMoeBlock

        # SGLang's own decision, block by block: shared experts fused into the routed experts
        fused = {m.num_fused_shared_experts for m in model.modules() if isinstance(m, Qwen2MoeSparseMoeBlock)}
        params = []
        for n, p in model.named_parameters():
            v = p.detach().float().numpy()
            params.append([n, list(p.shape), str(p.dtype).removeprefix("torch."), runs_of(v)])
        q.put((rank, (sorted(fused), params)))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def sglang_ranks(arch: str, tp: int, ep: int, tmp: str, as_on_cuda: bool = False) -> tuple[dict, list[str], list, list]:
    """The config, the canonical tensor names, every rank's parameters, and every rank's
    ``num_fused_shared_experts`` of its MoE blocks (one value each)."""
    names = identity_checkpoint(arch, tmp)
    ctx = rank_context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=params_job, args=(r, q, tp, ep, port, tmp, as_on_cuda)) for r in range(tp)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for r, v in got.items():
        assert not isinstance(v, str), f"rank {r}:\n{v}"
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    return config, names, [got[r][1] for r in range(tp)], [got[r][0] for r in range(tp)]


@pytest.mark.timeout(1800)  # thirty SGLang rank processes, case after case
def test_sglang_hybrid_parameters_are_the_fixture_awex_lays_out(tmp_path) -> None:
    cases = []
    for i, (arch, tp, ep, *platform) in enumerate(CASES):
        d = tmp_path / f"case{i}"
        d.mkdir()
        as_on_cuda = platform == ["cuda"]
        config, names, ranks, fused = sglang_ranks(arch, tp, ep, str(d), as_on_cuda)
        # every canonical tensor is somewhere in the engine
        held = {run[1] for rank in ranks for _, _, _, runs in rank for run in runs}
        assert held == set(range(len(names))), (arch, sorted(set(names) - {names[i] for i in held}))
        case = {"arch": arch, "tp": tp, "ep": ep, "config": config, "tensors": names, "ranks": ranks}
        if "moe_intermediate_size" in config:
            # one decision for every MoE block of every rank
            assert len({tuple(f) for f in fused}) == 1 and len(fused[0]) == 1, (arch, fused)
        else:
            assert fused == [[]] * tp, (arch, fused)
        if as_on_cuda:
            # the deployment awex is told of (`sglang:...,fused_shared_experts=N`): SGLang's own
            # decision on this platform
            case["platform"] = "cuda"
            case["fused_shared_experts"] = fused[0][0]
        elif fused[0]:
            # on CPU SGLang keeps every shared expert apart (what hybrid.rs lays out for these cases)
            assert fused[0] == [0], (arch, fused)
        cases.append(case)
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
