#!/usr/bin/env python3
"""PyTorch CUDA IPC weight update, done the way SGLang's `update_weights_from_tensor` does it.

The baseline that `awex-cli bench ipc` is compared against, on the same GPU and model shapes.

A trainer process holds every parameter of the model under its Hugging Face name, each its own
allocation from PyTorch's caching allocator. Per update it serialises the list of
`(name, tensor)` pairs with `ForkingPickler` (CUDA tensors travel as IPC handles; this is
SGLang's `MultiprocessingSerializer`) and sends the bytes. The receiver (the inference rank)
deserialises them, which rebuilds each tensor from its IPC handle, and `copy_()`s each into its
own parameter the way SGLang's weight loaders do: `q_proj`, `k_proj`, `v_proj` into slices of
the fused `qkv_proj`, `gate_proj` and `up_proj` into halves of `gate_up_proj`, the rest whole.
It then synchronises the device. The first update includes opening the IPC handles.

Usage: python3 bench/torch_ipc_baseline.py [--updates 7] [--device 0] [--layers N] [--json]
"""

import argparse
import io
import json
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

# Qwen3-8B (config.json of Qwen/Qwen3-8B)
QWEN3_8B = dict(
    hidden=4096,
    intermediate=12288,
    layers=36,
    heads=32,
    kv_heads=8,
    head_dim=128,
    vocab=151936,
    tied=False,
)


def hf_params(c):
    """(name, shape) of every canonical tensor, in checkpoint order."""
    h, i, d = c["hidden"], c["intermediate"], c["head_dim"]
    q, kv = c["heads"] * d, c["kv_heads"] * d
    out = [("model.embed_tokens.weight", (c["vocab"], h))]
    for l in range(c["layers"]):
        p = f"model.layers.{l}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (d,)),
            (p + "self_attn.k_norm.weight", (d,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not c["tied"]:
        out.append(("lm_head.weight", (c["vocab"], h)))
    return out


def sglang_params(c, device):
    """SGLang's tensors (tp=1) and, per HF name, the view of them it loads into."""
    h, i, d = c["hidden"], c["intermediate"], c["head_dim"]
    q, kv = c["heads"] * d, c["kv_heads"] * d
    params, views = {}, {}

    def new(name, shape):
        params[name] = torch.empty(shape, dtype=torch.bfloat16, device=device)
        return params[name]

    for name, shape in hf_params(c):
        if ".q_proj." in name:
            qkv = new(name.replace("q_proj", "qkv_proj"), (q + 2 * kv, h))
            views[name] = qkv[:q]
            views[name.replace("q_proj", "k_proj")] = qkv[q : q + kv]
            views[name.replace("q_proj", "v_proj")] = qkv[q + kv :]
        elif ".gate_proj." in name:
            gu = new(name.replace("gate_proj", "gate_up_proj"), (2 * i, h))
            views[name] = gu[:i]
            views[name.replace("gate_proj", "up_proj")] = gu[i:]
        elif ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        else:
            views[name] = new(name, shape)
    return params, views


def trainer(cfg, device, requests, replies):
    torch.cuda.set_device(device)
    g = torch.Generator(device=f"cuda:{device}")
    g.manual_seed(0)
    params = []
    for name, shape in hf_params(cfg):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.normal_(generator=g)
        params.append((name, t))
    torch.cuda.synchronize()
    replies.put(("ready", sum(t.numel() * t.element_size() for _, t in params)))
    while True:
        msg = requests.get()
        if msg == "quit":
            break
        # SGLang's MultiprocessingSerializer.serialize
        buf = io.BytesIO()
        ForkingPickler(buf).dump(params)
        replies.put(("update", buf.getvalue()))
    replies.put(("bye", None))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=7)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers, for a quick run")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cfg = dict(QWEN3_8B)
    if a.layers is not None:
        cfg["layers"] = a.layers
    torch.cuda.set_device(a.device)
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=trainer, args=(cfg, a.device, requests, replies))
    proc.start()
    _, nbytes = replies.get()
    params, views = sglang_params(cfg, a.device)
    for p in params.values():
        p.fill_(float("nan"))
    torch.cuda.synchronize()

    times, last = [], None
    for v in range(a.updates):
        t0 = time.perf_counter()
        requests.put(("update", v))
        kind, payload = replies.get()
        assert kind == "update", kind
        named = ForkingPickler.loads(payload)  # rebuilds each tensor from its IPC handle
        for name, t in named:
            views[name].copy_(t)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        if v < a.updates - 1:
            del named
        else:
            last = named

    verified = all(torch.equal(views[name], t) for name, t in last)
    del last
    requests.put("quit")
    while replies.get()[0] != "bye":
        pass
    proc.join()
    steady = statistics.median(times[1:])
    report = dict(
        baseline="torch.multiprocessing CUDA IPC (SGLang update_weights_from_tensor pattern)",
        torch=torch.__version__,
        device=torch.cuda.get_device_name(a.device),
        layers=cfg["layers"],
        tensors=len(hf_params(cfg)),
        bytes=nbytes,
        first_update_ms=times[0],
        steady_ms=times[1:],
        steady_median_ms=steady,
        steady_gbps=nbytes * 2 / steady / 1e6,
        verified=verified,
        unix_time=int(time.time()),
    )
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"torch baseline  {report['device']}, {report['tensors']} tensors, {nbytes / 1e9:.2f} GB")
        print(f"first update    {times[0]:.1f} ms")
        print(f"steady          {steady:.2f} ms median  (runs {' '.join(f'{t:.2f}' for t in times[1:])})")
        print(f"verified        {verified}")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
