"""What the live-server tests share: starting processes with their logs kept, waiting for a
server with a deadline, ending every process by its PID (its process group: a server's own
children go with it; ``scratch``), the gateway (``awex-cli serve``), the training job (FSDP2,
``trainer.py``, or Megatron-Core, ``megatron_trainer.py``), and the HF reference (greedy
decoding with transformers on the trainer's weights of a version)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
#: greedy tokens the server generates per check (with ``ignore_eos``)
TOKENS = 16

sys.path.insert(0, os.path.dirname(HERE))
from ports import free_port  # noqa: E402  (engines/tests/ports.py)


def tail(path: str, n: int = 6000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError as e:
        return f"(no log: {e})"


class Proc:
    """A process in its own process group, its output in ``log``; ``stop`` ends the group."""

    def __init__(self, name: str, argv: list[str], log: str, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.name, self.log = name, log
        self.out = open(log, "w")
        self.p = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
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


@contextlib.contextmanager
def scratch(request: Any, prefix: str) -> Iterator[tuple[str, list[Proc]]]:
    """A live fixture's scratch folder and processes: yields ``(dir, procs)``, the fixture
    appends every process it starts to ``procs``. An error (the fixture's own, e.g. a server
    that does not start) prints the end of each process's log; in the end every process is
    stopped, the last started first, and the folder is removed unless a test of the fixture's
    scope failed or ``AWEX_LIVE_KEEP`` is set (it holds the model and every log)."""
    d = tempfile.mkdtemp(prefix=prefix)
    procs: list[Proc] = []
    failed_before, failed = request.session.testsfailed, True
    try:
        yield d, procs
        failed = request.session.testsfailed > failed_before
    except BaseException:
        for p in procs:
            print(f"--- the end of {p.log}:\n{tail(p.log)}")
        raise
    finally:
        for p in reversed(procs):
            p.stop()
        if failed or os.environ.get("AWEX_LIVE_KEEP"):
            print(f"kept {d} (the model, the server's, the gateway's and the training ranks' logs)")
        else:
            shutil.rmtree(d, ignore_errors=True)


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


class PortTaken(RuntimeError):
    """A server's log says its port was taken before it could bind it."""


#: what a server's log says when its port is taken (uvicorn: "[Errno 98] error while attempting
#: to bind on address ...: address already in use"); the server may stay up without listening
PORT_TAKEN = "address already in use"


def wait_http(proc: Proc, url: str, deadline_s: float) -> float:
    """Waits until ``url`` answers 200 (``proc`` exiting first is an error, its log saying its
    port was taken raises :class:`PortTaken` at once); returns the seconds."""
    start = time.monotonic()
    while True:
        proc.check()
        if PORT_TAKEN in tail(proc.log, 1 << 20).lower():
            raise PortTaken(f"{proc.name} could not bind the port of {url}; the end of {proc.log}:\n{tail(proc.log)}")
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


def start_http(name: str, argv: Any, log: str, health: str, deadline_s: float, procs: list[Proc],
               env: dict[str, str] | None = None, attempts: int = 3,
               cwd: str | None = None) -> tuple[Proc, str, float]:
    """Starts an HTTP server on a :func:`free_port` and waits for ``health`` to answer 200:
    ``argv(port)`` is its command line. A port taken before the server bound it (its log says
    so) stops that server and starts it again on another port, up to ``attempts`` times; each
    attempt after the first logs to ``log`` with ``-N`` before the extension. Every process
    started is appended to ``procs``. Returns ``(proc, url, seconds)``."""
    root, ext = os.path.splitext(log)
    for attempt in range(1, attempts + 1):
        port = free_port()
        p = Proc(name, argv(port), log if attempt == 1 else f"{root}-{attempt}{ext}", env=env, cwd=cwd)
        procs.append(p)
        url = f"http://127.0.0.1:{port}"
        try:
            return p, url, wait_http(p, url + health, deadline_s)
        except PortTaken:
            p.stop()
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


#: the marker before a fenced block of the docs that the tests run (``doc_block``)
MARKER = re.compile(r"^<!-- awex-command: ([\w-]+) -->\n```\w*\n(.*?)^```", re.M | re.S)


