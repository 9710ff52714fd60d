"""Block-FP8 checkpoints and bf16 training sides shared by the engines' FP8 tests (SGLang's in
this folder, vLLM's in ``vllm/``): the reference quantiser of ``engines/fp8_refs.py`` applied to
tiny bf16 checkpoints, and awex Writers sending the bf16 weights."""

from __future__ import annotations

import importlib.util
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import checkpoints

HERE = os.path.dirname(os.path.abspath(__file__))


def _common() -> Any:
    """This folder's ``conftest.py`` (``boxes``, ``run_threads``), loaded by path: the vLLM tests'
    own ``conftest`` shadows the name."""
    spec = importlib.util.spec_from_file_location("awex_engines_conftest", os.path.join(HERE, "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_conftest = _common()
boxes, run_threads = _conftest.boxes, _conftest.run_threads

BLOCK = (128, 128)

#: Tiny models whose every TP shard is whole 128 x 128 blocks: 2 heads of 128 (q, k and v are
#: one head per rank at tp 2), hidden 256, MLP 512 (256 per rank), experts 256 (128 per rank at
#: tp 2, ep 1; whole at ep 2).
SIZES = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128,
         "intermediate_size": 512}
MOE_SIZES = {"moe_intermediate_size": 256}


#: DeepSeek-V3 (MLA with q_lora_rank) at DeepSeek-V3's proportions, every TP shard whole blocks at
#: tp 2: 4 heads (2 per rank) of nope 64 + rope 64 (q_b_proj: 256 rows per rank) and v 64
#: (kv_b_proj: 256 rows per rank; o_proj: 128 input columns per rank), q_lora_rank 128,
#: kv_lora_rank 128; the replicated ``fused_qkv_a_proj_with_mqa`` has 128 + 128 + 64 = 320 rows,
#: so its last block row is half a block (as DeepSeek-V3's 1536 + 576 = 2112 rows: 16.5 blocks),
#: and the scales of ``q_a_proj`` (1 block row) and ``kv_a_proj_with_mqa`` (2) concatenate.
#: Dense first layer MLP 512, 4 routed experts and one shared expert of 256 rows.
DEEPSEEK_SIZES = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
                  "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
                  "v_head_dim": 64, "intermediate_size": 512, "moe_intermediate_size": 256}


def sizes_of(arch: str) -> dict[str, Any]:
    """The config sizes of an FP8 case of ``arch``: every TP shard of 2 whole 128 x 128 blocks."""
    if arch.startswith("Deepseek"):
        return DEEPSEEK_SIZES
    return {**SIZES, **(MOE_SIZES if "Moe" in arch else {})}


def stored_fp8(name: str, router: bool) -> bool:
    """Whether an FP8 checkpoint stores tensor ``name`` as e4m3 blocks: the attention, MLP and
    expert linears (``*_proj.weight``), and with ``router`` the MoE router ``mlp.gate.weight``
    (vLLM 0.33's Qwen3-MoE builds its router with the checkpoint's quantisation; SGLang never
    quantises a router); never the embedding, the norms or ``lm_head``
    (``checkpoints.fp8_linear``: DeepSeek-V3's MLA projections included)."""
    return checkpoints.fp8_linear(name) or (router and name.endswith(".mlp.gate.weight"))


def checkpoints_of(base: str, arch: str, router: bool = False) -> tuple[dict[int, str], dict[int, str], int]:
    """``({version: bf16 checkpoint}, {version: FP8 checkpoint}, n)`` for versions 0, 1, 2, where
    ``n`` counts the scales of version 1 in which CPU torch's ``ref_vllm`` differs from CUDA's
    (``ref_vllm_cuda``): non-zero, so the comparison tells which arithmetic awex followed.
    ``router``: the FP8 checkpoints quantise the MoE router too (``stored_fp8``)."""
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
        weights = {n: t.to(torch.bfloat16) for n, t in load_file(os.path.join(f32, "model.safetensors")).items()}
        quantised = {}
        for name, t in weights.items():
            if stored_fp8(name, router):
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


#: a training rank's bf16 tensors in awex's training layout (fp32 where a bf16 model keeps fp32,
#: such as DeepSeek's router bias): ``conftest.fill_bf16``
fill_bf16 = _conftest.fill_bf16


def drive(gateway: str, name: str, canon: dict[int, dict], versions: list[int], join_timeout: float = 120) -> list[dict]:
    """The training side of one pair (``test_sglang_real.drive`` with bf16 torch tensors)."""
    import awex

    ctl = awex.Controller(gateway)
    n = ctl.status(name)["training"]["world_size"]
    writers = [awex.Writer(gateway, name, r) for r in range(n)]
    try:
        tensors = [fill_bf16(w.layout(), canon[versions[0]]) for w in writers]
        for w, a in zip(writers, tensors):
            assert w.register(list(a.items())) == len(a)
        run_threads([lambda w=w: w.join(timeout=join_timeout) for w in writers], timeout=join_timeout + 30)
        out = []
        for v in versions:
            if v != versions[0]:
                for w, a in zip(writers, tensors):
                    fill_bf16(w.layout(), canon[v], out=a)
            with ThreadPoolExecutor(max_workers=n) as ex:
                futures = [ex.submit(w.update, v, timeout=240) for w in writers]
                out.append(ctl.update(v, timeout=240, pair=name))
                for f in futures:
                    assert f.result(timeout=240)["state"] == "committed"
        return out
    finally:
        for w in writers:
            w.close()


def fp8_checkpoint(src: str, dst: str, block: tuple[int, int], router: bool = False) -> str:
    """``src`` with every linear weight (``*_proj.weight``, experts included; the router
    ``mlp.gate`` with ``router``; not the embedding, the norms or ``lm_head``) quantised by the
    ``vllm`` reference into e4m3 plus ``*_scale_inv``, the rest bf16, and a
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
        "weight_block_size": list(block),
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    out = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        t = t.to(torch.bfloat16)
        if stored_fp8(name, router):
            q, s = fp8_refs.ref_vllm(t, block=block)
            out[name] = q
            out[name + "_scale_inv"] = s.contiguous()
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"))
    return dst
