"""The adapter-overhead benchmark runs end to end at a small size (``--mode numpy`` stand-ins,
the real loader and gateway) and accounts for every rank's loader call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_e2e_gateway import awex_cli

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(HERE), "bench_sglang_overhead.py")


def test_benchmark_measures_every_rank_of_every_update() -> None:
    # (a run that hung here once was a loader that asked for the model before the controller had
    # stored it, and so never joined: the gateway now stores it at connect, and a rank that
    # cannot join fails the run at its join deadline, 60 s, instead of a 600 s wait)
    env = dict(os.environ, AWEX_CLI=awex_cli())
    out = subprocess.run([sys.executable, BENCH, "--engines", "2", "--tp", "2", "--updates", "2", "--layers", "2",
                          "--join-deadline-s", "60", "--json"], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout)
    assert (r["engines"], r["tp"], r["ranks"]) == (2, 2, 4)
    # 2 layers of the benchmark's Qwen3 shape (hidden 256, 16 heads of 32, 8 KV heads,
    # intermediate 512, vocabulary 4096, untied) at tp 2, float32
    h, d, inter, vocab = 256, 32, 512, 4096
    per_layer = 2 * d + (8 + 2 * 4) * d * h + h * 8 * d + 2 * (inter // 2) * h + h * (inter // 2) + 2 * h
    want = 4 * (2 * (vocab // 2) * h + 2 * per_layer + h)
    assert r["bytes_per_rank"] == want, (r["bytes_per_rank"], want)
    assert [u["version"] for u in r["updates"]] == [2, 3]
    for u in r["updates"]:
        assert u["ranks"] == 4 and u["transfer_ms"] > 0
        assert u["total_ms"] >= u["transfer_ms"] and u["overhead_ms"] == pytest.approx(u["total_ms"] - u["transfer_ms"])
        assert u["entry_ms"] >= u["status_ms"] and u["entry_ms"] >= u["check_ms"]
    # the floor of the same run: the stand-ins' session alone, once per measured update
    assert len(r["floor_ms"]) == 2 and all(f > 0 for f in r["floor_ms"])
    assert r["floor_median_ms"] == pytest.approx(sorted(r["floor_ms"])[0] / 2 + sorted(r["floor_ms"])[1] / 2)
