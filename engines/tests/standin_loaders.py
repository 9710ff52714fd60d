"""Custom weight loaders for the stand-in server's own tests."""

from __future__ import annotations

import json
import os
from typing import Any


def record(model: Any, named_tensors: Any) -> None:
    """Appends ``{"rank", "tensors", "pid"}`` to ``$STANDIN_RECORD`` and adds 1 in place to the
    model's first parameter."""
    rank = int(os.environ.get("AWEX_TP_RANK", "-1"))
    try:
        from sglang.srt.runtime_context import get_parallel

        rank = int(get_parallel().tp_rank)
    except Exception:
        pass
    with open(os.environ["STANDIN_RECORD"], "a") as f:
        f.write(json.dumps({"rank": rank, "tensors": len(named_tensors), "pid": os.getpid()}) + "\n")
    p = next(iter(model.parameters()))
    p.data.add_(1)


def boom(model: Any, named_tensors: Any) -> None:
    """Always fails."""
    raise RuntimeError("boom: the loader failed")
