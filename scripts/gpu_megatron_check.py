#!/usr/bin/env python3
"""A real Megatron-Core GPTModel on one GPU hands its weights to SGLang-layout torch tensors
through the `awex` Python package and the colocated `cuda-ipc` transport, checked bit for bit.

Three processes on one GPU:

- the controller (this process, no role): an in-process test gateway, the model's HF
  `config.json`, `Controller.connect(train="megatron:tp=1,local_spec=1", infer="sglang:tp=1",
  transport="cuda-ipc")`, then update 1 once both ranks joined;
- the writer (`--role writer`): torch.distributed (world 1) and Megatron's parallel state, a
  small Qwen3-shaped `GPTModel` built with `get_gpt_layer_local_spec()` (GQA, gated SiLU,
  RMSNorm with q/k norms, no biases, bf16 on the GPU, untied output layer) filled with random
  values, registered with `awex.megatron.named_tensors(model)`; it also converts its parameters
  to the canonical HF tensors and to SGLang's fused tensors with its own PyTorch code
  (independent of awex) and saves them as the expected result;
- the reader (`--role reader`): zeroed torch CUDA tensors in SGLang's layout (names and shapes
  from `Reader.layout()`), registered, joined, updated, then compared byte for byte with the
  expected tensors.

Needs torch with CUDA, megatron-core and an awex wheel built with the `cuda` feature. Prints a
table and `VERIFIED`, or the first mismatch (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

# the model: Qwen3-shaped, small (GQA 4 heads over 2 query groups)
HIDDEN, LAYERS, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = 256, 2, 4, 2, 64, 512, 1030
# Megatron pads the vocabulary to a multiple of 128 * tp, SGLang to a multiple of 64
MEGATRON_VOCAB = -(-VOCAB // 128) * 128
SGLANG_VOCAB = -(-VOCAB // 64) * 64
TRAIN = "megatron:tp=1,local_spec=1"
INFER = "sglang:tp=1"


def hf_config() -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "_name_or_path": "megatron-local-qwen3-tiny",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "head_dim": HEAD_DIM,
        "intermediate_size": FFN,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 128,
        "torch_dtype": "bfloat16",
    }


def log(role: str, *a: object) -> None:
    print(f"[{role}]", *a, flush=True)


# ---------------------------------------------------------------- the writer: Megatron side


def build_model():
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:  # the local spec's core attention is Megatron's own DotProductAttention
        from megatron.core.transformer.enums import AttnBackend

        backend = {"attention_backend": AttnBackend.local}
    except ImportError:
        backend = {}

    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=False,
        **backend,
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=MEGATRON_VOCAB,
        max_sequence_length=128,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    # the local spec's torch norms start in fp32 on the CPU; Float16Module casts the same way
    model = model.cuda().bfloat16()
    # distinct random values everywhere (norms start as ones, which would hide a swap)
    g = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32).to(p.dtype))
    torch.cuda.synchronize()
    return model


def canonical_from_megatron(params: dict) -> dict:
    """The HF tensors of a TP=1 local-spec Megatron GPT, by plain PyTorch (awex not involved)."""
    hf = {}
    hpg = HEADS // GROUPS
    hf["model.embed_tokens.weight"] = params["embedding.word_embeddings.weight"][:VOCAB]
    hf["lm_head.weight"] = params["output_layer.weight"][:VOCAB]
    hf["model.norm.weight"] = params["decoder.final_layernorm.weight"]
    for i in range(LAYERS):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        # Megatron's linear_qkv rows: for each query group g, [q heads of g][k head g][v head g]
        qkv = params[m + "self_attention.linear_qkv.weight"].view(GROUPS, hpg + 2, HEAD_DIM, HIDDEN)
        hf[h + "self_attn.q_proj.weight"] = qkv[:, :hpg].reshape(HEADS * HEAD_DIM, HIDDEN)
        hf[h + "self_attn.k_proj.weight"] = qkv[:, hpg].reshape(GROUPS * HEAD_DIM, HIDDEN)
        hf[h + "self_attn.v_proj.weight"] = qkv[:, hpg + 1].reshape(GROUPS * HEAD_DIM, HIDDEN)
        hf[h + "self_attn.o_proj.weight"] = params[m + "self_attention.linear_proj.weight"]
        hf[h + "self_attn.q_norm.weight"] = params[m + "self_attention.q_layernorm.weight"]
        hf[h + "self_attn.k_norm.weight"] = params[m + "self_attention.k_layernorm.weight"]
        hf[h + "input_layernorm.weight"] = params[m + "input_layernorm.weight"]
        hf[h + "post_attention_layernorm.weight"] = params[m + "pre_mlp_layernorm.weight"]
        fc1 = params[m + "mlp.linear_fc1.weight"]  # [gate; up], gated SiLU: silu(x@gate) * (x@up)
        hf[h + "mlp.gate_proj.weight"] = fc1[:FFN]
        hf[h + "mlp.up_proj.weight"] = fc1[FFN:]
        hf[h + "mlp.down_proj.weight"] = params[m + "mlp.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in hf.items()}


def sglang_from_canonical(hf: dict) -> dict:
    """SGLang's tp=1 tensors from the HF ones: fused qkv / gate_up, vocab padded with zero rows."""
    import torch

    def pad(t):
        out = torch.zeros((SGLANG_VOCAB,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        out[: t.shape[0]] = t
        return out

    sg = {}
    sg["model.embed_tokens.weight"] = pad(hf["model.embed_tokens.weight"])
    sg["lm_head.weight"] = pad(hf["lm_head.weight"])
    sg["model.norm.weight"] = hf["model.norm.weight"]
    for i in range(LAYERS):
        h = f"model.layers.{i}."
        sg[h + "self_attn.qkv_proj.weight"] = torch.cat(
            [hf[h + f"self_attn.{x}_proj.weight"] for x in "qkv"], dim=0
        )
        sg[h + "self_attn.o_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        sg[h + "self_attn.q_norm.weight"] = hf[h + "self_attn.q_norm.weight"]
        sg[h + "self_attn.k_norm.weight"] = hf[h + "self_attn.k_norm.weight"]
        sg[h + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        sg[h + "post_attention_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        sg[h + "mlp.gate_up_proj.weight"] = torch.cat(
            [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], dim=0
        )
        sg[h + "mlp.down_proj.weight"] = hf[h + "mlp.down_proj.weight"]
    return {k: v.contiguous() for k, v in sg.items()}


def writer(args) -> int:
    import torch

    import awex

    log("writer", "torch", torch.__version__, "on", torch.cuda.get_device_name(0))
    import megatron.core

    log("writer", "megatron-core", getattr(megatron.core, "__version__", "?"))
    model = build_model()
    named = awex.megatron.named_tensors(model)
    log("writer", f"GPTModel (local spec) named_parameters: {len(named)}")
    for n, p in named:
        log("writer", f"  {n:55s} {str(list(p.shape)):14s} {p.dtype} {p.device}")
    w = awex.Writer(args.gateway, args.pair, 0)
    log("writer", repr(w))
    log("writer", "registered", w.register(named), "tensors; missing:", w.missing())
    params = {n: p.detach() for n, p in named}
    expected = sglang_from_canonical(canonical_from_megatron(params))
    torch.save({k: v.cpu() for k, v in expected.items()}, os.path.join(args.workdir, "expected.pt"))
    torch.cuda.synchronize()
    t0 = time.time()
    w.join(timeout=300)
    log("writer", f"joined in {time.time() - t0:.2f} s (layout check passed)")
    res = w.update(1, timeout=300)
    log("writer", "update:", json.dumps(res))
    w.close()
    return 0


# ---------------------------------------------------------------- the reader: SGLang side

DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
          "u8": "uint8", "i8": "int8", "i32": "int32", "i64": "int64"}


def same_bytes(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def reader(args) -> int:
    import torch

    import awex

    torch.cuda.set_device(0)
    r = awex.Reader(args.gateway, args.pair, 0, engine=0)
    layout = r.layout()
    tensors = {
        t["name"]: torch.zeros(t["shape"], dtype=getattr(torch, DTYPES[t["dtype"]]), device="cuda")
        for t in layout
    }
    log("reader", repr(r))
    log("reader", "registered", r.register(list(tensors.items())), "zeroed CUDA tensors in SGLang's layout")
    t0 = time.time()
    r.join(timeout=300)
    log("reader", f"joined in {time.time() - t0:.2f} s")
    res = r.update(1, timeout=300)
    torch.cuda.synchronize()
    log("reader", "update:", json.dumps(res))
    expected = torch.load(os.path.join(args.workdir, "expected.pt"))
    got = {k: v.cpu() for k, v in tensors.items()}
    r.close()
    first = None
    if set(got) != set(expected):
        first = f"names differ: only awex {sorted(set(got) - set(expected))}, only expected {sorted(set(expected) - set(got))}"
    rows = []
    for name in sorted(expected):
        e, g = expected[name], got.get(name)
        ok = g is not None and same_bytes(e, g)
        rows.append((name, list(e.shape), str(e.dtype).replace("torch.", ""), ok))
        if not ok and first is None:
            if g is None:
                first = f"{name}: not in the reader's layout"
            elif g.shape != e.shape or g.dtype != e.dtype:
                first = f"{name}: got {list(g.shape)} {g.dtype}, expected {list(e.shape)} {e.dtype}"
            else:
                diff = (g.view(torch.uint8) != e.view(torch.uint8)).nonzero()
                first = f"{name}: {diff.shape[0]} bytes differ, first at byte index {diff[0].tolist()}"
    print(f"{'tensor (SGLang tp=1)':50s} {'shape':14s} {'dtype':9s} bit-equal", flush=True)
    for name, shape, dt, ok in rows:
        print(f"{name:50s} {str(shape):14s} {dt:9s} {'yes' if ok else 'NO'}", flush=True)
    n_bytes = sum(e.numel() * e.element_size() for e in expected.values())
    summary = {
        "tensors": len(rows),
        "bytes": n_bytes,
        "moved_bytes": res.get("bytes"),
        "update_seconds": res.get("seconds"),
        "verified": first is None,
        "first_mismatch": first,
    }
    with open(os.path.join(args.workdir, "result.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if first is None:
        print(f"VERIFIED: {len(rows)} tensors, {n_bytes} bytes, bit for bit", flush=True)
        return 0
    print(f"MISMATCH: {first}", flush=True)
    return 1


# ---------------------------------------------------------------- the controller


def controller(args) -> int:
    import awex
    from awex import _awex, _testing

    if not _awex.CUDA:
        print("this awex wheel was built without the `cuda` feature", flush=True)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    model_dir = os.path.join(args.workdir, "model")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf_config(), f, indent=2)
    gateway = _testing.start_gateway()
    pair = f"megatron-check-{os.getpid()}"
    ctl = awex.Controller(gateway)
    st = ctl.connect(pair, model=model_dir, train=TRAIN, infer=INFER, transport="cuda-ipc")
    log("controller", f"gateway {gateway}, pair {pair}: {TRAIN} -> {INFER} over cuda-ipc, model {model_dir}")
    log("controller", "pair state:", st.get("state"))
    common = ["--gateway", gateway, "--pair", pair, "--workdir", args.workdir]
    me = os.path.abspath(__file__)
    procs = {
        role: subprocess.Popen([sys.executable, me, "--role", role, *common])
        for role in ("writer", "reader")
    }
    rc = 1
    try:
        t0 = time.time()
        while True:
            dead = {r: p.poll() for r, p in procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"a rank exited before both joined: {dead}")
            try:
                ctl.wait_ready(timeout=5)
                break
            except TimeoutError:
                if time.time() - t0 > 300:
                    raise
        log("controller", f"both ranks joined after {time.time() - t0:.1f} s; starting update 1")
        t0 = time.time()
        up = ctl.update(1, timeout=300)
        log("controller", f"update 1: {up.get('state')} in {time.time() - t0:.2f} s")
        rc = 0
    except Exception as e:  # report and still collect the ranks' exit codes
        log("controller", f"failed: {type(e).__name__}: {e}")
    codes = {}
    for role, p in procs.items():
        try:
            codes[role] = p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            codes[role] = "killed"
    log("controller", "exit codes:", codes)
    if rc != 0 or any(c != 0 for c in codes.values()):
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["writer", "reader"])
    ap.add_argument("--gateway")
    ap.add_argument("--pair")
    ap.add_argument("--workdir", default=os.environ.get("AWEX_CHECK_DIR", "/tmp/awex-megatron-check"))
    args = ap.parse_args()
    if args.role == "writer":
        return writer(args)
    if args.role == "reader":
        return reader(args)
    return controller(args)


if __name__ == "__main__":
    sys.exit(main())
