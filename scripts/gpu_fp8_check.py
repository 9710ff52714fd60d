"""Compares a `awex-cli bench fp8 --dump DIR` directory with the torch references on CUDA.

Each dumped bf16 matrix goes through the recipe's torch reference (engines/fp8_refs.py; for
vLLM's also under torch.compile, as vLLM runs it) on the GPU; awex's CPU and GPU quantisations
must equal it byte for byte (e4m3 bytes and fp32 scales). Exits 1 on any difference.

    python scripts/gpu_fp8_check.py DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engines"))

import fp8_refs  # noqa: E402


def load(path: str, dtype: torch.dtype) -> torch.Tensor:
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=dtype)


def main() -> int:
    d = sys.argv[1]
    with open(os.path.join(d, "manifest.json")) as f:
        m = json.load(f)
    recipe = m["recipe"]
    refs = {"torch": fp8_refs.RECIPES[recipe]}
    if recipe == "vllm":
        refs["torch.compile"] = torch.compile(fp8_refs.ref_vllm, dynamic=True)
    fails = 0
    for mat in m["matrices"]:
        name, rows, cols = mat["name"], mat["rows"], mat["cols"]
        base = os.path.join(d, name)
        x = load(base + ".bf16", torch.int16).view(torch.bfloat16).view(rows, cols).cuda()
        want = {}
        for rn, f in refs.items():
            q, s = f(x)
            want[rn] = (q.view(torch.uint8).reshape(-1).cpu(), s.float().reshape(-1).cpu())
        for side in ("cpu", "gpu"):
            if not os.path.exists(f"{base}.{side}.e4m3"):
                continue
            q = load(f"{base}.{side}.e4m3", torch.uint8)
            s = load(f"{base}.{side}.scales", torch.float32)
            for rn, (wq, ws) in want.items():
                dq = int((q != wq).sum())
                ds = int((s.view(torch.int32) != ws.view(torch.int32)).sum())
                fails += dq + ds > 0
                print(f"{recipe:16} {name:18} awex {side} vs {rn:13}: e4m3 {dq} of {q.numel()} differ, "
                      f"scales {ds} of {s.numel()} differ{'  <-- FAIL' if dq or ds else ''}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
