"""Megatron-Core: the named tensors of a training rank, as awex's ``megatron`` backend names them.

Works with both layer specs: Transformer Engine (``linear_qkv.layer_norm_weight``, ...) and the
local spec (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``; connect the pair with
``megatron:...,local_spec=1``), and every expert module: TEGroupedMLP
(``mlp.experts.linear_fc1.weight{j}``), SequentialMLP (``mlp.experts.local_experts.{j}.linear_fc1.weight``,
``grouped_gemm=0``; the only one the local spec builds) and a single grouped weight
(``single_grouped_weight=1``). Multi-latent attention (DeepSeek-V3) has ``input_layernorm.weight``
under both specs; its local spec shows in ``self_attention.kv_layernorm.weight`` (Transformer
Engine's is ``linear_kv_up_proj.layer_norm_weight``). ``awex.Writer.attach`` picks all of it from
the names.
"""

from __future__ import annotations

from typing import Any, Iterable

# the attribute name Megatron's DistributedDataParallel and Float16Module wrap their model under
_WRAPPER = "module."


def _strip_wrappers(name: str) -> str:
    while name.startswith(_WRAPPER):
        name = name[len(_WRAPPER) :]
    return name


def named_tensors(model: Any) -> list[tuple[str, Any]]:
    """``[(name, tensor)]`` of a Megatron-Core model on this rank, ready for ``Writer.register``.

    ``model`` is a ``GPTModel``, possibly wrapped (``DistributedDataParallel``,
    ``Float16Module``: their ``module.`` prefixes are removed), or the list of model chunks that
    Megatron builds with virtual pipeline parallelism (``vpp > 1``): chunk ``v``'s names get the
    ``model{v}.`` prefix awex uses. A one-element list is a plain model. A router's
    score-correction bias follows the router's weight: ``mlp.router.expert_bias``, an fp32
    buffer (``TopKRouter`` with ``moe_router_enable_expert_bias``), which awex moves as the
    checkpoint's ``e_score_correction_bias``.
    """
    chunks: list[Any] = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("no model chunks given")
    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for v, chunk in enumerate(chunks):
        prefix = f"model{v}." if len(chunks) > 1 else ""
        for name, p in _params_and_expert_bias(chunk):
            full = prefix + _strip_wrappers(name)
            if full in seen:
                raise ValueError(f"parameter name `{full}` appears twice")
            seen.add(full)
            out.append((full, p))
    return out


def _params_and_expert_bias(chunk: Any) -> Iterable[tuple[str, Any]]:
    """``chunk.named_parameters()``, each module's ``expert_bias`` buffer after its parameters."""
    modules = getattr(chunk, "named_modules", None)
    if modules is None:
        yield from chunk.named_parameters()
        return
    seen: set[int] = set()
    for prefix, m in modules():
        for name, p in m.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield (f"{prefix}.{name}" if prefix else name), p
        b = getattr(m, "_buffers", {}).get(_EXPERT_BIAS)
        if b is not None:
            yield (f"{prefix}.{_EXPERT_BIAS}" if prefix else _EXPERT_BIAS), b


#: The router's score-correction bias buffer (megatron/core/transformer/moe/router.py).
_EXPERT_BIAS = "expert_bias"


def allocations(named: Iterable[tuple[str, Any]]) -> list[dict[str, Any]]:
    """The memory allocations behind registered torch tensors: one entry per storage, in order
    of first appearance, ``{"device", "base", "bytes", "names"}``.

    Megatron DDP with the distributed optimizer (and any ``_ParamAndGradBuffer``) keeps every
    parameter of a bucket group as a view of one contiguous ``buffer.param_data``: those
    parameters are one allocation here, as the cuda-ipc transport sees them (one IPC handle
    per allocation, the pointer of each tensor resolved to its allocation's base with
    ``cuMemGetAddressRange``; awex_gpu::cuda::ipc), not one per parameter.
    """
    out: list[dict[str, Any]] = []
    index: dict[tuple[str, int], int] = {}
    for name, t in named:
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if key not in index:
            index[key] = len(out)
            out.append({"device": str(t.device), "base": st.data_ptr(), "bytes": st.nbytes(), "names": []})
        out[index[key]]["names"].append(name)
    return out


def param_buffers(model: Any) -> list[Any]:
    """The contiguous parameter buffers (``param_data``) of a Megatron ``DistributedDataParallel``
    (``model.buffers`` and ``model.expert_parallel_buffers``), or of each VPP chunk of a list;
    empty for a model without them (plain module, DDP without the distributed optimizer)."""
    chunks: list[Any] = list(model) if isinstance(model, (list, tuple)) else [model]
    out: list[Any] = []
    for c in chunks:
        for attr in ("buffers", "expert_parallel_buffers"):
            bufs = getattr(c, attr, None)
            if not isinstance(bufs, (list, tuple)):  # nn.Module.buffers is a method
                continue
            for b in bufs:
                data = getattr(b, "param_data", None)
                if data is not None:
                    out.append(data)
    return out


__all__ = ["allocations", "named_tensors", "param_buffers"]
