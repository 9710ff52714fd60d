"""Conformance of awex's Megatron-Core layout against the real Megatron-Core 0.19.2 on CPU over
gloo (local layer spec, fp32): for every case, on every rank,

(a) the real model's parameter names, shapes and dtypes equal awex's layout (the receiving
    layout and the layout ``Writer.attach`` registers against);
(b) the real model, loaded with the bytes awex delivers from an HF checkpoint (a one-rank
    ``fsdp:dp=1`` Writer of the checkpoint's tensors; the real parameters registered as the
    readers' tensors), gives the HF transformers model's logits within fp32 tolerance;
(c) an update from the real parameters (rewritten in place, registered by ``Writer.attach``)
    into SGLang-layout readers (for DeepSeek-V3, whose SGLang side is mapped apart, one
    Megatron tp=1 reader, converted back to HF by ``convert.megatron_to_hf``) is bit-exact
    against an independent conversion, and the
    conversion of the rewritten parameters back to HF is bit-exact against the checkpoint.

DeepSeek-V3 runs Megatron-Core's multi-latent attention with the local spec and a parameter-free
core attention in place of the local ``DotProductAttention``, which refuses MLA's head sizes
(``megatron_cpu.MlaCoreAttention``; it holds no weight, so every parameter is Megatron's own).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
awex = pytest.importorskip("awex")
import awex._testing  # noqa: E402

import convert  # noqa: E402
import harness  # noqa: E402
import hf_models  # noqa: E402

TOKENS = [3, 17, 250, 42, 7, 299, 128, 64, 5, 11]

WORLD2 = [
    dict(name="tp2", kind="qwen3", parallel={"tp": 2}, infer="sglang:tp=2", wrong={"dp": 2}),
    dict(name="pp2_vpp2", kind="qwen3", parallel={"pp": 2, "vpp": 2}, infer="sglang:tp=2"),
    dict(name="pp2_uneven_tied", kind="qwen3", over={"num_hidden_layers": 3, "tie_word_embeddings": True},
         parallel={"pp": 2, "first_stage_layers": 1, "last_stage_layers": 2}, infer="sglang:tp=1"),
    dict(name="qwen2_tp2", kind="qwen2", parallel={"tp": 2}, infer="sglang:tp=2"),
    dict(name="moe_ep2", kind="qwen3_moe", over={"num_hidden_layers": 2}, parallel={"dp": 2, "ep": 2},
         infer="sglang:tp=2,ep=2"),
    # GLM-4.5: q/k/v biases, q/k norms, partial rotary, a dense first layer, a shared expert and
    # the router's expert_bias buffer
    dict(name="glm_tp2", kind="glm4_moe", over={"num_hidden_layers": 2}, parallel={"tp": 2},
         infer="sglang:tp=2,fused_shared_experts=0"),
    dict(name="glm_ep2", kind="glm4_moe", over={"num_hidden_layers": 2}, parallel={"dp": 2, "ep": 2},
         infer="sglang:tp=2,ep=2"),
    # ---- DeepSeek-V3: MLA with q_lora_rank (Megatron-Core's local-spec down projections split
    # over tp), a dense first layer, a shared expert, the router's expert_bias buffer; the update
    # goes into one Megatron tp=1 reader
    dict(name="deepseek_tp2", kind="deepseek_v3", over={"num_hidden_layers": 2}, parallel={"tp": 2},
         infer="megatron:tp=1,local_spec=1"),
    dict(name="deepseek_pp2", kind="deepseek_v3", over={"num_hidden_layers": 2}, parallel={"pp": 2},
         infer="megatron:tp=1,local_spec=1"),
    dict(name="deepseek_ep2", kind="deepseek_v3", over={"num_hidden_layers": 2}, parallel={"dp": 2, "ep": 2},
         infer="megatron:tp=1,local_spec=1"),
]
WORLD4 = [
    dict(name="tp4_kv2", kind="qwen3", over={"num_hidden_layers": 2}, parallel={"tp": 4}, infer="sglang:tp=4"),
    dict(name="tp2_dp2", kind="qwen3", over={"num_hidden_layers": 2}, parallel={"tp": 2, "dp": 2},
         infer="sglang:tp=2"),
    dict(name="moe_tp2_ep2_etp2", kind="qwen3_moe", over={"num_hidden_layers": 2},
         parallel={"tp": 2, "dp": 2, "ep": 2, "etp": 2}, infer="sglang:tp=2"),
]
# AWEX_TRAIN_CASES=tp2,dp2 keeps a subset (harness.selected)
WORLD2, WORLD4 = harness.selected(WORLD2), harness.selected(WORLD4)
DTYPES = {"float32": "f32"}


def spec(parallel: dict) -> str:
    return "megatron:" + ",".join(f"{k}={v}" for k, v in parallel.items()) + ",local_spec=1"


def run_world(world: int, cases: list[dict], out: str) -> dict:
    gw = awex._testing.start_gateway()
    ctl = awex.Controller(gw)
    state = {}
    wire = []
    for case in cases:
        d = os.path.join(out, case["name"])
        model = hf_models.build(hf_models.config(case["kind"], **case.get("over", {})))
        canon = hf_models.write_checkpoint(model, d)
        hf = json.load(open(os.path.join(d, "config.json")))
        if "num_local_experts" in hf:  # transformers 5 writes Qwen3-MoE's num_experts under this name
            hf.setdefault("num_experts", hf["num_local_experts"])
        if "n_routed_experts" in hf:  # GLM-4.5's name for it
            hf.setdefault("num_experts", hf["n_routed_experts"])
        load, upd, wrong = (f"{case['name']}-{x}" for x in ("load", "update", "wrong"))
        ctl.connect(load, model=d, train="fsdp:dp=1", infer=spec(case["parallel"]), transport="shm", join_deadline_s=harness.TIMEOUT)
        ctl.connect(upd, model=d, train=spec(case["parallel"]), infer=case["infer"], transport="tcp", join_deadline_s=harness.TIMEOUT)
        if case.get("wrong"):
            ctl.connect(wrong, model=d, train=spec(case["wrong"]), infer=case["infer"], transport="tcp")
        state[case["name"]] = dict(case=case, hf=hf, canon=canon, logits=hf_models.logits(model, TOKENS), out=out)
        wire.append(dict(name=case["name"], parallel=case["parallel"], hf=hf, tokens=TOKENS,
                         load_pair=load, update_pair=upd, wrong_pair=wrong if case.get("wrong") else None))
    procs = harness.launch("megatron_worker.py", world, gw, wire, out)
    try:
        for case in cases:
            name = case["name"]
            th = harness.Threads()
            th.start(lambda: harness.send_canonical(gw, f"{name}-load", state[name]["canon"]))
            harness.wait_ready(ctl, f"{name}-load", procs, out)
            ctl.update(1, timeout=harness.TIMEOUT, pair=f"{name}-load")
            th.wait()
            infer_ranks = infer_world(case["infer"])
            th = harness.Threads()
            state[name]["received"] = harness.receive(gw, f"{name}-update", infer_ranks, th)
            harness.wait_ready(ctl, f"{name}-update", procs, out)
            ctl.update(1, timeout=harness.TIMEOUT, pair=f"{name}-update")
            th.wait()
            harness.check_alive(procs, out)
    finally:
        ranks = harness.finish(procs, out)
    for name in state:
        state[name]["ranks"] = [r.get(name, {"error": "no result"}) for r in ranks]
    return state


def infer_world(infer: str) -> int:
    """The ranks of an update pair's receiving side: SGLang's tp, or 1 for a Megatron tp=1 side."""
    if infer.startswith("megatron:"):
        return 1
    return int(infer.split("tp=")[1].split(",")[0])


@pytest.fixture(scope="module")
def world2():
    with harness.scratch_dir("megatron2") as out:
        yield run_world(2, WORLD2, out)


@pytest.fixture(scope="module")
def world4():
    with harness.scratch_dir("megatron4") as out:
        yield run_world(4, WORLD4, out)


def result(request, name: str) -> dict:
    if not any(c["name"] == name for c in WORLD2 + WORLD4):
        pytest.skip(f"AWEX_TRAIN_CASES leaves out case {name}")
    world = "world2" if any(c["name"] == name for c in WORLD2) else "world4"
    st = request.getfixturevalue(world)[name]
    for r, res in enumerate(st["ranks"]):
        assert "error" not in res, f"rank {r}: {res['error']}"
    return st


NAMES = [c["name"] for c in WORLD2 + WORLD4]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_real_parameters_equal_awex_layout(request, name):
    st = result(request, name)
    for r, res in enumerate(st["ranks"]):
        real = [[n, s, DTYPES[d]] for n, s, d in res["real"]]
        assert real == res["load_layout"], f"rank {r}: the receiving layout differs from the real model"
        assert real == res["attach_layout"], f"rank {r}: the attached layout differs from the real model"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_delivered_by_awex_gives_hf_logits(request, name):
    st = result(request, name)
    got = torch.load(os.path.join(st["out"], f"{name}.logits.pt"))
    torch.testing.assert_close(got, st["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_update_from_real_parameters_is_bit_exact(request, name):
    st = result(request, name)
    saved = [torch.load(os.path.join(st["out"], f"{name}.rank{r}.pt")) for r in range(len(st["ranks"]))]
    p = dict(st["case"]["parallel"])
    rebuilt = convert.megatron_to_hf(saved, st["hf"], p)
    # the real parameters held the checkpoint exactly: rewritten, they are the checkpoint * 1.5 + 0.25
    assert sorted(rebuilt) == sorted(st["canon"])
    for n, t in st["canon"].items():
        assert torch.equal(rebuilt[n], t * 1.5 + 0.25), n
    if st["case"]["infer"].startswith("megatron:"):
        # one Megatron tp=1 reader: back to HF by the same independent conversion
        (arrays,) = st["received"].values()
        got = convert.megatron_to_hf([{n: torch.from_numpy(a) for n, a in arrays.items()}], st["hf"], {})
        assert sorted(got) == sorted(rebuilt)
        for n, t in got.items():
            assert t.numpy().tobytes() == rebuilt[n].numpy().tobytes(), f"`{n}` differs"
        return
    infer = dict(kv.split("=") for kv in st["case"]["infer"].split(":")[1].split(","))
    tp, ep = int(infer["tp"]), int(infer.get("ep", 1))
    for r, arrays in st["received"].items():
        for n, a in arrays.items():
            want = convert.sglang_expected(n, list(a.shape), rebuilt, st["hf"], tp, ep, r)
            assert want.shape == a.shape, (r, n)
            assert want.tobytes() == a.tobytes(), f"sglang rank {r} `{n}` differs"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_attach_reads_the_parallel_config_from_the_live_job(request, name):
    st = result(request, name)
    p = st["case"]["parallel"]
    for r, res in enumerate(st["ranks"]):
        d = res["detected"]
        assert d["backend"] == "megatron" and d["rank"] == r and d["layer_spec"] == "local"
        for k, v in p.items():
            assert d["parallel"][k] == v, (r, k)
        assert d["parallel"]["local_spec"] == 1
        assert res["live"] == d


@pytest.mark.timeout(600)
def test_attach_refuses_a_pair_that_disagrees_with_the_live_job(request):
    st = result(request, "tp2")
    for res in st["ranks"]:
        msg = res["wrong"]
        assert msg is not None, "attach accepted a pair with dp=2 for a tp=2 job"
        assert "the live megatron job disagrees with pair `tp2-wrong`" in msg
        assert "dp=1 here but dp=2 in the pair; tp=2 here but tp=1 in the pair" in msg
        assert 'connect the pair with train="megatron:tp=2,pp=1,dp=1,cp=1,ep=1,etp=2,vpp=1,local_spec=1"' in msg


@pytest.mark.timeout(600)
def test_detect_sees_through_ddp_and_float16module(request):
    st = result(request, "tp2")
    for r, res in enumerate(st["ranks"]):
        assert res["ddp_live"] == res["detected"]
        live = res["wrapped_live"]
        assert live["backend"] == "megatron" and live["rank"] == r
        assert live["dtype"] == "bfloat16"
        assert live["parallel"] == res["detected"]["parallel"]


@pytest.mark.timeout(600)
def test_distributed_optimizer_buffers_are_one_allocation_each(request):
    """Megatron DDP with the distributed optimizer: the parameters live in its contiguous
    ``buffer.param_data``; awex sees one allocation (one cuda-ipc handle) per buffer."""
    st = result(request, "tp2")
    for res in st["ranks"]:
        b = res["buffers"]
        assert b["buffers"], "DDP with the distributed optimizer has parameter buffers"
        assert b["allocations"] == b["buffers"]
        assert b["allocation_bytes"] == b["buffer_bytes"]
        assert sum(b["names_per_allocation"]) == b["params"] > len(b["buffers"])


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_hf_to_megatron_inverts_megatron_to_hf(kind):
    """The live test's Megatron trainer loads the served model's checkpoint with
    ``convert.hf_to_megatron``; ``megatron_to_hf`` (checked against the real model above) takes
    its tp 2 shards back to the checkpoint bit for bit, the padded vocabulary rows are zero."""
    import megatron_cpu

    cfg = hf_models.config(kind, num_hidden_layers=2)
    canon = convert.hf_canonical(hf_models.build(cfg))
    hf = cfg.to_dict()
    padded = megatron_cpu.padded_vocab(hf["vocab_size"], 2)
    shards = [convert.hf_to_megatron(canon, hf, 2, r, padded) for r in range(2)]
    assert shards[0]["embedding.word_embeddings.weight"].shape == (padded // 2, hf["hidden_size"])
    assert not shards[1]["output_layer.weight"][hf["vocab_size"] - padded // 2 :].any()
    rebuilt = convert.megatron_to_hf(shards, hf, {"tp": 2})
    assert sorted(rebuilt) == sorted(canon)
    for n, t in canon.items():
        assert torch.equal(rebuilt[n], t), n


def test_megatron_core_cannot_build_gated_delta_net_on_cpu():
    """Why awex-megatron refuses Qwen3-Next / Qwen3.5 (layout.rs ``hybrid_unmapped``): each of
    Megatron-Core 0.19.2's ways to Gated DeltaNet fails here, and its local norm cannot express
    the checkpoint's zero-centred norms. If one of these starts to pass (FLA or Transformer Engine
    installed, a local in_proj), the refusal is out of date."""
    import dataclasses

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as variants
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules, common
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    # a Qwen3-Next-shaped config: every 4th layer full attention (gated), the rest Gated DeltaNet
    cfg = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, attention_output_gate=True,
        transformer_impl="local", use_cpu_initialization=True)
    # experimental_attention_variant_module_specs.py `_get_backend_spec_provider`
    with pytest.raises(AssertionError, match="only supports transformer engine"):
        variants.get_transformer_block_with_experimental_attention_variant_spec(cfg)
    # the local backend has no fused norm + linear, which the spec makes GatedDeltaNet's in_proj
    gdn = variants.get_gated_delta_net_module_spec(cfg, backend=LocalSpecProvider())
    assert gdn.module is GatedDeltaNet and gdn.submodules.in_proj is None
    # ssm/gated_delta_net/common.py `_GDNBase.__init__`, before anything else
    assert not common.HAVE_FLA
    with pytest.raises(ImportError, match="FLA is not installed"):
        GatedDeltaNet(cfg, GatedDeltaNetSubmodules(), pg_collection=None)
    # transformer/torch_norm.py `WrappedTorchNorm`: no zero-centred gamma (Qwen3-Next's 1 + w)
    with pytest.raises(AssertionError, match="zero_centered_gamma not supported"):
        WrappedTorchNorm(dataclasses.replace(cfg, layernorm_zero_centered_gamma=True), 16)
