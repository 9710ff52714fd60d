"""awex: move fresh model weights from a training job into inference engines between RL steps.

A training process creates a ``Writer`` per rank, an inference process a ``Reader`` per rank;
both ``register`` their local tensors (zero copy), ``join`` the pair, then call ``update`` for
every version the ``Controller`` (the RL loop) starts. The gateway (``awex-cli serve``) is the
control plane; the bytes move between the ranks directly (shared memory or TCP).

    import awex
    with awex.Writer("http://gateway:7480", "rl", rank=r) as w:
        w.register(awex.megatron.named_tensors(model))
        w.join()
        while training:
            step()
            w.update(version)

``awex.Writer.attach(model, gateway, pair)`` does the same reading the backend, the parallel
config, the rank and the layer spec from the live Megatron-Core or FSDP2 model.
"""

from __future__ import annotations

from . import fsdp, megatron, sglang, vllm
from ._awex import __version__
from ._controller import Controller
from ._detect import detect
from ._rank import Reader, Writer
from ._spec import spec
from .errors import AwexError, Disconnected, GatewayError, LayoutError, UpdateFailed

__all__ = [
    "Writer",
    "Reader",
    "Controller",
    "detect",
    "spec",
    "AwexError",
    "LayoutError",
    "GatewayError",
    "UpdateFailed",
    "Disconnected",
    "megatron",
    "fsdp",
    "sglang",
    "vllm",
    "__version__",
]
