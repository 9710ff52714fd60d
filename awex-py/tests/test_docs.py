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


def _section(doc: str, title: str) -> str:
    text = (ROOT / doc).read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _code_of(block: str) -> list[str]:
    """A python block's code and the code in its comments (``# or by hand: w = ...``), as
    parseable snippets."""
    import ast

    snippets = [block]
    for line in block.splitlines():
        if "#" not in line:
            continue
        comment = line.split("#", 1)[1].strip()
        comment = comment.split(":", 1)[1].strip() if comment.startswith("or by hand:") else comment
        for part in comment.split(";"):
            try:
                ast.parse(part.strip())
            except SyntaxError:
                continue
            snippets.append(part.strip())
    return snippets


def test_fp8_framework_snippets_name_real_apis() -> None:
    """docs/fp8.md, "From each training framework": every ``awex.`` name its Python blocks use
    exists, every keyword passed to ``connect``, ``Writer`` or ``Writer.attach`` is a parameter
    of it, and every method called on the controller (``ctl``) or a Writer (``w``) is one."""
    import ast
    import inspect

    import awex

    blocks = re.findall(r"```python\n(.*?)```", _section("docs/fp8.md", "From each training framework"), flags=re.S)
    assert len(blocks) == 3, len(blocks)
    connect = set(inspect.signature(awex.Controller.connect).parameters)
    writer = set(inspect.signature(awex.Writer.__init__).parameters)
    owners = {"ctl": awex.Controller, "w": awex.Writer}
    checked = set()
    for block in blocks:
        for code in _code_of(block):
            for dotted in re.findall(r"\bawex(?:\.[A-Za-z_]\w*)+", code):
                obj: object = awex
                for attr in dotted.split(".")[1:]:
                    assert hasattr(obj, attr), f"docs/fp8.md uses `{dotted}`, which does not exist"
                    obj = getattr(obj, attr)
                checked.add(dotted)
            for node in ast.walk(ast.parse(code)):
                if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Attribute, ast.Name)):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else func.id
                kwargs = {k.arg for k in node.keywords if k.arg}
                if name == "connect":
                    assert kwargs <= connect, f"Controller.connect has no {kwargs - connect}"
                elif name in ("Writer", "attach"):
                    assert kwargs <= writer, f"awex.Writer has no {kwargs - writer}"
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in owners:
                    owner = owners[func.value.id]
                    assert hasattr(owner, name), f"{owner.__name__} has no method `{name}`"
                    checked.add(f"{func.value.id}.{name}")
    # the flags the text gives for connecting without an FP8 checkpoint
    assert {"infer_config", "infer_quant", "fp8_block", "fp8_recipe"} <= connect
    for name in ("awex.Controller", "awex.Writer.attach", "awex.Writer", "awex.megatron.named_tensors",
                 "awex.fsdp.named_tensors", "ctl.connect", "ctl.update", "w.update", "w.close", "w.register",
                 "w.join"):
        assert name in checked, (name, sorted(checked))
