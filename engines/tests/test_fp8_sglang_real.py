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

import json
import os

import pytest

import awex
import checkpoints
import rank_jobs
from conftest import MLA, Ranks, assert_mla_derived, drive, fill_bf16, free_port, pair_name, sglang_infer

#: 128 x 128 blocks, and tiny models whose every TP shard is whole blocks (Qwen3, Qwen3-MoE,
#: DeepSeek-V3's MLA at its proportions): shared with vLLM's FP8 test
from fp8_ckpts import BLOCK, sizes_of  # noqa: E402


# arch, tp, ep, [(training layout, transport)]
CASES = [
    ("Qwen3ForCausalLM", 1, 1, [("megatron:tp=1", "shm")]),
    # FSDP's dp 2 chunks cut blocks: the receiver quantises whole blocks from its staging
    ("Qwen3ForCausalLM", 2, 1, [("megatron:tp=2", "shm"), ("fsdp:dp=2", "tcp")]),
    ("Qwen3MoeForCausalLM", 2, 1, [("megatron:tp=2", "tcp")]),
    ("Qwen3MoeForCausalLM", 2, 2, [("fsdp:dp=2", "shm")]),
    # DeepSeek-V3: every MLA projection FP8 (the fused q/kv down projection too), w_kc / w_vc
    # derived from the FP8 kv_b_proj, the shared expert apart (as SGLang on CPU), the bf16 router
    # and its fp32 bias. Megatron's local spec splits the down projections over tp (64 of q_a's
    # 128 rows per training rank): SGLang's replicated copy is quantised from both halves.
    ("DeepseekV3ForCausalLM", 1, 1, [("megatron:tp=1,local_spec=1", "shm")]),
    ("DeepseekV3ForCausalLM", 2, 1, [("megatron:tp=2,local_spec=1", "shm"), ("fsdp:dp=2", "tcp")]),
    ("DeepseekV3ForCausalLM", 2, 2, [("fsdp:dp=2", "shm")]),
]


def _id(case) -> str:
    arch, tp, ep, _ = case
    return f"{arch}-tp{tp}-ep{ep}"


def checkpoints_of(base: str, arch: str) -> tuple[dict[int, str], dict[int, str], int]:
    """``({version: bf16 checkpoint}, {version: FP8 checkpoint}, n)`` for versions 0, 1, 2, where
    ``n`` counts the scales of version 1 in which CPU torch's ``ref_vllm`` differs from CUDA's
    (``ref_vllm_cuda``): non-zero, so the comparison tells which arithmetic awex followed."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    import fp8_refs

    cls_name, extra = checkpoints.ARCHS[arch]
    sizes = sizes_of(arch)
    cfg_dir = os.path.join(base, "config")
    getattr(transformers, cls_name)(**{**checkpoints.BASE, **extra, **sizes}, tie_word_embeddings=False,
                                    torch_dtype="float32").save_pretrained(cfg_dir)
    bf16, fp8 = {}, {}
    cpu_differs = 0
    for v in (0, 1, 2):
        f32 = checkpoints.write(os.path.join(base, f"f32-v{v}"), arch, tied=False, seed=200 + v,
                                config_of=cfg_dir)
        with open(os.path.join(f32, "config.json")) as f:
            cfg = json.load(f)
        cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
        # bf16, but the router's score-correction bias, which DeepSeek-V3's checkpoints and every
        # engine keep in fp32
        weights = {n: t if n.endswith(".e_score_correction_bias") else t.to(torch.bfloat16)
                   for n, t in load_file(os.path.join(f32, "model.safetensors")).items()}
        quantised = {}
        for name, t in weights.items():
            if checkpoints.fp8_linear(name):
                q, s = fp8_refs.ref_vllm_cuda(t, block=BLOCK)
                if v == 1:
                    cpu_differs += int((fp8_refs.ref_vllm(t, block=BLOCK)[1] != s).sum())
                quantised[name], quantised[name + "_scale_inv"] = q, s.contiguous()
            else:
                quantised[name] = t
        for out, tensors, extra_cfg in (
            (bf16, weights, {}),
            (fp8, quantised, {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                       "fmt": "e4m3", "weight_block_size": list(BLOCK)}}),
        ):
            d = os.path.join(base, f"{'fp8' if extra_cfg else 'bf16'}-v{v}")
            os.makedirs(d)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump({**cfg, **extra_cfg}, f, indent=1)
            save_file(tensors, os.path.join(d, "model.safetensors"))
            out[v] = d
    return bf16, fp8, cpu_differs


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
                         infer=sglang_infer(arch, tp, ep), transport=transport, join_deadline_s=600,
                         update_deadline_s=300)
        assert st["inference"]["fp8"]["config"]["encoding"]["block"] == list(BLOCK), st["inference"]
        assert st["inference"]["fp8"]["recipe"] == "vllm", st["inference"]
        names.append(name)
    ranks = Ranks(tp, rank_jobs.fp8_receive_job, tp, ep, free_port(), fp8, gateway, names, [1, 2])
    try:
        canon = {v: load_file(os.path.join(bf16[v], "model.safetensors")) for v in (1, 2)}
        for name in names:
            updates = drive(gateway, name, canon, [1, 2], fill_rank=fill_bf16, timeout=240)
            assert [u["state"] for u in updates] == ["committed", "committed"]
            ctl.disconnect(name)
    finally:
        results = ranks.results(timeout=600)
    for res in results:
        assert res["diffs"] == [], "\n".join(res["diffs"][:20])
        assert res["checked"] == 2 * len(pairs), res
        # SGLang holds the linear weights as e4m3: the comparison covered them
        assert any(n.endswith(("qkv_proj.weight", "qkv_a_proj_with_mqa.weight")) for n in res["fp8"]), res["fp8"]
        assert any(n.endswith(("gate_up_proj.weight", "w13_weight")) for n in res["fp8"]), res["fp8"]
    assert len({res["params"] for res in results}) == 1
    if arch in MLA:
        assert_mla_derived(results)
        for res in results:
            # the MLA projections SGLang holds FP8: the fused down projection, q_b, kv_b, o
            for proj in ("fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"):
                assert f"model.layers.0.self_attn.{proj}.weight" in res["fp8"], res["fp8"]
            # post_load_weights took the GPU's branch (sglang_cpu.derive_mla_as_on_gpu): bf16
            # w_kc / w_vc dequantised from the FP8 kv_b_proj, not the CPU's per-tensor FP8
            assert res["derived_dtypes"] == ["torch.bfloat16"], res["derived_dtypes"]
            # the router stays bf16
            assert "model.layers.1.mlp.gate.weight" not in res["fp8"], res["fp8"]
