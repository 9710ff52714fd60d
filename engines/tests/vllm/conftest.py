"""The vLLM tests need vLLM 0.33.0 importable: it is not in `engines/requirements.lock` (its
pins conflict with SGLang's; `engines/requirements-vllm.txt` lists them, installed with
`pip install --no-deps --target DIR` and put on `PYTHONPATH`). Without it they are skipped,
saying so, instead of failing."""

from __future__ import annotations

import importlib.util

import pytest


def _vllm_importable() -> bool:
    # `vllm` alone may resolve to this tests folder (a namespace package on sys.path): ask for a
    # module only the real package has
    try:
        return importlib.util.find_spec("vllm.config") is not None
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _vllm_importable():
        return
    skip = pytest.mark.skip(
        reason="vllm is not importable: install engines/requirements-vllm.txt (--no-deps --target DIR) and add DIR to PYTHONPATH"
    )
    for item in items:
        if "/vllm/" in str(item.fspath):
            item.add_marker(skip)
