"""FP8 inside SGLang 0.5.23: awex's receive fills SGLang's block-FP8 parameters, then SGLang's own
FP8 post-load runs, and the served model equals SGLang's own load of the FP8 checkpoint.

For every case, three versions of a bf16 checkpoint (dims that are multiples of 128 per rank:
SGLang refuses a per-rank output that cuts a block) and, from each, the FP8 checkpoint the
reference quantiser writes (``fp8_refs.ref_vllm_cuda``: vLLM's ``per_block_cast_to_fp8`` with
CUDA torch's arithmetic, awex's default recipe and device; 128 x 128 blocks). The pair is
connected from Python with the FP8 checkpoint's ``config.json`` as the inference side's config
(``Controller.connect(infer_config=...)``). SGLang's real model classes on CPU, one process
per TP rank, build the server's model from the FP8 checkpoint of version 0, and every update
runs as SGLang's scheduler runs the gateway's session (``rank_jobs.session``: SGLang's own
``WeightUpdater.begin_weight_update``, ``update_weights_from_tensor`` dispatching to
``awex.sglang.receive``, ``end_weight_update``, which runs every ``Fp8LinearMethod`` /
``Fp8MoEMethod.process_weights_after_loading``). awex Writers in a bf16 training layout
(Megatron, FSDP) send the bf16 weights; the inference ranks receive them into staging and
quantise them into SGLang's e4m3 weights and fp32 ``weight_scale_inv``. After each version every
parameter must equal SGLang's own load of that version's FP8 checkpoint, byte for byte.
"""

from __future__ import annotations

import os

import pytest

import awex
import rank_jobs
from conftest import Ranks, free_port, pair_name
from fp8_ckpts import BLOCK, checkpoints_of, drive

# arch, tp, ep, [(training layout, transport)]
CASES = [
    ("Qwen3ForCausalLM", 1, 1, [("megatron:tp=1", "shm")]),
    # FSDP's dp 2 chunks cut blocks: the receiver quantises whole blocks from its staging
    ("Qwen3ForCausalLM", 2, 1, [("megatron:tp=2", "shm"), ("fsdp:dp=2", "tcp")]),
    ("Qwen3MoeForCausalLM", 2, 1, [("megatron:tp=2", "tcp")]),
    ("Qwen3MoeForCausalLM", 2, 2, [("fsdp:dp=2", "shm")]),
]


def _id(case) -> str:
    arch, tp, ep, _ = case
    return f"{arch}-tp{tp}-ep{ep}"



@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fp8_receive_matches_sglang_load_of_the_reference_checkpoint(case, gateway, tmp_path) -> None:
    from safetensors.torch import load_file

    arch, tp, ep, pairs = case
    bf16, fp8, cpu_differs = checkpoints_of(str(tmp_path), arch)
    assert cpu_differs > 0, "CPU and CUDA torch agree on every scale: the check cannot tell them apart"
    ctl = awex.Controller(gateway)
    names = []
    for train, transport in pairs:
        name = pair_name(f"fp8-{arch[:5]}-{transport}")
        st = ctl.connect(name, model=bf16[0], infer_config=fp8[0], train=train,
                         infer=f"sglang:tp={tp},ep={ep}", transport=transport, join_deadline_s=600,
                         update_deadline_s=300)
        assert st["inference"]["fp8"]["config"]["encoding"]["block"] == list(BLOCK), st["inference"]
        assert st["inference"]["fp8"]["recipe"] == "vllm", st["inference"]
        names.append(name)
    ranks = Ranks(tp, rank_jobs.fp8_receive_job, tp, ep, free_port(), fp8, gateway, names, [1, 2])
    try:
        canon = {v: load_file(os.path.join(bf16[v], "model.safetensors")) for v in (1, 2)}
        for name in names:
            updates = drive(gateway, name, canon, [1, 2])
            assert [u["state"] for u in updates] == ["committed", "committed"]
            ctl.disconnect(name)
    finally:
        results = ranks.results(timeout=600)
    for res in results:
        assert res["diffs"] == [], "\n".join(res["diffs"][:20])
        assert res["checked"] == 2 * len(pairs), res
        # SGLang holds the linear weights as e4m3: the comparison covered them
        assert any(n.endswith("qkv_proj.weight") for n in res["fp8"]), res["fp8"]
        assert any(n.endswith(("gate_up_proj.weight", "w13_weight")) for n in res["fp8"]), res["fp8"]
    assert len({res["params"] for res in results}) == 1
