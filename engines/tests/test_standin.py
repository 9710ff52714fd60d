"""The stand-in SGLang server itself: every route's contract, the fault options, the payload."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

import checkpoints

HERE = os.path.dirname(os.path.abspath(__file__))
STANDIN = os.path.join(os.path.dirname(HERE), "sglang_standin.py")
sys.path.insert(0, os.path.dirname(HERE))
import sglang_standin  # noqa: E402

P = sglang_standin.EMPTY_PAYLOAD_B64


class Standin:
    """A stand-in server process; ``call`` returns ``(status, body)``."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        e = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        e.update(env or {})
        self.proc = subprocess.Popen([sys.executable, STANDIN, *args], stdout=subprocess.PIPE, env=e, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the stand-in exited with {self.proc.wait()}")
        self.info = json.loads(line)
        self.url = self.info["url"]

    def call(self, path: str, body: dict[str, Any] | None = None, method: str | None = None,
             timeout: float = 60) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method or ("POST" if data else "GET"))
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw, ctype = r.status, r.read(), r.headers.get("Content-Type")
        except urllib.error.HTTPError as e:
            status, raw, ctype = e.code, e.read(), e.headers.get("Content-Type")
        return status, json.loads(raw) if ctype == "application/json" else raw.decode()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> str:
    """A config.json only: the stand-in's ranks hold zero torch tensors in SGLang's layout."""
    d = tmp_path_factory.mktemp("cfg")
    cfg = dict(checkpoints.BASE, architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False, torch_dtype="float32")
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture()
def record(tmp_path) -> dict[str, str]:
    return {"STANDIN_RECORD": str(tmp_path / "calls.jsonl")}


def calls(env: dict[str, str]) -> list[dict[str, Any]]:
    try:
        with open(env["STANDIN_RECORD"]) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


LOADER = "standin_loaders.record"


def update(s: Standin, tp: int, **extra: Any) -> tuple[int, Any]:
    body = {"serialized_named_tensors": [P] * tp, "load_format": LOADER, **extra}
    return s.call("/update_weights_from_tensor", body)


def test_empty_payload_is_sglangs_serialisation_of_an_empty_list() -> None:
    from sglang.srt.utils.common import MultiprocessingSerializer

    assert MultiprocessingSerializer.serialize([], output_str=True) == P
    assert base64.b64decode(P) == b"\x80\x04]\x94."
    assert MultiprocessingSerializer.deserialize(base64.b64decode(P)) == []
    assert sglang_standin.deserialize(base64.b64decode(P)) == []


