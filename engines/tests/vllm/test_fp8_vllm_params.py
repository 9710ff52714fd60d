"""vLLM 0.33's own block-FP8 parameters on CPU: what awex's FP8 ``vllm`` layout must hold.

For every case, an FP8 checkpoint (the ``vllm`` reference quantiser of ``engines/fp8_refs.py``
applied to a tiny bf16 checkpoint, ``quantization_config`` with 16 x 16 blocks:
``fp8_ckpts.fp8_checkpoint``, as ``test_fp8_sglang_params.py``, with Qwen3-MoE's router quantised
too, as vLLM's class holds it) is loaded by vLLM's real model
classes, one process per TP rank (``vllm_fp8_rank.py params``: vLLM's ``initialize_model``, the
class's own ``load_weights``, vLLM's ``process_weights_after_loading``; only the FP8 kernel
choice is stubbed, ``fp8_kernel_stubs.py``). Every rank's parameters (name, shape, dtype: the
e4m3 weights ``Fp8LinearMethod`` / ``Fp8MoEMethod.create_weights`` create and their fp32
``*_scale_inv``) must equal ``tests/tests/fixtures/fp8_vllm_params.json``, which
``tests/tests/fp8.rs`` compares with awex's own FP8 ``vllm`` layout of the same pair.
``AWEX_WRITE_FP8_FIXTURE=1`` rewrites the fixture.
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

import checkpoints  # noqa: E402
import fp8_ckpts  # noqa: E402

free_port = fp8_ckpts._conftest.free_port

FIXTURE = os.path.join(HERE, "..", "..", "..", "tests", "tests", "fixtures", "fp8_vllm_params.json")
BLOCK = (16, 16)

# arch, tp, ep
CASES = [
    ("Qwen3ForCausalLM", 1, 1),
    ("Qwen3ForCausalLM", 2, 1),
    ("Qwen3MoeForCausalLM", 2, 1),
    ("Qwen3MoeForCausalLM", 2, 2),
]


def run_ranks(mode: str, spec: dict, tp: int, d: str) -> None:
    """``vllm_fp8_rank.py MODE`` in one process per TP rank; a failed rank's log is raised."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [
        forked.popen(os.path.join(HERE, "vllm_fp8_rank.py"), [mode, json.dumps(spec), str(r), d],
                     os.path.join(d, f"{mode}{r}.log"), "vllm_preload", env=env)
        for r in range(tp)
    ]
    try:
        for r, p in enumerate(procs):
            if p.wait(timeout=600) != 0:
                raise AssertionError(f"vLLM rank {r} failed:\n" + open(os.path.join(d, f"{mode}{r}.log")).read()[-6000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def vllm_params(arch: str, tp: int, ep: int, d: str) -> list[list]:
    src = checkpoints.write(os.path.join(d, "bf16"), arch, tied=False, seed=7)
    # vLLM's Qwen3-MoE quantises its router too (``models/qwen3_moe.py``: ``GateLinear(...,
    # quant_config=quant_config)``): the checkpoint stores it as FP8
    ckpt = fp8_ckpts.fp8_checkpoint(src, os.path.join(d, "fp8"), BLOCK, router=True)
    spec = dict(tp=tp, ep=ep, hf_dir=ckpt, ckpt=ckpt, dtype="bfloat16", port=free_port())
    run_ranks("params", spec, tp, d)
    out = []
    for r in range(tp):
        with open(os.path.join(d, f"params{r}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.mark.timeout(1500)  # seven vLLM processes, one after another per case
def test_vllm_fp8_parameters_are_the_fixture_awex_lays_out(tmp_path) -> None:
    cases = []
    for i, (arch, tp, ep) in enumerate(CASES):
        d = tmp_path / f"case{i}"
        d.mkdir()
        ranks = vllm_params(arch, tp, ep, str(d))
        with open(os.path.join(str(d), "fp8", "config.json")) as f:
            config = json.load(f)
        cases.append({"arch": arch, "tp": tp, "ep": ep, "config": config, "ranks": ranks})
        # what vLLM holds FP8: the linear weights and expert stacks, each with its block scales
        n_fp8 = 0
        for params in ranks:
            names = {n: (s, dt) for n, s, dt in params}
            for n, (shape, dtype) in names.items():
                if dtype == "float8_e4m3fn":
                    n_fp8 += 1
                    s_shape, s_dtype = names[n + "_scale_inv"]
                    assert s_dtype == "float32"
                    assert s_shape[:-2] == shape[:-2]
                    assert s_shape[-2:] == [-(-shape[-2] // BLOCK[0]), -(-shape[-1] // BLOCK[1])]
            if "Moe" in arch:
                assert {"w13_weight_scale_inv", "w2_weight_scale_inv"} <= {n.rsplit(".", 1)[-1] for n in names}
                assert names["model.layers.0.mlp.gate.weight"][1] == "float8_e4m3fn"
        assert n_fp8 >= 4 * tp, (arch, tp, n_fp8)
    fixture = {"block": list(BLOCK), "cases": cases}
    if os.environ.get("AWEX_WRITE_FP8_FIXTURE") == "1":
        os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
        with open(FIXTURE, "w") as f:
            json.dump(fixture, f, indent=1)
            f.write("\n")
    with open(FIXTURE) as f:
        want = json.load(f)
    assert fixture == want, "vLLM's FP8 parameters changed: rerun with AWEX_WRITE_FP8_FIXTURE=1 and check tests/tests/fp8.rs"
