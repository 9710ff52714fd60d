"""The vLLM tests need vLLM 0.33.0 importable: it is not in `engines/requirements.lock` (its
pins conflict with SGLang's); `engines/vllm-pkgs.sh VENV` installs `engines/requirements-vllm.lock`
into a folder of its own, which goes on `PYTHONPATH`. Without it the tests are skipped, saying
why; with `AWEX_REQUIRE_VLLM=1` (set by `.ci/engines`) every one of them fails instead."""

from __future__ import annotations

import importlib.util
import os

import pytest

REASON = ("vllm is not importable: put the folder `engines/vllm-pkgs.sh VENV` prints on PYTHONPATH "
          "(engines/requirements-vllm.lock, installed --no-deps --target DIR)")


def _vllm_importable() -> bool:
    # `vllm` alone may resolve to this tests folder (a namespace package on sys.path): ask for a
    # module only the real package has
    try:
        return importlib.util.find_spec("vllm.config") is not None
    except ImportError:
        return False


def required() -> bool:
    """Whether a missing vLLM fails the tests (CI) instead of skipping them."""
    return os.environ.get("AWEX_REQUIRE_VLLM", "") not in ("", "0")


def _mine(item: pytest.Item) -> bool:
    return "/vllm/" in str(item.fspath)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if required() or _vllm_importable():
        return
    for item in items:
        if _mine(item):
            item.add_marker(pytest.mark.skip(reason=REASON))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # before any fixture (the Megatron world of test_from_megatron.py is module-scoped)
    if required() and _mine(item) and not _vllm_importable():
        pytest.fail(f"AWEX_REQUIRE_VLLM is set and {REASON}", pytrace=False)
