"""``engines/python312.sh``: the Python 3.12 every engine venv is built with, found among the
ones that run. On a machine where ``python3.12`` on PATH is a pyenv shim of an inactive version
("pyenv: python3.12: command not found", exit 127), ``engines/venv.sh`` used to print that error
and the next line of the user's recipe ran ``/bin/python``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIND = os.path.join(ROOT, "engines", "python312.sh")
SHIM = "#!/bin/sh\necho \"pyenv: python3.12: command not found\" >&2\nexit 127\n"


def script(path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def working(path) -> str:
    """A Python 3.12 that runs (this test's own interpreter, the real-engine venv's 3.12)."""
    return script(path, f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")


def run(tmp_path, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """``argv`` with PATH holding the failing shim first, and no pyenv, uv or system 3.12
    but what the test puts there."""
    fake = tmp_path / "shims"
    script(fake / "python3.12", SHIM)
    script(fake / "uv", "#!/bin/sh\nexit 2\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWEX_", "PYENV", "UV_"))}
    base.update(PATH=f"{fake}:/usr/bin:/bin", HOME=str(tmp_path / "home"), PYENV_ROOT=str(tmp_path / "pyenv"),
                AWEX_PYTHON312_SYSTEM="", AWEX_ENGINES_CACHE=str(tmp_path / "cache"))
    base.update(env)
    return subprocess.run(argv, capture_output=True, text=True, env=base, timeout=120)


def test_a_failing_shim_on_path_is_skipped_for_pyenvs_installed_version(tmp_path) -> None:
    older = working(tmp_path / "pyenv" / "versions" / "3.12.1" / "bin" / "python3.12")
    newer = working(tmp_path / "pyenv" / "versions" / "3.12.10" / "bin" / "python3.12")
    out = run(tmp_path, [FIND])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == newer != older


def test_uvs_managed_interpreter_is_found(tmp_path) -> None:
    uv = working(tmp_path / "home" / ".local" / "share" / "uv" / "python" / "cpython-3.12.8-linux-x86_64-gnu" / "bin" / "python3.12")
    out = run(tmp_path, [FIND])
    assert (out.returncode, out.stdout.strip()) == (0, uv), out.stderr


def test_no_python312_says_what_to_install(tmp_path) -> None:
    # an interpreter of another version is not taken either
    script(tmp_path / "pyenv" / "versions" / "3.12.1" / "bin" / "python3.12", f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.exit(1)'\n")
    out = run(tmp_path, [FIND])
    assert out.returncode == 1 and out.stdout == ""
    assert "no Python 3.12 that runs (tried: python3.12 " in out.stderr, out.stderr
    for fix in ("uv python install 3.12", "pyenv install 3.12", "apt-get install python3.12 python3.12-venv",
                "AWEX_ENGINES_PYTHON"):
        assert fix in out.stderr, out.stderr


def test_a_broken_awex_engines_python_is_named_and_nothing_else_is_tried(tmp_path) -> None:
    working(tmp_path / "pyenv" / "versions" / "3.12.1" / "bin" / "python3.12")
    out = run(tmp_path, [FIND], AWEX_ENGINES_PYTHON="python3.12")
    assert out.returncode == 1 and out.stdout == ""
    assert "AWEX_ENGINES_PYTHON=python3.12 is not a Python 3.12 that runs" in out.stderr, out.stderr
    assert "pyenv: python3.12: command not found" in out.stderr


def test_venv_sh_fails_with_the_message_and_prints_no_path(tmp_path) -> None:
    # what `VENV=$(engines/venv.sh)` captures must be nothing, so that `$VENV/bin/python` is not /bin/python
    for tool in ("venv.sh", "vllm-server-venv.sh"):
        out = run(tmp_path, [os.path.join(ROOT, "engines", tool)])
        assert out.returncode == 1 and out.stdout == "", (tool, out.stdout, out.stderr)
        assert "uv python install 3.12" in out.stderr, (tool, out.stderr)
