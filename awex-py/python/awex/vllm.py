"""vLLM: awex as a native weight-transfer backend of an unmodified vLLM (0.32, 0.33).

vLLM runs every ``vllm.general_plugins`` entry point in each worker before the model is built;
awex's wheel declares ``awex = "awex.vllm:register"``, which registers
:class:`AwexWeightTransferEngine` with ``WeightTransferEngineFactory.register_engine("awex", ...)``
(``vllm/distributed/weight_transfer/factory.py``). Start the server with::

    AWEX_GATEWAY=http://gateway:7480 AWEX_PAIR=rl VLLM_SERVER_DEV_MODE=1 \\
        vllm serve M --weight-transfer-config '{"backend": "awex"}'

and connect the pair with ``infer="vllm:tp=N,..."`` and the server's URL: the gateway calls
``/init_weight_transfer_engine`` once (every worker builds and joins its ``awex.Reader``), then per
update ``/pause`` -> ``/start_weight_update`` -> ``/update_weights {"update_info": {"version": N}}``
-> ``/finish_weight_update`` -> ``/resume`` (``vllm/entrypoints/rl/online/api_router.py``).

The live parameters are not always what was loaded: after loading, each layer's quantisation
method runs ``process_weights_after_loading``, which may repack or replace them (vLLM's CPU
platform prepacks every unquantised linear layer and leaves ``layer.weight`` an empty parameter:
``dispatch_cpu_unquantized_gemm(..., remove_weight=True)``, ``vllm/model_executor/layers/utils.py``;
FP8 and other quantised methods transform their weights). So every worker receives into awex's
own *landing* tensors, one per parameter of the rank's layout in the shape vLLM loads it in
(what ``record_metadata_for_reloading`` recorded when the model was built), and only once its
``awex.Reader`` returned (in an atomic pair: once every rank received and the gateway said
``apply``) feeds them to the model through vLLM's layerwise reload
(``vllm/model_executor/model_loader/reload/layerwise.py``: ``initialize_layerwise_reload``, each
parameter loaded with vLLM's ``default_weight_loader`` since the tensor is this rank's shard
already, ``finalize_layerwise_reload``), which re-runs every layer's post-load processing and
copies the result into the live tensors' storage (CUDA graphs keep their addresses). A transfer
that fails leaves the model untouched. The landing tensors cost one copy of the rank's weights
(on the model's device).

Delta updates (a pair connected with ``deltas``, ``docs/deltas.md``): only awex writes the
landing tensors (vLLM's reload reads them: ``default_weight_loader`` copies each into the
materialised parameter, ``param.data.copy_``, ``model_loader/weight_utils.py``, and the post-load
step works on that), so after each update they hold exactly the version received and the Reader
takes deltas against it; the reload then runs on the whole landed weights as for a full update.
``AWEX_VLLM_DELTAS=0`` in the server's environment makes its ranks refuse deltas (every byte).

A block-FP8 server (a pair connected with the FP8 checkpoint's ``infer_config``): the layout's
FP8 tensors are ``f8e4m3`` and the landing tensors are vLLM's loadable ``float8_e4m3fn`` weights
and fp32 ``weight_scale_inv`` (``Fp8LinearMethod`` / ``Fp8MoEMethod.create_weights``); the
Reader receives the trainer's bf16 into host staging and quantises into them with the pair's
recipe, and the layerwise reload runs vLLM's FP8 post-load on them. A pair whose encoding does
not match the served model (connected without the FP8 config, or with another block) is refused
when the landing tensors are built, naming the parameter (``landing_tensors``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

#: the backend name in ``--weight-transfer-config``
BACKEND = "awex"

_lock = threading.Lock()
_log = logging.getLogger("awex.vllm")

#: the process-wide Reader (one vLLM worker is one TP rank)
_reader: Any = None
#: the Reader's registered landing tensors, ``{name: tensor}`` in the layout's order
_landing: dict[str, Any] = {}

#: awex's dtype names (``awex-core/src/dtype.rs``) -> torch's attribute names
_TORCH_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
                 "u8": "uint8", "i8": "int8", "i32": "int32", "i64": "int64", "f8e4m3": "float8_e4m3fn"}


def named_tensors(model: Any) -> list[tuple[str, Any]]:
    """``[(name, tensor)]`` of a vLLM model as awex's ``vllm`` backend names them.

    ``named_parameters()`` lists a tied ``lm_head.weight`` once, as ``model.embed_tokens.weight``
    (``ParallelLMHead.tie_weights`` shares the Parameter), which is what the layout expects.
    """
    module = model
    if not hasattr(module, "named_parameters"):
        module = getattr(model, "model", None)
        if module is None or not hasattr(module, "named_parameters"):
            raise TypeError(f"expected a vLLM model (an nn.Module), not {type(model).__name__}")
    return [(n.replace("_orig_mod.", ""), p.data) for n, p in module.named_parameters()]


def _modules(model: Any) -> dict[str, Any]:
    """``{module name: module}`` of a vLLM model, named as ``named_tensors`` names parameters
    (without ``torch.compile``'s ``_orig_mod``)."""
    if not hasattr(model, "named_modules"):
        raise TypeError(f"expected a vLLM model (an nn.Module), not {type(model).__name__}")
    return {".".join(p for p in n.split(".") if p != "_orig_mod"): m for n, m in model.named_modules()}


def _parameter(modules: dict[str, Any], name: str) -> tuple[Any, str]:
    """``(module, attribute)`` that holds parameter ``name``."""
    owner, _, attr = name.rpartition(".")
    module = modules.get(owner)
    if module is None or module._parameters.get(attr) is None:
        raise ValueError(f"awex.vllm: the layout names `{name}`, which is not a parameter of the served "
                         "model; the pair's model or vllm parallel config differs from the server's")
    return module, attr


def loadable_shapes(model: Any, names: list[str]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """``{name: (shape, torch dtype)}`` each parameter is *loaded* in: what vLLM recorded for
    layerwise reload when it built the model (``record_metadata_for_reloading``, called by
    ``initialize_model`` in ``vllm/model_executor/model_loader/utils.py``), or the live parameter
    for the few that vLLM keeps live through a reload (``SKIP_TENSORS``, e.g. ``bias``).
    A parameter with neither raises ``ValueError``: the reload would drop it."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    modules = _modules(model)
    out = {}
    for name in names:
        owner, _, attr = name.rpartition(".")
        module = modules.get(owner)
        if attr.endswith("_scale_inv") and (module is None or module._parameters.get(attr) is None):
            raise ValueError(
                f"awex.vllm: the pair's layout has the FP8 block scales `{name}`, but the served model holds no such "
                "parameter: the pair is block FP8 and the server's checkpoint is not; connect the pair without "
                "infer_config / infer_quant, or serve the FP8 checkpoint")
        module, attr = _parameter(modules, name)
        if attr in SKIP_TENSORS:
            t = module._parameters[attr]
        else:
            info = LAYERWISE_INFO.get(module)
            t = info.restore_metadata[0].get(attr) if info is not None else None
            if t is None:
                raise ValueError(
                    f"awex.vllm: vLLM recorded no reload metadata for `{name}` (record_metadata_for_reloading "
                    "runs when vLLM's model loader builds the model, vllm/model_executor/model_loader/utils.py); "
                    "build the model with vLLM's initialize_model")
        out[name] = (tuple(int(d) for d in t.shape), t.dtype)
    return out


def landing_tensors(layout: list[dict[str, Any]], model: Any, device: Any) -> dict[str, Any]:
    """Zeroed tensors of the rank's layout on ``device`` (zero: padding rows no placement covers
    stay zero, as vLLM's loaders leave them), after checking each against the shape and dtype vLLM
    loads that parameter in; a mismatch raises ``ValueError`` naming the parameter."""
    import torch

    names = [t["name"] for t in layout]
    if not names:
        raise ValueError("awex.vllm: the rank's layout is empty")
    want = loadable_shapes(model, names)
    out = {}
    for t in layout:
        name, shape = t["name"], tuple(int(d) for d in t["shape"])
        dtype = getattr(torch, _TORCH_DTYPES.get(str(t["dtype"]), ""), None)
        if dtype is None:
            raise ValueError(f"awex.vllm: layout tensor `{name}` has dtype {t['dtype']!r}, which awex.vllm cannot allocate")
        vshape, vdtype = want[name]
        fp8 = torch.float8_e4m3fn
        if vdtype != dtype and fp8 in (vdtype, dtype):
            served = "block FP8" if vdtype == fp8 else f"{vdtype}"
            paired = "block FP8" if dtype == fp8 else f"{dtype}"
            raise ValueError(
                f"awex.vllm: vLLM holds `{name}` as {vdtype} {list(vshape)} (the served model is {served}), but the "
                f"pair's layout says {dtype} {list(shape)} ({paired}); connect the pair with the served checkpoint's "
                "config (infer_config=<its config.json or directory>) so that both sides agree on FP8")
        if vshape != shape and name.endswith("_scale_inv"):
            raise ValueError(
                f"awex.vllm: vLLM holds the FP8 block scales `{name}` as {list(vshape)}, but the pair's layout says "
                f"{list(shape)}: the pair's block size differs from the served checkpoint's weight_block_size; "
                "connect the pair with infer_config=<the served checkpoint> (or the same fp8_block)")
        if vshape != shape or vdtype != dtype:
            raise ValueError(
                f"awex.vllm: vLLM loads `{name}` as {vdtype} {list(vshape)}, but the pair's layout says "
                f"{dtype} {list(shape)}; connect the pair with the served model's config, dtype and parallel config")
        out[name] = torch.zeros(shape, dtype=dtype, device=device)
    return out


def _experts_post_load_on_update(model: Any) -> list[Any]:
    """Makes the CPU MoE experts' own post-load step run on a weight update too, for the length
    of one layerwise reload; returns the patched quantisation methods (``_restore_setup_kernel``
    undoes it).

    vLLM 0.32 / 0.33 skip it on an update: ``UnquantizedFusedMoEMethod._setup_kernel``
    (``vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py``) calls
    ``self.moe_kernel.fused_experts.process_weights_after_loading(layer)`` only when
    ``self.moe_kernel is None`` (the first load); on a reload the kernel exists, so it copies the
    checkpoint-format ``w13_weight`` / ``w2_weight`` into the layer and stops. The CPU experts'
    step is not optional: ``CPUUnquantizedExperts.process_weights_after_loading``
    (``fused_moe/experts/cpu_moe.py``) pads the intermediate size to the kernel's alignment
    (``_pad_moe_intermediate``) and prepacks both weights into the grouped-gemm layout
    (``cpu_prepack_moe_weight`` -> ``torch.ops._C.prepack_moe_weight``, a same-shaped tensor in
    another element order) that ``cpu_fused_moe`` reads. Without it the reload's
    ``_copy_and_restore_kernel_tensors`` (``model_loader/reload/layerwise.py``) writes the plain
    weights into the prepacked storage, and the experts compute with scrambled weights: a MoE
    model on vLLM's CPU build is served wrongly after any reload, vLLM's own ``reload_weights``
    included, and stays so.

    The fix runs exactly the first load's step on the reloaded layer, after the engine's own
    ``_setup_kernel`` and before the reload copies the layer's result into the live storage: the
    same method of the same experts object, on the materialised layer that holds the landed
    checkpoint-format weights. It runs only where the engine did not (an engine that runs it on
    updates, or rebuilt the kernel, is left alone), and only for ``CPUUnquantizedExperts`` (and
    its x86 / Arm subclasses), whose step is a pure function of the loaded weights."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without them has nothing to redo
        return []
    patched = []
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if not isinstance(qm, UnquantizedFusedMoEMethod) or "_setup_kernel" in qm.__dict__:
            continue
        kernel = getattr(qm, "moe_kernel", None)
        if kernel is None or not isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            continue

        def setup_kernel(layer: Any, w13: Any, w2: Any, _qm: Any = qm) -> None:
            kernel = _qm.moe_kernel
            experts = kernel.fused_experts
            own = experts.process_weights_after_loading
            ran = []

            def counted(layer: Any) -> None:
                ran.append(True)
                own(layer)

            experts.process_weights_after_loading = counted
            try:
                type(_qm)._setup_kernel(_qm, layer, w13, w2)
            finally:
                del experts.process_weights_after_loading
            if not ran and _qm.moe_kernel is kernel:
                experts.process_weights_after_loading(layer)

        qm._setup_kernel = setup_kernel
        patched.append(qm)
    return patched


def _restore_setup_kernel(patched: list[Any]) -> None:
    for qm in patched:
        qm.__dict__.pop("_setup_kernel", None)


#: where a parameter keeps its loader: a plain ``torch.nn.Parameter`` in the ``weight_loader``
#: attribute itself; vLLM's own parameter classes (``BasevLLMParameter``,
#: ``vllm/model_executor/parameter.py``: ``ModelWeightParameter`` and the others that linear,
#: embedding and conv layers create) behind a ``weight_loader`` property, in ``_weight_loader``
_LOADER_KEYS = ("weight_loader", "_weight_loader")
_MISSING = object()


def _loader_state(param: Any) -> tuple[Any, ...]:
    """What ``_restore_loader`` puts back: the parameter's own loader attributes, as stored."""
    return tuple(param.__dict__.get(k, _MISSING) for k in _LOADER_KEYS)


def _restore_loader(param: Any, state: tuple[Any, ...]) -> None:
    for k, v in zip(_LOADER_KEYS, state):
        if v is _MISSING:
            param.__dict__.pop(k, None)
        else:
            param.__dict__[k] = v


def load_landed(model: Any, model_config: Any, landing: dict[str, Any]) -> None:
    """Loads the landing tensors into ``model`` through vLLM's layerwise reload, so that every
    layer's post-load processing runs again and its result lands in the live tensors' storage.

    A CPU MoE layer also gets the experts' own post-load step that vLLM skips on a reload
    (``_experts_post_load_on_update``).

    Each landed tensor is this rank's shard already, so the loader vLLM's reload wraps is
    ``default_weight_loader`` (a checked copy) for the length of the call; the parameters' own
    loaders (which cut a checkpoint tensor to the rank) are put back after. The reload is always
    finalised, also on an error: no layer is left on the meta device.
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    modules = _modules(model)
    # a parameter vLLM keeps live through the reload (bias) gets back the loader it had before;
    # the others (on the meta device during the reload) the one vLLM's reload gave them
    before = {}
    for name in landing:
        module, attr = _parameter(modules, name)
        param = module._parameters[attr]
        before[id(param)] = _loader_state(param)
    swapped: list[tuple[Any, Any]] = []
    patched = _experts_post_load_on_update(model)
    try:
        initialize_layerwise_reload(model)
    except BaseException:
        _restore_setup_kernel(patched)
        raise
    try:
        targets = []
        for name, src in landing.items():
            module, attr = _parameter(modules, name)
            param = module._parameters[attr]
            swapped.append((param, before.get(id(param), _loader_state(param))))
            param.weight_loader = default_weight_loader
            targets.append((module, param, src))
        for module in {id(m): m for m, _, _ in targets}.values():
            initialize_online_processing(module)  # wraps the swapped loaders for deferred processing
        # a layer is processed (and its live tensors written) once its last parameter is loaded
        for _, param, src in targets:
            param.weight_loader(param, src)
    finally:
        try:
            finalize_layerwise_reload(model, model_config)
        finally:
            _restore_setup_kernel(patched)
            for param, state in swapped:
                _restore_loader(param, state)


def parallel_of(vllm_config: Any) -> dict[str, int]:
    """awex's ``vllm`` parallel config from vLLM's ``ParallelConfig``: ``tp``, ``ep`` (``tp`` with
    ``enable_expert_parallel``, else 1)."""
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    if int(getattr(pc, "data_parallel_size", 1)) > 1 or int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
        raise ValueError("awex drives vLLM engines with tensor (and expert) parallelism only: one server per engine, no data or pipeline parallelism")
    ep = tp if getattr(pc, "enable_expert_parallel", False) else 1
    return {"tp": tp, "ep": ep}


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def build_reader(model: Any, vllm_config: Any, *, gateway: str | None = None, pair: str | None = None,
                 engine: int | None = None, rank: int | None = None, device: Any = None, **opts: Any) -> Any:
    """The process-wide ``awex.Reader`` of this worker, registered with its landing tensors
    (``landing_tensors``, on ``device``: the model's device by default).

    ``gateway``/``pair``/``engine`` default to ``AWEX_GATEWAY``, ``AWEX_PAIR``, ``AWEX_ENGINE``
    (0); ``rank`` to the worker's TP rank; ``deltas`` (in ``opts``) to ``AWEX_VLLM_DELTAS``
    (on: the landing tensors hold what was received). Built once; later calls return the same
    Reader.
    """
    global _reader, _landing
    from ._rank import Reader

    with _lock:
        if _reader is not None:
            return _reader
        gateway = gateway or os.environ.get("AWEX_GATEWAY")
        pair = pair or os.environ.get("AWEX_PAIR")
        if not gateway or not pair:
            raise RuntimeError("awex.vllm: set AWEX_GATEWAY and AWEX_PAIR in the vLLM server's environment")
        if engine is None:
            engine = int(os.environ.get("AWEX_ENGINE", "0"))
        opts.setdefault("deltas", _deltas_from_env())
        r = Reader(gateway, pair, _tp_rank() if rank is None else rank, engine=engine,
                   backend="vllm", parallel=parallel_of(vllm_config), **opts)
        try:
            if device is None:
                device = next(iter(model.parameters())).device
            landing = landing_tensors(r.layout(), model, device)
            r.register(list(landing.items()))
        except BaseException:
            r.close()
            raise
        _reader, _landing = r, landing
        return r


def _deltas_from_env() -> bool:
    """``AWEX_VLLM_DELTAS``: 1 (take delta updates into the landing tensors, the default) or 0."""
    v = os.environ.get("AWEX_VLLM_DELTAS", "1")
    if v not in ("0", "1"):
        raise RuntimeError(f"AWEX_VLLM_DELTAS={v!r}: 1 (take delta updates, the default) or 0")
    return v == "1"


def _close_reader() -> None:
    global _reader, _landing
    with _lock:
        if _reader is not None:
            _reader.close()
            _reader, _landing = None, {}


@dataclass
class AwexInitInfo:
    """``/init_weight_transfer_engine``'s ``init_info``: optional overrides of the environment."""

    gateway: str | None = None
    pair: str | None = None
    engine: int | None = None
    timeout: float | None = None


@dataclass
class AwexUpdateInfo:
    """``/update_weights``'s ``update_info``: the version the gateway started."""

    version: int
    timeout: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class AwexWeightTransferEngine(WeightTransferEngine):
        """Receives each version from the training ranks through awex into its landing tensors,
        then loads them through vLLM's layerwise reload (see the module's docstring).

        The reload opens and closes inside ``receive_weights``, not at ``start_weight_update`` /
        ``finish_weight_update`` as vLLM's ``nccl`` engine does (it receives a version over
        several ``/update_weights`` calls): awex receives a whole version in one call, and the
        model leaves its serving state only after every byte arrived, never across HTTP calls
        (an attempt abandoned between them cannot leave it on the meta device)."""

        init_info_cls = AwexInitInfo
        update_info_cls = AwexUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: AwexInitInfo) -> None:
            opts = {"timeout": init_info.timeout} if init_info.timeout is not None else {}
            reader = build_reader(self.model, self.vllm_config, gateway=init_info.gateway,
                                  pair=init_info.pair, engine=init_info.engine, device=self.device, **opts)
            if not reader.joined:
                reader.join()

        def start_weight_update(self) -> None:  # the reload opens once the version arrived
            pass

        def receive_weights(self, update_info: AwexUpdateInfo) -> None:
            from .errors import AwexError

            reader = build_reader(self.model, self.vllm_config, device=self.device)
            if not reader.joined:
                reader.join()
            try:
                reader.update(int(update_info.version), timeout=update_info.timeout, wait_commit=False)
            except (AwexError, TimeoutError) as e:
                # The version failed before the model was touched, and the gateway knows it (this
                # rank's report, another rank's, or the deadline). Not raised: an exception in
                # one worker's RPC with tp > 1 leaves vLLM's executor reading the other workers'
                # answers one call late (`MultiprocExecutor.collective_rpc`'s `get_response`
                # stops at the first failed rank, `vllm/v1/executor/multiproc_executor.py`),
                # which breaks the server's next calls. The worker's update session stays open;
                # the gateway closes it (`/finish_weight_update`) before resuming.
                _log.warning("awex.vllm: version %s not received, the model keeps the last one: %s",
                             update_info.version, e)
                return
            load_landed(self.model, self.model_config, _landing)

        def finish_weight_update(self) -> None:  # load_landed finalised the reload
            pass

        def shutdown(self) -> None:
            _close_reader()

    return AwexWeightTransferEngine


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the ``awex`` backend once per process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND in WeightTransferEngineFactory._registry:  # general plugins may run more than once
        return
    WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())


__all__ = ["BACKEND", "register", "named_tensors", "parallel_of", "build_reader", "loadable_shapes",
           "landing_tensors", "load_landed", "AwexInitInfo", "AwexUpdateInfo"]
