"""Reading a live training job: which backend a model object belongs to, its parallel config,
the rank, the layer spec and expert layout, from the model and its process groups.

Megatron-Core: ``megatron.core.parallel_state`` (tp, pp, dp, cp, ep, etp, vpp) and the model's
``TransformerConfig`` (first/last stage layers); the layer spec and the expert module from the
real parameter names, which the backend crates read (``_awex.options_from_names``), so that
the names are spelt once, in Rust. FSDP2: every DTensor parameter's device mesh and
placements, and the fused experts from the names.
"""

from __future__ import annotations

import sys
from typing import Any

from . import _awex
from . import fsdp as _fsdp
from . import megatron as _megatron
from .errors import LayoutError

# the classes that hold the model under `.module` (Megatron DDP, Float16Module, torch DDP)
_WRAPPERS = ("DistributedDataParallel", "Float16Module", "FullyShardedDataParallel")


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: awex reads this rank from the process group "
            "(call torch.distributed.init_process_group first, or pass rank= to awex.Writer)"
        )
    return dist.get_rank(), dist.get_world_size()


def _unwrap(m: Any) -> Any:
    while type(m).__name__ in _WRAPPERS and hasattr(m, "module"):
        m = m.module
    return m


def _is_megatron(chunks: list[Any]) -> bool:
    core = sys.modules.get("megatron.core.transformer.module")
    if core is None:
        return False
    return all(isinstance(_unwrap(c), core.MegatronModule) for c in chunks)


def _is_dtensor(p: Any) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(p, mod.DTensor)


def _names_spec(names: list[str]) -> dict[str, int]:
    """The layer spec and expert module (``local_spec``, ``grouped_gemm``,
    ``single_grouped_weight``), from the real parameter names: awex-megatron, which spells
    those names, reads them (``_awex.options_from_names``)."""
    return dict(_awex.options_from_names("megatron", names))


