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
    tensors are passed as they are. A module's persistent buffers follow its parameters: the
    ones a checkpoint stores (``state_dict`` beyond the parameters; FSDP2 leaves them whole on
    every rank), such as GLM-4.5's router ``mlp.gate.e_score_correction_bias``. Non-persistent
    ones (rotary ``inv_freq``) are not part of the model awex moves. The order is
    ``named_parameters()``'s (modules in ``named_modules()`` order, a shared parameter once).
    """
    out: list[tuple[str, Any]] = []
    modules = getattr(module, "named_modules", None)
    if modules is None:
        for name, p in module.named_parameters():
            out.append((_clean(name), p.to_local() if hasattr(p, "to_local") else p))
        return out
    seen: set[int] = set()
    for prefix, m in modules():
        for name, p in m.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = p.to_local() if hasattr(p, "to_local") else p
            out.append((_clean(f"{prefix}.{name}" if prefix else name), local))
        skip = getattr(m, "_non_persistent_buffers_set", set())
        for name, b in getattr(m, "_buffers", {}).items():
            if b is not None and name not in skip:
                out.append((_clean(f"{prefix}.{name}" if prefix else name), b))
    return out


__all__ = ["named_tensors"]
