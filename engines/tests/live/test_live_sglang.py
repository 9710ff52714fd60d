"""A live SGLang server updated by awex from a real training job, end to end on CPU.

SGLang 0.5.23 (the real-engine venv, plus the HTTP server's packages from
``engines/sglang-server-pkgs.sh``) serves a tiny Qwen3 made on the spot (``tiny_model.py``) with
its CPU engine, started with the CPU command of docs/sglang.md ("Launch": the block marked
``awex-command: sglang-cpu``), read from the page and run as written with its variables set
(``serve.shell_command``), so the page cannot go stale; it puts ``cpu_kernels/`` on the
server's ``PYTHONPATH``: a pure-torch ``sgl_kernel`` stand-in (every
``sgl-kernel`` wheel on the index is a CUDA build; see its docstring for the names it provides),
the only code in the server that is not SGLang's or awex's. Then the story of
``serve.scenario``: a real Megatron-Core training job (``megatron_trainer.py``: Megatron-Core
0.19.2 ``GPTModel``, local layer spec, tp 2 over gloo in two processes, AdamW on a few tokens;
attached with awex's Megatron backend, the pair's training side ``megatron:tp=2,local_spec=1``)
sends three versions through the gateway, each served (``/v1/completions`` greedy tokens equal
transformers' on the trainer's weights gathered to one process, log-probabilities within
``serve.LOGPROB_TOL``) and reported (``/model_info``'s ``weight_version``); the job killed
mid-update fails the version, the server keeps serving the previous one and reports it again
(the gateway sets the failed version's number back); the retry commits. The pair has deltas on:
versions 2 and 3 move only the elements the optimiser step changed (``awex.sglang.receive``
applies them to the live parameters), and the test prints the density it measured.

``AWEX_SGLANG_SERVER_PKGS`` names the package folder (``.ci/engines`` sets it;
``AWEX_REQUIRE_LIVE=1`` makes a missing one fail instead of skip); ``AWEX_LIVE_TP`` (default 2)
is the server's tensor parallel size; the scratch folder (model, logs) is kept after a failure,
and always with ``AWEX_LIVE_KEEP=1``.
"""

from __future__ import annotations

import os
import sys

import pytest

import serve
import tiny_model

awex = pytest.importorskip("awex")

# the server's start-up (4-5 minutes on a loaded 2-core machine) counts against the first test
pytestmark = pytest.mark.timeout(2400)

PKGS = os.environ.get("AWEX_SGLANG_SERVER_PKGS", "")
TP = int(os.environ.get("AWEX_LIVE_TP", "2"))
PAIR = "live-sglang"
DOC = "docs/sglang.md"
#: the training job (``serve.TRAINERS``): Megatron-Core here, FSDP2 feeds the live vLLM server
TRAIN = "megatron:tp=2,local_spec=1"
KERNELS = os.path.join(serve.HERE, "cpu_kernels")
START_S = 900.0


@pytest.fixture(scope="module")
def live(request):
    if not PKGS or not os.path.isdir(os.path.join(PKGS, "uvicorn")):
        why = f"no live SGLang server packages (AWEX_SGLANG_SERVER_PKGS={PKGS!r}; engines/sglang-server-pkgs.sh builds them)"
        if os.environ.get("AWEX_REQUIRE_LIVE", "") not in ("", "0"):
            pytest.fail(why)
        pytest.skip(why)
    with serve.scratch(request, "awex-live-sglang-") as (d, procs):
        model = tiny_model.make(os.path.join(d, "model"))
        gw = serve.start_gateway(d, procs)
        # the CPU command of docs/sglang.md ("Launch"), as written, with its variables set; the
        # page's `$PWD` is the repository's root, where the server starts
        env, argv = serve.with_tp(*serve.shell_command(serve.doc_block(DOC, "sglang-cpu"), dict(
            GATEWAY=gw, PAIR=PAIR, MODEL=model, PORT="{port}", VENV=sys.prefix, SGLANG_PKGS=PKGS,
            PWD=serve.ROOT)), TP)
        env = dict({k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "AWEX_", "PYTHON"))}, **env)

        server, url, took = serve.start_http("the SGLang server", lambda port: serve.at_port(argv, port),
                                             os.path.join(d, "sglang.log"), "/health", START_S, procs, env=env,
                                             cwd=serve.ROOT)
        print(f"SGLang server (tp {TP}) answered /health after {took:.0f} s")
        yield dict(dir=d, model=model, gateway=gw, url=url, server=server, procs=procs)


def served_version(url: str) -> str | None:
    """The version SGLang reports (``/model_info``'s ``weight_version``,
    ``srt/entrypoints/http_server.py``)."""
    status, out = serve.http(url + "/model_info", timeout=30)
    assert status == 200, f"/model_info answered {status}: {out}"
    return out["weight_version"]


def test_assign_req_to_token_pool_cpu_writes_each_requests_slots_after_the_earlier_ones() -> None:
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("sgl_kernel_standin", os.path.join(KERNELS, "sgl_kernel", "__init__.py"))
    k = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(k)
    pool = torch.full((3, 6), -1, dtype=torch.int32)
    k.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), pool, torch.tensor([1, 0]), torch.tensor([3, 3]),
                                   torch.tensor([10, 11, 20, 21, 22]), 6)
    assert pool.tolist() == [[20, 21, 22, -1, -1, -1], [-1] * 6, [-1, 10, 11, -1, -1, -1]]
    with pytest.raises(NotImplementedError, match="copy_all_layer_kv_cache_cpu"):
        k.copy_all_layer_kv_cache_cpu()


def test_live_sglang_serves_each_committed_version_and_the_last_one_after_a_killed_trainer(live) -> None:
    # SGLang records the trigger's `weight_version` once the loader returned, and awex's loader
    # returns (SGLang 0.5.23 ends the server on a loader exception) also when the version
    # failed: the scenario asserts that the gateway's `/update_weight_version` (sent with the
    # failed attempt's `end_weight_update`) has the server report version 3 again.
    serve.scenario(live, PAIR, f"sglang:tp={TP},engines=1", served_version, train=TRAIN, deltas=True)
