"""What the live-server tests share: starting processes with their logs kept, waiting for a
server with a deadline, ending every process by its PID (its process group: a server's own
children go with it), the gateway (``awex-cli serve``), the training job, and the HF reference
(greedy decoding with transformers on the trainer's weights of a version)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
#: greedy tokens the server generates per check (with ``ignore_eos``)
TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, n: int = 6000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError as e:
        return f"(no log: {e})"


class Proc:
    """A process in its own process group, its output in ``log``; ``stop`` ends the group."""

    def __init__(self, name: str, argv: list[str], log: str, env: dict[str, str] | None = None) -> None:
        self.name, self.log = name, log
        self.out = open(log, "w")
        self.p = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        self.pid = self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def check(self) -> None:
        """Raises with the log's tail if the process exited."""
        if not self.alive():
            raise RuntimeError(f"{self.name} (pid {self.pid}) exited with {self.p.returncode}; "
                               f"the end of {self.log}:\n{tail(self.log)}")

    def stop(self, grace_s: float = 20.0, sig: int = signal.SIGTERM) -> None:
        """Sends ``sig`` to the process group, then SIGKILL after ``grace_s``."""
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(self.pid, s)
            except ProcessLookupError:
                break
            try:
                self.p.wait(grace_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.pid, signal.SIGKILL)  # what the leader left behind
        except ProcessLookupError:
            pass
        self.out.close()


def http(url: str, body: Any = None, timeout: float = 60.0, method: str | None = None) -> tuple[int, Any]:
    """``(status, parsed JSON or text)`` of one request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_http(proc: Proc, url: str, deadline_s: float) -> float:
    """Waits until ``url`` answers 200 (``proc`` exiting first is an error); returns the seconds."""
    start = time.monotonic()
    while True:
        proc.check()
        try:
            if http(url, timeout=5)[0] == 200:
                return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() - start > deadline_s:
            raise TimeoutError(f"{proc.name} did not answer {url} within {deadline_s:.0f} s; "
                               f"the end of {proc.log}:\n{tail(proc.log)}")
        time.sleep(2)


def awex_cli() -> str:
    for c in (os.environ.get("AWEX_CLI"), f"{ROOT}/target/debug/awex-cli", f"{ROOT}/target/release/awex-cli",
              shutil.which("awex-cli")):
        if c and os.path.exists(c):
            return c
    raise RuntimeError("no awex-cli binary (cargo build -p awex-cli, or set AWEX_CLI)")


def start_gateway(d: str) -> tuple[Proc, str]:
    port = free_port()
    p = Proc("the gateway", [awex_cli(), "serve", "--bind", f"127.0.0.1:{port}", "--ephemeral"],
             os.path.join(d, "gateway.log"))
    url = f"http://127.0.0.1:{port}"
    wait_http(p, url + "/healthz", 60)
    return p, url


class Job:
    """The training job (``trainer.py``): WORLD FSDP2 ranks over gloo, one process each."""

    def __init__(self, d: str, gateway: str, pair: str, model_dir: str, versions: list[int],
                 hold: int | None = None, world: int = 2, tag: str = "job") -> None:
        self.d = d
        port = free_port()
        spec = json.dumps({"versions": versions, "hold": hold})
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self.ranks = [
            Proc(f"training rank {r} ({tag})",
                 [sys.executable, os.path.join(HERE, "trainer.py"), str(r), str(world), str(port), gateway, pair,
                  model_dir, d, spec],
                 os.path.join(d, f"{tag}-rank{r}.out"), env=env)
            for r in range(world)
        ]

    def check(self) -> None:
        for p in self.ranks:
            if not p.alive() and p.p.returncode != 0:
                p.check()

    def joined(self) -> bool:
        """Whether every rank of this job joined the pair (its log says ``joined`` after its
        last ``attached``: a restarted job appends to the same logs)."""
        return all("joined" in tail(os.path.join(self.d, f"rank{r}.log"), 10**6).rsplit("attached", 1)[-1]
                   for r in range(len(self.ranks)))

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.ranks:
            p.p.wait(max(1.0, deadline - time.monotonic()))
            if p.p.returncode != 0:
                p.check()

    def kill(self) -> None:
        for p in self.ranks:
            p.stop(grace_s=10, sig=signal.SIGKILL)

    def stop(self) -> None:
        for p in self.ranks:
            p.stop(grace_s=10)


def hf_greedy(model_dir: str, weights: str | None, prompt: list[int], n: int = TOKENS) -> tuple[list[int], list[float]]:
    """Greedy decoding of ``n`` tokens with transformers' own forward on the model (the weights of
    ``weights``, a ``{name: tensor}`` file the trainer wrote, else the saved model): the tokens and
    each one's log-probability."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(torch.load(weights), strict=False)
        if missing or unexpected:
            raise RuntimeError(f"{weights}: missing {missing}, unexpected {unexpected}")
    ids, toks, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            t = int(torch.argmax(logits))
            toks.append(t)
            lps.append(float(lp[t]))
            ids.append(t)
    return toks, lps
