"""vLLM 0.33's own gpt-oss model (``GptOssForCausalLM``, unquantized) on CPU at tp 1, 2, 4 and
with expert parallelism (tp 2, ep 2), element by element against what ``gpt_oss_layout.py``
writes down from its code: the experts transposed per expert (``w13_weight``
``[E_local, 2I / tp, H]``, gate/up interleave kept), ``w2_bias`` zero on TP ranks but 0,
``sinks`` in the model's dtype split by heads; vLLM's names (``model.embedding``,
``layers.{l}.attn``, ``mlp.experts.routed_experts``).

A tiny checkpoint whose every element names itself (``identity.py``) is loaded by vLLM's real
model class, one process per TP rank (``vllm_load_rank.py``: its own ``load_weights`` and
every layer's own ``weight_loader``; the attention kernel stubbed as for the other models, it
holds no parameter).
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
import gpt_oss_layout  # noqa: E402
import identity  # noqa: E402

free_port = fp8_ckpts._conftest.free_port

ARCH = "GptOssForCausalLM"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, dict]:
    from safetensors.numpy import load_file

    d = str(tmp_path_factory.mktemp("gpt-oss"))
    identity.identity_checkpoint(ARCH, d)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    return d, config, load_file(os.path.join(d, "model.safetensors"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_vllm_gpt_oss_parameters_are_the_written_down_layout(ckpt, tmp_path, tp, ep) -> None:
    import numpy as np

    d, config, tensors = ckpt
    spec = dict(tp=tp, ep=ep, hf_dir=d, dtype="float32", port=free_port(), dump="npz")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [
        forked.popen(os.path.join(HERE, "vllm_load_rank.py"), [json.dumps(spec), str(r), str(tmp_path)],
                     os.path.join(tmp_path, f"rank{r}.log"), "vllm_preload", env=env)
        for r in range(tp)
    ]
    try:
        for r, p in enumerate(procs):
            if p.wait(timeout=600) != 0:
                raise AssertionError(f"vLLM rank {r} failed:\n" + open(os.path.join(tmp_path, f"rank{r}.log")).read()[-6000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r in range(tp):
        got = dict(np.load(os.path.join(tmp_path, f"params{r}.npz")))
        with open(os.path.join(tmp_path, f"dtypes{r}.json")) as f:
            dtypes = json.load(f)
        want = gpt_oss_layout.expected("vllm", tensors, config, tp, ep, r)
        gpt_oss_layout.compare("vllm", got, dtypes, want, r)
