"""FP8 inside vLLM 0.33: awex's ``WeightTransferEngine`` fills vLLM's block-FP8 parameters, vLLM's
own FP8 post-load runs, and the served model equals vLLM's own load of the FP8 checkpoint.

For every case, three versions of a bf16 checkpoint (dims that are multiples of 128 per rank:
vLLM refuses a per-rank output that cuts a block, ``validate_fp8_block_shape``) and, from each,
the FP8 checkpoint the reference quantiser writes (``fp8_refs.ref_vllm_cuda``: vLLM's
``per_block_cast_to_fp8`` with CUDA torch's arithmetic, awex's default recipe; 128 x 128 blocks;
``fp8_ckpts.checkpoints_of``, shared with the SGLang test). The pair is connected from Python with
the FP8 checkpoint's ``config.json`` as the inference side's config
(``Controller.connect(infer_config=...)``). vLLM's real model classes on CPU, one process per TP
rank (``vllm_fp8_rank.py receive``: ``initialize_model`` with vLLM's parallel groups over gloo;
only the FP8 kernel choice stubbed, ``fp8_kernel_stubs.py``), load the FP8 checkpoint of version
0 (the class's ``load_weights``, then ``process_weights_after_loading``: every
``Fp8LinearMethod`` / ``Fp8MoEMethod``), then receive versions 1 and 2 through the ``awex``
backend that vLLM's plugin loader registered, driven by vLLM's own ``Worker`` methods (init,
start, update, finish): the Reader receives bf16 into staging and quantises into the engine's
landing tensors (e4m3 and fp32 ``weight_scale_inv``), which vLLM's layerwise reload loads with
the FP8 layers' post-load step. awex Writers in a bf16 training layout (Megatron, FSDP) send the
bf16 weights. After each version every parameter must equal a fresh vLLM model's own load of
that version's FP8 checkpoint, byte for byte, in the same storage as before the update.
DeepSeek-V3's MLA attention backend is stubbed (``vllm_rank.stub_gpu_kernels``: it selects a GPU
backend and creates no parameter), so what that backend derives from ``kv_b_proj`` after loading
is not compared; every parameter is.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)  # vllm_preload.py, for the forkserver
import forked  # noqa: E402  (engines/tests/forked.py)

import fp8_ckpts  # noqa: E402
from fp8_ckpts import BLOCK, checkpoints_of  # noqa: E402

free_port, pair_name = fp8_ckpts._conftest.free_port, fp8_ckpts._conftest.pair_name

# arch, tp, ep, training layout, transport
CASES = [
    ("Qwen3ForCausalLM", 1, 1, "megatron:tp=1", "shm"),
    # FSDP's dp 2 chunks cut blocks: the receiver quantises whole blocks from its staging
    ("Qwen3ForCausalLM", 2, 1, "fsdp:dp=2", "tcp"),
    ("Qwen3MoeForCausalLM", 2, 1, "megatron:tp=2", "shm"),
    ("Qwen3MoeForCausalLM", 2, 2, "fsdp:dp=2", "shm"),
    # DeepSeek-V3 (MLA; fp8_ckpts.DEEPSEEK_SIZES): the fused q/kv down projection (its last
    # block row half a block), q_b_proj and kv_b_proj over tp, o_proj, the dense first layer, the
    # routed and shared experts as e4m3; the router and its fp32 bias keep their dtypes
    ("DeepseekV3ForCausalLM", 2, 1, "fsdp:dp=2", "shm"),
    # Megatron's local spec splits the down projections over its tp: vLLM's replicated copy is
    # quantised from both halves; experts over vLLM's ep 2
    ("DeepseekV3ForCausalLM", 2, 2, "megatron:tp=2,local_spec=1", "tcp"),
]
#: the MLA projections vLLM's DeepSeek-V3 holds as e4m3 (with ``*_scale_inv``)
MLA_FP8 = ("self_attn.fused_qkv_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight",
           "self_attn.o_proj.weight")
VERSIONS = [1, 2]


@pytest.fixture(scope="module")
def gateway() -> str:
    from awex import _testing

    return _testing.start_gateway()


def _id(case) -> str:
    arch, tp, ep, train, transport = case
    return f"{arch}-tp{tp}-ep{ep}-{train.split(':')[0]}-{transport}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fp8_receive_matches_vllm_load_of_the_reference_checkpoint(case, gateway, tmp_path) -> None:
    import awex
    from safetensors.torch import load_file

    arch, tp, ep, train, transport = case
    # vLLM's Qwen3-MoE holds its router as FP8 too (awex_vllm::CLASS_FP8_PARTS)
    moe = "Moe" in arch
    bf16, fp8, cpu_differs = checkpoints_of(str(tmp_path), arch, router=moe)
    assert cpu_differs > 0, "CPU and CUDA torch agree on every scale: the check cannot tell them apart"
    ctl = awex.Controller(gateway)
    name = pair_name(f"vfp8-{arch[:5]}-{transport}")
    st = ctl.connect(name, model=bf16[0], infer_config=fp8[0], train=train, infer=f"vllm:tp={tp},ep={ep}",
                     transport=transport, join_deadline_s=600, update_deadline_s=300)
    assert st["inference"]["fp8"]["config"]["encoding"]["block"] == list(BLOCK), st["inference"]
    assert st["inference"]["fp8"]["recipe"] == "vllm", st["inference"]
    d = str(tmp_path)
    spec = dict(tp=tp, ep=ep, hf_dir=fp8[0], dtype="bfloat16", port=free_port(), fp8=fp8, versions=VERSIONS,
                gateway=gateway, pair=name, timeout=300.0)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [
        forked.popen(os.path.join(HERE, "vllm_fp8_rank.py"), ["receive", json.dumps(spec), str(r), d],
                     os.path.join(d, f"receive{r}.log"), "vllm_preload", env=env)
        for r in range(tp)
    ]

    def logs() -> str:
        return "\n".join(f"-- vLLM rank {r}:\n" + open(os.path.join(d, f"receive{r}.log")).read()[-6000:]
                         for r in range(tp))

    try:
        canon = {v: load_file(os.path.join(bf16[v], "model.safetensors")) for v in VERSIONS}
        with ThreadPoolExecutor(max_workers=1) as ex:
            fut = ex.submit(fp8_ckpts.drive, gateway, name, canon, VERSIONS, join_timeout=600)
            while True:
                try:
                    updates = fut.result(timeout=5)
                    break
                except TimeoutError:
                    if any(p.poll() not in (None, 0) for p in procs):
                        raise AssertionError(f"a vLLM rank exited during the updates:\n{logs()}") from None
        assert [u["state"] for u in updates] == ["committed", "committed"]
        for r, p in enumerate(procs):
            if p.wait(timeout=300) != 0:
                raise AssertionError(f"vLLM rank {r} failed:\n{logs()}")
        ctl.disconnect(name)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for r in range(tp):
        with open(os.path.join(d, f"result{r}.json")) as f:
            results.append(json.load(f))
    for res in results:
        assert res["engine"] == "AwexWeightTransferEngine", res
        assert res["diffs"] == [], "\n".join(res["diffs"][:20])
        assert res["checked"] == len(VERSIONS), res
        # vLLM holds the linear weights and the expert stacks as e4m3: the comparison covered them
        attn = MLA_FP8 if arch.startswith("Deepseek") else ("qkv_proj.weight",)
        for suffix in attn:
            assert any(n.endswith(suffix) for n in res["fp8"]), (suffix, res["fp8"])
            assert any(n.endswith(suffix + "_scale_inv") for n in res["params_names"]), (suffix, res)
        assert any(n.endswith(("gate_up_proj.weight", "w13_weight")) for n in res["fp8"]), res["fp8"]
        if arch.startswith("Deepseek"):
            assert any(n.endswith("experts.w13_weight") for n in res["fp8"]), res["fp8"]
            # DeepSeek's router and its fp32 bias keep their dtypes in vLLM
            assert not any(n.endswith("mlp.gate.weight") for n in res["fp8"]), res["fp8"]
        if moe:
            assert any(n.endswith("mlp.gate.weight") for n in res["fp8"]), res["fp8"]
    assert len({res["params"] for res in results}) == 1
