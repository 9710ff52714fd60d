"""Times variants of awex's batch FP8 kernel on one GPU, out of separate allocations laid out as
a Megatron sender of qwen3-30b-a3b (per expert: fc1 1536 x 2048, fc2 2048 x 768) and of
qwen3-8b, into SGLang's engine layout (w13 / w2 stacks and their fp32 scales).

Every variant's e4m3 bytes and scales are compared byte for byte with the shipped kernel's
(awex-gpu/src/cuda/fp8_table.ptx, whose bytes the bench checks against the CPU reference), after
poisoning the outputs. The in-run floor: a device-to-device copy's rate (bytes read + written),
and the FP8 floor = (bf16 read + e4m3 and scales written) at that rate.

Runs on the device machine (CuPy, ptxas): python3 scripts/fp8_variants/run.py [--layers N]
Prints a table last; --json PATH writes every figure.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import cupy as cp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHIPPED = os.path.join(ROOT, "awex-gpu/src/cuda/fp8_table.ptx")
CHUNK = os.path.join(HERE, "fp8_table_chunk.ptx")


def tuned(src, directives):
    """The PTX with `directives` (and no others) between the parameter list and the body."""
    src = re.sub(r"^\.(maxntid|minnctapersm|maxnreg)[^\n]*\n", "", src, flags=re.M)
    i = src.index(")\n{")
    return src[: i + 2] + directives + "\n" + src[i + 2 :]


def ptxas_regs(path):
    try:
        exe = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
        r = subprocess.run(
            [exe, "-arch=sm_90", "-v", path, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=120,
        )
        m = re.findall(r"Used (\d+) registers", r.stderr)
        return int(m[-1]) if m else r.stderr.strip()[-200:]
    except Exception as e:  # noqa: BLE001
        return f"ptxas: {e}"


class Layout:
    """Sources in separate allocations, destinations in engine stacks, and the job list."""

    def __init__(self, name, mats, pool):
        # mats: list of (rows, cols, dst_array_u8, dst_offset, dst_pitch, scale_array, scale_off, scale_pitch)
        self.name = name
        self.srcs = []
        self.jobs = []
        self.bf16_bytes = 0
        self.e4m3_bytes = 0
        self.scale_bytes = 0
        off = 0
        for rows, cols, dst, doff, dpitch, sc, soff, spitch in mats:
            n = rows * cols * 2
            mem = cp.cuda.Memory(n)  # its own cudaMalloc, as a per-tensor sender
            p = cp.cuda.MemoryPointer(mem, 0)
            # random finite bf16: windows of a random pool
            if off + n > pool.nbytes:
                off = (off * 7919) % (pool.nbytes - n)
            cp.cuda.runtime.memcpy(p.ptr, pool.data.ptr + off, n, 3)
            off += n + 4096
            self.srcs.append(mem)
            self.jobs.append(
                (
                    p.ptr,
                    dst.data.ptr + doff,
                    sc.data.ptr + soff * 4,
                    rows,
                    cols,
                    2 * cols,
                    dpitch,
                    spitch,
                )
            )
            self.bf16_bytes += n
            self.e4m3_bytes += rows * cols
            self.scale_bytes += -(-rows // 128) * -(-cols // 128) * 4

    def table(self, chunk):
        """The 64-byte entries and the per-CTA job index for runs of `chunk` block columns."""
        ent = np.zeros((len(self.jobs), 16), dtype=np.uint32)
        idx = []
        first = 0
        for i, (src, dst, sc, rows, cols, sp, dp, scp) in enumerate(self.jobs):
            gx, gy = -(-cols // 128), -(-rows // 128)
            ctas = gy * -(-gx // chunk)
            e = ent[i]
            e[0:2] = [src & 0xFFFFFFFF, src >> 32]
            e[2:4] = [dst & 0xFFFFFFFF, dst >> 32]
            e[4:6] = [sc & 0xFFFFFFFF, sc >> 32]
            e[6:13] = [rows, cols, sp, dp, scp, gx, first]
            idx.append(np.full(ctas, i, dtype=np.uint32))
            first += ctas
        return cp.asarray(ent.reshape(-1)), cp.asarray(np.concatenate(idx)), first


def moe(layers, experts, pool):
    mats, outs = [], []
    for _ in range(layers):
        w13 = cp.empty(experts * 1536 * 2048, dtype=cp.uint8)
        w2 = cp.empty(experts * 2048 * 768, dtype=cp.uint8)
        s13 = cp.empty(experts * 12 * 16, dtype=cp.float32)
        s2 = cp.empty(experts * 16 * 6, dtype=cp.float32)
        outs += [w13, w2, s13, s2]
        for e in range(experts):
            # Megatron's SequentialMLP: fc1 (gate and up stacked) then fc2, expert by expert
            mats.append((1536, 2048, w13, e * 1536 * 2048, 2048, s13, e * 12 * 16, 16))
            mats.append((2048, 768, w2, e * 2048 * 768, 768, s2, e * 16 * 6, 6))
    return Layout(f"qwen3-30b-a3b experts x {layers} layers", mats, pool), outs


def dense(layers, pool):
    shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096), (4096, 12288)]
    mats, outs = [], []
    for _ in range(layers):
        for r, c in shapes:
            d = cp.empty(r * c, dtype=cp.uint8)
            s = cp.empty(-(-r // 128) * -(-c // 128), dtype=cp.float32)
            outs += [d, s]
            mats.append((r, c, d, 0, c, s, 0, -(-c // 128)))
    return Layout(f"qwen3-8b linears x {layers} layers", mats, pool), outs


def timed(fn, reps):
    fn()
    fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(ts)), ts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dense-layers", type=int, default=12)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json")
    ap.add_argument("--only", help="comma-separated variant names")
    ap.add_argument("--sweep", choices=["first", "second"], default="second")
    args = ap.parse_args()

    shipped = open(SHIPPED).read()
    chunk_src = open(CHUNK).read()
    tmp = os.environ.get("OUT", "/tmp")
    variants = {}  # name -> (ptx text, entry, chunk, flags)
    variants["shipped"] = (shipped, "awex_fp8_block_table", 1, None)
    if args.sweep == "first":
        # the sweep of 2026-12-03 call 1: occupancy, runs of blocks, L2 prefetch of the next block
        for occ in (4, 5, 6):
            variants[f"shipped minnctapersm {occ}"] = (
                tuned(shipped, f".maxntid 256, 1, 1\n.minnctapersm {occ}"),
                "awex_fp8_block_table",
                1,
                None,
            )
        for c in (1, 2, 4, 8, 16):
            for pf in (0, 1):
                variants[f"chunk {c} prefetch {pf}"] = (chunk_src, "awex_fp8_block_chunk", c, pf)
        for c in (4, 8):
            variants[f"chunk {c} prefetch 1 minnctapersm 4"] = (
                tuned(chunk_src, ".maxntid 256, 1, 1\n.minnctapersm 4"),
                "awex_fp8_block_chunk",
                c,
                1,
            )
    else:
        # runs of blocks without prefetch, at 3 and 4 blocks of 256 threads per multiprocessor
        variants["shipped minnctapersm 4"] = (
            tuned(shipped, ".maxntid 256, 1, 1\n.minnctapersm 4"),
            "awex_fp8_block_table",
            1,
            None,
        )
        four = tuned(chunk_src, ".maxntid 256, 1, 1\n.minnctapersm 4")
        for c in (1, 2, 3, 4, 6):
            variants[f"chunk {c}"] = (chunk_src, "awex_fp8_block_chunk", c, 0)
            variants[f"chunk {c} minnctapersm 4"] = (four, "awex_fp8_block_chunk", c, 0)
    if args.only:
        keep = set(args.only.split(","))
        variants = {k: v for k, v in variants.items() if k in keep or k == "shipped"}

    modules, regs = {}, {}
    for name, (src, entry, _, _) in variants.items():
        key = (src, entry)
        if key not in modules:
            path = os.path.join(tmp, f"variant{len(modules)}.ptx")
            open(path, "w").write(src)
            regs[key] = ptxas_regs(path)
            modules[key] = cp.RawModule(path=path).get_function(entry)

    dev = cp.cuda.Device()
    print("device", cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(), flush=True)
    rng = cp.random.default_rng(7)
    pool = (rng.standard_normal(1 << 27, dtype=cp.float32) * 0.05).view(cp.uint32)
    pool = (pool >> 16).astype(cp.uint16)  # bf16 bits (truncated), 256 MiB
    # the copy floor: 4 GiB device to device
    n = 4 << 30
    a, b = cp.empty(n, dtype=cp.uint8), cp.empty(n, dtype=cp.uint8)
    copy_ms, _ = timed(lambda: cp.cuda.runtime.memcpy(b.data.ptr, a.data.ptr, n, 3), args.reps)
    copy_rate = 2 * n / copy_ms / 1e6  # GB/s, read + write
    del a, b
    print(f"copy 4 GiB: {copy_ms:.3f} ms = {copy_rate:.0f} GB/s (read + write)", flush=True)

    status = cp.zeros(64, dtype=cp.uint32)
    results = {"copy_ms": copy_ms, "copy_gbps": copy_rate, "layouts": []}
    rows = []
    for make in (lambda: moe(args.layers, 128, pool), lambda: dense(args.dense_layers, pool)):
        layout, outs = make()
        floor = (layout.bf16_bytes + layout.e4m3_bytes + layout.scale_bytes) / copy_rate / 1e6
        print(f"== {layout.name}: {len(layout.jobs)} jobs, bf16 {layout.bf16_bytes / 1e9:.2f} GB, floor {floor:.3f} ms", flush=True)
        ref = None
        lres = {"name": layout.name, "jobs": len(layout.jobs), "floor_ms": floor, "variants": []}
        tables = {}
        for name, (src, entry, chunk, flags) in variants.items():
            if chunk not in tables:
                tables[chunk] = layout.table(chunk)
            tab, idx, ctas = tables[chunk]
            f = modules[(src, entry)]
            status[:] = 0
            status[1] = 0xFFFFFFFF
            if flags is None:
                argv = (tab, idx, status, np.uint32(0))
            else:
                argv = (tab, idx, status, np.uint32(0), np.uint32(chunk), np.uint32(flags))

            def run():
                f((ctas,), (256,), argv)

            for o in outs:
                o.view(cp.uint8).fill(0x5A)
            run()
            cp.cuda.Device().synchronize()
            if ref is None:
                ref = [o.view(cp.uint8).copy() for o in outs]
                same = "reference"
            else:
                bad = sum(int(cp.count_nonzero(o.view(cp.uint8) != r)) for o, r in zip(outs, ref))
                same = "equal" if bad == 0 else f"{bad} BYTES DIFFER"
            st = cp.asnumpy(status[:2])
            ms, ts = timed(run, args.reps)
            k = (src, entry)
            print(f"  {name:40s} {ms:8.3f} ms  x floor {ms / floor:.3f}  regs {regs[k]}  ctas {ctas}  {same}  status {st[0]}", flush=True)
            lres["variants"].append({"name": name, "ms": ms, "runs": ts, "x_floor": ms / floor, "regs": regs[k], "ctas": ctas, "bytes": same})
            rows.append((layout.name, name, ms, ms / floor, regs[k], same))
        results["layouts"].append(lres)
        del outs, layout, tables, ref
        cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)
    print("\n| layout | variant | ms | x FP8 floor | regs | bytes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f} | {r[4]} | {r[5]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
