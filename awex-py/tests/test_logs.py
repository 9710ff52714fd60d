"""The module installs no log subscriber of its own unless AWEX_LOG asks for one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import awex
from awex import _testing
gw = _testing.start_gateway()
ctl = awex.Controller(gw)
ctl.connect("logged-py", model="qwen3-tiny", train="megatron:tp=1", infer="sglang:tp=1")
ctl.disconnect()
"""


def run(**env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("AWEX_LOG") and k != "RUST_LOG"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", SCRIPT], env=e, capture_output=True, text=True,
                          timeout=120)


def test_no_subscriber_unless_asked():
    out = run()
    assert out.returncode == 0, out.stderr
    assert "pair connected" not in out.stderr
    # RUST_LOG alone is the host's business: awex does not act on it
    out = run(RUST_LOG="info")
    assert out.returncode == 0, out.stderr
    assert "pair connected" not in out.stderr


def test_awex_log_installs_a_json_subscriber_on_stderr():
    out = run(AWEX_LOG="info", AWEX_LOG_FORMAT="json")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(l) for l in out.stderr.splitlines() if l.startswith("{")]
    connected = [l for l in lines if l["fields"].get("message") == "pair connected"]
    assert connected, out.stderr
    assert connected[0]["level"] == "INFO"
    assert connected[0]["fields"]["pair"] == "logged-py"


def test_a_bad_filter_is_refused_naming_the_variable():
    out = run(AWEX_LOG="very=loud=please")
    assert out.returncode != 0
    assert "AWEX_LOG `very=loud=please` is not a log filter" in out.stderr