def megatron_parallel(chunks: list[Any] | None = None) -> dict[str, int]:
    """tp, pp, dp, cp, ep, etp, vpp (and explicit first/last stage layers) of this process."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron.core.parallel_state is not initialized (call parallel_state.initialize_model_parallel first)"
        )
    p = {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(with_context_parallel=False),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    }
    if chunks:
        if p["vpp"] == 1 and len(chunks) > 1:
            p["vpp"] = len(chunks)
        if p["vpp"] != len(chunks):
            raise LayoutError(
                f"parallel_state says virtual pipeline size {p['vpp']} but {len(chunks)} model chunks were given; "
                "pass the list of every chunk of this stage"
            )
        cfg = getattr(_unwrap(chunks[0]), "config", None)
        for key, attr in (("first_stage_layers", "num_layers_in_first_pipeline_stage"),
                          ("last_stage_layers", "num_layers_in_last_pipeline_stage")):
            v = getattr(cfg, attr, None)
            if v is not None:
                p[key] = int(v)
    return p


def _megatron_coords_check(p: dict[str, int], rank: int) -> None:
    """Refuses a rank order other than Megatron's default tp-cp-ep-dp-pp, which awex numbers."""
    from megatron.core import parallel_state as ps

    tp, cp, dp = p["tp"], p["cp"], p["dp"]
    stage = tp * cp * dp
    s = rank % stage
    etp, ep = p["etp"], p["ep"]
    want = {
        "tensor-parallel rank": (s % tp, ps.get_tensor_model_parallel_rank()),
        "context-parallel rank": ((s // tp) % cp, ps.get_context_parallel_rank()),
        "data-parallel rank": (s // (tp * cp), ps.get_data_parallel_rank(with_context_parallel=False)),
        "pipeline stage": (rank // stage, ps.get_pipeline_model_parallel_rank()),
        "expert tensor-parallel rank": (s % etp, ps.get_expert_tensor_parallel_rank()),
        "expert-parallel rank": ((s // etp) % ep, ps.get_expert_model_parallel_rank()),
    }
    for what, (awex_v, mcore_v) in want.items():
        if awex_v != mcore_v:
            raise LayoutError(
                f"global rank {rank} has {what} {mcore_v} in megatron.core.parallel_state, but awex numbers ranks "
                f"in Megatron's default order tp-cp-ep-dp-pp, which gives {awex_v}; initialise parallel_state "
                "with order='tp-cp-ep-dp-pp'"
            )


def _placement_kind(pl: Any) -> str:
    name = type(pl).__name__
    if name == "Replicate":
        return "R"
    if "Shard" in name:
        return f"S{getattr(pl, 'dim', 0)}"
    return name


def _mesh_roles(names: list[str], kinds: list[set[str]]) -> list[str]:
    """Which of replicate / dp / tp each mesh dim is: from its name when it has one
    (``("replicate", "shard")``, ``("dp", "tp")``), else from the placements on it (HSDP's
    replicate dim holds only ``Replicate``)."""
    roles: list[str] = []
    for d, k in enumerate(kinds):
        named = names[d].lower() if d < len(names) else ""
        if "rep" in named or named == "ddp":
            roles.append("replicate")
        elif "tp" in named or "tensor" in named:
            roles.append("tp")
        elif "dp" in named or "shard" in named or "fsdp" in named:
            roles.append("dp")
        else:
            roles.append("")
    if all(roles):
        return roles
    n = len(kinds)
    if n == 1:
        return ["replicate"] if kinds[0] == {"R"} else ["dp"]
    if n == 2:
        return ["replicate", "dp"] if kinds[0] == {"R"} else ["dp", "tp"]
    return ["replicate", "dp", "tp"][:n] if n == 3 else [f"dim{d}" for d in range(n)]


def fsdp_parallel(params: list[tuple[str, Any]], rank: int) -> dict[str, int]:
    """dp, replicate, tp of an FSDP2 (HSDP, FSDP + TP) module, from its DTensors' meshes and placements."""
    dts = [(n, p) for n, p in params if _is_dtensor(p)]
    if not dts:
        raise LayoutError("no parameter is a DTensor: shard the module with fully_shard (FSDP2) first")
    mesh = max((p.device_mesh for _, p in dts), key=lambda m: m.ndim)
    kinds: list[set[str]] = [set() for _ in range(mesh.ndim)]
    for n, p in dts:
        if p.device_mesh.ndim != mesh.ndim:
            continue
        for d, pl in enumerate(p.placements):
            kinds[d].add(_placement_kind(pl))
    roles = _mesh_roles(list(mesh.mesh_dim_names or []), kinds)
    order = {"replicate": 0, "dp": 1, "tp": 2}
    if (
        any(r not in order for r in roles)
        or len(set(roles)) != len(roles)
        or [order[r] for r in roles] != sorted(order[r] for r in roles)
    ):
        raise LayoutError(
            f"FSDP device mesh of shape {tuple(mesh.shape)} has dims {roles} (from placements {kinds}); "
            "awex supports a (replicate, dp, tp) mesh in that order"
        )
    sizes = {"dp": 1, "replicate": 1, "tp": 1}
    for d, r in enumerate(roles):
        sizes[r] = int(mesh.size(d))
    flat = [int(x) for x in mesh.mesh.flatten().tolist()]
    if flat != list(range(len(flat))):
        raise LayoutError(
            f"FSDP device mesh {mesh.mesh.tolist()} is not ranks 0..{len(flat) - 1} in row-major order; "
            "awex numbers ranks as (replicate * dp + dp_rank) * tp + tp_rank"
        )
    coord = mesh.get_coordinate()
    if coord is not None:
        c = dict(zip(roles, coord))
        awex_rank = (c.get("replicate", 0) * sizes["dp"] + c.get("dp", 0)) * sizes["tp"] + c.get("tp", 0)
        if awex_rank != rank:
            raise LayoutError(f"global rank {rank} sits at mesh coordinate {coord}, which awex numbers {awex_rank}")
    out = dict(sizes)
    # transformers 5's fused experts from the names awex-fsdp gives them, and the transformers
    # release whose dtype rules the parameters follow (fp32 routers from 5.24)
    out.update(_awex.options_from_tensors("fsdp", [(n, _dtype_name(p)) for n, p in params]))
    return out


def _dtype_name(t: Any) -> str:
    return str(getattr(t, "dtype", "")).replace("torch.", "")


def _dtype(tensors: list[tuple[str, Any]]) -> str | None:
    kinds = {_dtype_name(t) for _, t in tensors}
    return kinds.pop() if len(kinds) == 1 else None


def _main_dtype(tensors: list[tuple[str, Any]]) -> str | None:
    """The dtype that holds most elements (a bf16 model whose routers transformers keeps in fp32
    is bf16)."""
    count: dict[str, int] = {}
    for _, t in tensors:
        n = t.numel() if hasattr(t, "numel") else 0
        count[_dtype_name(t)] = count.get(_dtype_name(t), 0) + int(n)
    return max(count, key=lambda k: count[k]) if count else None


def inspect(model: Any) -> dict[str, Any]:
    """What ``Writer.attach`` finds in a live model: ``backend``, ``parallel``, ``rank``,
    ``world_size``, ``layer_spec``, ``dtype``, ``spec`` (the layout spec string) and
    ``tensors`` (the named local tensors to register)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("no model chunks given")
    rank, world = _rank_and_world()
    if _is_megatron(chunks):
        tensors = _megatron.named_tensors(chunks if len(chunks) > 1 else chunks[0])
        # the parameters' dtype (the router's fp32 expert_bias buffer aside)
        dtype = _dtype([t for c in chunks for t in c.named_parameters()])
        p = megatron_parallel(chunks)
        _megatron_coords_check(p, rank)
        names = [n for n, _ in tensors]
        p.update(_names_spec(names))
        backend = "megatron"
        layer_spec = "local" if p["local_spec"] else "transformer_engine"
        expected = p["tp"] * p["pp"] * p["dp"] * p["cp"]
    else:
        params = []
        for c in chunks:
            params.extend(c.named_parameters())
        if not any(_is_dtensor(p) for _, p in params):
            raise LayoutError(
                f"{type(chunks[0]).__name__} is neither a Megatron-Core model (MegatronModule, possibly "
                "wrapped in DistributedDataParallel / Float16Module, or a list of VPP chunks) nor a module "
                "with FSDP2 (DTensor) parameters"
            )
        p = fsdp_parallel(params, rank)
        tensors = _fsdp.named_tensors(chunks[0]) if len(chunks) == 1 else [
            t for c in chunks for t in _fsdp.named_tensors(c)
        ]
        backend = "fsdp"
        layer_spec = "hf"
        dtype = _main_dtype(params)
        expected = p["dp"] * p["replicate"] * p["tp"]
    if expected != world:
        raise LayoutError(
            f"the {backend} parallel config {p} spans {expected} ranks but torch.distributed has {world}"
        )
    spec = backend + ":" + ",".join(f"{k}={v}" for k, v in p.items())
    return {
        "backend": backend,
        "parallel": p,
        "rank": rank,
        "world_size": world,
        "layer_spec": layer_spec,
        "dtype": dtype,
        "spec": spec,
        "tensors": tensors,
    }


def parse_spec(spec: str) -> tuple[str, dict[str, int]]:
    """``"megatron:tp=2,pp=2"`` -> ``("megatron", {"tp": 2, "pp": 2})``."""
    backend, _, rest = spec.partition(":")
    out: dict[str, int] = {}
    for part in filter(None, rest.split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = int(v)
    return backend, out


def resolved(backend: str, p: dict[str, int]) -> dict[str, int]:
    """A parallel config with the backend's defaults filled in, those that follow other keys
    included (Megatron's etp = tp, grouped_gemm = not local_spec), as the backend itself fills
    them (``_awex.resolved_parallel``)."""
    return dict(_awex.resolved_parallel(backend, p))


def check_pair(found: dict[str, Any], pair: str, pair_spec: str, layout_dtype: str | None, moe: bool) -> None:
    """Refuses a live config that disagrees with the pair's training side, naming each difference."""
    backend, theirs = parse_spec(pair_spec)
    if backend != found["backend"]:
        raise LayoutError(
            f"this process runs a {found['backend']} model, but pair `{pair}` describes its training side as "
            f"`{pair_spec}`; connect the pair with train=\"{found['spec']}\""
        )
    mine, theirs_r = resolved(backend, found["parallel"]), resolved(backend, theirs)
    # the dtypes that `fp32` (Megatron) and `transformers` (FSDP) decide are compared tensor by
    # tensor (check_tensors): a model without routers looks the same under every release
    ignore = {"fp32", "transformers"} | (set() if moe else {"grouped_gemm", "single_grouped_weight", "etp", "ep"})
    diffs = [
        f"{k}={mine.get(k)} here but {k}={theirs_r.get(k)} in the pair"
        for k in sorted(set(mine) | set(theirs_r))
        if k not in ignore and mine.get(k) != theirs_r.get(k)
    ]
    if diffs:
        raise LayoutError(
            f"the live {backend} job disagrees with pair `{pair}` (`{pair_spec}`): " + "; ".join(diffs)
            + f"; connect the pair with train=\"{found['spec']}\""
        )
    live = found.get("dtype")
    if layout_dtype is not None and live is not None and _DTYPE_NAMES.get(layout_dtype, layout_dtype) != live:
        hint = " (fp32=1 says the trainer keeps fp32 parameters of a lower-precision model)" if backend == "megatron" else ""
        raise LayoutError(
            f"the live parameters are {live} but pair `{pair}`'s training layout needs {layout_dtype}{hint}"
        )


def check_tensors(found: dict[str, Any], pair: str, pair_spec: str, layout: list[dict[str, Any]]) -> None:
    """Refuses live tensors whose dtype or shape differ from the pair's training layout, naming
    every one: a rank registers its tensors in place, so awex converts dtypes between the sides
    (the sender narrows or widens to what the engine holds), never within a rank."""
    want = {t["name"]: (list(t["shape"]), t["dtype"]) for t in layout}
    diffs = []
    for name, t in found["tensors"]:
        if name not in want:
            continue  # register names a tensor the layout does not have
        shape, dtype = [int(x) for x in getattr(t, "shape", ())], _dtype_name(t)
        w_shape, w_dtype = want[name]
        if shape != w_shape or dtype != _DTYPE_NAMES.get(w_dtype, w_dtype):
            diffs.append(f"`{name}` is {dtype} {shape} here but the layout needs {w_dtype} {w_shape}")
    if not diffs:
        return
    n = len(diffs)
    shown = diffs if n <= 8 else diffs[:8] + [f"and {n - 8} more"]
    backend, theirs = parse_spec(pair_spec)
    hint = ""
    if backend == found["backend"] == "fsdp":
        mine_v = resolved(backend, found["parallel"]).get("transformers")
        theirs_v = resolved(backend, theirs).get("transformers")
        if mine_v != theirs_v:
            hint = (
                f"; the live dtypes follow the rules of transformers={mine_v} (the release the fsdp key "
                f"`transformers` names, major * 100 + minor), the pair's layout those of transformers={theirs_v}: "
                f"connect the pair with train=\"{found['spec']}\""
            )
    raise LayoutError(
        f"{n} live tensor{'s' if n != 1 else ''} of this rank disagree{'s' if n == 1 else ''} with pair "
        f"`{pair}`'s training layout (`{pair_spec}`): " + "; ".join(shown) + hint
    )


_DTYPE_NAMES = {
    "f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64", "u8": "uint8", "i8": "int8",
    "i32": "int32", "i64": "int64", "f8e4m3": "float8_e4m3fn",
}
