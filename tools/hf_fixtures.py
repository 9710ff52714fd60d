#!/usr/bin/env python3
"""Writes awex's HF catalogue fixtures: the tensors real `transformers` saves for tiny models.

For each architecture awex supports, this builds a tiny config with transformers' own
config classes, instantiates `AutoModelForCausalLM.from_config` in bf16 on the CPU,
saves it with `save_pretrained(..., safe_serialization=True)`, and reads back the
safetensors header(s): every tensor's name, shape and dtype as written on disk.

Output: `$OUT/<name>.json` (or `--out DIR`) holding
    {"transformers_version", "torch_version", "config": <saved config.json>,
     "tensors": {name: {"shape": [...], "dtype": "BF16"}}}

Usage (needs torch, transformers and no network):
    PYTHONUNBUFFERED=1 python3 tools/hf_fixtures.py [--out DIR]

The awex-core test `tests/catalogue.rs` compares `Catalogue::of` against these files.
"""

import argparse
import json
import os
import struct
import sys
import tempfile
import traceback

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

# Sizes shared by every fixture: GQA (4 query heads over 2 KV heads), head_dim 16,
# a vocabulary that is not a multiple of 64.
COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=1000,
    max_position_embeddings=128,
)

MOE = dict(
    COMMON,
    num_hidden_layers=4,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
)


def fixtures():
    """(name, config) for every fixture."""
    return [
        ("llama", LlamaConfig(**COMMON, attention_bias=False, tie_word_embeddings=False)),
        ("qwen2", Qwen2Config(**COMMON, tie_word_embeddings=False)),
        ("qwen3", Qwen3Config(**COMMON, tie_word_embeddings=False)),
        ("qwen3-tied", Qwen3Config(**COMMON, tie_word_embeddings=True)),
        # q/k/v *and* o_proj biases.
        ("qwen3-attention-bias", Qwen3Config(**COMMON, attention_bias=True, tie_word_embeddings=False)),
        ("llama-attention-bias", LlamaConfig(**COMMON, attention_bias=True, tie_word_embeddings=False)),
        # num_attention_heads * head_dim = 128 != hidden_size = 64.
        ("qwen3-wide-head", Qwen3Config(**dict(COMMON, head_dim=32), tie_word_embeddings=False)),
        # Layer 0 dense through mlp_only_layers; layers 1..3 MoE.
        (
            "qwen3-moe",
            Qwen3MoeConfig(
                **MOE, decoder_sparse_step=1, mlp_only_layers=[0], tie_word_embeddings=False
            ),
        ),
        # Every second layer MoE: layers 1 and 3.
        (
            "qwen3-moe-step2",
            Qwen3MoeConfig(
                **MOE, decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=False
            ),
        ),
        # Every layer MoE: `block_sparse_moe.gate`, experts w1/w2/w3 of intermediate_size rows.
        (
            "mixtral",
            MixtralConfig(
                **dict(COMMON, num_hidden_layers=2, intermediate_size=32),
                num_local_experts=4,
                num_experts_per_tok=2,
                tie_word_embeddings=False,
            ),
        ),
        # MLA with q_lora_rank; layer 0 dense (first_k_dense_replace), layers 1..2 MoE with a
        # shared expert and the fp32 router bias.
        ("deepseek-v3", DeepseekV3Config(**DEEPSEEK, q_lora_rank=32)),
        # MLA without q_lora_rank: a plain q_proj.
        ("deepseek-v3-no-q-lora", DeepseekV3Config(**DEEPSEEK, q_lora_rank=None)),
        # DeepSeek-V2 (V2-Lite's shape): MLA without q_lora_rank, layer 0 dense, two shared
        # experts, a router without a score-correction bias (topk_method greedy).
        (
            "deepseek-v2",
            DeepseekV2Config(
                **dict(DEEPSEEK, n_shared_experts=2), q_lora_rank=None, topk_method="greedy"
            ),
        ),
        # GLM-4.5: q/k/v biases (no o bias), q/k norms, layer 0 dense (first_k_dense_replace),
        # layers 1..2 MoE with a shared expert and the router bias.
        ("glm4-moe", Glm4MoeConfig(**GLM, attention_bias=True, use_qk_norm=True)),
        # GLM-4.5-Air's shape: no q/k norms; no biases either here.
        ("glm4-moe-plain", Glm4MoeConfig(**GLM, attention_bias=False, use_qk_norm=False)),
        # Gated DeltaNet + gated full attention (layers 0..2 linear, 3 full), every layer MoE
        # with a shared expert and its gate; fused in_proj_qkvz / in_proj_ba.
        ("qwen3-next", Qwen3NextConfig(**HYBRID, **HYBRID_MOE, decoder_sparse_step=1, mlp_only_layers=[])),
        # Qwen3.5 dense: in_proj_qkv / in_proj_z / in_proj_b / in_proj_a apart.
        ("qwen3.5", Qwen3_5TextConfig(**HYBRID)),
        # Qwen3.5-MoE: every layer MoE with the gated shared expert, no dense intermediate size.
        ("qwen3.5-moe", Qwen3_5MoeTextConfig(**{k: v for k, v in HYBRID.items() if k != "intermediate_size"}, **HYBRID_MOE)),
        # gpt-oss: q/k/v/o biases, per-head attention sinks, sliding / full layers alternating
        # (the config's default `layer_types`), a router with a bias, every layer MoE with the
        # experts fused and transposed (`gate_up_proj` [E, H, 2I] interleaved, `down_proj`
        # [E, I, H]) and their biases, as transformers saves them.
        ("gpt-oss", GptOssConfig(**dict(COMMON, intermediate_size=48), num_local_experts=8, num_experts_per_tok=2, sliding_window=8)),
    ]


