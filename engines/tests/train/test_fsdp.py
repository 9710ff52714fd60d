"""Conformance of awex's FSDP2 layout against real torch FSDP2 on CPU over gloo: for every case,
on every rank, each parameter's ``to_local()`` equals awex's layout for that rank byte for byte
(name, shape, dtype and the bytes placed from the checkpoint), the mesh is read back by
``Writer.attach``, and an update from the real DTensors (rewritten in place) into SGLang-layout
readers (for DeepSeek-V3, whose SGLang side is mapped apart, one Megatron tp=1 reader,
converted back to HF by ``convert.megatron_to_hf``) is bit-exact against an independent
conversion.

The families whose router transformers keeps in fp32 from 5.24 on (DeepSeek-V2/V3, Kimi-K2,
GLM-4.5) also run as users load them: a checkpoint written in bf16 (``model.to(torch.bfloat16)
.save_pretrained``: every tensor BF16, the router bias included) loaded with
``from_pretrained(dtype="auto")``, where the running release's own rules decide the dtypes; the
pair's training side names that release (``transformers=``), and ``attach`` refuses a pair laid
out for the other router rule, naming the routers. CI runs this file with the pinned
transformers (.ci/engines) and with the newest release (.ci/engines-newest).

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
        # as users load models: a bf16 checkpoint, from_pretrained(dtype="auto"), where the
        # release's own rules keep the routers (5.24 on) and the router bias in fp32
        dict(name="deepseek_bf16_dp2", kind="deepseek_v3", over=MOE, parallel={"dp": 2, "fused_experts": 1},
             infer="megatron:tp=1,local_spec=1", dtype="bf16"),
        # without q_lora_rank (Megatron-Core cannot build it): into SGLang-layout readers, MLA by heads
        dict(name="deepseek_no_q_lora_bf16_dp2", kind="deepseek_v3", over=dict(MOE, q_lora_rank=None),
             parallel={"dp": 2, "fused_experts": 1}, infer="sglang:tp=2,fused_shared_experts=0", dtype="bf16"),
        dict(name="kimi_bf16_dp2", kind="kimi_k2", over=MOE, parallel={"dp": 2, "fused_experts": 1},
             infer="megatron:tp=1,local_spec=1", dtype="bf16"),
        dict(name="deepseek_v2_bf16_dp2", kind="deepseek_v2", over=MOE, parallel={"dp": 2, "fused_experts": 1},
             infer="sglang:tp=2,fused_shared_experts=0", dtype="bf16"),
        dict(name="glm_bf16_dp2", kind="glm4_moe", over=MOE, parallel={"dp": 2, "fused_experts": 1},
             infer="sglang:tp=2,fused_shared_experts=0", dtype="bf16"),
    ],
    3: [
        dict(name="dp3_uneven", kind="qwen3", over={"num_hidden_layers": 2}, parallel={"dp": 3}, infer="sglang:tp=1"),
        # 4 experts over 3 ranks: torch.chunk gives 2, 2 and an empty shard
        dict(name="moe_fused_dp3", kind="qwen3_moe", over=MOE, parallel={"dp": 3, "fused_experts": 1},
             infer="sglang:tp=1"),
        # 4 experts over 3 ranks, MLA's rows unevenly
        dict(name="deepseek_fused_dp3", kind="deepseek_v3", over=MOE, parallel={"dp": 3, "fused_experts": 1},
             infer="megatron:tp=1,local_spec=1"),
        dict(name="deepseek_bf16_dp3", kind="deepseek_v3", over=MOE, parallel={"dp": 3, "fused_experts": 1},
             infer="megatron:tp=1,local_spec=1", dtype="bf16"),
    ],
    4: [
        dict(name="hsdp_2x2", kind="qwen3", over={"num_hidden_layers": 2}, parallel={"dp": 2, "replicate": 2},
             infer="sglang:tp=2"),
        dict(name="glm_bf16_hsdp_2x2", kind="glm4_moe", over=MOE, parallel={"dp": 2, "replicate": 2,
             "fused_experts": 1}, infer="sglang:tp=2,fused_shared_experts=0", dtype="bf16"),
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


#: The running transformers release as the fsdp key `transformers` names it (major * 100 + minor).
RELEASE = (lambda v: int(v[0]) * 100 + int(v[1]))(__import__("transformers").__version__.split("."))
#: The families whose router transformers keeps in fp32 from 5.24 on (and in the model's dtype before)
FP32_ROUTER_KINDS = ("deepseek_v3", "kimi_k2", "deepseek_v2", "glm4_moe")


def spec(p: dict) -> str:
    return "fsdp:" + ",".join(f"{k}={v}" for k, v in p.items())


def other_release(release: int) -> int:
    """A release whose router dtype rule is the other one: the pair a live model must refuse."""
    return 519 if release >= 524 else 524


def load(case: dict, scratch: str):
    """The case's HF model as its workers load it, and the bf16 checkpoint they load it from
    (``None``: built in fp32)."""
    model = hf_models.build(hf_models.config(case["kind"], **case.get("over", {})))
    if case.get("dtype") != "bf16":
        return model, None
    path = hf_models.save_bf16(model, os.path.join(scratch, f"ckpt-{case['name']}"))
    return hf_models.load_auto(path), path


def run_world(world: int, cases: list[dict], out: str, env: dict | None = None) -> dict:
    gw = awex._testing.start_gateway()
    ctl = awex.Controller(gw)
    state, wire = {}, []
    for case in cases:
        model, ckpt = load(case, out)
        canon = convert.hf_canonical(model)
        cfg = model.config.to_dict()
        cfg["torch_dtype"] = cfg["dtype"] = "bfloat16" if case.get("dtype") == "bf16" else "float32"
        cfg["architectures"] = [type(model).__name__]
        hf = dict(cfg)
        if "num_local_experts" in hf:
            hf.setdefault("num_experts", hf["num_local_experts"])
        if "n_routed_experts" in hf:
            hf.setdefault("num_experts", hf["n_routed_experts"])
        pair = f"{case['name']}-update"
        plain = {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, list, bool, type(None)))}
        parallel = dict(case["parallel"])
        other = None
        if case.get("dtype") == "bf16":
            # the layout of the release in use; and one of the other release's router rule
            parallel["transformers"] = RELEASE
            if case["kind"] in FP32_ROUTER_KINDS:
                other = f"{case['name']}-other-release"
                ctl.connect(other, model=plain, train=spec(dict(case["parallel"], transformers=other_release(RELEASE))),
                            infer=case["infer"], transport="tcp", join_deadline_s=harness.TIMEOUT)
        ctl.connect(pair, model=plain, train=spec(parallel), infer=case["infer"], transport="tcp",
                    join_deadline_s=harness.TIMEOUT)
        state[case["name"]] = dict(case=case, hf=hf, canon=canon)
        wire.append(dict(name=case["name"], kind=case["kind"], over=case.get("over", {}),
                         parallel=case["parallel"], update_pair=pair, other_release_pair=other,
                         bf16_checkpoint=ckpt))
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
        why = (f"AWEX_TRANSFORMERS4={TF4!r} does not name a folder with transformers 4 "
               "(engines/tf4-pkgs.sh VENV builds it)")
        if os.environ.get("AWEX_REQUIRE_TF4", "") not in ("", "0"):
            pytest.fail(why)  # .ci/engines: the folder is an install step, not an option
        pytest.skip(why)
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
        real = [[n, s, {"float32": "f32", "bfloat16": "bf16"}[d], h] for n, s, d, h in res["real"]]
        assert [x[:3] for x in real] == [x[:3] for x in res["layout"]], f"rank {r}: names/shapes/dtypes"
        assert real == res["layout"], f"rank {r}: bytes differ"
    if name.startswith("moe_fused"):
        names = [n for n, *_ in st["ranks"][0]["real"]]
        assert "model.layers.0.mlp.experts.gate_up_proj" in names
    if name.startswith(("glm", "deepseek", "kimi")) and not name.startswith("deepseek_v2"):
        names = [n for n, *_ in st["ranks"][0]["real"]]
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    if name.startswith("deepseek"):
        names = [n for n, *_ in st["ranks"][0]["real"]]
        assert "model.layers.0.self_attn.kv_b_proj.weight" in names
    if name.endswith("_tf4"):
        names = [n for n, *_ in st["ranks"][0]["real"]]
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def as_torch(a) -> torch.Tensor:
    """A received numpy array as a torch tensor (ml_dtypes' bfloat16 included)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view("int16")).view(torch.bfloat16)
    return torch.from_numpy(a)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_update_from_real_dtensors_is_bit_exact(request, name):
    """The rewritten live tensors (``t * 1.5 + 0.25`` in place, in each tensor's own dtype: a
    bf16 model's fp32 routers stay fp32) reach the readers as the engines' own loaders would
    take them: converted to the dtype the reader holds with torch's rounding (``copy_``)."""
    st = result(request, name)
    rewritten = {n: t.mul(1.5).add(0.25) for n, t in st["canon"].items()}
    if st["case"]["infer"].startswith("megatron:"):
        # one Megatron tp=1 reader, back to HF by the independent conversion
        (arrays,) = st["received"].values()
        got = convert.megatron_to_hf([{n: as_torch(a) for n, a in arrays.items()}], st["hf"], {})
        assert sorted(got) == sorted(rewritten)
        for n, t in got.items():
            assert raw(t) == raw(rewritten[n].to(t.dtype)), f"`{n}` differs"
        return
    infer = dict(kv.split("=") for kv in st["case"]["infer"].split(":")[1].split(","))
    tp, ep = int(infer["tp"]), int(infer.get("ep", 1))
    # every value of a bf16 or fp32 tensor is exact in fp32: the expected values in fp32, then
    # in the reader's dtype
    wide = {n: t.float() for n, t in rewritten.items()}
    for r, arrays in st["received"].items():
        for n, a in arrays.items():
            want = torch.from_numpy(convert.sglang_expected(n, list(a.shape), wide, st["hf"], tp, ep, r))
            got = as_torch(a)
            assert tuple(want.shape) == a.shape, (r, n)
            assert raw(want.to(got.dtype)) == raw(got), f"sglang rank {r} `{n}` differs"


BF16_NAMES = [n for n in NAMES if "_bf16" in n]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", BF16_NAMES)
def test_bf16_checkpoint_loads_with_the_release_dtype_rules_and_attach_refuses_the_other_release(request, name):
    """A bf16 checkpoint loaded with ``dtype="auto"``: the router bias fp32 under every release,
    the router fp32 from transformers 5.24 on (bf16 before), everything else bf16; ``attach``
    reads the release's rule from the live routers and refuses, naming the routers, a pair laid
    out for the other one."""
    st = result(request, name)
    kind = st["case"]["kind"]
    fp32_router = RELEASE >= 524 and kind in FP32_ROUTER_KINDS
    for r, res in enumerate(st["ranks"]):
        dtypes = {n: d for n, _, d, _ in res["real"]}
        routers = [n for n in dtypes if n.endswith(".mlp.gate.weight")]
        assert routers, dtypes
        for n, d in dtypes.items():
            if n in routers:
                want = "float32" if fp32_router else "bfloat16"
            elif n.endswith("e_score_correction_bias"):
                want = "float32"
            else:
                want = "bfloat16"
            assert d == want, f"rank {r} `{n}` is {d} under transformers {RELEASE}"
        got = res["detected"]["parallel"].get("transformers")
        assert got == (524 if fp32_router else None), res["detected"]
        if kind in FP32_ROUTER_KINDS:
            msg = res["refused"]
            assert msg and msg != "accepted", msg
            assert f"of this rank disagree" in msg and f"pair `{name}-other-release`" in msg, msg
            for n in routers:
                assert f"`{n}` is {'float32' if fp32_router else 'bfloat16'}" in msg, msg
            assert "e_score_correction_bias`" not in msg and ".mlp.experts." not in msg, msg


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
