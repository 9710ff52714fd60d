"""Conformance of awex's FSDP2 layout against real torch FSDP2 on CPU over gloo: for every case,
on every rank, each parameter's ``to_local()`` equals awex's layout for that rank byte for byte
(name, shape, dtype and the bytes placed from the checkpoint), the mesh is read back by
``Writer.attach``, and an update from the real DTensors (rewritten in place) into SGLang-layout
readers (for DeepSeek-V3, whose SGLang side is mapped apart, one Megatron tp=1 reader,
converted back to HF by ``convert.megatron_to_hf``) is bit-exact against an independent
conversion.

transformers 5 holds Qwen3-MoE experts fused (``mlp.experts.gate_up_proj``); the per-expert
names of transformers 4 are checked with transformers 4 imported from the folder named by
``AWEX_TRANSFORMERS4`` (``pip install --target DIR -r engines/requirements-train-tf4.txt``),
and skipped without it.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
awex = pytest.importorskip("awex")
import awex._testing  # noqa: E402

import convert  # noqa: E402
import harness  # noqa: E402
import hf_models  # noqa: E402

MOE = {"num_hidden_layers": 2}
WORLDS = {
    2: [
        dict(name="dp2", kind="qwen3", parallel={"dp": 2}, infer="sglang:tp=2"),
        dict(name="dp2_tied", kind="qwen3", over={"tie_word_embeddings": True, "num_hidden_layers": 2},
             parallel={"dp": 2}, infer="sglang:tp=2"),
        dict(name="moe_fused_dp2", kind="qwen3_moe", over=MOE, parallel={"dp": 2, "fused_experts": 1},
             infer="sglang:tp=2"),
        # GLM-4.5: the router's e_score_correction_bias is a buffer, registered by attach
        dict(name="glm_fused_dp2", kind="glm4_moe", over=MOE, parallel={"dp": 2, "fused_experts": 1},
             infer="sglang:tp=2,fused_shared_experts=0"),
        # DeepSeek-V3: MLA (q/kv down and up projections, their norms), a dense first layer, a
        # shared expert, the router's e_score_correction_bias buffer
        dict(name="deepseek_fused_dp2", kind="deepseek_v3", over=MOE, parallel={"dp": 2, "fused_experts": 1},
             infer="megatron:tp=1,local_spec=1"),
    ],
    3: [
        dict(name="dp3_uneven", kind="qwen3", over={"num_hidden_layers": 2}, parallel={"dp": 3}, infer="sglang:tp=1"),
        # 4 experts over 3 ranks: torch.chunk gives 2, 2 and an empty shard
        dict(name="moe_fused_dp3", kind="qwen3_moe", over=MOE, parallel={"dp": 3, "fused_experts": 1},
             infer="sglang:tp=1"),
        # 4 experts over 3 ranks, MLA's rows unevenly
        dict(name="deepseek_fused_dp3", kind="deepseek_v3", over=MOE, parallel={"dp": 3, "fused_experts": 1},
             infer="megatron:tp=1,local_spec=1"),
    ],
    4: [
        dict(name="hsdp_2x2", kind="qwen3", over={"num_hidden_layers": 2}, parallel={"dp": 2, "replicate": 2},
             infer="sglang:tp=2"),
        dict(name="fsdp_tp_2x2", kind="qwen3", over={"num_hidden_layers": 2}, parallel={"dp": 2, "tp": 2},
             infer="sglang:tp=2"),
    ],
}
TF4_CASES = [
    dict(name="moe_per_expert_tf4", kind="qwen3_moe", over=MOE, parallel={"dp": 2}, infer="sglang:tp=2"),
]
TF4 = os.environ.get("AWEX_TRANSFORMERS4")
# AWEX_TRAIN_CASES=... keeps a subset (harness.selected)
WORLDS = {w: harness.selected(cs) for w, cs in WORLDS.items()}
TF4_CASES = harness.selected(TF4_CASES)


def spec(p: dict) -> str:
    return "fsdp:" + ",".join(f"{k}={v}" for k, v in p.items())


def run_world(world: int, cases: list[dict], out: str, env: dict | None = None) -> dict:
    gw = awex._testing.start_gateway()
    ctl = awex.Controller(gw)
    state, wire = {}, []
    for case in cases:
        model = hf_models.build(hf_models.config(case["kind"], **case.get("over", {})))
        canon = convert.hf_canonical(model)
        cfg = model.config.to_dict()
        cfg["torch_dtype"] = "float32"
        cfg["architectures"] = [type(model).__name__]
        hf = dict(cfg)
        if "num_local_experts" in hf:
            hf.setdefault("num_experts", hf["num_local_experts"])
        if "n_routed_experts" in hf:
            hf.setdefault("num_experts", hf["n_routed_experts"])
        pair = f"{case['name']}-update"
        ctl.connect(pair, model={k: v for k, v in cfg.items() if isinstance(v, (int, float, str, list, bool, type(None)))},
                    train=spec(case["parallel"]), infer=case["infer"], transport="tcp",
                    join_deadline_s=harness.TIMEOUT)
        state[case["name"]] = dict(case=case, hf=hf, canon=canon)
        wire.append(dict(name=case["name"], kind=case["kind"], over=case.get("over", {}),
                         parallel=case["parallel"], update_pair=pair))
    old = dict(os.environ)
    os.environ.pop("AWEX_WORKER_TRANSFORMERS4", None)
    os.environ.update(env or {})
    try:
        procs = harness.launch("fsdp_worker.py", world, gw, wire, out)
    finally:
        os.environ.clear()
        os.environ.update(old)
    try:
        for case in cases:
            name = case["name"]
            th = harness.Threads()
            ranks = 1 if case["infer"].startswith("megatron:") else int(case["infer"].split("tp=")[1].split(",")[0])
            state[name]["received"] = harness.receive(gw, f"{name}-update", ranks, th)
            harness.wait_ready(ctl, f"{name}-update", procs, out)
            ctl.update(1, timeout=harness.TIMEOUT, pair=f"{name}-update")
            th.wait()
            harness.check_alive(procs, out)
    finally:
        results = harness.finish(procs, out)
    for name in state:
        state[name]["ranks"] = [r.get(name, {"error": "no result"}) for r in results]
    return state


@pytest.fixture(scope="module")
def worlds():
    out = {}
    with harness.scratch_dir("fsdp") as d:
        for world, cases in WORLDS.items():
            if not cases:
                continue
            os.makedirs(os.path.join(d, str(world)))
            out.update(run_world(world, cases, os.path.join(d, str(world))))
        yield out


@pytest.fixture(scope="module")
def tf4():
    if not TF4 or not os.path.isdir(os.path.join(TF4, "transformers")):
        pytest.skip("AWEX_TRANSFORMERS4 does not name a folder with transformers 4")
    with harness.scratch_dir("fsdp-tf4") as d:
        yield run_world(2, TF4_CASES, d, {"AWEX_WORKER_TRANSFORMERS4": TF4})


NAMES = [c["name"] for cs in WORLDS.values() for c in cs] + [c["name"] for c in TF4_CASES]


def result(request, name: str) -> dict:
    if name not in NAMES:
        pytest.skip(f"AWEX_TRAIN_CASES leaves out case {name}")
    st = request.getfixturevalue("tf4" if name.endswith("_tf4") else "worlds")[name]
    for r, res in enumerate(st["ranks"]):
        assert "error" not in res, f"rank {r}: {res['error']}"
    return st


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_to_local_equals_awex_layout_byte_for_byte(request, name):
    st = result(request, name)
    for r, res in enumerate(st["ranks"]):
        real = [[n, s, {"float32": "f32"}[d], h] for n, s, d, h in res["real"]]
        assert [x[:3] for x in real] == [x[:3] for x in res["layout"]], f"rank {r}: names/shapes/dtypes"
        assert real == res["layout"], f"rank {r}: bytes differ"
    if name.startswith("moe_fused"):
        names = [n for n, *_ in st["ranks"][0]["real"]]
        assert "model.layers.0.mlp.experts.gate_up_proj" in names
    if name.startswith(("glm", "deepseek")):
        names = [n for n, *_ in st["ranks"][0]["real"]]
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    if name.startswith("deepseek"):
        names = [n for n, *_ in st["ranks"][0]["real"]]
        assert "model.layers.0.self_attn.kv_b_proj.weight" in names
    if name.endswith("_tf4"):
        names = [n for n, *_ in st["ranks"][0]["real"]]
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_update_from_real_dtensors_is_bit_exact(request, name):
    st = result(request, name)
    rewritten = {n: t * 1.5 + 0.25 for n, t in st["canon"].items()}
    if st["case"]["infer"].startswith("megatron:"):
        # one Megatron tp=1 reader, back to HF by the independent conversion
        (arrays,) = st["received"].values()
        got = convert.megatron_to_hf([{n: torch.from_numpy(a) for n, a in arrays.items()}], st["hf"], {})
        assert sorted(got) == sorted(rewritten)
        for n, t in got.items():
            assert t.numpy().tobytes() == rewritten[n].numpy().tobytes(), f"`{n}` differs"
        return
    infer = dict(kv.split("=") for kv in st["case"]["infer"].split(":")[1].split(","))
    tp, ep = int(infer["tp"]), int(infer.get("ep", 1))
    for r, arrays in st["received"].items():
        for n, a in arrays.items():
            want = convert.sglang_expected(n, list(a.shape), rewritten, st["hf"], tp, ep, r)
            assert want.shape == a.shape, (r, n)
            assert want.tobytes() == a.tobytes(), f"sglang rank {r} `{n}` differs"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_attach_reads_the_mesh_from_the_dtensors(request, name):
    st = result(request, name)
    want = {"dp": 1, "replicate": 1, "tp": 1}
    want.update(st["case"]["parallel"])
    for r, res in enumerate(st["ranks"]):
        d = res["detected"]
        assert d["backend"] == "fsdp" and d["rank"] == r
        assert {k: d["parallel"].get(k, 0) for k in want} == want
        assert res["live"] == d
