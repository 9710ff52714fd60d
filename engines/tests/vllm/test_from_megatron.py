"""A real Megatron-Core 0.19.2 training job updating vLLM 0.33.0's real model classes through
awex's registered ``WeightTransferEngine``, on CPU.

For every case: a small HF model with random weights (``train/hf_models.py``) is written as a
checkpoint; the Megatron ranks (``train/megatron_worker.py``: real GPTModel chunks, local spec,
gloo) receive it through awex, rewrite every parameter in place (``p * 1.5 + 0.25``) and send
the live parameters with ``awex.Writer.attach(model, ...)`` to a pair whose inference side is
``vllm:tp=T,ep=E``. Every vLLM TP rank (``vllm_receive.py``) builds the model class with vLLM's
``initialize_model`` and parallel groups over gloo, zeroes it, runs vLLM's post-load pass (in the
``prepack`` cases every linear layer's post-load step replaces its weight with an empty
parameter and keeps a packed copy, as vLLM's CPU platform does), and receives through the
``awex`` backend that vLLM's plugin loader registered, driven by vLLM's own ``Worker`` methods
(init, start, update, finish). What every layer computes with afterwards must be
byte-identical to what the class's own ``load_weights`` makes of the rewritten checkpoint
(``canonical * 1.5 + 0.25``, which the Megatron suite checks is exactly what the rewritten
parameters hold), with the same names and shapes: the update went through vLLM's layerwise
reload, which re-ran the post-load step.

CI runs ``CASES`` (one Megatron world of 2 ranks: TP, uneven PP with tied embeddings into vLLM
TP=4 with KV-head replication, MoE with EP into vLLM with EP); ``AWEX_VLLM_FULL=1`` adds
``MORE`` (vLLM TP=1, MoE without EP, MoE into TP=4/EP=4, tied MoE)::

    PYTHONPATH=$(engines/vllm-pkgs.sh VENV) VENV/bin/python -m pytest engines/tests/vllm/test_from_megatron.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(HERE), "train")
sys.path.insert(0, TRAIN)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)  # vllm_preload.py, for the forkserver
import forked  # noqa: E402  (engines/tests/forked.py)

torch = pytest.importorskip("torch")
awex = pytest.importorskip("awex")
import awex._testing  # noqa: E402

import harness  # noqa: E402
import hf_models  # noqa: E402

TOKENS = [3, 17, 250, 42, 7, 299, 128, 64, 5, 11]
L2 = {"num_hidden_layers": 2}

CASES = [
    # atomic: vLLM's receive_weights stages, waits for `apply` and applies inside the one call;
    # prepack: every linear layer's post-load step replaces its weight, as vLLM's CPU platform does
    dict(name="tp2_to_tp2", kind="qwen3", over=L2, parallel={"tp": 2}, vllm={"tp": 2}, atomic=True, prepack=True),
    dict(name="pp2_uneven_tied_to_tp4", kind="qwen3", over={"num_hidden_layers": 3, "tie_word_embeddings": True},
         parallel={"pp": 2, "first_stage_layers": 1, "last_stage_layers": 2}, vllm={"tp": 4}),
    dict(name="moe_ep2_to_tp2_ep2", kind="qwen3_moe", over=L2, parallel={"dp": 2, "ep": 2}, vllm={"tp": 2, "ep": 2},
         prepack=True),
]
MORE = [
    dict(name="tp2_to_tp1", kind="qwen3", over=L2, parallel={"tp": 2}, vllm={"tp": 1}),
    dict(name="pp2_vpp2_to_tp2", kind="qwen3", parallel={"pp": 2, "vpp": 2}, vllm={"tp": 2}),
    dict(name="qwen3_tied_tp2_to_tp2", kind="qwen3", over={"num_hidden_layers": 2, "tie_word_embeddings": True},
         parallel={"tp": 2}, vllm={"tp": 2}),
    dict(name="moe_ep2_to_tp2", kind="qwen3_moe", over=L2, parallel={"dp": 2, "ep": 2}, vllm={"tp": 2}),
    dict(name="moe_tp2_to_tp4_ep4", kind="qwen3_moe", over=L2, parallel={"tp": 2}, vllm={"tp": 4, "ep": 4}),
    dict(name="moe_tied_ep2_to_tp2_ep2", kind="qwen3_moe", over={"num_hidden_layers": 2, "tie_word_embeddings": True},
         parallel={"dp": 2, "ep": 2}, vllm={"tp": 2, "ep": 2}),
]
ALL = CASES + (MORE if os.environ.get("AWEX_VLLM_FULL") else [])


def megatron_spec(parallel: dict) -> str:
    return "megatron:" + ",".join(f"{k}={v}" for k, v in parallel.items()) + ",local_spec=1"


def vllm_spec(v: dict) -> str:
    return f"vllm:tp={v['tp']},ep={v.get('ep', 1)}"


def launch_vllm(case: dict, st: dict, gw: str) -> list[Any]:
    out = st["dir"]
    spec = dict(tp=case["vllm"]["tp"], ep=case["vllm"].get("ep", 1), hf_dir=out, port=harness.free_port(),
                gateway=gw, pair=st["update"], expected=st["expected"], timeout=harness.TIMEOUT,
                prepack=case.get("prepack", False))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return [
        forked.popen(os.path.join(HERE, "vllm_receive.py"), [json.dumps(spec), str(r), out],
                     os.path.join(out, f"vllm{r}.log"), "vllm_preload", env=env)
        for r in range(spec["tp"])
    ]


def vllm_failed(procs: list[Any], out: str) -> None:
    for r, p in enumerate(procs):
        if p.poll() not in (None, 0):
            tail = open(os.path.join(out, f"vllm{r}.log")).read()[-4000:]
            raise RuntimeError(f"vLLM rank {r} exited with {p.returncode}:\n{tail}")


def wait_ready(ctl, pair: str, megatron: list, vllm: list, out: str, case_dir: str) -> None:
    deadline = time.time() + harness.TIMEOUT
    while True:
        try:
            ctl.wait_ready(5.0, pair=pair)
            return
        except TimeoutError:
            harness.check_alive(megatron, out)
            vllm_failed(vllm, case_dir)
            if time.time() > deadline:
                raise


def run_world(cases: list[dict], out: str) -> dict:
    gw = awex._testing.start_gateway()
    ctl = awex.Controller(gw)
    state, wire = {}, []
    for case in cases:
        d = os.path.join(out, case["name"])
        model = hf_models.build(hf_models.config(case["kind"], **case.get("over", {})))
        canon = hf_models.write_checkpoint(model, d)
        hf = json.load(open(os.path.join(d, "config.json")))
        if "num_local_experts" in hf:  # transformers 5 writes Qwen3-MoE's num_experts under this name
            hf.setdefault("num_experts", hf["num_local_experts"])
        expected = os.path.join(d, "expected.pt")
        torch.save({n: t * 1.5 + 0.25 for n, t in canon.items()}, expected)
        load, upd = f"{case['name']}-load", f"{case['name']}-update"
        ctl.connect(load, model=d, train="fsdp:dp=1", infer=megatron_spec(case["parallel"]), transport="shm",
                    join_deadline_s=harness.TIMEOUT)
        ctl.connect(upd, model=d, train=megatron_spec(case["parallel"]), infer=vllm_spec(case["vllm"]),
                    transport="tcp", join_deadline_s=harness.TIMEOUT, atomic=case.get("atomic", False))
        state[case["name"]] = dict(case=case, canon=canon, dir=d, expected=expected, update=upd,
                                   apply=ctl.status(upd)["options"].get("apply", "in_place"))
        wire.append(dict(name=case["name"], parallel=case["parallel"], hf=hf, tokens=TOKENS,
                         load_pair=load, update_pair=upd, wrong_pair=None))
    procs = harness.launch("megatron_worker.py", 2, gw, wire, out)
    try:
        for case in cases:
            name, st = case["name"], state[case["name"]]
            # vLLM's imports overlap the checkpoint's load into Megatron
            vprocs = launch_vllm(case, st, gw)
            try:
                th = harness.Threads()
                th.start(lambda: harness.send_canonical(gw, f"{name}-load", st["canon"]))
                harness.wait_ready(ctl, f"{name}-load", procs, out)
                ctl.update(1, timeout=harness.TIMEOUT, pair=f"{name}-load")
                th.wait()
                wait_ready(ctl, st["update"], procs, vprocs, out, st["dir"])
                ctl.update(1, timeout=harness.TIMEOUT, pair=st["update"])
                deadline = time.time() + harness.TIMEOUT
                for p in vprocs:
                    p.wait(max(1.0, deadline - time.time()))
                vllm_failed(vprocs, st["dir"])
            finally:
                for p in vprocs:
                    if p.poll() is None:
                        p.kill()
            harness.check_alive(procs, out)
    finally:
        ranks = harness.finish(procs, out)
    for name, st in state.items():
        st["ranks"] = [r.get(name, {"error": "no result"}) for r in ranks]
    return state


@pytest.fixture(scope="module")
def world():
    with harness.scratch_dir("megatron-vllm") as out:
        yield run_world(ALL, out)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [c["name"] for c in ALL])
def test_megatron_update_into_vllm_equals_vllms_load_weights(world, name):
    st = world[name]
    assert st["apply"] == ("atomic" if st["case"].get("atomic") else "in_place")
    for r, res in enumerate(st["ranks"]):
        assert "error" not in res, f"megatron rank {r}: {res['error']}"
    for r in range(st["case"]["vllm"]["tp"]):
        engine = json.load(open(os.path.join(st["dir"], f"engine{r}.json")))["engine"]
        assert engine == "AwexWeightTransferEngine", engine
        got = torch.load(os.path.join(st["dir"], f"recv{r}.pt"))
        ref = torch.load(os.path.join(st["dir"], f"ref{r}.pt"))
        assert sorted(got) == sorted(ref), f"vLLM rank {r}: names differ: {sorted(set(got) ^ set(ref))}"
        for n, t in ref.items():
            assert tuple(t.shape) == tuple(got[n].shape), f"vLLM rank {r} `{n}`: {tuple(t.shape)} vs {tuple(got[n].shape)}"
            assert t.contiguous().numpy().tobytes() == got[n].contiguous().numpy().tobytes(), \
                f"vLLM rank {r} `{n}`: the bytes received from Megatron differ from vLLM's load_weights"
        # every parameter was zeroed before the receive: a nonzero in each shows it was written
        for n, t in got.items():
            assert bool(t.ne(0).any()) or not bool(ref[n].ne(0).any()), f"vLLM rank {r} `{n}` was not received"
