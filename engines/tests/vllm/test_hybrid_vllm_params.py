"""vLLM 0.33's own hybrid linear-attention models on CPU (Qwen3-Next, Qwen3.5, Qwen3.5-MoE),
element by element: what awex's vLLM layout must hold on every rank.

As ``engines/tests/test_hybrid_sglang_params.py`` for SGLang: a checkpoint whose every element
names itself (``identity.py``) is loaded by vLLM's real model classes, one process per TP rank
(``vllm_load_rank.py``: ``vllm_rank.build``, vLLM's ``initialize_model``, and the class's own
``load_weights``; attention kernels stubbed and the Gated DeltaNet norm built on CPU, see
``vllm_rank.stub_gpu_kernels``, neither on the weight path). Every parameter of every rank, as
runs of canonical elements, must equal ``awex-vllm/tests/fixtures/hybrid_vllm_params.json``;
``awex-vllm/tests/hybrid.rs`` checks that awex's vLLM layout places exactly those runs.
``AWEX_WRITE_HYBRID_FIXTURE=1`` rewrites the fixture.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)  # vllm_preload.py, for the forkserver
import forked  # noqa: E402  (engines/tests/forked.py)

import fp8_ckpts  # noqa: E402
import identity  # noqa: E402

free_port = fp8_ckpts._conftest.free_port

FIXTURE = os.path.join(HERE, "..", "..", "..", "awex-vllm", "tests", "fixtures", "hybrid_vllm_params.json")

# arch, tp, ep: tp 4 holds one of the 4 linear-attention key-head groups per rank; vLLM's expert
# parallelism is the whole TP group (ep = tp)
CASES = [
    ("Qwen3NextForCausalLM", 1, 1),
    ("Qwen3NextForCausalLM", 2, 1),
    ("Qwen3NextForCausalLM", 4, 1),
    ("Qwen3NextForCausalLM", 2, 2),
    ("Qwen3_5ForCausalLM", 2, 1),
    ("Qwen3_5ForCausalLM", 4, 1),
    ("Qwen3_5MoeForCausalLM", 2, 2),
]


def vllm_ranks(arch: str, tp: int, ep: int, d: str) -> tuple[dict, list[str], list]:
    names = identity.identity_checkpoint(arch, d)
    spec = dict(tp=tp, ep=ep, hf_dir=d, dtype="float32", port=free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [
        forked.popen(os.path.join(HERE, "vllm_load_rank.py"), [json.dumps(spec), str(r), d],
                     os.path.join(d, f"rank{r}.log"), "vllm_preload", env=env)
        for r in range(tp)
    ]
    try:
        for r, p in enumerate(procs):
            if p.wait(timeout=600) != 0:
                raise AssertionError(f"vLLM rank {r} failed:\n" + open(os.path.join(d, f"rank{r}.log")).read()[-6000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ranks = []
    for r in range(tp):
        with open(os.path.join(d, f"params{r}.json")) as f:
            ranks.append(json.load(f))
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    return config, names, ranks


@pytest.mark.timeout(1500)  # sixteen vLLM processes
def test_vllm_hybrid_parameters_are_the_fixture_awex_lays_out(tmp_path) -> None:
    cases = []
    for i, (arch, tp, ep) in enumerate(CASES):
        d = tmp_path / f"case{i}"
        d.mkdir()
        config, names, ranks = vllm_ranks(arch, tp, ep, str(d))
        held = {run[1] for rank in ranks for _, _, _, runs in rank for run in runs}
        assert held == set(range(len(names))), (arch, sorted(set(names) - {names[i] for i in held}))
        cases.append({"arch": arch, "tp": tp, "ep": ep, "config": config, "tensors": names, "ranks": ranks})
    fixture = {"span": identity.SPAN, "cases": cases}
    if os.environ.get("AWEX_WRITE_HYBRID_FIXTURE") == "1":
        os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
        with open(FIXTURE, "w") as f:
            json.dump(fixture, f, separators=(",", ":"))
            f.write("\n")
    with open(FIXTURE) as f:
        want = json.load(f)
    assert fixture == want, (
        "vLLM's hybrid-model parameters changed: rerun with AWEX_WRITE_HYBRID_FIXTURE=1 and check "
        "awex-vllm/tests/hybrid.rs")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