def doc_blocks(path: str) -> dict[str, str]:
    """Every block of the page ``path`` (relative to the repository's root) that follows a
    ``<!-- awex-command: NAME -->`` line, by NAME (a name given twice on one page is an error)."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    out: dict[str, str] = {}
    for m in MARKER.finditer(text):
        if m.group(1) in out:
            raise ValueError(f"{path}: two blocks marked awex-command: {m.group(1)}")
        out[m.group(1)] = m.group(2)
    return out


def doc_block(path: str, name: str) -> str:
    """The block of the page ``path`` marked ``<!-- awex-command: NAME -->``."""
    blocks = doc_blocks(path)
    if name not in blocks:
        raise ValueError(f"{path} has no block marked <!-- awex-command: {name} --> (it has {sorted(blocks)}): "
                         "the live tests run the commands the docs show, so the page must keep that marker")
    return blocks[name]


VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def shell_command(block: str, values: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """One shell command of a docs block, as the shell would run it: ``(env, argv)``. The block
    is one command (lines joined at a trailing backslash; ``#`` comments dropped), optionally
    ``env NAME=value ... PROGRAM ARGS``; quotes are removed as the shell removes them and every
    ``$NAME`` / ``${NAME}`` inside double quotes is replaced by ``values[NAME]`` (a name not in
    ``values`` is an error, so a variable the docs add must be given by the test; an unquoted
    ``$`` is refused, the shell would split its value)."""
    lines = [ln for ln in block.replace("\\\n", " ").splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if len(lines) != 1:
        raise ValueError(f"a docs command block must hold one command, not {len(lines)}: {block!r}")
    words: list[str] = []
    # shlex drops the quotes: expand `$` in the raw word unless it was single-quoted
    for raw in _raw_words(lines[0]):
        word = "".join(shlex.split(raw, comments=False))
        if "'" in raw and "$" in raw:
            raise ValueError(f"a docs command word mixes single quotes and $: {raw} (quote it with \" instead)")
        if "$" in raw and not (raw.count('"') >= 2 and all(_inside_double(raw, m.start()) for m in VAR.finditer(raw))):
            raise ValueError(f"a docs command word with an unquoted $: {raw} (the shell would split it; quote it with \")")
        if "'" not in raw:
            def sub(m: re.Match) -> str:
                name = m.group(1) or m.group(2)
                if name not in values:
                    raise ValueError(f"the docs command uses ${name}, which the test does not set: {lines[0]}")
                return values[name]
            word = VAR.sub(sub, word)
        words.append(word)
    env: dict[str, str] = {}
    if words and words[0] == "env":
        words = words[1:]
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if not words:
        raise ValueError(f"a docs command without a program: {lines[0]}")
    return env, words


def _inside_double(word: str, at: int) -> bool:
    """Whether position ``at`` of ``word`` lies inside double quotes."""
    return word[:at].count('"') % 2 == 1


def _raw_words(line: str) -> list[str]:
    """``line`` split into shell words with their quotes kept (a comment ends it)."""
    words, cur, quote, i = [], "", None, 0
    while i < len(line):
        c = line[i]
        if quote:
            cur += c
            if c == quote:
                quote = None
        elif c in "'\"":
            quote, cur = c, cur + c
        elif c == "#" and not cur:
            break
        elif c.isspace():
            if cur:
                words.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    if quote:
        raise ValueError(f"an unclosed {quote} in {line}")
    if cur:
        words.append(cur)
    return words


def at_port(argv: list[str], port: int) -> list[str]:
    """``argv`` with its ``{port}`` placeholder (what :func:`shell_command` was given for
    ``$PORT``) replaced: :func:`start_http` picks the port of each attempt."""
    return [a.replace("{port}", str(port)) for a in argv]


def commands(block: str) -> list[str]:
    """The shell commands of a docs block, one a line (lines joined at a trailing backslash,
    comments and blank lines dropped)."""
    return [ln.strip() for ln in block.replace("\\\n", " ").splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def with_tp(env: dict[str, str], argv: list[str], tp: int) -> tuple[dict[str, str], list[str]]:
    """A docs command (tensor parallel 2) for ``tp`` ranks: the size flag's value and the
    OpenMP binding (``0|1`` to one core a rank)."""
    if tp == 2:
        return env, argv
    argv = list(argv)
    for flag in ("--tensor-parallel-size", "--tp"):
        if flag in argv:
            argv[argv.index(flag) + 1] = str(tp)
    env = {k: ("|".join(str(i) for i in range(tp)) if k.endswith("_OMP_THREADS_BIND") else v) for k, v in env.items()}
    return env, argv


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """A docs command with the value of its ``flag`` (which it must have) replaced."""
    if flag not in argv:
        raise ValueError(f"the docs command has no {flag}: {argv}")
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def start_gateway(d: str, procs: list[Proc]) -> str:
    _, url, _ = start_http("the gateway", lambda port: [awex_cli(), "serve", "--bind", f"127.0.0.1:{port}", "--ephemeral"],
                           os.path.join(d, "gateway.log"), "/healthz", 60, procs)
    return url


#: the training jobs the live tests run, by the pair's training side: one script each, the same
#: arguments (``trainer.py``'s docstring)
TRAINERS = {"fsdp:dp=2": "trainer.py", "fsdp:dp=2,fused_experts=1": "trainer.py",
            "megatron:tp=2,local_spec=1": "megatron_trainer.py"}


class Job:
    """A training job (``TRAINERS[train]``): WORLD ranks over gloo, one process each."""

    def __init__(self, d: str, gateway: str, pair: str, model_dir: str, versions: list[int],
                 hold: int | None = None, world: int = 2, tag: str = "job", train: str = "fsdp:dp=2") -> None:
        self.d = d
        # a restarted job appends to the same rank logs: read only what this job wrote
        self.logs = [os.path.join(d, f"rank{r}.log") for r in range(world)]
        self.offsets = [os.path.getsize(p) if os.path.exists(p) else 0 for p in self.logs]
        port = free_port()
        spec = json.dumps({"versions": versions, "hold": hold})
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self.ranks = [
            Proc(f"training rank {r} ({tag})",
                 [sys.executable, os.path.join(HERE, TRAINERS[train]), str(r), str(world), str(port), gateway, pair,
                  model_dir, d, spec],
                 os.path.join(d, f"{tag}-rank{r}.out"), env=env)
            for r in range(world)
        ]

    def check(self) -> None:
        for p in self.ranks:
            if not p.alive() and p.p.returncode != 0:
                p.check()

    def joined(self) -> bool:
        """Whether every rank of this job joined the pair (wrote ``joined`` to its log)."""
        for path, offset in zip(self.logs, self.offsets):
            try:
                with open(path, errors="replace") as f:
                    f.seek(offset)
                    if " joined\n" not in f.read():  # trainer.py's line "HH:MM:SS joined"
                        return False
            except OSError:
                return False
        return True

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


def hf_model(model_dir: str, weights: str | None) -> Any:
    """transformers' own model of ``model_dir`` in float32, with the weights of ``weights`` (a
    ``{name: tensor}`` file the trainer wrote, of the model's dtype) when given, else the saved
    model's."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(torch.load(weights), strict=False)
        if missing or unexpected:
            raise RuntimeError(f"{weights}: missing {missing}, unexpected {unexpected}")
    return model


def hf_forced(model_dir: str, weights: str | None, prompt: list[int],
              tokens: list[int]) -> tuple[list[float], list[float]]:
    """transformers' forward (``hf_model``) over ``prompt + tokens``: for each of ``tokens``, its
    log-probability and the largest log-probability at its position (what greedy decoding takes)."""
    import torch

    model = hf_model(model_dir, weights)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    rows = lp[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    return ([float(r[t]) for r, t in zip(rows, tokens)], [float(r.max()) for r in rows])


def hf_greedy(model_dir: str, weights: str | None, prompt: list[int], n: int = TOKENS) -> tuple[list[int], list[float]]:
    """Greedy decoding of ``n`` tokens with transformers' own forward on the model (``hf_model``):
    the tokens and each one's log-probability."""
    import torch

    model = hf_model(model_dir, weights)
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


#: the largest difference allowed between a server's and transformers' log-probability of a
#: generated token (float32 on both sides; the engines' CPU kernels and transformers' sum differently)
LOGPROB_TOL = 1e-3
#: how long one update (or a re-join) may take on a loaded 2-core machine
UPDATE_S = 300.0


def completion(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The server's greedy tokens for ``prompt`` (``/v1/completions``, ``ignore_eos``) and their
    log-probabilities."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 1}
    status, out = http(url + "/v1/completions", body, timeout=120)
    if status != 200:
        raise AssertionError(f"/v1/completions answered {status}: {out}")
    choice = out["choices"][0]
    return [int(t) for t in choice["token_ids"]], [float(x) for x in choice["logprobs"]["token_logprobs"]]


def assert_serves(url: str, model_dir: str, weights: str | None, what: str,
                  logprob_tol: float = LOGPROB_TOL, near_ties: float | None = None) -> list[int]:
    """Checks that the server at ``url`` generates what transformers does with ``weights``
    (log-probabilities within ``logprob_tol``); returns the tokens. With ``near_ties`` (a server
    computing in bf16, transformers in float32: their greedy choices may part where the best two
    tokens are that close) the server's tokens are checked as a greedy decoding of transformers'
    model up to ``near_ties``: at every position transformers' log-probability of the server's
    token is within ``near_ties`` of the largest there (so it is transformers' own choice wherever
    the best two are further apart) and within ``logprob_tol`` of the server's."""
    import tiny_model

    prompt = tiny_model.prompt_ids(model_dir)
    got, got_lp = completion(url, prompt)
    if near_ties is not None:
        want_lp, best = hf_forced(model_dir, weights, prompt, got)
        behind = [(i, t, round(b - w, 3)) for i, (t, w, b) in enumerate(zip(got, want_lp, best)) if b - w > near_ties]
        assert not behind, (f"{what}: the server generates {got}, which is not transformers' greedy decoding on "
                            f"the trainer's weights: (position, token, log-probability behind the best) {behind}")
        worst = max(abs(a - b) for a, b in zip(got_lp, want_lp))
        ties = sum(1 for w, b in zip(want_lp, best) if w < b)
        print(f"{what}: {len(got)} tokens, transformers' greedy choice ({ties} within {near_ties} of a better one), "
              f"log-probabilities within {worst:.2e} (tolerance {logprob_tol})")
        assert worst <= logprob_tol, f"{what}: log-probabilities differ by up to {worst:.2e} (> {logprob_tol})"
        return got
    want, want_lp = hf_greedy(model_dir, weights, prompt)
    assert got == want, f"{what}: the server generates {got}, transformers on the trainer's weights {want}"
    worst = max(abs(a - b) for a, b in zip(got_lp, want_lp))
    print(f"{what}: {len(got)} tokens equal, log-probabilities within {worst:.2e} (tolerance {logprob_tol})")
    assert worst <= logprob_tol, f"{what}: log-probabilities differ by up to {worst:.2e} (> {logprob_tol})"
    return want


def wait_for(cond, timeout: float, what: str, check=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f} s")
        time.sleep(0.5)


def scenario(live: dict[str, Any], pair: str, infer: str, served_version, train: str = "fsdp:dp=2",
             deltas: bool = False, logprob_tol: float = LOGPROB_TOL, near_ties: float | None = None,
             serves_the_checkpoint: bool = True) -> None:
    """The live tests' story against one started server (``live``: ``dir``, ``model``,
    ``gateway``, ``url``, ``server``, ``procs``): the untouched server generates what
    transformers does with the saved model; a training job (``train``, a key of ``TRAINERS``:
    FSDP2 dp 2 or Megatron-Core tp 2, two processes over gloo) connected through the gateway
    with the server's URL (an atomic pair) sends versions 1-3, each committed, served (greedy
    tokens equal, log-probabilities within ``LOGPROB_TOL``) and reported by
    ``served_version(url)``; version 4 runs while the job is killed: it fails, the server answers
    with version 3 and reports it; a restarted job (the same steps) retries, version 4 commits
    and is served. With ``deltas`` the pair is connected with delta updates: versions 2 and 3
    must move only what the optimiser step changed against the version the server holds (the
    update's ``base``), and their measured density and bytes are printed. ``logprob_tol`` and
    ``near_ties``: those of every check (``assert_serves``). ``serves_the_checkpoint`` False: the
    server is known to serve something else than its checkpoint when the story starts (a test
    before it left it so), so its first tokens are taken unchecked; every version is checked."""
    import awex
    import tiny_model

    d, url, model = live["dir"], live["url"], live["model"]

    def check(weights: str | None, what: str) -> list[int]:
        return assert_serves(url, model, weights, what, logprob_tol=logprob_tol, near_ties=near_ties)

    before = check(None, "before any update") if serves_the_checkpoint else completion(url, tiny_model.prompt_ids(model))[0]
    ctl = awex.Controller(live["gateway"])
    ctl.connect(pair, model=model, train=train, infer=infer, transport="tcp", urls=[url], atomic=True,
                join_deadline_s=UPDATE_S, update_deadline_s=60, deltas=deltas)
    job = Job(d, live["gateway"], pair, model, versions=[1, 2, 3, 4], hold=4, train=train)
    try:
        ctl.wait_ready(UPDATE_S)
        served = {0: before}
        for v in (1, 2, 3):
            t0 = time.monotonic()
            st = ctl.update(v, timeout=UPDATE_S)
            assert st["state"] == "committed", st
            print(f"version {v} committed in {time.monotonic() - t0:.1f} s")
            if deltas and v > 1:
                # taken against the version the server provably holds, and counted
                base, delta = st.get("base") or {}, st.get("delta") or {}
                assert base.get("version") == v - 1 and not base.get("except"), st
                dense, elements = delta["dense_bytes"]["inference"], delta["elements"]["inference"]
                changed, moved = delta["changed"]["inference"], st["bytes"]["inference"]
                assert elements > 0 and dense > 0, st
                print(f"version {v}: a delta against version {v - 1}: {changed / elements:.2%} of the "
                      f"elements changed, {moved} of {dense} dense bytes moved ({moved / dense:.2%})")
            elif deltas:
                assert not st.get("base"), f"the first update must move every byte: {st}"
            served[v] = check(os.path.join(d, f"v{v}.pt"), f"version {v}")
            assert served[v] != served[v - 1], f"versions {v - 1} and {v} generate the same tokens: the check cannot fail"
            assert served_version(url) == str(v)

        # version 4: rank 1 holds its part back; the job is killed while the version runs
        ctl.start_update(4)
        wait_for(lambda: os.path.exists(os.path.join(d, "held4")), UPDATE_S, "held version 4", job.check)
        wait_for(lambda: (ctl.status(pair)["current_update"] or {}).get("state") == "running", 60,
                 "running version 4")
        job.kill()
        try:
            ctl.wait_update(4, timeout=UPDATE_S)
        except awex.UpdateFailed as e:
            print(f"version 4 failed as it must: {e}")
        else:
            raise AssertionError("version 4 committed although the training job was killed while it ran")
        st = ctl.status(pair)
        assert (st["torn_version"], st["serving_version"]) == (None, 3), st
        live["server"].check()
        wait_for(lambda: served_version(url) == "3", 60, "version 3 reported after the failure")
        assert check(os.path.join(d, "v3.pt"), "after the failed version 4") == served[3]

        # the retry: a restarted job takes the same four steps and sends version 4 again
        job = Job(d, live["gateway"], pair, model, versions=[4], tag="restart", train=train)
        wait_for(job.joined, UPDATE_S, "re-join of the restarted job", job.check)
        st = ctl.update(4, timeout=UPDATE_S)
        assert (st["state"], st["attempt"]) == ("committed", 2), st
        check(os.path.join(d, "v4.pt"), "version 4, retried")
        assert served_version(url) == "4"
        job.wait(120)
    except BaseException:
        for p in job.ranks + live["procs"]:
            print(f"--- the end of {p.log}:\n{tail(p.log)}")
        for r in range(2):
            print(f"--- training rank {r}'s log:\n{tail(os.path.join(d, f'rank{r}.log'))}")
        raise
    finally:
        job.stop()
        try:
            ctl.disconnect(pair)
        except Exception:  # noqa: BLE001 -- the pair may be gone with a failure above
            pass
