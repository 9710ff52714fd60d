#!/usr/bin/env python3
"""One GPU: the Python Writer over cuda-ipc into SGLang-layout torch CUDA tensors through
``awex.sglang.receive`` (called as SGLang calls a custom weight loader), checked bit for bit
against an independent PyTorch conversion; then the Python NCCL path as far as one GPU allows.

Part 1 (cuda-ipc): the writer registers random bf16 torch CUDA tensors in the layout of
``megatron:tp=1,local_spec=1`` (names and shapes from ``Writer.layout()``) and saves the SGLang
tensors it expects, converted by ``scripts/gpu_megatron_check.py``'s plain-PyTorch functions; the
SGLang side is an ``nn.Module`` whose parameters are zeroed CUDA tensors named as SGLang's
``Qwen3ForCausalLM``; it calls ``awex.sglang.receive(model, [])`` once before the update (the
warm-up trigger: registers and joins in the background) and once while update 1 runs with the
trigger's payload naming version 1 and its attempt, as SGLang's ``update_weights_from_tensor``
does, then compares byte for byte.

Part 2 (nccl): a Writer and a Reader over ``nccl`` register torch CUDA tensors (the rank's GPU is
the tensors'), join through the gateway (training rank 0 publishes the NCCL unique id under
kv ``nccl.uid``) and initialise the communicator. Two processes on one GPU cannot share an NCCL
communicator (NCCL refuses: "Duplicate GPU detected"), so this part records how the join fails
(the error, no hang) and that ``close()`` tears down; the two-GPU run is its own issue.

Part 3 (cuda-ipc, expandable segments): part 1 again with the writer's process under
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, so its tensors live in PyTorch's
``cuMemCreate`` chunks, which awex shares as spans of file descriptors; checked bit for bit, and
PyTorch's snapshot must show expandable segments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_megatron_check as ref  # noqa: E402  (the model constants and the reference conversion)

DTYPES = ref.DTYPES


def log(role: str, *a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {role}:", *a, flush=True)


def torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def module_of(named: dict):
    """An nn.Module whose named_parameters() are exactly `named` (SGLang's names)."""
    import torch

    root = torch.nn.Module()
    for name, t in named.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def ipc_writer(args, registered=None) -> int:
    import torch

    import awex

    w = awex.Writer(args.gateway, args.pair, 0)
    g = torch.Generator(device="cuda").manual_seed(1234)
    params = {
        t["name"]: (torch.randn(t["shape"], generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch_dtype(t["dtype"]))
        for t in w.layout()
    }
    log("writer", f"{len(params)} random torch CUDA tensors in Megatron's layout; registered", w.register(list(params.items())))
    if registered:
        registered()
    expected = ref.sglang_from_canonical(ref.canonical_from_megatron(params))
    torch.save({k: v.cpu() for k, v in expected.items()}, os.path.join(args.workdir, "expected.pt"))
    torch.cuda.synchronize()
    w.join(timeout=120)
    log("writer", "joined; update:", json.dumps(w.update(1, timeout=120)))
    w.close()
    return 0


def sglang_reader(args) -> int:
    import torch

    import awex
    import awex.sglang as sg

    os.environ.update(AWEX_GATEWAY=args.gateway, AWEX_PAIR=args.pair, AWEX_ENGINE="0", AWEX_TP_RANK="0")
    probe = awex.Reader(args.gateway, args.pair, 0, engine=0)  # names and shapes only, never joined
    layout = probe.layout()
    probe.close()
    model = module_of({t["name"]: torch.zeros(t["shape"], dtype=torch_dtype(t["dtype"]), device="cuda") for t in layout})
    log("sglang", f"model with {len(list(model.named_parameters()))} zeroed CUDA parameters (SGLang names)")
    sg.receive(model, [])  # warm-up trigger: registers and joins in the background
    log("sglang", "warm-up receive returned")
    t0 = time.time()
    ctl = awex.Controller(args.gateway)
    while True:
        cur = ctl.status(args.pair).get("current_update") or {}
        if cur.get("version") == 1 and cur.get("state") in ("pending", "running"):
            break
        if time.time() - t0 > 120:
            raise TimeoutError("update 1 never started")
        time.sleep(0.05)
    t0 = time.time()
    # the update's trigger payload as SGLang hands it to the loader (awex-sglang's work_payload,
    # each entry's tensor moved to the device): bytes straight into the parameters
    sg.receive(model, [(f"awex.work/1/{cur['attempt']}/receive", torch.LongTensor([]).to("cuda"))])
    torch.cuda.synchronize()
    log("sglang", f"receive of update 1 returned after {time.time() - t0:.2f} s")
    expected = torch.load(os.path.join(args.workdir, "expected.pt"))
    got = {n: p.detach().cpu() for n, p in model.named_parameters()}
    bad = [n for n in expected if n not in got or not ref.same_bytes(expected[n], got[n])]
    extra = sorted(set(got) - set(expected))
    n_bytes = sum(e.numel() * e.element_size() for e in expected.values())
    for n in sorted(expected):
        print(f"  {n:50s} {str(list(expected[n].shape)):14s} {'yes' if n not in bad else 'NO'}", flush=True)
    result = {"tensors": len(expected), "bytes": n_bytes, "mismatched": bad, "unexpected": extra}
    with open(os.path.join(args.workdir, "ipc_result.json"), "w") as f:
        json.dump(result, f, indent=2)
    if bad or extra:
        print(f"MISMATCH: {bad[:3]} extra {extra[:3]}", flush=True)
        return 1
    print(f"VERIFIED (cuda-ipc via awex.sglang.receive): {len(expected)} tensors, {n_bytes} bytes, bit for bit", flush=True)
    return 0


def nccl_rank(args) -> int:
    import torch

    import awex

    side = args.role.split("-")[1]
    dev = torch.device("cuda", 0)
    r = awex.Writer(args.gateway, args.pair, 0) if side == "writer" else awex.Reader(args.gateway, args.pair, 0, engine=0)
    tensors = [(t["name"], torch.zeros(t["shape"], dtype=torch_dtype(t["dtype"]), device=dev)) for t in r.layout()]
    n = r.register(tensors)
    log(side, f"nccl: registered {n} torch CUDA tensors on {dev}; missing {len(r.missing())}")
    out = {"registered": n, "device": str(dev)}
    t0 = time.time()
    try:
        r.join(timeout=90)
        out["joined"] = True
        log(side, f"joined in {time.time() - t0:.2f} s")
    except Exception as e:  # one GPU: NCCL refuses two ranks on it
        out.update(joined=False, error=f"{type(e).__name__}: {e}", after_s=round(time.time() - t0, 2))
        log(side, f"join failed after {time.time() - t0:.2f} s: {type(e).__name__}: {e}")
    t0 = time.time()
    r.close()
    out["close_s"] = round(time.time() - t0, 3)
    log(side, f"closed in {out['close_s']} s")
    with open(os.path.join(args.workdir, f"nccl_{side}.json"), "w") as f:
        json.dump(out, f, indent=2)
    return 0


def ipc_writer_expandable(args) -> int:
    """Part 1's writer with PyTorch's expandable segments on (set before torch is imported)."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    # pads, so that the weights straddle the chunk boundaries: 20 MiB chunks of the large pool,
    # 2 MiB ones of the small pool (allocations of at most 1 MiB)
    pads = [torch.empty((39 << 19) + 12345, dtype=torch.uint8, device="cuda")]
    pads += [torch.empty(900 << 10, dtype=torch.uint8, device="cuda") for _ in range(2)]

    def snapshot():  # while the registered weights are alive
        segments = torch.cuda.memory_snapshot()
        blocks = [b for seg in segments for b in seg.get("blocks", []) if b.get("state") == "active_allocated"]
        two_mib = 2 << 20
        crossing = sum(1 for b in blocks if b["address"] // two_mib != (b["address"] + b["size"] - 1) // two_mib)
        with open(os.path.join(args.workdir, "expandable.json"), "w") as f:
            json.dump({"alloc_conf": os.environ["PYTORCH_CUDA_ALLOC_CONF"], "segments": len(segments),
                       "expandable_segments": sum(1 for x in segments if x.get("is_expandable")),
                       "active_blocks": len(blocks), "blocks_over_a_2mib_boundary": crossing, "pads": len(pads)}, f)

    return ipc_writer(args, snapshot)


def run_pair(ctl, pair: str, transport: str, roles: list, common: list, model_dir: str, update: bool) -> dict:
    st = ctl.connect(pair, model=model_dir, train=ref.TRAIN, infer=ref.INFER, transport=transport)
    log("controller", f"pair {pair}: {ref.TRAIN} -> {ref.INFER} over {transport}: {st.get('state')}")
    me = os.path.abspath(__file__)
    procs = {r: subprocess.Popen([sys.executable, me, "--role", r, "--pair", pair, *common]) for r in roles}
    res = {}
    try:
        if update:
            t0 = time.time()
            while True:
                if any(p.poll() not in (None, 0) for p in procs.values()):
                    raise RuntimeError("a rank exited early")
                try:
                    ctl.wait_ready(pair=pair, timeout=5)
                    break
                except TimeoutError:
                    if time.time() - t0 > 120:
                        raise
            t0 = time.time()
            res["update"] = ctl.update(1, pair=pair, timeout=120).get("state")
            log("controller", f"update 1 over {transport}: {res['update']} in {time.time() - t0:.2f} s")
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        log("controller", "failed:", res["error"])
    for r, p in procs.items():
        try:
            res[r] = p.wait(timeout=150)
        except subprocess.TimeoutExpired:
            p.kill()
            res[r] = "killed"
    try:
        ctl.disconnect(pair)
    except Exception as e:  # noqa: BLE001
        log("controller", f"disconnect {pair}: {e}")
    return res


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
        json.dump(ref.hf_config(), f, indent=2)
    gateway = _testing.start_gateway()
    ctl = awex.Controller(gateway)
    common = ["--gateway", gateway, "--workdir", args.workdir]
    pid = os.getpid()
    ipc = run_pair(ctl, f"ipc-{pid}", "cuda-ipc", ["ipc-writer", "sglang"], common, model_dir, True)
    nccl = run_pair(ctl, f"nccl-{pid}", "nccl", ["nccl-writer", "nccl-reader"], common, model_dir, False)
    exp_dir = os.path.join(args.workdir, "expandable")
    os.makedirs(exp_dir, exist_ok=True)
    exp_common = ["--gateway", gateway, "--workdir", exp_dir]
    expandable = run_pair(ctl, f"exp-{pid}", "cuda-ipc", ["ipc-writer-expandable", "sglang"], exp_common, model_dir, True)
    for f in ("expandable.json", "ipc_result.json"):
        p = os.path.join(exp_dir, f)
        if os.path.exists(p):
            expandable[f] = json.load(open(p))
    summary = {"cuda_ipc": ipc, "nccl_one_gpu": nccl, "expandable_segments": expandable}
    for f in ("ipc_result.json", "nccl_writer.json", "nccl_reader.json"):
        p = os.path.join(args.workdir, f)
        if os.path.exists(p):
            summary[f] = json.load(open(p))
    print(json.dumps(summary, indent=2), flush=True)
    with open(os.path.join(args.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    ok = all(r.get("sglang") == 0 for r in (ipc, expandable))
    ok = ok and ipc.get("ipc-writer") == 0 and expandable.get("ipc-writer-expandable") == 0
    ok = ok and expandable.get("expandable.json", {}).get("expandable_segments", 0) > 0
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="controller")
    ap.add_argument("--gateway")
    ap.add_argument("--pair")
    ap.add_argument("--workdir", default=os.environ.get("AWEX_CHECK_DIR", "/tmp/awex-pynccl-check"))
    args = ap.parse_args()
    roles = {"controller": controller, "ipc-writer": ipc_writer, "sglang": sglang_reader,
             "nccl-writer": nccl_rank, "nccl-reader": nccl_rank, "ipc-writer-expandable": ipc_writer_expandable}
    return roles[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
