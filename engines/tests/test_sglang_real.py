"""SGLang 0.5.23's real model classes on CPU, one process per TP rank, fed by awex.

For every case: SGLang's own ``load_weights`` of a canonical checkpoint (a) and
``awex.sglang.receive`` on a server model loaded from another version, fed by awex Writers in
Megatron and FSDP layouts over shm and tcp (b), must leave every parameter byte-identical,
padding included; for two consecutive versions through one process-wide Reader per pair.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

import awex
import checkpoints
import rank_jobs
from conftest import (MLA, Ranks, assert_mla_derived, drive, fill, fill_bf16, free_port, pair_name, rank_context,
                      sglang_infer)

HERE = os.path.dirname(os.path.abspath(__file__))

# arch, tied, tp, ep, [(training layout, transport)]
CASES = [
    ("Qwen3ForCausalLM", False, 1, 1, [("megatron:tp=1", "shm"), ("fsdp:dp=2", "tcp")]),
    ("Qwen3ForCausalLM", True, 2, 1, [("megatron:tp=2", "tcp"), ("fsdp:dp=2", "shm")]),
    # 4 TP ranks over 2 KV heads: every KV head is held by two ranks
    ("Qwen3ForCausalLM", False, 4, 1, [("megatron:tp=2,pp=2", "shm"), ("fsdp:dp=2", "tcp")]),
    ("Qwen2ForCausalLM", False, 2, 1, [("megatron:tp=2", "shm"), ("fsdp:dp=1", "tcp")]),
    ("LlamaForCausalLM", True, 2, 1, [("megatron:tp=2", "tcp"), ("fsdp:dp=2", "shm")]),
    ("Qwen3MoeForCausalLM", False, 2, 1, [("megatron:tp=2", "shm"), ("fsdp:dp=2", "tcp")]),
    ("Qwen3MoeForCausalLM", True, 2, 2, [("megatron:tp=1,dp=2,ep=2", "tcp"), ("fsdp:dp=2", "shm")]),
    # GLM-4.5: q/k/v biases, q/k norms, a dense first layer, a shared expert, the fp32 router
    # and its fp32 bias
    ("Glm4MoeForCausalLM", False, 1, 1, [("megatron:tp=1", "shm"), ("fsdp:dp=2", "tcp")]),
    ("Glm4MoeForCausalLM", False, 2, 1, [("megatron:tp=2", "tcp"), ("fsdp:tp=2", "shm")]),
    ("Glm4MoeForCausalLM", False, 2, 2, [("megatron:tp=1,dp=2,ep=2", "tcp"),
                                         ("fsdp:dp=2,fused_experts=1", "shm")]),
    # the shared expert fused into the routed experts, as SGLang does at ep=1 on an H100/H200
    ("Glm4MoeForCausalLM", False, 1, 1, [("fsdp:dp=1", "shm")], "fused"),
    ("Glm4MoeForCausalLM", False, 2, 1, [("megatron:tp=2", "tcp"), ("fsdp:dp=2", "shm")], "fused"),
    # ---- DeepSeek-V3 (MLA): fused_qkv_a_proj_with_mqa, q_b_proj / kv_b_proj over tp, the w_kc /
    # w_vc post_load_weights derives from kv_b_proj, a dense first layer, a shared expert (apart
    # and fused), the fp32 router bias; and MLA without q_lora_rank (q_proj, kv_a_proj_with_mqa)
    ("DeepseekV3ForCausalLM", False, 1, 1, [("fsdp:dp=1", "shm"), ("megatron:tp=1", "tcp")]),
    ("DeepseekV3ForCausalLM", False, 2, 1, [("megatron:tp=2", "tcp"), ("fsdp:dp=2", "shm")]),
    ("DeepseekV3ForCausalLM", False, 2, 2, [("megatron:tp=1,dp=2,ep=2", "tcp"), ("fsdp:dp=2", "shm")]),
    ("DeepseekV3ForCausalLM", False, 1, 1, [("fsdp:dp=1", "shm")], "fused"),
    ("DeepseekV3ForCausalLM", False, 2, 1, [("fsdp:dp=2", "tcp")], "fused"),
    ("DeepseekV3ForCausalLM-no-q-lora", False, 2, 1, [("fsdp:dp=2", "shm")]),
    # DeepSeek-V2 (V2-Lite's shape): no q_lora_rank, two shared experts, no router bias
    ("DeepseekV2ForCausalLM", False, 2, 1, [("fsdp:dp=2", "shm")]),
]

def _id(case) -> str:
    arch, tied, tp, ep, _, *fused = case
    return f"{arch}-{'tied' if tied else 'untied'}-tp{tp}-ep{ep}{'-fused' if fused else ''}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_receive_matches_sglang_load(case, gateway, ckpt_dir) -> None:
    arch, tied, tp, ep, pairs, *fused = case
    ckpts = ckpt_dir(arch, tied)
    ctl = awex.Controller(gateway)
    names, refused = [], []
    for train, transport in pairs:
        name = pair_name(f"{arch[:5]}-{transport}")
        infer = sglang_infer(arch, tp, ep, bool(fused))
        try:
            ctl.connect(name, model=ckpts[0], train=train, infer=infer, transport=transport,
                        join_deadline_s=600)
        except Exception as e:  # noqa: BLE001 (the message decides)
            # the inference side is what this test checks: a training layout that does not map
            # the family yet (DeepSeek-V3's MLA on Megatron/FSDP comes on another branch) leaves
            # its pair out, and the case is skipped, naming the refusals, when none is left
            if "which awex does not map" not in str(e):
                raise
            refused.append(f"{train}: {e}")
            continue
        names.append(name)
    if not names:
        pytest.skip("no training layout maps this model yet: " + "; ".join(refused))
    pairs = [p for p in pairs if not any(r.startswith(f"{p[0]}: ") for r in refused)]
    # SGLang 0.5.23's Qwen3MoeForCausalLM ignores tie_word_embeddings: it always has its own
    # lm_head, which its load_weights leaves unloaded for a tied checkpoint (no lm_head.weight);
    # awex writes the tied embedding there. Pinned below instead of compared.
    untied_head = arch == "Qwen3MoeForCausalLM" and tied
    ranks = Ranks(tp, rank_jobs.receive_job, tp, ep, free_port(), ckpts, gateway, names, [1, 2], untied_head,
                  checkpoints.CLASS_OF.get(arch, arch) if fused else None)
    try:
        canon = {v: checkpoints.tensors(ckpts[v]) for v in (1, 2)}
        for name in names:
            updates = drive(gateway, name, canon, [1, 2])
            assert [u["state"] for u in updates] == ["committed", "committed"]
            assert all(u["bytes"]["inference"] > 0 for u in updates)
            ctl.disconnect(name)
    finally:
        results = ranks.results()
    for r, res in enumerate(results):
        assert res["diffs"] == [], "\n".join(res["diffs"][:20])
        assert res["checked"] == 2 * len(pairs), res
        # the warm-up call returns at once (the join runs in the background)
        assert max(res["warmup_s"]) < 5.0, res["warmup_s"]
    assert len({res["params"] for res in results}) == 1
    if arch in MLA:
        assert_mla_derived(results)
    if untied_head:
        for res in results:
            # awex's lm_head is the embedding, byte for byte; SGLang's own load is not
            assert res["head_is_embedding"] == [True] * 2 * len(pairs), res["head_is_embedding"]
            assert res["sglang_head_is_embedding"] is False


#: A bf16 trainer on transformers >= 5.24 keeps DeepSeek-V2/V3's and GLM-4.5's routers in fp32
#: (``fsdp:...,transformers=524``); its checkpoint then holds fp32 values there that bf16 cannot
#: hold. SGLang's own load of such values (a bf16 server on a checkpoint of fp32 tensors) narrows
#: them into its bf16 parameters (DeepSeek's gate) and keeps them in its fp32 ones (the router
#: bias, GLM-4.5's gate): awex's sender must convert exactly so. The 5.19 layout (bf16 routers,
#: rounded by torch on the trainer) must land the same bytes in DeepSeek's bf16 gate.
ROUTER_CASES = [
    ("DeepseekV3ForCausalLM", 2, [("fsdp:dp=2,transformers=524", "shm"), ("fsdp:dp=2", "tcp")]),
    ("DeepseekV2ForCausalLM", 2, [("fsdp:dp=2,fused_experts=1,transformers=525", "tcp")]),
    ("Glm4MoeForCausalLM", 2, [("fsdp:dp=2,transformers=524", "shm")]),
]


@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: c[0])
def test_fp32_routers_of_a_bf16_trainer_land_as_sglangs_own_load_narrows_them(case, gateway, ckpt_dir) -> None:
    import torch

    arch, tp, pairs = case
    ckpts = ckpt_dir(arch, False, "bfloat16")
    ctl = awex.Controller(gateway)
    names = []
    for train, transport in pairs:
        name = pair_name(f"{arch[:5]}-router-{transport}")
        ctl.connect(name, model=ckpts[0], train=train, infer=sglang_infer(arch, tp, 1), transport=transport,
                    join_deadline_s=600)
        names.append(name)
    ranks = Ranks(tp, rank_jobs.receive_job, tp, 1, free_port(), ckpts, gateway, names, [1, 2], False, None,
                  "bfloat16")
    try:
        canon = {v: {n: torch.from_numpy(a) for n, a in checkpoints.tensors(ckpts[v]).items()} for v in (1, 2)}
        for name, (train, _) in zip(names, pairs):
            w = awex.Writer(gateway, name, 0)
            try:
                router = [t["dtype"] for t in w.layout() if t["name"].endswith(".mlp.gate.weight")]
            finally:
                w.close()
            assert router and set(router) == {"f32" if "transformers=52" in train else "bf16"}, (train, router)
            updates = drive(gateway, name, canon, [1, 2], fill_rank=fill_bf16)
            assert [u["state"] for u in updates] == ["committed", "committed"]
            ctl.disconnect(name)
    finally:
        results = ranks.results()
    for res in results:
        assert res["diffs"] == [], "\n".join(res["diffs"][:20])
        assert res["checked"] == 2 * len(pairs), res
    if arch in MLA:
        assert_mla_derived(results)


def test_a_bf16_router_bias_checkpoint_is_widened_as_sglangs_own_load_widens_it(ckpt_dir, tmp_path) -> None:
    """A DeepSeek-V3 checkpoint as ``model.to(torch.bfloat16).save_pretrained`` writes it: every
    tensor BF16, the router's ``e_score_correction_bias`` (fp32 in the model) included. awex
    (``awex-cli demo --model DIR``: the checkpoint is version 0, every rank's tensors dumped)
    opens it and delivers the bias widened; the bytes equal SGLang's own load of the same
    directory into its fp32 parameter, and torch's widening."""
    import subprocess

    import torch
    from safetensors.torch import load_file, save_file

    cli = os.path.join(os.path.dirname(os.path.dirname(HERE)), "target", "debug", "awex-cli")
    assert os.path.exists(cli), f"{cli} is missing: cargo build -p awex-cli (.ci/engines builds it)"
    src = ckpt_dir("DeepseekV3ForCausalLM", False)[1]
    ckpt = str(tmp_path / "bf16")
    os.makedirs(ckpt)
    tensors = {n: t.to(torch.bfloat16) for n, t in load_file(os.path.join(src, "model.safetensors")).items()}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert tensors[bias].dtype == torch.bfloat16
    save_file(tensors, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(cfg, f)
    dump = str(tmp_path / "dump")
    run = subprocess.run([cli, "demo", "--model", ckpt, "--train", "fsdp:dp=1", "--infer",
                          "sglang:tp=1,fused_shared_experts=0", "--transport", "tcp", "--updates", "1",
                          "--dump-dir", dump, "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["verified"] is True
    # version 0 is the checkpoint itself: what the SGLang rank received
    got = load_file(os.path.join(dump, "infer", "engine-0", "rank-0.safetensors"))
    (res,) = Ranks(1, rank_jobs.tensors_job, 1, 1, free_port(), ckpt, "bfloat16", [bias]).results()
    sglang_dtype, sglang_bytes = res[bias]
    assert sglang_dtype == "torch.float32"
    assert got[bias].dtype == torch.float32
    raw = got[bias].contiguous().view(torch.uint8).numpy().tobytes()
    assert raw == sglang_bytes
    assert raw == tensors[bias].float().view(torch.uint8).numpy().tobytes()


def test_loader_faults(gateway, ckpt_dir) -> None:
    """Bad configuration, a moved data pointer (Reader recreated, bytes land in the new
    storage) and a changed shape (refused, the version fails naming the rank)."""
    ckpts = ckpt_dir("Qwen3ForCausalLM", False)
    ctl = awex.Controller(gateway)
    name = pair_name("faults")
    ctl.connect(name, model=ckpts[0], train="fsdp:dp=1", infer="sglang:tp=2", transport="shm", join_deadline_s=600)
    returned = rank_context().Queue()
    ranks = Ranks(2, rank_jobs.faults_job, 2, free_port(), ckpts, gateway, name, returned)
    canon = {v: checkpoints.tensors(ckpts[v]) for v in (1, 2)}
    canon[3] = canon[1]
    w = awex.Writer(gateway, name, 0)
    failure = None
    try:
        arrays = fill(w.layout(), canon[1])
        w.register(list(arrays.items()))
        w.join(timeout=120)
        for v in (1, 2, 3):
            fill(w.layout(), canon[v], out=arrays)
            with ThreadPoolExecutor(max_workers=1) as ex:
                f = ex.submit(w.update, v, timeout=120)
                if v < 3:
                    assert ctl.update(v, timeout=120)["state"] == "committed"
                    f.result(timeout=120)
                    # as the gateway does: the next version only once every loader call returned
                    assert sorted(returned.get(timeout=120) for _ in range(2)) == [(0, v), (1, v)]
                else:
                    with pytest.raises(awex.UpdateFailed) as failure:
                        ctl.update(v, timeout=120)
                    with pytest.raises(awex.UpdateFailed):
                        f.result(timeout=120)
                    # the retry, every loader on the default (report and return)
                    f = ex.submit(w.update, v, timeout=120)
                    with pytest.raises(awex.UpdateFailed) as retry:
                        ctl.update(v, timeout=120)
                    with pytest.raises(awex.UpdateFailed):
                        f.result(timeout=120)
    finally:
        w.close()
        results = ranks.results()
    r0, r1 = results
    for r, res in enumerate(results):
        assert res["no_env_report"] == "None", res["no_env_report"]
        assert res["no_env"] == (
            f"awex.sglang.receive (engine 0, TP rank {r}): AWEX_GATEWAY and AWEX_PAIR not set in the "
            "SGLang server's environment; launch it with AWEX_GATEWAY=http://HOST:PORT AWEX_PAIR=NAME "
            "[AWEX_ENGINE=N] [AWEX_TOKEN=...]"
        )
        assert res["bad_engine"] == (
            f"awex.sglang.receive (engine zero, TP rank {r}): AWEX_ENGINE='zero' is not an engine index (0, 1, ...)"
        )
        assert res["payload"].startswith(f"awex.sglang.receive (engine zero, TP rank {r}): awex.sglang.receive takes")
        assert res["v1"] == [] and res["v2"] == [], (res["v1"], res["v2"])
        assert res["recreated"] == 1 and res["moved_still"]
    assert r0["v3"] == (
        "awex.sglang.receive (engine 0, TP rank 0): parameter `model.norm.weight` changed from "
        "torch.float32 [64] to torch.float32 [128] since it was registered; awex writes in place into "
        "the registered storage and cannot follow a changed shape or dtype (restart the server, or keep "
        "the storage's shape and dtype)"
    )
    assert "TP rank 0" in str(failure.value) and "changed from" in str(failure.value), str(failure.value)
    # rank 1 (default: report) received its share of version 3 or learnt that it failed, and returned
    assert r1["v3"] == "returned None", r1["v3"]
    # the retry: rank 0 reported its refusal to the gateway and returned instead of raising
    assert r0["v3_retry"] == r1["v3_retry"] == "returned None", (r0["v3_retry"], r1["v3_retry"])
    assert "TP rank 0" in str(retry.value) and "changed from" in str(retry.value), str(retry.value)
