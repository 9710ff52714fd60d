"""What a delta update can save on one GPU: the bytes an encoder must read against a dense copy.

Run on a CUDA machine with torch and triton (no awex build needed):

    python bench/gpu/delta_roofline.py --params 8.19e9 --lr 1e-6

Makes two bf16 versions of a model of `--params` elements the way an optimiser does (an fp32
master, one Adam-like step of at most `lr` per element, cast to bf16), then times on the device
with CUDA events (median of `--reps`):

- copy:    the dense update's floor (read N bytes, write N bytes), `dst.copy_(new)`;
- compare: the least an encoder does (read the new version and the base: 2N bytes), a Triton
           kernel counting changed elements per 4096-element tile;
- apply:   scattering the changed elements into a copy of the base (read index + value, write
           the element), `dst.view(int16)[idx] = val`;
and prints each time, its bytes per second and the ratios. Nothing here is awex's data path: it
measures the floor a delta path on one GPU would stand on.
"""

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _count_changed(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # 8e9 elements: past int32
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=0)
    b = tl.load(b_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + pid, tl.sum((a != b).to(tl.int32), axis=0))


def timed(fn, reps):
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=8.19e9)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = int(args.params)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(args.seed)
    # versions made in slices (the fp32 master of 8B elements would not fit beside them)
    old = torch.empty(n, dtype=torch.bfloat16, device=dev)
    new = torch.empty_like(old)
    step = 1 << 28
    for i in range(0, n, step):
        k = min(step, n - i)
        master = torch.randn(k, generator=g, device=dev) * 0.02
        old[i : i + k] = master.to(torch.bfloat16)
        # Adam's step is about lr * sign(m / sqrt(v)) early on: at most lr per element
        upd = torch.rand(k, generator=g, device=dev) * 2 - 1
        new[i : i + k] = (master - args.lr * upd.sign() * upd.abs().sqrt()).to(torch.bfloat16)
        del master, upd
    a16, b16 = old.view(torch.int16), new.view(torch.int16)
    tile = 4096
    counts = torch.empty(triton.cdiv(n, tile), dtype=torch.int32, device=dev)

    def compare():
        _count_changed[(triton.cdiv(n, tile),)](a16, b16, counts, n, BLOCK=tile)

    compare()
    changed = int(counts.sum().item())
    # the changed set (index, value): what a delta carries, and what apply reads
    idx = torch.nonzero(a16 != b16).flatten()
    val = b16[idx]
    dst = torch.empty_like(a16)
    nbytes = 2 * n
    t_copy = timed(lambda: dst.copy_(b16), args.reps)
    t_cmp = timed(compare, args.reps)
    dst.copy_(a16)

    def apply():
        dst[idx] = val

    t_apply = timed(apply, args.reps)
    assert torch.equal(dst, b16), "apply left the destination unequal to the new version"
    out = {
        "params": n,
        "lr": args.lr,
        "device": torch.cuda.get_device_name(),
        "changed": changed,
        "density": changed / n,
        "copy_s": t_copy,
        "copy_TBps_read_plus_write": 2 * nbytes / t_copy / 1e12,
        "compare_s": t_cmp,
        "compare_TBps_read": 2 * nbytes / t_cmp / 1e12,
        "apply_s": t_apply,
        "delta_over_dense": (t_cmp + t_apply) / t_copy,
        "apply_over_dense": t_apply / t_copy,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
