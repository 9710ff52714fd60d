"""The documentation's Python examples are complete programs: each runs, as its own process,
against a gateway started in this one (``awex._testing``), and must exit 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from awex import _testing

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)


def example(doc: str, marker: str) -> str:
    """The one ```python block of ``doc`` that contains ``marker``."""
    found = [b for b in python_blocks(doc) if marker in b]
    assert len(found) == 1, f"{doc}: {len(found)} python blocks contain {marker!r}"
    return found[0]


def run_program(code: str, gateway: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AWEX_GATEWAY=gateway)
    env.pop("AWEX_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("doc", "marker", "lines"),
    [
        ("README.md", 'ctl.connect("readme"', ["version 3 committed: "]),
        ("docs/python.md", "def controller(", ["version 3: committed, "]),
    ],
)
def test_doc_example_is_a_complete_program(doc: str, marker: str, lines: list[str]) -> None:
    code = example(doc, marker)
    gateway = _testing.start_gateway()
    done = run_program(code, gateway)
    assert done.returncode == 0, f"{doc} example failed:\n{done.stdout}\n{done.stderr}"
    for line in lines:
        assert line in done.stdout, done.stdout