def test_session_routes_and_loader_calls(config_dir, record) -> None:
    s = Standin("--model-path", config_dir, "--tp", "2", "--mode", "torch", "--custom-weight-loader", LOADER,
                env=record)
    try:
        st, info = s.call("/get_server_info")
        assert st == 200
        assert {k: info[k] for k in ("tp_size", "ep_size", "dp_size", "version", "custom_weight_loader",
                                     "weight_cache_mode", "model_path")} == {
            "tp_size": 2, "ep_size": 1, "dp_size": 1, "version": "0.5.23", "custom_weight_loader": [LOADER],
            "weight_cache_mode": "off", "model_path": config_dir}
        assert s.call("/server_info")[1] == info
        # >= 0.5.21: an update outside a session is refused, the loader not called
        assert update(s, 2) == (400, {"success": False, "message": "update_weights_from_tensor must run "
                                      "between begin_weight_update() and end_weight_update()"})
        assert calls(record) == []
        assert s.call("/end_weight_update", {}) == (400, {"success": False, "message": "no weight-update "
                                                          "session is open; call begin_weight_update() first"})
        assert s.call("/pause_generation", {"mode": "retract"}) == (
            200, {"message": "Generation paused successfully.", "status": "ok"})
        assert s.call("/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
        assert s.call("/begin_weight_update", {}) == (400, {"success": False, "message": "a weight-update "
                                                            "session is already open; call end_weight_update() first"})
        assert update(s, 2, load_format="other.loader") == (400, {"success": False,
                                                                  "message": "Unknown load_format=other.loader"})
        assert update(s, 1)[0] == 400  # one payload per TP rank
        assert update(s, 2, weight_version="7", flush_cache=True) == (
            200, {"success": True, "message": "Success Weight version updated to 7."})
        got = calls(record)
        assert sorted(c["rank"] for c in got) == [0, 1] and {c["tensors"] for c in got} == {0}
        assert len({c["pid"] for c in got}) == 2  # one process per TP rank
        assert s.call("/model_info")[1]["weight_version"] == "7"
        assert s.call("/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
        assert s.call("/continue_generation", {}) == (
            200, {"message": "Generation continued successfully.", "status": "ok"})
        state = s.call("/standin/state")[1]
        assert state["paused"] is False and state["session"] is None and state["weight_version"] == "7"
        # the loader wrote in place into each rank's first parameter (zeros + 1)
        params = s.call("/standin/params")[1]["ranks"]
        assert len(params) == 2 and all(len(r) == 19 for r in params)
        assert s.call("/pause_generation", method="GET")[0] == 405
    finally:
        s.close()


def test_flush_cache_fails_while_requests_run(config_dir, record) -> None:
    s = Standin("--model-path", config_dir, "--tp", "1", "--mode", "torch", "--custom-weight-loader", LOADER,
                "--running-requests", "3", env=record)
    try:
        assert s.call("/flush_cache")[0] == 400
        s.call("/pause_generation", {"mode": "in_place"})
        s.call("/begin_weight_update", {})
        assert update(s, 1, flush_cache=True) == (400, {"success": False, "message": sglang_standin.FLUSH_FAILED})
        assert len(calls(record)) == 1  # the weights were loaded before the flush failed
        assert update(s, 1, flush_cache=False)[0] == 200
        s.call("/end_weight_update", {})
        s.call("/pause_generation", {"mode": "retract"})  # running -> waiting: a paused flush works
        assert s.call("/flush_cache")[0] == 200
        s.call("/continue_generation", {})
        assert s.call("/flush_cache")[0] == 400  # not paused: the waiting requests block it
    finally:
        s.close()


def test_pre_0_5_21_server_has_no_session_routes(config_dir, record) -> None:
    s = Standin("--model-path", config_dir, "--tp", "1", "--mode", "torch", "--custom-weight-loader", LOADER,
                "--version", "0.5.20", env=record)
    try:
        assert s.call("/get_server_info")[1]["version"] == "0.5.20"
        assert s.call("/begin_weight_update", {}) == (404, {"detail": "Not Found"})
        assert s.call("/end_weight_update", {}) == (404, {"detail": "Not Found"})
        assert update(s, 1, weight_version="3")[0] == 200
    finally:
        s.close()


def test_update_weight_version_sets_the_reported_version_and_keeps_requests_when_asked(config_dir, record) -> None:
    s = Standin("--model-path", config_dir, "--tp", "1", "--mode", "torch", "--custom-weight-loader", LOADER,
                "--running-requests", "2", env=record)
    try:
        assert s.call("/model_info")[1]["weight_version"] == "default"
        s.call("/pause_generation", {"mode": "retract"})
        assert s.call("/update_weight_version", {"new_version": "3", "abort_all_requests": False}) == (
            200, {"success": True, "message": "Weight version updated to 3", "new_version": "3"})
        assert s.call("/model_info")[1]["weight_version"] == "3"
        assert s.call("/standin/state")[1]["waiting"] == 2  # the retracted requests are kept
        assert s.call("/update_weight_version", {})[0] == 422
        assert s.call("/update_weight_version", {"new_version": "4"})[0] == 200  # aborts by default
        assert s.call("/model_info")[1]["weight_version"] == "4"
        assert s.call("/standin/state")[1]["waiting"] == 0
    finally:
        s.close()


def test_faults(config_dir, record) -> None:
    s = Standin("--model-path", config_dir, "--tp", "2", "--mode", "torch", "--custom-weight-loader", LOADER,
                "standin_loaders.boom", "--fail-rank", "1", env=record)
    try:
        s.call("/begin_weight_update", {})
        assert update(s, 2)[0] == 200  # no weight_version (a warm-up): no fault
        assert update(s, 2, weight_version="1") == (400, {
            "success": False, "message": "TP rank 1: RuntimeError: injected failure of TP rank 1's loader (--fail-rank)"})
        assert update(s, 2, weight_version="1")[0] == 200  # --fail-times 1: the retry succeeds
        assert update(s, 2, load_format="standin_loaders.boom") == (400, {
            "success": False, "message": "TP rank 0: RuntimeError: boom: the loader failed | "
                                         "TP rank 1: RuntimeError: boom: the loader failed"})
    finally:
        s.close()
    before = len(calls(record))
    s = Standin("--model-path", config_dir, "--mode", "torch", "--custom-weight-loader", LOADER,
                "--reject-update", "the server refuses", "--hang-s", "2", env=record)
    try:
        s.call("/begin_weight_update", {})
        assert update(s, 1)[0] == 200  # the warm-up is not refused
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            update_timeout(s, 0.5)
        assert update(s, 1, weight_version="2") == (400, {"success": False, "message": "the server refuses"})
        assert time.monotonic() - t >= 2.0
        assert len(calls(record)) == before + 1
    finally:
        s.close()


def update_timeout(s: Standin, timeout: float) -> None:
    body = json.dumps({"serialized_named_tensors": [P], "load_format": LOADER, "weight_version": "1"}).encode()
    req = urllib.request.Request(s.url + "/update_weights_from_tensor", data=body, method="POST")
    try:
        urllib.request.urlopen(req, timeout=timeout)
    except (TimeoutError, urllib.error.URLError) as e:
        if isinstance(e, urllib.error.URLError) and not isinstance(e.reason, TimeoutError):
            raise
        raise TimeoutError from e


def test_crash_mode_exits_like_sglang(config_dir, record) -> None:
    s = Standin("--model-path", config_dir, "--mode", "torch", "--custom-weight-loader", "standin_loaders.boom",
                "--loader-exception", "crash", env=record)
    try:
        s.call("/begin_weight_update", {})
        with pytest.raises((urllib.error.URLError, ConnectionError, http_client_errors())):
            s.call("/update_weights_from_tensor", {"serialized_named_tensors": [P],
                                                   "load_format": "standin_loaders.boom"})
        assert s.proc.wait(timeout=20) == 1
    finally:
        s.close()


def http_client_errors():
    import http.client

    return http.client.HTTPException
