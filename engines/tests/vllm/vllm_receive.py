"""One TP rank of a vLLM 0.33 model receiving a weight update through awex's registered
``WeightTransferEngine``, driven the way vLLM's own worker drives it, then loaded with the
model class's own ``load_weights`` for the reference.

    python vllm_receive.py CASE_JSON RANK OUT_DIR

1. builds the model class on CPU with vLLM's parallel groups over gloo (``vllm_rank.build``:
   vLLM's ``initialize_model``), loads CASE["expected"] (an HF checkpoint) with the class's own
   ``load_weights`` and keeps that as the reference (OUT_DIR/ref{R}.pt), then zeroes every
   parameter (so a parameter the receive misses shows) and runs vLLM's own post-load pass
   (``process_weights_after_loading``, ``vllm/model_executor/model_loader/utils.py``), as the
   server's loader does; with CASE["prepack"] the unquantised linear layers' post-load step does
   what vLLM's CPU platform does to them (``cpu_prepack``): keep a packed copy for the kernel
   and leave ``layer.weight`` an empty parameter;
2. runs vLLM's ``load_general_plugins()`` (``vllm/plugins/__init__.py``: every
   ``vllm.general_plugins`` entry point, awex's wheel declares ``awex = "awex.vllm:register"``)
   and creates the engine with ``WeightTransferEngineFactory.create_engine(config, vllm_config,
   device, model)``, as ``Worker.load_model`` does (``vllm/v1/worker/gpu_worker.py``);
3. calls the worker's own methods on it: ``Worker.init_weight_transfer_engine(init_info)``
   (``parse_init_info`` then ``init_transfer_engine``: the ``awex.Reader`` joins),
   ``Worker.start_weight_update()``, ``Worker.update_weights({"version": 1})``
   (``WeightTransferEngine.update_weights``, ``vllm/distributed/weight_transfer/base.py``:
   ``parse_update_info`` then ``receive_weights``), ``Worker.finish_weight_update()``; the
   worker object is ``Worker.__new__`` with the attributes those methods read (its ``__init__``,
   ``load_model`` and GPU model runner need a GPU);
4. saves what the model computes with after the update (a prepacked layer's packed copy, else
   the parameter) under the parameters' names: OUT_DIR/recv{R}.pt.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_rank  # noqa: E402


class _LoraState:
    """The worker's ``model_runner`` as the weight-update methods use it: vLLM's own
    ``LoRAModelRunnerMixin.reset_lora_state`` with LoRA off (``lora_config`` None: a no-op) for
    ``Worker.finish_weight_update``, and (vLLM 0.34) ``get_model()`` with no
    ``extensible_kv_cache`` for ``Worker._start_weight_update``'s
    ``kv_cache_lent_for_weight_update`` (a standard KV cache: nothing lent); the GPU model runner
    itself left out."""

    lora_config = None

    def __init__(self, model=None) -> None:
        from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

        self.reset_lora_state = LoRAModelRunnerMixin.reset_lora_state.__get__(self)
        self._model = model

    def get_model(self):
        return self._model


def worker_for(vc, rank: int, model):
    """``Worker.__new__`` with the attributes its ``__init__`` sets that the weight-update
    methods read, as ``__init__`` sets them (``vllm/v1/worker/gpu_worker.py``): vLLM 0.33's
    ``_weight_update_active`` and ``_weight_update_is_draft``, and 0.34's
    ``_incomplete_weight_updates``, ``_kv_cache_reclaimable`` and ``_weight_update_kv_cache_loan``
    (harmless where a release does not read them). Its ``__init__``, ``load_model`` and GPU model
    runner need a GPU."""
    import contextlib

    from vllm.v1.worker.gpu_worker import Worker

    worker = Worker.__new__(Worker)
    worker.vllm_config = vc
    worker.rank = rank
    worker._weight_update_active = False
    worker._weight_update_is_draft = False
    worker._incomplete_weight_updates = set()
    worker._kv_cache_reclaimable = False
    worker._weight_update_kv_cache_loan = contextlib.ExitStack()
    worker.model_runner = _LoraState(model)
    return worker


def cpu_prepack() -> None:
    """Makes ``UnquantizedLinearMethod.process_weights_after_loading`` do to every unquantised
    linear layer what vLLM's CPU platform does (``dispatch_cpu_unquantized_gemm(layer,
    remove_weight=True)``, ``vllm/model_executor/layers/utils.py``): the kernel keeps its own
    packed copy of the weight (here ``layer.packed_weight``, a plain attribute as the CPU
    platform's ``layer.cpu_linear`` closure is) and ``layer.weight`` becomes an empty parameter.
    The oneDNN / sgl-kernel packers need vLLM's CPU build; the effect on the parameters is the same."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    own = UnquantizedLinearMethod.process_weights_after_loading

    def prepack(self, layer: torch.nn.Module) -> None:
        own(self, layer)
        layer.packed_weight = layer.weight.detach().clone()
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device),
                                          requires_grad=False)

    UnquantizedLinearMethod.process_weights_after_loading = prepack


def computed_with(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """``{name: tensor}``: what each parameter's layer computes with (its packed copy when the
    post-load step prepacked it, else the parameter)."""
    modules = dict(model.named_modules())
    out = {}
    for name in names:
        owner, _, attr = name.rpartition(".")
        module = modules[owner]
        t = module.packed_weight if attr == "weight" and hasattr(module, "packed_weight") else getattr(module, attr)
        out[name] = t.detach().clone()
    return out


def main() -> None:
    case = json.loads(sys.argv[1])
    rank, out = int(sys.argv[2]), sys.argv[3]
    model, vc = vllm_rank.build(case, rank)

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    expected = torch.load(case["expected"])
    with set_current_vllm_config(vc):
        model.load_weights(iter(expected.items()))
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(ref, os.path.join(out, f"ref{rank}.pt"))
    with torch.no_grad():  # nothing of the reference survives into the receive
        for p in model.parameters():
            p.zero_()
    if case.get("prepack"):
        cpu_prepack()
    with set_current_vllm_config(vc):
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))

    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    if "awex" not in WeightTransferEngineFactory._registry:
        raise SystemExit("the awex wheel's vllm.general_plugins entry point did not register the `awex` backend")
    vc.weight_transfer_config = WeightTransferConfig(backend="awex")
    # `WeightTransferEngine.update_weights` ends with `torch.accelerator.synchronize()`; PyPI's
    # (CUDA) torch names CUDA the accelerator even without a driver, where the call raises.
    # Nothing is asynchronous on CPU.
    torch.accelerator.synchronize = lambda device=None: None

    worker = worker_for(vc, rank, model)
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        vc.weight_transfer_config, vc, torch.device("cpu"), model)
    engine = worker.weight_transfer_engine
    engine_name = type(engine).__name__

    with set_current_vllm_config(vc):
        worker.init_weight_transfer_engine({"gateway": case["gateway"], "pair": case["pair"], "engine": 0,
                                            "timeout": case.get("timeout", 240.0)})
    worker.start_weight_update()
    worker.update_weights({"version": 1, "timeout": case.get("timeout", 240.0)})
    worker.finish_weight_update()
    torch.save(computed_with(model, list(ref)), os.path.join(out, f"recv{rank}.pt"))
    worker.shutdown_weight_transfer_engine()
    with open(os.path.join(out, f"engine{rank}.json"), "w") as f:
        json.dump({"engine": engine_name}, f)


if __name__ == "__main__":
    main()
