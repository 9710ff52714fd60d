"""Turning the Python-side ways of naming a model and a layout into what the extension takes."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Mapping


def model_args(model: Any) -> dict[str, str]:
    """``model=`` as the extension's ``model`` (preset or path) or ``model_json`` (a config dict)."""
    if model is None:
        return {}
    if isinstance(model, Mapping):
        return {"model_json": json.dumps(dict(model))}
    if isinstance(model, (str, os.PathLike)):
        return {"model": os.fspath(model)}
    raise TypeError(
        f"model must be a preset name, a config.json path, an HF model directory or a config dict, not {type(model).__name__}"
    )


def fp8_args(infer_quant: Any, infer_config: Any, fp8_block: Any, fp8_recipe: Any) -> dict[str, Any]:
    """``connect``'s FP8 arguments as the extension takes them: ``infer_config`` (a
    ``config.json`` path, an HF directory or a config dict) read into its JSON text."""
    out: dict[str, Any] = {"infer_quant": infer_quant, "fp8_recipe": fp8_recipe}
    if fp8_block is not None:
        if isinstance(fp8_block, (str, bytes)) or len(fp8_block) != 2:
            raise TypeError(f"fp8_block must be two block edges (rows, cols) such as (128, 128), not {fp8_block!r}")
        out["fp8_block"] = [int(e) for e in fp8_block]
    if infer_config is None:
        return out
    if isinstance(infer_config, Mapping):
        out["infer_config_json"] = json.dumps(dict(infer_config))
        return out
    if not isinstance(infer_config, (str, os.PathLike)):
        raise TypeError(
            "infer_config must be the FP8 checkpoint's config.json path, its HF directory or a config dict, "
            f"not {type(infer_config).__name__}"
        )
    from . import _awex

    path = os.fspath(infer_config)
    # read by the extension, as awex-cli reads --infer-config: a FIFO is refused, not waited on
    try:
        out["infer_config_json"] = _awex.read_config(path)
    except ValueError as e:
        raise ValueError(f"infer_config: {e}") from None
    out["infer_config_what"] = os.path.join(path, "config.json") if os.path.isdir(path) else path
    return out


def parallel_config(parallel: Mapping[str, Any] | None, what: str) -> dict[str, int] | None:
    """Checks a parallel config: string keys, non-negative integer values."""
    if parallel is None:
        return None
    if not isinstance(parallel, Mapping):
        raise TypeError(f"{what} must be a dict such as {{'tp': 2, 'pp': 2}}, not {type(parallel).__name__}")
    out: dict[str, int] = {}
    for k, v in parallel.items():
        if not isinstance(k, str):
            raise TypeError(f"{what} keys are strings; got {k!r}")
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{what}[{k!r}] must be a non-negative integer, not {v!r}")
        out[k] = v
    return out


@functools.lru_cache(maxsize=1)
def registered_backends() -> dict[str, tuple[str, ...]]:
    """The backends this build registered, by side: ``{"training": (...), "inference": (...)}``."""
    from . import _awex

    report = _awex.detect({}, None, None)
    return {side: tuple(sorted(v["backend"] for v in report[side])) for side in ("training", "inference")}


def check_backend(backend: str) -> None:
    """Refuses a backend no side registered, naming those that are (as the CLI does)."""
    known = registered_backends()
    if not isinstance(backend, str) or not any(backend in names for names in known.values()):
        from .errors import LayoutError

        raise LayoutError(
            f"no backend named `{backend}`; registered: training {', '.join(known['training'])}; "
            f"inference {', '.join(known['inference'])}"
        )


def spec(backend: str, parallel: Mapping[str, int] | None = None, **keys: int) -> str:
    """A layout spec string, ``spec("megatron", tp=2, pp=2) == "megatron:tp=2,pp=2"``; a
    backend this build did not register is refused with ``awex.LayoutError``."""
    check_backend(backend)
    merged = dict(parallel_config(parallel, "parallel") or {})
    merged.update(parallel_config(keys, "parallel") or {})
    return backend + (":" + ",".join(f"{k}={v}" for k, v in merged.items()) if merged else "")
