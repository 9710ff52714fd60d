"""One rank of the live vLLM test's training job: a real FSDP2 job on CPU over gloo (``fully_shard``
per decoder layer and on the model) that learns a few tokens with AdamW and sends every version
through awex (``awex.Writer.attach``) to the pair the test connected.

    python trainer.py RANK WORLD PORT GATEWAY PAIR MODEL_DIR OUT_DIR SPEC_JSON

SPEC: ``{"versions": [V, ...], "hold": H or null}``. The job takes one optimizer step per version
1..max(versions), in order and from the saved model (so a restarted job reaches the same weights:
the same steps on the same data); after each step of a version it sends, rank 0 writes the full
parameters (``DTensor.full_tensor()``, a gather) to OUT_DIR/v{V}.pt for the test's HF reference,
then every rank runs ``Writer.update(V)`` (waits for the version to start, sends, waits for the
commit). With ``hold`` H, rank 1 writes OUT_DIR/held{H} at version H instead of sending and
waits to be killed (the test kills the job mid-update). Every rank writes OUT_DIR/rank{R}.log
lines as it goes. That loop (``run_versions``) and the arguments are shared with
``megatron_trainer.py``, the Megatron-Core job.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
TIMEOUT = 300.0
LR = 0.05


def main() -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import awex
    import tiny_model

    rank, world, gateway, pair, model_dir, out, spec, say = start(sys.argv)
    torch.manual_seed(0)
    # the saved model's dtype (config.json): float32, or bf16 for a model vLLM's CPU build serves
    # in bf16 only (tiny_model.DTYPE)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ids = torch.tensor([tiny_model.train_ids(model_dir)])

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def full() -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    w = awex.Writer.attach(model, gateway, pair, timeout=TIMEOUT)
    run_versions(w, rank, out, spec, step, full, say)
    dist.destroy_process_group()
    say("done")


def run_versions(w, rank: int, out: str, spec: dict, step, full, say) -> None:
    """The job's loop after ``Writer.attach`` (``w``), shared with ``megatron_trainer.py``: joins,
    then for each version takes ``step()`` (one optimizer step, returns the loss), and for a
    version the test asks for has rank 0 save ``full()`` (every rank calls it: a gather; on
    rank 0 the whole model in HF names) as OUT_DIR/v{V}.pt, then sends it (or, rank 1 at the held
    version, writes OUT_DIR/held{V} and waits to be killed). Closes the writer."""
    import torch
    import torch.distributed as dist

    say(f"attached: {w.detected}")
    w.join(TIMEOUT)
    say("joined")
    try:
        for version in range(1, max(spec["versions"]) + 1):
            loss = step()
            say(f"step {version}: loss {loss:.4f}")
            if version not in spec["versions"]:
                continue
            weights = full()
            if rank == 0:
                tmp = os.path.join(out, f"v{version}.pt.tmp")
                torch.save(weights, tmp)
                os.replace(tmp, os.path.join(out, f"v{version}.pt"))
            dist.barrier()
            if version == spec.get("hold") and rank == 1:
                open(os.path.join(out, f"held{version}"), "w").close()
                say(f"holding version {version} back until killed")
                while True:
                    time.sleep(1)
            r = w.update(version, timeout=TIMEOUT)
            say(f"version {version}: {r}")
    finally:
        w.close()


def start(argv: list[str]) -> tuple[int, int, str, str, str, str, dict, Any]:
    """A trainer process's start: reads its command line (``RANK WORLD PORT GATEWAY PAIR
    MODEL_DIR OUT_DIR SPEC_JSON``), opens its log and joins the gloo group; returns ``(rank,
    world, gateway, pair, model_dir, out, spec, say)``."""
    import torch.distributed as dist

    rank, world, port = int(argv[1]), int(argv[2]), int(argv[3])
    gateway, pair, model_dir, out = argv[4], argv[5], argv[6], argv[7]
    spec = json.loads(argv[8])
    say = logger(out, rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT))
    return rank, world, gateway, pair, model_dir, out, spec, say


def logger(out: str, rank: int):
    """``say(msg)``: appends ``HH:MM:SS msg`` to OUT_DIR/rank{R}.log (a restarted job appends)."""
    log = open(os.path.join(out, f"rank{rank}.log"), "a", buffering=1)

    def say(msg: str) -> None:
        log.write(f"{time.strftime('%H:%M:%S')} {msg}\n")

    return say


if __name__ == "__main__":
    main()
