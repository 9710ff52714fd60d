"""Runs a multi-process training job for the conformance tests: an in-process awex gateway,
the HF side (checkpoint sender, SGLang-layout readers) in this process, and WORLD rank
processes over one gloo group that run every case in order (so process groups and imports are
paid once per world)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from ports import free_port  # noqa: E402,F401  (engines/tests/ports.py)
TIMEOUT = 240.0
NP = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "i64": np.int64, "i32": np.int32}
try:
    import ml_dtypes

    NP["bf16"] = ml_dtypes.bfloat16
except ImportError:  # bf16 readers need it
    pass



def selected(cases: list[dict]) -> list[dict]:
    """The cases ``AWEX_TRAIN_CASES`` keeps (a comma-separated subset of case names, for
    working on one case; every case without it). The tests are parametrised over what it keeps,
    so a left-out case neither runs nor starts its world's processes."""
    only = os.environ.get("AWEX_TRAIN_CASES")
    if not only:
        return cases
    keep = {n.strip() for n in only.split(",")}
    return [c for c in cases if c["name"] in keep]


@contextlib.contextmanager
def scratch_dir(name: str) -> Iterator[str]:
    """A fresh folder of this test run (its own, not pytest's shared per-user base folder),
    removed afterwards; kept when AWEX_TRAIN_KEEP is set, to read the rank logs."""
    d = tempfile.mkdtemp(prefix=f"awex-train-{name}-")
    try:
        yield d
    finally:
        if not os.environ.get("AWEX_TRAIN_KEEP"):
            shutil.rmtree(d, ignore_errors=True)




class Threads:
    """Runs callables in threads and re-raises the first failure on `wait`."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def start(self, fn: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 -- re-raised by wait()
                self.errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def wait(self, timeout: float = TIMEOUT) -> None:
        for t in self.threads:
            t.join(timeout)
        if any(t.is_alive() for t in self.threads):
            raise TimeoutError("a rank thread did not finish")
        if self.errors:
            raise self.errors[0]


def send_canonical(gateway: str, pair: str, canon: dict[str, Any]) -> None:
    """An awex Writer in the one-rank `fsdp:dp=1` layout (the checkpoint's names and full
    shapes), registered with the checkpoint's tensors, sending version 1."""
    import awex

    arrays = {n: t.numpy() for n, t in canon.items()}
    with awex.Writer(gateway, pair, 0, timeout=TIMEOUT) as w:
        w.register(arrays)
        w.join(TIMEOUT)
        w.update(1, timeout=TIMEOUT)


def receive(gateway: str, pair: str, ranks: int, threads: Threads) -> dict[int, dict[str, np.ndarray]]:
    """Readers of every inference rank (engine 0) with zeroed numpy tensors of their layout."""
    import awex

    out: dict[int, dict[str, np.ndarray]] = {}
    for r in range(ranks):
        rd = awex.Reader(gateway, pair, r, engine=0, timeout=TIMEOUT)
        arrays = {t["name"]: np.zeros(t["shape"], NP[t["dtype"]]) for t in rd.layout()}
        rd.register(arrays)
        out[r] = arrays

        def go(rd: Any = rd) -> None:
            try:
                rd.join(TIMEOUT)
                rd.update(1, timeout=TIMEOUT)
            finally:
                rd.close()

        threads.start(go)
    return out


def launch(worker: str, world: int, gateway: str, cases: list[dict], out: str) -> list[subprocess.Popen]:
    path = os.path.join(out, "cases.json")
    with open(path, "w") as f:
        json.dump(cases, f)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = []
    for r in range(world):
        log = open(os.path.join(out, f"rank{r}.log"), "w")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, worker), str(r), str(world), str(port), gateway, path, out],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        ))
    return procs


def wait_ready(ctl: Any, pair: str, procs: list[subprocess.Popen], out: str) -> None:
    """Waits until every rank of `pair` joined, failing at once when a rank process died."""
    deadline = time.time() + TIMEOUT
    while True:
        try:
            ctl.wait_ready(5.0, pair=pair)
            return
        except TimeoutError:
            check_alive(procs, out)
            if time.time() > deadline:
                raise


def check_alive(procs: list[subprocess.Popen], out: str) -> None:
    for r, p in enumerate(procs):
        if p.poll() not in (None, 0):
            with open(os.path.join(out, f"rank{r}.log")) as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"rank {r} exited with {p.returncode}:\n{tail}")


def finish(procs: list[subprocess.Popen], out: str, timeout: float = TIMEOUT) -> list[dict]:
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
    results = []
    for r in range(len(procs)):
        try:
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append(json.load(f))
        except FileNotFoundError:
            results.append({})
    check_alive(procs, out)
    return results
