"""Shared fixtures: an in-process gateway, tiny models, and a whole pair run from threads."""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import pytest

import awex
from awex import _testing

# qwen3-tiny's sizes (GQA 4 heads over 2 KV heads, vocab 1000 is padded by both engines), fp32
TINY_F32: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "_name_or_path": "tiny-f32",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

_names = itertools.count()


@pytest.fixture(scope="session")
def gateway() -> str:
    return _testing.start_gateway()


@pytest.fixture()
def pair_name(request: pytest.FixtureRequest) -> str:
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"py-{os.getpid()}-{next(_names)}-{base}"


def run_all(calls: list[Callable[[], Any]], timeout: float = 120.0) -> list[Any]:
    """Runs every call in its own thread (ranks block until all of them arrive) and returns
    their results, re-raising the first exception."""
    with ThreadPoolExecutor(max_workers=len(calls)) as ex:
        futures = [ex.submit(c) for c in calls]
        return [f.result(timeout=timeout) for f in futures]


def np_dtype(name: str) -> Any:
    if name == "bf16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return ml_dtypes.bfloat16
    return {"f32": np.float32, "f16": np.float16, "f64": np.float64, "u8": np.uint8,
            "i8": np.int8, "i32": np.int32, "i64": np.int64}[name]


def boxes(t: dict[str, Any]):
    """(canonical name, canonical slices, local slices, extent) of every placement of a tensor."""
    for p in t["placements"]:
        if p.get("transposed"):
            # (an inference engine holding the box with its last two dims swapped: gpt-oss's
            # experts); these helpers slice boxes as they are
            raise NotImplementedError(f"`{t['name']}` holds `{p['canonical']}` transposed; boxes() does not slice transposed placements")
        off, ext = p["region"]["offset"], p["region"]["extent"]
        loc = p["local_offset"]
        lead = len(loc) - len(ext)
        canon = tuple(slice(o, o + e) for o, e in zip(off, ext))
        local = tuple(
            slice(l, l + 1) if i < lead else slice(l, l + ext[i - lead]) for i, l in enumerate(loc)
        )
        yield p["canonical"], canon, local, tuple(ext)


def canonical_shapes(layouts: list[list[dict[str, Any]]]) -> dict[str, tuple[int, ...]]:
    """Full canonical shapes, from the union of a side's placements (the training side covers
    every canonical tensor)."""
    shapes: dict[str, list[int]] = {}
    for layout in layouts:
        for t in layout:
            for name, canon, _, _ in boxes(t):
                ends = [s.stop for s in canon]
                old = shapes.setdefault(name, ends)
                shapes[name] = [max(a, b) for a, b in zip(old, ends)]
    return {k: tuple(v) for k, v in shapes.items()}


def fill_from_canonical(layout, canonical, dtype_of, rng) -> dict[str, np.ndarray]:
    """A rank's local arrays holding the canonical values at their placements and random junk
    in the padding (which must never travel)."""
    out = {}
    for t in layout:
        dt = dtype_of(t["dtype"])
        a = rng.integers(0, 256, size=int(np.prod(t["shape"])) * np.dtype(dt).itemsize, dtype=np.uint8)
        a = a.view(dt).reshape(t["shape"])
        for name, canon, local, ext in boxes(t):
            a[local] = canonical[name][canon].astype(dt).reshape(a[local].shape)
        out[t["name"]] = a
    return out


def expected_local(t: dict[str, Any], canonical, dtype) -> np.ndarray:
    """What an inference rank's tensor must hold: canonical values at its placements, zero
    elsewhere."""
    a = np.zeros(t["shape"], dtype=dtype)
    for name, canon, local, _ in boxes(t):
        a[local] = canonical[name][canon].astype(dtype).reshape(a[local].shape)
    return a


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(view), b.view(view))


def shm_segments(pair: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"awex-{pair}-"))
    except FileNotFoundError:
        return []
