"""Python scripts started the way ``subprocess.Popen([sys.executable, script, *args])`` starts
them, but forked from a forkserver that imported the heavy modules once (torch, an engine):
on a 2-core machine each import costs 10-20 s a process, most of a test case's time.

A process has one forkserver, whose preloaded modules are fixed when it starts: the first
caller's ``preload`` wins, and a caller asking for another one gets ``None`` from
:func:`context` (and :func:`popen` falls back to a plain subprocess), so SGLang's preload (which
installs a stub ``vllm`` module) never reaches a vLLM rank. ``AWEX_RANKS_SPAWN=1`` turns the
forkserver off: every process starts afresh.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from typing import Any

#: the module the forkserver of this process preloads, once chosen
_CHOSEN: str | None = None


def context(preload: str) -> Any:
    """The forkserver context whose server imported ``preload`` first, or ``None`` when this
    process's forkserver preloads another module or ``AWEX_RANKS_SPAWN`` is set."""
    global _CHOSEN
    if os.environ.get("AWEX_RANKS_SPAWN", "") not in ("", "0"):
        return None
    if _CHOSEN is None:
        _CHOSEN = preload
        mp.get_context("forkserver").set_forkserver_preload([preload])
        # the forkserver imports `preload` with the sys.path of a fresh interpreter (Python
        # 3.12.1's does not take the parent's): hand this one over through PYTHONPATH while
        # it starts (it starts now, and preloads while the caller goes on)
        from multiprocessing import forkserver

        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
    return mp.get_context("forkserver") if _CHOSEN == preload else None


def _run(script: str, args: list[str], log: str, env: dict[str, str] | None) -> None:
    """The child: stdout and stderr into ``log``, ``env`` as its environment, then ``script``
    as ``__main__`` with ``args``; exits with the script's status."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    code = 0
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            # the OpenMP runtime read the variable when the forkserver loaded torch
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import runpy

        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class Forked:
    """A script forked from the forkserver, with ``Popen``'s ``wait``, ``poll``, ``kill`` and
    ``returncode``."""

    def __init__(self, ctx: Any, script: str, args: list[str], log: str, env: dict[str, str] | None) -> None:
        self.p = ctx.Process(target=_run, args=(script, list(args), log, env), daemon=False)
        self.p.start()
        self.pid = self.p.pid

    @property
    def returncode(self) -> int | None:
        return self.p.exitcode

    def poll(self) -> int | None:
        return self.p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.p.join(timeout)
        if self.p.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked {self.p.name}", timeout or 0)
        return self.p.exitcode

    def kill(self) -> None:
        self.p.kill()
        self.p.join(10)


class _Plain:
    """``subprocess.Popen`` of the same script, its output into ``log`` (the fallback)."""

    def __init__(self, script: str, args: list[str], log: str, env: dict[str, str] | None) -> None:
        self.out = open(log, "w")
        self.p = subprocess.Popen([sys.executable, script, *args], stdout=self.out, stderr=subprocess.STDOUT, env=env)
        self.pid = self.p.pid

    @property
    def returncode(self) -> int | None:
        return self.p.returncode

    def poll(self) -> int | None:
        return self.p.poll()

    def wait(self, timeout: float | None = None) -> int:
        code = self.p.wait(timeout)
        self.out.close()
        return code

    def kill(self) -> None:
        self.p.kill()
        self.p.wait(10)
        self.out.close()


def popen(script: str, args: list[str], log: str, preload: str, env: dict[str, str] | None = None) -> Any:
    """Starts ``python script *args`` with its output in ``log``: forked from the forkserver
    that preloads ``preload`` when this process has (or can start) one, else a plain process."""
    ctx = context(preload)
    if ctx is None:
        return _Plain(script, args, log, env)
    return Forked(ctx, script, args, log, env)


def run(script: str, args: list[str], log: str, preload: str, env: dict[str, str] | None = None,
        timeout: float = 600) -> None:
    """:func:`popen`, waited for; a non-zero exit raises with the end of ``log``."""
    t = time.monotonic()
    p = popen(script, args, log, preload, env)
    code = p.wait(timeout)
    if code != 0:
        with open(log, errors="replace") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{os.path.basename(script)} {' '.join(args)[:200]} exited with {code} after "
                           f"{time.monotonic() - t:.0f} s:\n{tail}")
