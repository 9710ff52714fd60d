"""End to end: the gateway (``awex-cli serve``) drives SGLang's update session on the stand-in
server, whose TP rank processes hold SGLang's real model classes and run
``awex.sglang.receive``, fed by an awex Writer.

The order the gateway must follow per update of version V (``docs/sglang.md``):
``pause_generation {"mode": "retract"}`` -> ``begin_weight_update`` (>= 0.5.21) -> the update
starts -> ``update_weights_from_tensor`` {one empty payload per TP rank, ``load_format``
``awex.sglang.receive``, ``weight_version`` "V", ``flush_cache`` true} -> ranks report ->
``end_weight_update`` -> commit -> ``continue_generation``; at connect, ``server_info`` (``get_server_info`` on servers older than its rename), ``model_info`` (the served architectures) and
one warm-up ``update_weights_from_tensor`` with ``flush_cache`` false, itself inside
``begin_weight_update`` / ``end_weight_update`` on >= 0.5.21 (SGLang 0.5.23 refuses any
``update_weights_from_*`` outside a session).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from typing import Any

import pytest

import awex
import checkpoints
from conftest import fill, free_port, pair_name
from test_standin import Standin
from sglang_standin import EMPTY_PAYLOAD_B64

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOADER = "awex.sglang.receive"


def awex_cli() -> str:
    for c in (os.environ.get("AWEX_CLI"), f"{ROOT}/target/release/awex-cli", f"{ROOT}/target/debug/awex-cli",
              shutil.which("awex-cli")):
        if c and os.path.exists(c):
            return c
    pytest.skip("no awex-cli binary (cargo build -p awex-cli, or set AWEX_CLI)")


@pytest.fixture(scope="module")
def served_gateway():
    port = free_port()
    proc = subprocess.Popen([awex_cli(), "serve", "--bind", f"127.0.0.1:{port}", "--ephemeral"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/healthz", timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[int, str]:
    base = tmp_path_factory.mktemp("e2e")
    v0 = checkpoints.write(str(base / "v0"), "Qwen3ForCausalLM", tied=False, seed=200)
    return {0: v0, 1: checkpoints.write(str(base / "v1"), "Qwen3ForCausalLM", tied=False, seed=201, config_of=v0)}


_probe: dict[str, str] = {}


def gateway_reads_server_info(gw: str, ckpts: dict[int, str]) -> str:
    """'' when the gateway reads a server's info at connect, else why not; probed once against a
    quick stand-in (plain torch ranks) so that a gateway without the session fails fast."""
    if gw not in _probe:
        name = pair_name("probe")
        s = Standin("--model-path", ckpts[0], "--mode", "torch", "--custom-weight-loader", LOADER,
                    env={"AWEX_GATEWAY": gw, "AWEX_PAIR": name, "AWEX_ENGINE": "0"})
        try:
            ctl = awex.Controller(gw)
            try:
                ctl.connect(name, model=ckpts[0], train="fsdp:dp=1", infer="sglang:tp=1,engines=1",
                            transport="shm", urls=[s.url], join_deadline_s=5)
                ctl.disconnect(name)
            except Exception as e:
                _probe[gw] = f"connect failed: {e}"
            routes = s.call("/standin/state")[1]["routes"]
            if gw not in _probe:
                ok = "/get_server_info" in routes or "/server_info" in routes
                _probe[gw] = "" if ok else f"the gateway did not read the server's info at connect (routes: {routes})"
        finally:
            s.close()
    return _probe[gw]


def start_pair(gw: str, ckpts: dict[int, str], *standin_args: str, tp: int = 2, **connect: Any):
    why = gateway_reads_server_info(gw, ckpts)
    if why:
        pytest.fail(why)
    name = pair_name("e2e")
    env = {"AWEX_GATEWAY": gw, "AWEX_PAIR": name, "AWEX_ENGINE": "0"}
    s = Standin("--model-path", ckpts[0], "--tp", str(tp), "--mode", "sglang", "--custom-weight-loader", LOADER,
                "--running-requests", "2", *standin_args, env=env)
    ctl = awex.Controller(gw)
    connect.setdefault("join_deadline_s", 120)
    connect.setdefault("update_deadline_s", 60)
    try:
        ctl.connect(name, model=ckpts[0], train="fsdp:dp=1", infer=f"sglang:tp={tp},engines=1", transport="shm",
                    urls=[s.url], **connect)
        # fail fast (not at the join deadline) when the gateway does not drive the session
        routes = s.call("/standin/state")[1]["routes"]
        if "/get_server_info" not in routes and "/server_info" not in routes:
            pytest.fail(f"the gateway did not read the server's info at connect (routes called: {routes})")
    except BaseException:
        s.close()
        raise
    w = awex.Writer(gw, name, 0)
    arrays = fill(w.layout(), checkpoints.tensors(ckpts[1]))
    w.register(list(arrays.items()))
    w.join(timeout=120)
    return name, s, ctl, w


def writer_update(w, version: int, timeout: float = 120) -> threading.Thread:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = w.update(version, timeout=timeout)
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.out = out  # type: ignore[attr-defined]
    t.start()
    return t


def updates(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [e["body"] for e in state["log"] if e["route"] == "/update_weights_from_tensor"]


def session_routes(state: dict[str, Any]) -> list[str]:
    return [r for r in state["routes"] if r not in ("/standin/params",)]


def test_update_follows_sglangs_session_and_lands_every_byte(served_gateway, ckpts) -> None:
    name, s, ctl, w = start_pair(served_gateway, ckpts)
    ref = Standin("--model-path", ckpts[1], "--tp", "2", "--mode", "sglang")
    try:
        t = writer_update(w, 1)
        st = ctl.update(1, timeout=120)
        t.join(120)
        assert st["state"] == "committed"
        state = s.call("/standin/state")[1]
        assert session_routes(state) == [
            "/server_info", "/model_info", "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",
            "/pause_generation", "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",
            "/continue_generation"]
        warm, upd = updates(state)
        # `selector` defaults to "all" (target and draft model; managers/io_struct.py): the
        # trigger names the target model, for which the session was opened
        assert warm == {"serialized_named_tensors": [EMPTY_PAYLOAD_B64] * 2, "load_format": LOADER,
                        "flush_cache": False, "selector": "target"}
        payloads = upd.pop("serialized_named_tensors")
        assert upd == {"load_format": LOADER, "weight_version": "1", "flush_cache": True, "selector": "target"}
        # each TP rank's payload names the work; SGLang's own deserialiser reads it
        from sglang.srt.utils.common import MultiprocessingSerializer

        assert len(payloads) == 2 and payloads[0] == payloads[1]
        [(name, tensor)] = MultiprocessingSerializer.deserialize(payloads[0])
        assert name == "awex.work/1/1/receive"
        assert (str(tensor.dtype), tuple(tensor.shape)) == ("torch.int64", (0,))
        begins = [e["body"] for e in state["log"] if e["route"] == "/begin_weight_update"]
        assert begins == [{"selector": "target"}] * 2
        pause = [e["body"] for e in state["log"] if e["route"] == "/pause_generation"]
        assert pause == [{"mode": "retract"}]
        assert state["weight_version"] == "1" and state["paused"] is False
        # every parameter of every rank equals SGLang's own load of version 1
        assert s.call("/standin/params")[1] == ref.call("/standin/params")[1]
    finally:
        ref.close()
        w.close()
        s.close()


def test_one_ranks_loader_fails_then_retry_commits(served_gateway, ckpts) -> None:
    name, s, ctl, w = start_pair(served_gateway, ckpts, "--fail-rank", "1")
    try:
        t = writer_update(w, 1)
        with pytest.raises(awex.UpdateFailed, match="TP rank 1"):
            ctl.update(1, timeout=120)
        t.join(120)
        state = s.call("/standin/state")[1]
        assert state["paused"] is True  # parameters were written: generation stays paused
        assert state["session"] is not None  # the failed attempt's session is still open
        log = len(state["log"])
        t = writer_update(w, 1)
        assert ctl.update(1, timeout=120)["state"] == "committed"
        t.join(120)
        assert not t.is_alive() and t.out["result"]["state"] == "committed", t.out
        state = s.call("/standin/state")[1]
        assert state["paused"] is False and state["weight_version"] == "1"
        # the retry closed the failed attempt's session before opening its own (SGLang refuses
        # a second begin_weight_update while one is open) and set the reported version back to
        # the one at connect (nothing was committed yet)
        retry = [e for e in state["log"][log:] if e["route"] != "/standin/params"]
        assert [e["route"] for e in retry] == [
            "/end_weight_update", "/update_weight_version", "/pause_generation", "/begin_weight_update",
            "/update_weights_from_tensor", "/end_weight_update", "/continue_generation"]
        assert retry[1]["body"] == {"new_version": "default", "abort_all_requests": False}
    finally:
        w.close()
        s.close()


def test_atomic_pair_through_the_loader_keeps_the_live_weights_on_a_failure_before_apply(served_gateway, ckpts) -> None:
    # atomic: the loader receives into staging, reports, waits for `apply` inside the open
    # trigger, then copies into SGLang's parameters. Version 1 fails before `apply` (the
    # training rank never sends): every parameter is still the server's own load, the version
    # is not torn and generation resumes; the retry commits every byte.
    name, s, ctl, w = start_pair(served_gateway, ckpts, atomic=True, update_deadline_s=5)
    before = Standin("--model-path", ckpts[0], "--tp", "2", "--mode", "sglang")
    after = Standin("--model-path", ckpts[1], "--tp", "2", "--mode", "sglang")
    try:
        assert ctl.status(name)["options"]["apply"] == "atomic"
        assert before.call("/standin/params")[1] != after.call("/standin/params")[1]  # the test can fail
        with pytest.raises(awex.UpdateFailed):
            ctl.update(1, timeout=60)
        st = ctl.status(name)
        assert st["torn_version"] is None and st["serving_version"] is None, st
        deadline = time.monotonic() + 30
        while s.call("/standin/state")[1]["paused"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.call("/standin/state")[1]["paused"] is False  # nothing live was written: it serves again
        assert s.call("/standin/params")[1] == before.call("/standin/params")[1]
        t = writer_update(w, 1)
        u = ctl.update(1, timeout=60)
        t.join(60)
        assert (u["state"], u["attempt"]) == ("committed", 2)
        assert s.call("/standin/params")[1] == after.call("/standin/params")[1]
        routes = [e["route"] for e in s.call("/standin/state")[1]["log"]]
        assert routes.count("/update_weights_from_tensor") == 3  # warm-up, attempt 1, attempt 2: one call each
    finally:
        w.close()
        s.close()
        before.close()
        after.close()


def test_server_rejects_the_update(served_gateway, ckpts) -> None:
    name, s, ctl, w = start_pair(served_gateway, ckpts, "--reject-update", "the server refuses")
    try:
        # the server's refusal may fail the version before the writer took its event: the
        # writer then skips the dead attempt and waits for the next one, until its timeout
        t = writer_update(w, 1, timeout=15)
        with pytest.raises(awex.UpdateFailed, match="the server refuses"):
            ctl.update(1, timeout=120)
        t.join(60)
        assert not t.is_alive()
        err = t.out.get("error")
        assert isinstance(err, (awex.UpdateFailed, TimeoutError)), t.out
    finally:
        w.close()
        s.close()


def test_server_hangs_past_the_deadline(served_gateway, ckpts) -> None:
    name, s, ctl, w = start_pair(served_gateway, ckpts, "--hang-s", "60", update_deadline_s=5)
    try:
        t = writer_update(w, 1)
        start = time.monotonic()
        with pytest.raises(awex.UpdateFailed):
            ctl.update(1, timeout=60)
        assert time.monotonic() - start < 30
        t.join(60)
    finally:
        w.close()
        s.close()


def test_connect_refuses_a_server_that_serves_another_architecture(served_gateway, ckpts, tmp_path) -> None:
    """The gateway reads ``/model_info``'s ``architectures`` (``http_server.py`` ``model_info``)
    and refuses a server whose model is not the pair's; another model path alone is fine."""
    llama = checkpoints.write(str(tmp_path / "llama"), "LlamaForCausalLM", tied=False, seed=7)
    name = pair_name("arch")
    s = Standin("--model-path", llama, "--mode", "torch", "--custom-weight-loader", LOADER,
                env={"AWEX_GATEWAY": served_gateway, "AWEX_PAIR": name, "AWEX_ENGINE": "0"})
    try:
        with pytest.raises(Exception) as e:
            awex.Controller(served_gateway).connect(
                name, model=ckpts[0], train="fsdp:dp=1", infer="sglang:tp=1,engines=1", transport="shm",
                urls=[s.url], join_deadline_s=5)
        assert (f"engine 0 at {s.url}: the pair's model is Qwen3ForCausalLM but the server reports "
                f'architectures=["LlamaForCausalLM"] (model_path {llama})') in str(e.value), str(e.value)
        routes = s.call("/standin/state")[1]["routes"]
        assert routes == ["/server_info", "/model_info"], routes  # refused before any update call
    finally:
        s.close()
