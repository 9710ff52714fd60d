"""docs/quickstart-rl.md, run as written: every block marked ``<!-- awex-guide: run -->`` in one
bash (``set -euo pipefail``, the steps share variables), each step's output checked against the
``<!-- awex-guide: prints -->`` block under it (a line of it matches a line of the output, in
order, ``...`` matching any text). The page's server commands are checked to be the CPU
commands of docs/vllm.md and docs/sglang.md, which the live tests run.

The whole guide (both live servers and the training job) runs with ``AWEX_QUICKSTART=1``
(``.ci/engines`` sets it); the ports the guide defaults to are set to free ones, which the guide
allows (``: "${GW_PORT:=7480}"``). Its scratch folder is kept after a failure.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile

import pytest

import serve

GUIDE = "docs/quickstart-rl.md"
BLOCK = re.compile(r"^<!-- awex-guide: (run|prints) -->\n```\w*\n(.*?)^```", re.M | re.S)
#: the guide's server blocks: (the doc, its block, what the guide appends to run it in the background)
SERVERS = {"vllm": ("docs/vllm.md", "vllm-cpu", ' > "$W/vllm.log" 2>&1 &'),
           "sglang": ("docs/sglang.md", "sglang-cpu", ' > "$W/sglang.log" 2>&1 &')}

pytestmark = pytest.mark.timeout(3600)


def steps() -> list[tuple[str, str | None]]:
    """The guide's ``(run block, prints block or None)`` in order."""
    with open(os.path.join(serve.ROOT, GUIDE)) as f:
        text = f.read()
    out: list[tuple[str, str | None]] = []
    for m in BLOCK.finditer(text):
        if m.group(1) == "run":
            out.append((m.group(2), None))
        else:
            assert out and out[-1][1] is None, f"{GUIDE}: a prints block without a run block before it"
            out[-1] = (out[-1][0], m.group(2))
    return out


def matches(pattern: str, output: str) -> str | None:
    """None when every line of ``pattern`` matches a line of ``output`` in order (``...`` any
    text), else the first line that does not."""
    lines = output.splitlines()
    i = 0
    for p in pattern.splitlines():
        if p.strip() in ("", "..."):
            continue
        rx = re.compile(".*".join(re.escape(part) for part in p.split("...")))
        while i < len(lines) and not rx.fullmatch(lines[i]):
            i += 1
        if i == len(lines):
            return p
        i += 1
    return None


def test_matches_reads_dots_as_any_text_and_keeps_the_order() -> None:
    out = "a\nversion 1 (loss 3.2): rl-vllm committed in 0.4 s\nb\nok\n"
    assert matches("version 1 (loss ...): rl-vllm committed in ... s\nok", out) is None
    assert matches("ok\nversion 1 (loss ...): rl-vllm committed in ... s", out) is not None
    assert matches("version 2 (loss ...)...", out) == "version 2 (loss ...)..."


def test_the_guides_server_commands_are_the_ones_the_live_tests_run() -> None:
    runs = [run for run, _ in steps()]
    assert len(runs) >= 8, f"{GUIDE}: {len(runs)} run blocks"
    for name, (doc, block, background) in SERVERS.items():
        want = serve.commands(serve.doc_block(doc, block))
        assert len(want) == 1
        found = [c for run in runs for c in serve.commands(run) if c.endswith(background)]
        assert len(found) == 1, f"{GUIDE}: no single command of the {name} server ending in {background!r}"
        assert found[0][: -len(background)] == want[0], (
            f"{GUIDE}'s {name} server command differs from {doc}'s block {block}:\n{found[0]}\n{want[0]}")
    # every run block has what it prints, but the two that start a server in the background
    assert sum(p is None for _, p in steps()) == len(SERVERS)


@pytest.mark.skipif(os.environ.get("AWEX_QUICKSTART", "") in ("", "0"),
                    reason="the whole guide runs with AWEX_QUICKSTART=1 (.ci/engines sets it): two live servers")
def test_the_guide_runs_as_written() -> None:
    script = ["set -euo pipefail"]
    for i, (run, _) in enumerate(steps()):
        # test-only lines between the steps: where each step's output starts, and the scratch folder
        script += [f"echo '@@step {i}'", run, f"echo \"@@scratch ${{W:-}}\""]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_", "SGLANG_", "PYTHON")) and k not in ("AWEX_GATEWAY", "AWEX_PAIR", "AWEX_ENGINE",
                                                                       "AWEX_TOKEN", "VIRTUAL_ENV")}
    # (the guide's names, not VLLM_PORT / SGLANG_PORT: the engines read those from their
    # environment as the first of their internal ports; on 2026-12-06 an SGLang rank's socket
    # took the HTTP port that SGLANG_PORT named, "[Errno 98] address already in use")
    env.update(GW_PORT=str(serve.free_port()), PORT_VLLM=str(serve.free_port()), PORT_SGLANG=str(serve.free_port()))
    err = tempfile.NamedTemporaryFile("w+", prefix="awex-quickstart-stderr-", suffix=".log", delete=False)
    p = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=serve.ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=err, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=3300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the servers, when a step failed before the last one
        except ProcessLookupError:
            pass
    scratch = re.findall(r"^@@scratch (.+)$", out, re.M)
    logs = ""
    if scratch and os.path.isdir(scratch[-1]):
        for name in ("gateway.log", "vllm.log", "sglang.log"):
            logs += f"\n--- the end of {scratch[-1]}/{name}:\n{serve.tail(os.path.join(scratch[-1], name), 3000)}"
    why = f"stdout:\n{out[-6000:]}\nstderr ({err.name}):\n{serve.tail(err.name, 4000)}{logs}"
    parts = re.split(r"^@@step (\d+)\n", out, flags=re.M)
    printed = {int(parts[i]): re.sub(r"^@@scratch.*\n?", "", parts[i + 1], flags=re.M) for i in range(1, len(parts), 2)}
    for i, (run, prints) in enumerate(steps()):
        assert i in printed, f"step {i} of {GUIDE} did not run (bash exited {p.returncode}):\n{run}\n{why}"
        if prints is not None:
            missing = matches(prints, printed[i])
            assert missing is None, f"step {i} of {GUIDE} did not print {missing!r}:\n{run}\n{why}"
    assert p.returncode == 0, f"bash exited {p.returncode}\n{why}"
    os.unlink(err.name)
