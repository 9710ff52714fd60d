"""Real torch FSDP2 on CPU (gloo) holding gpt-oss, element by element: what awex's FSDP2 layout
must hold on every rank (``awex-fsdp/tests/gpt_oss.rs`` checks it against the fixture).

gpt-oss has no inference layout yet (its engines hold the experts transposed, see
``docs/models.md``), so the pair-based conformance of ``test_fsdp.py`` cannot run it; this test
records instead, on every rank of dp 2, dp 3 (4 experts: ``torch.chunk`` gives 2, 2 and an empty
shard) and HSDP 2 x 2, each parameter's ``to_local()`` of transformers' own
``GptOssForCausalLM`` loaded from a checkpoint whose every element names itself
(``identity.py``) and sharded with ``fully_shard`` per layer and at the root (as
``fsdp_worker.shard`` does), as runs ``[local start, canonical tensor (index into the sorted
names), canonical start, length]``, and compares them with
``awex-fsdp/tests/fixtures/gpt_oss_fsdp.json`` (``AWEX_WRITE_GPT_OSS_FSDP_FIXTURE=1`` rewrites it).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import fsdp_worker  # noqa: E402
from identity import SPAN, identity_checkpoint, runs_of  # noqa: E402
from ports import free_port  # noqa: E402

FIXTURE = os.path.join(HERE, "..", "..", "..", "awex-fsdp", "tests", "fixtures", "gpt_oss_fsdp.json")
CASES = [{"dp": 2}, {"dp": 3}, {"dp": 2, "replicate": 2}]


def rank_job(rank: int, world: int, port: int, ckpt: str, parallel: dict, q) -> None:
    try:
        import torch.distributed as dist
        import transformers

        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        fsdp_worker.shard(model, {"parallel": parallel})
        out = []
        for n, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            out.append([n, list(local.shape), str(local.dtype).removeprefix("torch."),
                        runs_of(local.detach().numpy())])
        dist.destroy_process_group()
        q.put((rank, out))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def fsdp_ranks(ckpt: str, parallel: dict) -> list:
    import multiprocessing as mp

    world = parallel.get("dp", 1) * parallel.get("replicate", 1)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_job, args=(r, world, port, ckpt, parallel, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for r, v in got.items():
        assert not isinstance(v, str), f"rank {r}:\n{v}"
    return [got[r] for r in range(world)]


@pytest.mark.timeout(900)
def test_fsdp2_gpt_oss_shards_are_the_fixture_awex_lays_out(tmp_path) -> None:
    d = str(tmp_path / "ckpt")
    names = identity_checkpoint("GptOssForCausalLM", d)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    # the lane of the newest releases (.ci/engines-newest) runs this file too: the release that
    # wrote the config is no part of what is compared
    config.pop("transformers_version", None)
    cases = []
    for parallel in CASES:
        ranks = fsdp_ranks(d, parallel)
        held = {run[1] for rank in ranks for _, _, _, runs in rank for run in runs}
        assert held == set(range(len(names))), (parallel, sorted(set(names) - {names[i] for i in held}))
        cases.append({"parallel": parallel, "config": config, "tensors": names, "ranks": ranks})
    fixture = {"span": SPAN, "cases": cases}
    if os.environ.get("AWEX_WRITE_GPT_OSS_FSDP_FIXTURE") == "1":
        with open(FIXTURE, "w") as f:
            json.dump(fixture, f, separators=(",", ":"))
            f.write("\n")
    with open(FIXTURE) as f:
        want = json.load(f)
    assert fixture == want, (
        "FSDP2's gpt-oss shards changed: rerun with AWEX_WRITE_GPT_OSS_FSDP_FIXTURE=1 and check "
        "awex-fsdp/tests/gpt_oss.rs")
