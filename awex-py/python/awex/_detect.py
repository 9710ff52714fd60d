"""``detect()``: which training and inference engines run in this process's environment."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from . import _awex


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def detect(checkpoint: str | os.PathLike[str] | None = None, sglang_url: str | None = None) -> dict[str, Any]:
    """Scores every backend awex was built with from this process's environment variables, its
    importable packages (``megatron.core``, ``sglang``, ...), and optionally a checkpoint
    directory and a running SGLang server. Returns ``{"training": [...], "inference": [...]}``,
    best first; each entry has ``backend``, ``score`` (0..1), ``evidence`` (what it found),
    ``not_found`` (what it looked for and did not find) and, when known, ``parallel``."""
    packages = {name: _importable(name) for name in _awex.detect_packages()}
    path = os.fspath(checkpoint) if checkpoint is not None else None
    return _awex.detect(packages, path, sglang_url)
