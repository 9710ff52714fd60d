"""PyTorch FSDP2 (``fully_shard``, HSDP, FSDP + TP): the local shards of a training rank under
their HF module names, as awex's ``fsdp`` backend names them."""

from __future__ import annotations

from typing import Any

# wrapper segments that FSDP1, activation checkpointing and torch.compile insert into names
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean(name: str) -> str:
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def named_tensors(module: Any) -> list[tuple[str, Any]]:
    """``[(name, local shard)]`` of an FSDP2-sharded module, ready for ``Writer.register``.

    Each DTensor parameter contributes its local shard (``p.to_local()``: this rank's rows under
    ``torch.chunk`` semantics, possibly empty), which shares memory with the parameter; plain
    tensors are passed as they are.
    """
    out: list[tuple[str, Any]] = []
    for name, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out.append((_clean(name), local))
    return out


__all__ = ["named_tensors"]
