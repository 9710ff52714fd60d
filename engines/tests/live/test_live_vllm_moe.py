"""The live vLLM test's story (``test_live_vllm.py``, ``serve.scenario``) on a hybrid MoE model:
vLLM's CPU build serves a tiny bf16 ``Qwen3_5MoeForCausalLM`` made on the spot
(``tiny_model.make(family="qwen3.5-moe")``: a Gated DeltaNet layer and a gated full-attention
layer, each with 4 routed experts and a gated shared expert), started as the Qwen3.5 one
(``test_live_vllm_hybrid.py``).

vLLM (0.32.0 here, 0.33.0 too) skips its CPU experts' post-load step on every reload
(``UnquantizedFusedMoEMethod._setup_kernel``, ``fused_moe/unquantized_fused_moe_method.py``,
prepacks the experts only while ``moe_kernel`` is None, on the first load), so a reload leaves
plain weights in storage its CPU MoE kernel reads as prepacked. The first test pins that fault:
the started server serves its checkpoint, vLLM's own ``reload_weights`` of the same checkpoint
(no awex involved) leaves it serving something else; once a vLLM reloads right, it says so.
The second test then runs the story from that broken server: a real FSDP2 training job
(2 ranks, gloo, ``trainer.py``, bf16 parameters, transformers' fused experts) sends versions
through the gateway with deltas, and after each the server's greedy tokens are transformers'
greedy decoding on the trainer's weights up to bf16's near-ties, with log-probabilities within
the tolerance; the killed job's version fails and its retry commits. awex's updates are served
right because ``awex.vllm`` runs the experts' step on the reloaded layer
(``_experts_post_load_on_update``).

``AWEX_LIVE_MOE_FAMILY=qwen3-next`` runs the same module on a tiny ``Qwen3NextForCausalLM`` of
the same sizes (the same MoE block; ``.ci/engines`` runs both).

Its own module: one live server at a time (the Qwen3.5 server of ``test_live_vllm_hybrid.py``
is gone before this one starts). The last test reloads with vLLM's own ``reload_weights`` once
more, after awex's updates: every parameter's own loader is back.
"""

from __future__ import annotations

import os

import pytest

import serve
from test_live_vllm import PAIR, TP, served_version, start_live
from test_live_vllm_hybrid import LOGPROB_TOL, NEAR_TIES

pytest.importorskip("awex")

# the server's start-up (1-5 minutes on a loaded 2-core machine) counts against the first test
pytestmark = pytest.mark.timeout(2400)
#: the tiny model's family (``tiny_model.make``): ``qwen3.5-moe``, or ``qwen3-next``
FAMILY = os.environ.get("AWEX_LIVE_MOE_FAMILY", "qwen3.5-moe")
PAIR_MOE = PAIR + "-" + FAMILY
#: vLLM's own reload (one layerwise pass over a two-layer model on a loaded 2-core machine)
RELOAD_S = 600.0


@pytest.fixture(scope="module")
def live(request):
    if FAMILY not in ("qwen3.5-moe", "qwen3-next"):
        pytest.fail(f"AWEX_LIVE_MOE_FAMILY={FAMILY!r}: qwen3.5-moe (the default) or qwen3-next")
    yield from start_live(request, FAMILY, PAIR_MOE)


def test_vllm_own_reload_serves_the_cpu_moe_wrongly(live) -> None:
    """The started server serves its checkpoint; vLLM's own ``reload_weights`` of that checkpoint
    (``/collective_rpc``, the model's directory, through the layerwise reload awex's updates
    take, without awex's re-run of the experts' step) leaves it generating something else."""
    url, model = live["url"], live["model"]
    serve.assert_serves(url, model, None, "as started", logprob_tol=LOGPROB_TOL, near_ties=NEAR_TIES)
    status, out = serve.http(url + "/collective_rpc", {"method": "reload_weights"}, timeout=RELOAD_S)
    assert status == 200, f"/collective_rpc reload_weights answered {status}: {out}"
    live["reloaded"] = True
    try:
        serve.assert_serves(url, model, None, "after vLLM's own reload_weights", logprob_tol=LOGPROB_TOL,
                            near_ties=NEAR_TIES)
    except AssertionError as e:
        print(f"vLLM's own reload serves the CPU MoE wrongly, as known: {e}")
        return
    raise AssertionError(
        "vLLM's own reload_weights now serves the tiny Qwen3.5-MoE right on CPU: this vLLM runs the CPU "
        "experts' post-load step (CPUUnquantizedExperts.process_weights_after_loading) on reloads; "
        "awex.vllm._experts_post_load_on_update then leaves it alone (it runs the step only where the "
        "engine did not), and this test and docs/vllm.md's note on the fault can go")


def test_live_vllm_serves_a_hybrid_moe_updated_by_fsdp2(live) -> None:
    # transformers 5 holds each layer's experts fused (``mlp.experts.gate_up_proj``, ``down_proj``);
    # after the test above the server serves neither the checkpoint nor any version yet
    serve.scenario(live, PAIR_MOE, f"vllm:tp={TP}", served_version, train="fsdp:dp=2,fused_experts=1",
                   deltas=True, logprob_tol=LOGPROB_TOL, near_ties=NEAR_TIES,
                   serves_the_checkpoint=not live.get("reloaded"))


def test_vllm_own_reload_still_loads_after_awex_updates(live) -> None:
    """After awex's updates every parameter has its own loader back (``awex.vllm.load_landed``),
    so vLLM's own ``reload_weights`` of the checkpoint still cuts each tensor to the rank (it
    stopped with ``Attempted to load weight (torch.Size([512, 1, 4])) into parameter
    (torch.Size([256, 1, 4]))``, the Gated DeltaNet's ``conv1d``, when awex left vLLM's
    ``default_weight_loader`` on a ``BasevLLMParameter``). What it then serves is the fault the
    first test pins, so only the load is checked."""
    status, out = serve.http(live["url"] + "/collective_rpc", {"method": "reload_weights"}, timeout=RELOAD_S)
    assert status == 200, f"/collective_rpc reload_weights after awex's updates answered {status}: {out}"
