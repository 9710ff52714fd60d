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


# inference backends that only receive into a training job's own parameters, never serve
_RECEIVERS = {"megatron"}


def _live(model: Any) -> dict[str, Any] | None:
    """What this process's live job says about itself: with a model, everything ``Writer.attach``
    finds; without, Megatron's parallel_state (when initialised) or torch.distributed's rank."""
    import sys

    from . import _attach

    if model is not None:
        found = _attach.inspect(model)
        return {k: v for k, v in found.items() if k != "tensors"}
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return None
    out: dict[str, Any] = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        out["backend"] = "megatron"
        out["parallel"] = _attach.megatron_parallel()
    return out


def detect(
    checkpoint: str | os.PathLike[str] | None = None,
    sglang_url: str | None = None,
    model: Any = None,
) -> dict[str, Any]:
    """Scores every backend awex was built with from this process's environment variables, its
    importable packages (``megatron.core``, ``sglang``, ...), and optionally a checkpoint
    directory and a running SGLang server. Returns ``{"training": [...], "inference": [...],
    "live": ...}``, best first; each entry has ``backend``, ``score`` (0..1), ``evidence`` (what
    it found), ``not_found`` (what it looked for and did not find) and, when known, ``parallel``.
    ``live`` is what the running job says: with ``model`` (as for ``Writer.attach``) its
    ``backend``, ``parallel``, ``rank``, ``world_size``, ``layer_spec``, ``dtype`` and ``spec``;
    without, the initialised process groups' view, or ``None``."""
    packages = {name: _importable(name) for name in _awex.detect_packages()}
    path = os.fspath(checkpoint) if checkpoint is not None else None
    out = _awex.detect(packages, path, sglang_url)
    out["inference"] = [v for v in out["inference"] if v["backend"] not in _RECEIVERS]
    out["live"] = _live(model)
    return out
