#!/usr/bin/env python3
"""How many bytes a real optimiser step changes, in bf16 and after FP8 block quantisation.

Trains a tiny transformers Qwen3 on CPU (fp32 master weights, AdamW, random tokens, the bf16
cast after each step) and measures, per step, over the same tensors:

- changed bf16 elements (all tensors);
- for the 2-D weights of the decoder layers (what an FP8 inference side quantises): changed
  e4m3 bytes and changed scales after 128 x 128 block quantisation with awex's default recipe
  (`vllm`, CUDA rounding: awex-core/src/encoding/recipe.rs `Recipe::Vllm` with
  `TorchDevice::Cuda`: `sf = max(amax, 1e-4) * fl(1/448)`, `q = e4m3(x * fl(1/sf))`, round to
  nearest even, the scale an fp32);
- the bytes awex's delta encoding puts on the wire for those changes, per format
  (awex-core/src/encoding/delta.rs; each tensor taken as one segment);
- the real step's size per element: mean |master_t - master_{t-1}| / lr.

The same is measured for awex's synthetic versions (`Weights::Stepped`, awex-core/src/weights.rs)
on the same shapes: its version `v` is `master_0 + lr * (u_1 + ... + u_v)` with `u_k` drawn per
element and step (`--synthetic-step uniform`: uniform in [-1, 1), the model before calibration;
`adam`: awex's calibrated model, see `stepped_u` below), from awex's seeded init (`--init awex`;
`triangular`: the one before calibration) or from the tiny model's init (`--init model`).

Usage (torch and transformers, CPU):

    python bench/delta_density.py --steps 10 --lr 1e-6 --json out.json
    python bench/delta_density.py --steps 60 --layers 2 --vocab 8192 --synthetic-step ''
    python bench/delta_density.py --steps 0 --synthetic-step uniform,adam --init triangular,awex

Figures of a run are in docs/deltas.md.
"""

import argparse
import json
import math
import sys

import numpy as np
import torch

CHUNK = 256
BLOCK = 128


def bits16(t):
    return t.contiguous().view(torch.int16)


