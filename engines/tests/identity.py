"""Checkpoints whose every element names itself, and the runs of canonical elements an engine's
parameter holds: how the hybrid-model tests (``test_hybrid_sglang_params.py``,
``vllm/test_hybrid_vllm_params.py``) read an engine's own load element by element."""

from __future__ import annotations

import os
from typing import Any

import checkpoints

#: Elements per tensor the identity encoding can name (the largest tiny tensor: 1000 x 64).
SPAN = 1 << 16


def identity_checkpoint(arch: str, path: str) -> list[str]:
    """A checkpoint of ``arch`` (transformers' own names, shapes and config) whose element
    ``i`` of the ``t``-th tensor (by name) is ``(t + 1) * SPAN + i``. Returns the names."""
    import numpy as np
    from safetensors.numpy import save_file

    checkpoints.write(path, arch, tied=False, seed=3)
    tensors = checkpoints.tensors(path)
    names = sorted(tensors)
    assert len(names) + 1 < (1 << 24) // SPAN, len(names)
    out = {}
    for t, name in enumerate(names):
        shape = tensors[name].shape
        n = int(np.prod(shape))
        assert n <= SPAN, (name, shape)
        out[name] = ((t + 1) * SPAN + np.arange(n, dtype=np.int64)).astype(np.float32).reshape(shape)
    save_file(out, os.path.join(path, "model.safetensors"))
    return names


def runs_of(values: Any) -> list[list[int]]:
    """A parameter's elements as maximal runs of consecutive canonical elements:
    ``[local start, canonical tensor (its index in the sorted names), canonical start, length]``;
    zeros, which no checkpoint element is, are padding and in no run."""
    import numpy as np

    flat = values.reshape(-1).astype(np.float64)
    ints = flat.astype(np.int64)
    if not (flat == ints).all():
        bad = int(np.flatnonzero(flat != ints)[0])
        raise AssertionError(f"element {bad} = {flat[bad]} is no checkpoint element (changed on load)")
    runs: list[list[int]] = []
    i, n = 0, len(ints)
    while i < n:
        if ints[i] == 0:
            i += 1
            continue
        t, e = divmod(int(ints[i]), SPAN)
        j = i + 1
        while j < n and ints[j] == ints[j - 1] + 1 and ints[j] // SPAN == t:
            j += 1
        runs.append([i, t - 1, e, j - i])
        i = j
    return runs
