"""``forked.py``: scripts forked from a preloading forkserver behave as ``subprocess.Popen`` of
them would (argv, environment, output, exit status), and a second preload falls back to a
plain process instead of reaching a script with the wrong modules."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import forked

SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "env", os.environ.get("AWEX_FORKED_T"), "main", __name__, flush=True)
print("to stderr", file=sys.stderr, flush=True)
print("preloaded", sys.argv[3] in sys.modules, flush=True)
sys.exit(int(sys.argv[1]))
"""


def _preload() -> str:
    # the preload of this suite's SGLang ranks (``conftest.rank_context``): asking for another
    # one first would leave them to spawn
    return forked._CHOSEN or "sglang_preload"


@pytest.mark.parametrize("code", [0, 3])
def test_a_forked_script_gets_its_argv_env_and_log_and_exits_with_its_status(tmp_path, code) -> None:
    script, log = tmp_path / "s.py", tmp_path / "s.log"
    script.write_text(SCRIPT)
    env = dict(os.environ, AWEX_FORKED_T="yes")
    p = forked.popen(str(script), [str(code), "x y", _preload()], str(log), _preload(), env=env)
    fork = os.environ.get("AWEX_RANKS_SPAWN", "") in ("", "0")
    if fork:
        assert isinstance(p, forked.Forked)
    assert p.wait(300) == code and p.returncode == code and p.poll() == code
    out = log.read_text()
    assert f"argv ['{code}', 'x y', '{_preload()}'] env yes main __main__" in out, out
    # the script starts with the forkserver's preload imported (what saves the time)
    assert f"preloaded {fork}" in out, out
    assert "to stderr" in out, out


def test_run_raises_with_the_scripts_log_and_a_hung_script_times_out(tmp_path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("raise ValueError('the reason')\n")
    with pytest.raises(RuntimeError, match="exited with 1") as e:
        forked.run(str(bad), [], str(tmp_path / "bad.log"), _preload(), timeout=120)
    assert "ValueError: the reason" in str(e.value)
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(600)\n")
    p = forked.popen(str(hang), [], str(tmp_path / "hang.log"), _preload())
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.5)
    p.kill()
    assert p.poll() is not None


def test_another_preload_than_the_forkservers_gets_a_plain_process(tmp_path) -> None:
    first = _preload()
    assert forked.context(first) is not None or os.environ.get("AWEX_RANKS_SPAWN")
    assert forked.context(first + "_other") is None
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    p = forked.popen(str(script), ["0", "", "json"], str(tmp_path / "s.log"), first + "_other")
    assert isinstance(p, forked._Plain)
    assert p.wait(120) == 0
    assert sys.executable  # the plain process ran the same interpreter