def quantise_vllm_cuda(w_bf16):
    """awex's Recipe::Vllm with TorchDevice::Cuda on a [rows, cols] bf16 matrix: (e4m3 bytes
    [rows, cols] as uint8, scales [ceil(rows/128), ceil(cols/128)] as fp32)."""
    rows, cols = w_bf16.shape
    br, bc = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    x = torch.zeros(br * BLOCK, bc * BLOCK, dtype=torch.float32)
    x[:rows, :cols] = w_bf16.float()
    blocks = x.view(br, BLOCK, bc, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    recip448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    sf = amax.clamp(min=1e-4) * recip448
    m = torch.tensor(1.0, dtype=torch.float32) / sf
    q = (blocks * m[:, None, :, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    q = q.view(br * BLOCK, bc * BLOCK)[:rows, :cols].contiguous()
    return q, sf


def encoded_bytes(changed, elem, fmt):
    """Bytes of one segment of `changed` (bool array) of `elem`-byte elements on the wire."""
    n = changed.size
    c = int(changed.sum())
    dense = n * elem + 1
    if c == 0:
        return 1
    if fmt == "chunk256":
        # tag 1, a count byte per chunk of 256, then (offset u8 + value) per change or the
        # whole chunk where that is not smaller (delta.rs `dense_chunk`)
        pad = (-n) % CHUNK
        per = np.concatenate([changed, np.zeros(pad, bool)]).reshape(-1, CHUNK).sum(1)
        lens = np.full(per.size, CHUNK)
        if pad:
            lens[-1] = CHUNK - pad
        whole = (per * (1 + elem) >= lens * elem) | (per >= 255)
        body = np.where(whole, lens * elem, per * (1 + elem)).sum()
        sparse = 1 + per.size + int(body)
    elif fmt == "gaps":
        # tag, varint count, then LEB128 varint gaps (index - previous index - 1), then values
        idx = np.flatnonzero(changed)
        gaps = np.diff(np.concatenate([[-1], idx])) - 1
        lens = np.ones_like(gaps)
        for k in range(1, 10):
            lens += gaps >= (1 << (7 * k))
        sparse = 1 + 5 + int(lens.sum()) + c * elem
    elif fmt == "rice":
        # tag, count (u32), Rice parameter k (u8), the gaps Rice-coded (quotient in unary, k
        # low bits), bit-packed, then the values; k chosen per segment as the smallest
        idx = np.flatnonzero(changed)
        gaps = np.diff(np.concatenate([[-1], idx])) - 1
        bits = min(int((gaps >> k).sum()) + c * (1 + k) for k in range(0, 32))
        sparse = 1 + 4 + 1 + (bits + 7) // 8 + c * elem
    else:
        raise ValueError(fmt)
    return min(dense, sparse)


class Tally:
    def __init__(self):
        self.d = {}

    def add(self, key, v):
        self.d[key] = self.d.get(key, 0) + v


def measure(prev, cur, quantised, fmts):
    """Compares two versions ({name: bf16 tensor}); returns a dict of counts."""
    t = Tally()
    for name, b in cur.items():
        a = prev[name]
        ch = (bits16(a) != bits16(b)).numpy().ravel()
        t.add("bf16_elems", ch.size)
        t.add("bf16_changed", int(ch.sum()))
        for f in fmts:
            t.add(f"bf16_wire_{f}", encoded_bytes(ch, 2, f))
        if name in quantised:
            qa, sa = quantised[name][0]
            qb, sb = quantised[name][1]
            cq = (qa != qb).numpy().ravel()
            cs = (sa.view(torch.int32) != sb.view(torch.int32)).numpy().ravel()
            t.add("e4m3_bytes", cq.size)
            t.add("e4m3_changed", int(cq.sum()))
            t.add("scales", cs.size)
            t.add("scales_changed", int(cs.sum()))
            for f in fmts:
                e = encoded_bytes(cq, 1, f)
                t.add(f"e4m3_wire_{f}", e)
                t.add(f"fp8_wire_{f}", e + encoded_bytes(cs, 4, f))
            t.add("fp8_dense", cq.size + 4 * cs.size)
        else:
            # stays bf16 on the FP8 side
            for f in fmts:
                t.add(f"fp8_wire_{f}", encoded_bytes(ch, 2, f))
            t.add("fp8_dense", 2 * ch.size)
            t.add("fp8_bf16_dense", 2 * ch.size)
    return t.d


def summarise(step, d, fmts, extra):
    r = {"step": step, **extra}
    r["bf16_changed_pct"] = 100.0 * d["bf16_changed"] / d["bf16_elems"]
    r["e4m3_changed_pct"] = 100.0 * d["e4m3_changed"] / d["e4m3_bytes"]
    r["scales_changed_pct"] = 100.0 * d["scales_changed"] / d["scales"]
    for f in fmts:
        r[f"bf16_wire_pct_{f}"] = 100.0 * d[f"bf16_wire_{f}"] / (2 * d["bf16_elems"])
        r[f"bf16_bytes_per_change_{f}"] = d[f"bf16_wire_{f}"] / max(d["bf16_changed"], 1)
        r[f"fp8_wire_pct_{f}"] = 100.0 * d[f"fp8_wire_{f}"] / d["fp8_dense"]
        r[f"e4m3_bytes_per_change_{f}"] = d[f"e4m3_wire_{f}"] / max(d["e4m3_changed"], 1)
    r["fp8_bf16_share_pct"] = 100.0 * d.get("fp8_bf16_dense", 0) / d["fp8_dense"]
    return r


def is_quantised(name, p):
    # the decoder layers' linear weights; embeddings, lm_head and norms stay bf16
    return p.dim() == 2 and ".layers." in name and name.endswith("proj.weight")


def snapshot(named, quantised_names):
    cur = {n: p.detach().to(torch.bfloat16).clone() for n, p in named}
    q = {n: quantise_vllm_cuda(cur[n]) for n in quantised_names}
    return cur, q


# awex-core/src/weights.rs ADAM_MEAN_STEP and INIT_STD
ADAM_MEAN_STEP = 0.18
INIT_STD = 0.02


def stepped_u(kind, gen, shape):
    """One synthetic step per element, in units of lr."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1
    if kind == "uniform":
        # awex before calibration: uniform in [-1, 1)
        return u
    if kind == "adam":
        # awex's calibrated model (`Stepped`): uniform in [-2 m, 2 m), m = ADAM_MEAN_STEP
        return u * 2 * ADAM_MEAN_STEP
    raise ValueError(kind)


def synthetic_init(kind, gen, shape):
    if kind == "triangular":
        # awex's seeded init before calibration: triangular on (-1, 1) times 0.035
        a = torch.rand(shape, generator=gen, dtype=torch.float64)
        b = torch.rand(shape, generator=gen, dtype=torch.float64)
        return (a + b - 1.0) * 0.035
    # awex's seeded init (`Stepped`): 12 uniforms summed, less 6, times INIT_STD
    u = torch.rand((12, *shape), generator=gen, dtype=torch.float64)
    return (u.sum(0) - 6.0) * INIT_STD


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--synthetic-steps", type=int, default=4)
    ap.add_argument("--synthetic-step", default="uniform,adam", help="uniform (awex before "
                    "calibration), adam (awex's calibrated step); comma-separated, or empty")
    ap.add_argument("--init", default="triangular,awex,model", help="synthetic init(s): "
                    "triangular (awex before calibration), awex, model (the tiny model's)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    cfg = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=args.seq,
    )
    model = Qwen3ForCausalLM(cfg).float()
    named = [(n, p) for n, p in model.named_parameters()]
    nparams = sum(p.numel() for _, p in named)
    qnames = {n for n, p in named if is_quantised(n, p)}
    fmts = ["chunk256", "gaps", "rice"]
    print(
        f"tiny Qwen3: {nparams / 1e6:.1f} M parameters, {len(named)} tensors, "
        f"{len(qnames)} quantised to FP8; lr {args.lr:g}, AdamW, random tokens",
        file=sys.stderr,
    )
    init = {n: p.detach().double().clone() for n, p in named}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    out = {"args": vars(args), "params": nparams, "real": [], "synthetic": {}}

    prev, prevq = snapshot(named, qnames)
    prev_master = {n: p.detach().clone() for n, p in named}
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        cur, curq = snapshot(named, qnames)
        mean_step = sum(
            float((p.detach() - prev_master[n]).abs().sum()) for n, p in named
        ) / (nparams * args.lr)
        d = measure(prev, {n: cur[n] for n in cur}, {n: (prevq[n], curq[n]) for n in qnames}, fmts)
        extra = {"loss": float(loss), "mean_abs_step_over_lr": mean_step}
        r = summarise(step, d, fmts, extra)
        out["real"].append(r)
        print(json.dumps({"real": r}), flush=True)
        prev, prevq = cur, curq
        prev_master = {n: p.detach().clone() for n, p in named}

    for kind in [k for k in args.synthetic_step.split(",") if k]:
        for init_kind in args.init.split(","):
            gen = torch.Generator().manual_seed(args.seed + 1)
            master = {
                n: (init[n].clone() if init_kind == "model" else synthetic_init(init_kind, gen, p.shape))
                for n, p in named
            }
            as_bf16 = lambda: {n: m.float().to(torch.bfloat16) for n, m in master.items()}  # noqa: E731
            prev = as_bf16()
            prevq = {n: quantise_vllm_cuda(prev[n]) for n in qnames}
            rows = []
            for step in range(1, args.synthetic_steps + 1):
                us = 0.0
                for n in master:
                    u = stepped_u(kind, gen, master[n].shape)
                    us += float(u.abs().sum())
                    master[n] += args.lr * u
                cur = as_bf16()
                curq = {n: quantise_vllm_cuda(cur[n]) for n in qnames}
                d = measure(prev, cur, {n: (prevq[n], curq[n]) for n in qnames}, fmts)
                r = summarise(step, d, fmts, {"mean_abs_step_over_lr": us / nparams})
                rows.append(r)
                print(json.dumps({f"synthetic {kind} init {init_kind}": r}), flush=True)
                prev, prevq = cur, curq
            out["synthetic"][f"{kind}/{init_kind}"] = rows

    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
