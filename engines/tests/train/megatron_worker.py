"""One rank of the Megatron-Core conformance job (started by test_megatron.py): for every case,
in order, over one gloo process group:

1. build the case's real GPTModel chunks (local spec, CPU) and record every parameter's name,
   shape and dtype, and awex's layout for this rank;
2. receive the HF checkpoint's bytes into the real parameters (a ``Reader`` of the pair's
   ``megatron`` receiving side), run the pipeline forward, keep the logits;
3. rewrite the parameters in place (``p * 1.5 + 0.25``, the same on every replica), save them,
   and send them to the SGLang-layout readers through ``Writer.attach(model, ...)``.

Usage: ``python megatron_worker.py RANK WORLD PORT GATEWAY CASES_JSON OUT_DIR``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_cpu  # noqa: E402

TIMEOUT = 240.0


def layout_rows(layout: list[dict]) -> list[list]:
    return [[t["name"], list(t["shape"]), t["dtype"]] for t in layout]


def run_case(case: dict, rank: int, gateway: str, out: str) -> dict:
    import awex
    from megatron.core import parallel_state as ps

    p = case["parallel"]
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.get("tp", 1),
        pipeline_model_parallel_size=p.get("pp", 1),
        virtual_pipeline_model_parallel_size=p.get("vpp") if p.get("vpp", 1) > 1 else None,
        expert_model_parallel_size=p.get("ep", 1),
        expert_tensor_parallel_size=p.get("etp"),
    )
    try:
        hf = case["hf"]
        chunks = megatron_cpu.build_gpt(hf, case)
        model = chunks if len(chunks) > 1 else chunks[0]
        named = awex.megatron.named_tensors(model)
        real = [[n, list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in named]
        # (b) the checkpoint's bytes delivered into the real parameters
        with awex.Reader(gateway, case["load_pair"], rank, engine=0, timeout=TIMEOUT) as r:
            load_layout = layout_rows(r.layout())
            r.register(named)
            r.join(TIMEOUT)
            r.update(1, timeout=TIMEOUT)
        tokens = torch.tensor([case["tokens"]])
        logits = megatron_cpu.forward(chunks, tokens, hf["vocab_size"])
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            torch.save(logits, os.path.join(out, f"{case['name']}.logits.pt"))
        # (c) new weights, in place, sent from the live model
        with torch.no_grad():
            for _, t in named:
                t.mul_(1.5).add_(0.25)
        torch.save({n: t.detach().clone() for n, t in named}, os.path.join(out, f"{case['name']}.rank{rank}.pt"))
        w = awex.Writer.attach(model, gateway, case["update_pair"], timeout=TIMEOUT)
        try:
            attach_layout = layout_rows(w.layout())
            detected = w.detected
            live = awex.detect(model=model)["live"]
            w.join(TIMEOUT)
            w.update(1, timeout=TIMEOUT)
        finally:
            w.close()
        res = {"real": real, "load_layout": load_layout, "attach_layout": attach_layout,
               "detected": detected, "live": live}
        if case.get("wrong_pair"):
            res.update(extras(case, chunks, gateway))
        return res
    finally:
        dist.barrier()
        ps.destroy_model_parallel()


def extras(case: dict, chunks: list, gateway: str) -> dict:
    """A pair whose training side disagrees with the live job is refused; a model wrapped in
    Megatron's DistributedDataParallel or in Float16Module (bf16) is still recognised, through its ``module.`` wrapper. Runs after the
    case's update (the wrapper casts the model in place)."""
    import dataclasses

    import awex
    from megatron.core.transformer.module import Float16Module

    out: dict = {}
    try:
        awex.Writer.attach(chunks[0], gateway, case["wrong_pair"], timeout=TIMEOUT).close()
        out["wrong"] = None
    except awex.LayoutError as e:
        out["wrong"] = str(e)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(chunks[0].config, DistributedDataParallelConfig(), module=chunks[0])
    out["ddp_live"] = awex.detect(model=ddp)["live"]
    # the distributed optimizer's DDP: every parameter a view of its bucket's contiguous
    # param_data, so awex sees one allocation per buffer, not one per parameter
    dist_opt = DistributedDataParallel(
        chunks[0].config, DistributedDataParallelConfig(use_distributed_optimizer=True), module=chunks[0]
    )
    named = awex.megatron.named_tensors(dist_opt)
    buffers = awex.megatron.param_buffers(dist_opt)
    allocs = awex.megatron.allocations(named)
    out["buffers"] = {
        "params": len(named),
        "buffers": [b.data_ptr() for b in buffers],
        "buffer_bytes": [b.untyped_storage().nbytes() for b in buffers],
        "allocations": [a["base"] for a in allocs],
        "allocation_bytes": [a["bytes"] for a in allocs],
        "names_per_allocation": [len(a["names"]) for a in allocs],
    }
    cfg16 = dataclasses.replace(chunks[0].config, bf16=True)
    wrapped = Float16Module(cfg16, chunks[0])  # casts the chunk to bf16: the case's last step
    out["wrapped_live"] = awex.detect(model=wrapped)["live"]
    return out


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    gateway, cases, out = sys.argv[4], json.load(open(sys.argv[5])), sys.argv[6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT))
    megatron_cpu.install_shims()
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run_case(case, rank, gateway, out)
        except Exception:  # reported to the test, which fails the case with it
            results[case["name"]] = {"error": traceback.format_exc()}
            with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
            raise
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
