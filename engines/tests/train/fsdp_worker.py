"""One rank of the FSDP2 conformance job (started by test_fsdp.py): for every case, in order,
over one gloo process group: build the HF model (same seed on every rank), shard it with
FSDP2 (``fully_shard``; HSDP on a 2-D mesh; TP with ``parallelize_module`` first), record each
parameter's ``to_local()`` (name, shape, dtype, bytes) and awex's layout for this rank filled
from the checkpoint, then rewrite the shards in place and send them with ``Writer.attach``. A
``bf16`` case loads the model as users do (a bf16 checkpoint, ``from_pretrained(dtype="auto")``)
and first attaches to a pair laid out for the other transformers release, which must be refused.

Usage: ``python fsdp_worker.py RANK WORLD PORT GATEWAY CASES_JSON OUT_DIR``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
TF4 = os.environ.get("AWEX_WORKER_TRANSFORMERS4")  # set by test_fsdp.py for the transformers 4 case only

TIMEOUT = 240.0


def shard(model, case):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    p = case["parallel"]
    dp, rep, tp = p.get("dp", 1), p.get("replicate", 1), p.get("tp", 1)
    assert dp * rep * tp == dist.get_world_size()
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        plan = {"model.embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel()}
        for l in range(model.config.num_hidden_layers):
            b = f"model.layers.{l}."
            for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[b + m] = ColwiseParallel()
            for m in ("self_attn.o_proj", "mlp.down_proj"):
                plan[b + m] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        fmesh = mesh["dp"]
    elif rep > 1:
        fmesh = init_device_mesh("cpu", (rep, dp), mesh_dim_names=("replicate", "shard"))
    else:
        fmesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        # FSDP2 groups one dtype: the modules transformers keeps in fp32 (5.24's routers) get
        # groups of their own, as transformers' own FSDP plan gives them (distributed/mixin.py)
        dtypes = {p.dtype for p in layer.parameters()}
        if len(dtypes) > 1:
            main = max(dtypes, key=lambda d: sum(p.numel() for p in layer.parameters() if p.dtype == d))
            for m in layer.modules():
                own = list(m.parameters(recurse=False))
                if own and m is not layer and all(p.dtype != main for p in own):
                    fully_shard(m, mesh=fmesh)
        fully_shard(layer, mesh=fmesh)
    fully_shard(model, mesh=fmesh)
    return model


def fill(entry, canon):
    """A local tensor built from awex's layout, in the layout's dtype: each placement's canonical
    box at its offset (converted to that dtype)."""
    import torch

    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    out = torch.zeros(entry["shape"], dtype=dtypes[entry["dtype"]])
    for pl in entry["placements"]:
        src = canon[pl["canonical"]]
        off, ext, loc = pl["region"]["offset"], pl["region"]["extent"], pl["local_offset"]
        box = src[tuple(slice(o, o + e) for o, e in zip(off, ext))]
        lead = len(loc) - box.ndim
        idx = tuple(loc[:lead]) + tuple(slice(o, o + e) for o, e in zip(loc[lead:], ext))
        out[idx] = box.to(out.dtype)
    return out


def raw(t) -> bytes:
    """A tensor's bytes, whatever its dtype (numpy has no bfloat16)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def run_case(case, rank, gateway, out):
    import awex
    import torch
    import torch.distributed as dist

    import convert
    import hf_models

    if case.get("bf16_checkpoint"):
        # as users load a bf16 checkpoint: the release's own dtype rules decide each tensor's dtype
        model = hf_models.load_auto(case["bf16_checkpoint"])
    else:
        model = hf_models.build(hf_models.config(case["kind"], **case.get("over", {})))
    canon = convert.hf_canonical(model)
    model = shard(model, case)
    named = awex.fsdp.named_tensors(model)
    real = [[n, list(t.shape), str(t.dtype).replace("torch.", ""), digest(raw(t))] for n, t in named]
    with torch.no_grad():
        for _, t in named:
            t.mul_(1.5).add_(0.25)
    refused = None
    if case.get("other_release_pair"):
        # a pair whose layout follows the other transformers release: refused by name
        try:
            awex.Writer.attach(model, gateway, case["other_release_pair"], timeout=TIMEOUT).close()
            refused = "accepted"
        except awex.LayoutError as e:
            refused = str(e)
    w = awex.Writer.attach(model, gateway, case["update_pair"], timeout=TIMEOUT)
    try:
        layout = w.layout()
        filled = [[e["name"], list(e["shape"]), e["dtype"], digest(raw(fill(e, canon)))] for e in layout]
        detected, live = w.detected, awex.detect(model=model)["live"]
        w.join(TIMEOUT)
        w.update(1, timeout=TIMEOUT)
    finally:
        w.close()
    dist.barrier()
    return {"real": real, "layout": filled, "detected": detected, "live": live, "refused": refused}


def main():
    if TF4:
        sys.path.insert(0, TF4)
    import torch.distributed as dist

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    gateway, cases, out = sys.argv[4], json.load(open(sys.argv[5])), sys.argv[6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT))
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run_case(case, rank, gateway, out)
        except Exception:
            results[case["name"]] = {"error": traceback.format_exc()}
            with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
            raise
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