DEEPSEEK = dict(
    COMMON,
    num_hidden_layers=3,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    tie_word_embeddings=False,
)


GLM = dict(
    COMMON,
    num_hidden_layers=3,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
)

# The hybrid Qwen models (Qwen3-Next, Qwen3.5): 4 layers, every 4th full attention; 4 key
# heads and 8 value heads of 16 in the linear-attention layers.
HYBRID = dict(
    COMMON,
    num_hidden_layers=4,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)

HYBRID_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)

#: Parameters published checkpoints store in fp32 whatever the model's dtype and that the
#: engines create in fp32 (the Gated DeltaNet `A_log`: SGLang 0.5.23 `Qwen3GatedDeltaNet`,
#: vLLM 0.33 `QwenGatedDeltaNetAttention`, `dtype=torch.float32`): kept so, as `FP32_BUFFERS`.
FP32_PARAMS = (".A_log",)

#: Buffers a model creates in fp32 whatever its dtype and that published checkpoints store in
#: fp32 (GLM-4.5's `Glm4MoeTopkRouter.e_score_correction_bias`, which has no
#: `_keep_in_fp32_modules_strict` entry): `.to(bf16)` must not cast them.
FP32_BUFFERS = ("e_score_correction_bias",)


def read_header(path):
    """The JSON header of one safetensors file, without `__metadata__`."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def saved_tensors(directory):
    """name -> {shape, dtype} over every safetensors file `save_pretrained` wrote."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
    out = {}
    for file in files:
        for name, info in read_header(os.path.join(directory, file)).items():
            if name in out:
                raise SystemExit(f"{name} appears in two shards")
            out[name] = {"shape": list(info["shape"]), "dtype": info["dtype"]}
    return dict(sorted(out.items())), files


def build(cfg):
    """The model of `cfg`, in bf16 on the CPU."""
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    except TypeError:
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    fp32 = {n: b.data.clone() for n, b in model.named_buffers() if n.endswith(FP32_BUFFERS) and b.dtype == torch.float32}
    model = model.to(torch.bfloat16)
    for name, buf in model.named_buffers():
        if name in fp32:
            buf.data = fp32[name]
    # `from_pretrained` keeps `_keep_in_fp32_modules_strict` in fp32 whatever the dtype (DeepSeek-V3's
    # router `e_score_correction_bias`, stored fp32 in the published checkpoints); `from_config`
    # does not, so do what loading does
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    for name, buf in list(model.named_buffers()) + list(model.named_parameters()):
        if any(k in name for k in keep) or name.endswith(FP32_PARAMS):
            buf.data = buf.data.float()
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "fixtures-out"))
    ap.add_argument("--only", default="", help="comma-separated fixture names (default: all)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    failed = 0
    only = set(args.only.split(",")) if args.only else None
    for name, cfg in fixtures():
        if only is not None and name not in only:
            continue
        try:
            torch.manual_seed(0)
            model = build(cfg)
            memory = {k: list(v.shape) for k, v in model.state_dict().items()}
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp, safe_serialization=True)
                with open(os.path.join(tmp, "config.json")) as f:
                    config = json.load(f)
                tensors, files = saved_tensors(tmp)
            doc = {
                "transformers_version": transformers.__version__,
                "torch_version": torch.__version__,
                "config": config,
                "tensors": tensors,
            }
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
                f.write("\n")
            numel = sum(
                int(torch.Size(t["shape"]).numel()) for t in tensors.values()
            )
            dtypes = sorted({t["dtype"] for t in tensors.values()})
            print(
                f"{name}: {config.get('architectures')} {len(tensors)} tensors, "
                f"{numel} elements, dtypes {dtypes}, files {files}, "
                f"config dtype {config.get('dtype', config.get('torch_dtype'))}"
            )
            if "moe" in name:
                for k in sorted(tensors):
                    if k.startswith("model.layers.1.mlp") and ".experts.1" not in k and not any(
                        f".experts.{e}." in k for e in range(2, 8)
                    ):
                        print(f"  saved  {k} {tensors[k]['shape']}")
                for k in sorted(memory):
                    if k.startswith("model.layers.1.mlp"):
                        print(f"  memory {k} {memory[k]}")
                keys = [
                    "decoder_sparse_step",
                    "mlp_only_layers",
                    "num_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                ]
                print("  config", {k: config.get(k) for k in keys})
            extra = sorted(set(memory) - set(tensors))
            missing = sorted(set(tensors) - set(memory))
            if extra or missing:
                print(f"  in memory only: {extra[:12]}")
                print(f"  on disk only:   {missing[:12]}")
        except Exception:
            failed += 1
            print(f"{name}: FAILED")
            traceback.print_exc()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
