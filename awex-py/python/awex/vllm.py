"""vLLM: awex as a native weight-transfer backend of an unmodified vLLM 0.33.

vLLM runs every ``vllm.general_plugins`` entry point in each worker before the model is built;
awex's wheel declares ``awex = "awex.vllm:register"``, which registers
:class:`AwexWeightTransferEngine` with ``WeightTransferEngineFactory.register_engine("awex", ...)``
(``vllm/distributed/weight_transfer/factory.py``). Start the server with::

    AWEX_GATEWAY=http://gateway:7480 AWEX_PAIR=rl VLLM_SERVER_DEV_MODE=1 \\
        vllm serve M --weight-transfer-config '{"backend": "awex"}'

and connect the pair with ``infer="vllm:tp=N,..."`` and the server's URL: the gateway calls
``/init_weight_transfer_engine`` once (every worker builds and joins its ``awex.Reader``), then per
update ``/pause`` -> ``/start_weight_update`` -> ``/update_weights {"update_info": {"version": N}}``
-> ``/finish_weight_update`` -> ``/resume`` (``vllm/entrypoints/rl/online/api_router.py``). In
``receive_weights`` every TP worker receives its shard in place into the live parameters.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

#: the backend name in ``--weight-transfer-config``
BACKEND = "awex"

_lock = threading.Lock()
#: the process-wide Reader (one vLLM worker is one TP rank)
_reader: Any = None


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
                 engine: int | None = None, rank: int | None = None, **opts: Any) -> Any:
    """The process-wide ``awex.Reader`` of this worker, registered with the live parameters.

    ``gateway``/``pair``/``engine`` default to ``AWEX_GATEWAY``, ``AWEX_PAIR``, ``AWEX_ENGINE``
    (0); ``rank`` to the worker's TP rank. Built once; later calls return the same Reader.
    """
    global _reader
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
        r = Reader(gateway, pair, _tp_rank() if rank is None else rank, engine=engine,
                   backend="vllm", parallel=parallel_of(vllm_config), **opts)
        try:
            r.register(named_tensors(model))
        except BaseException:
            r.close()
            raise
        _reader = r
        return r


def _close_reader() -> None:
    global _reader
    with _lock:
        if _reader is not None:
            _reader.close()
            _reader = None


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
        """Receives each version in place from the training ranks through awex."""

        init_info_cls = AwexInitInfo
        update_info_cls = AwexUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: AwexInitInfo) -> None:
            opts = {"timeout": init_info.timeout} if init_info.timeout is not None else {}
            reader = build_reader(self.model, self.vllm_config, gateway=init_info.gateway,
                                  pair=init_info.pair, engine=init_info.engine, **opts)
            if not reader.joined:
                reader.join()

        def start_weight_update(self) -> None:  # in place: nothing to prepare
            pass

        def receive_weights(self, update_info: AwexUpdateInfo) -> None:
            reader = build_reader(self.model, self.vllm_config)
            if not reader.joined:
                reader.join()
            # raises awex.UpdateFailed / Disconnected / TimeoutError: vLLM turns it into an error answer
            reader.update(int(update_info.version), timeout=update_info.timeout, wait_commit=False)

        def finish_weight_update(self) -> None:
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


__all__ = ["BACKEND", "register", "named_tensors", "parallel_of", "build_reader", "AwexInitInfo", "AwexUpdateInfo"]
