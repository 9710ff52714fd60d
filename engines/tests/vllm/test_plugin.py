"""`awex.vllm.register` against vLLM 0.33.0's own `WeightTransferEngineFactory`: registers the
`awex` backend once (a second call is a no-op), the factory's lazy registry resolves it to a
`WeightTransferEngine` subclass, and vLLM's `parse_update_info` / `parse_init_info` accept the
bodies the gateway sends (`awex-vllm/src/control.rs`)."""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "..", "awex-py", "python", "awex", "vllm.py")


def load_plugin():
    # awex.vllm's registration needs no compiled extension: load the file alone
    spec = importlib.util.spec_from_file_location("awex_vllm_plugin", SRC)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_register_is_idempotent_and_resolves_to_a_weight_transfer_engine() -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    plugin = load_plugin()
    plugin.register()
    plugin.register()  # vLLM raises "already registered" on a second register_engine
    cls = WeightTransferEngineFactory._registry["awex"]()
    assert issubclass(cls, WeightTransferEngine)
    engine = cls.__new__(cls)  # parse_* use only the class attributes
    assert engine.parse_update_info({"version": 7}).version == 7
    assert engine.parse_init_info({}).gateway is None
    try:
        engine.parse_update_info({"weights": 1})
    except ValueError as e:
        assert "Invalid update_info" in str(e)
    else:
        raise AssertionError("an unknown update_info field must be refused")


def test_the_entry_point_is_declared() -> None:
    text = open(os.path.join(HERE, "..", "..", "..", "awex-py", "pyproject.toml")).read()
    assert '[project.entry-points."vllm.general_plugins"]\nawex = "awex.vllm:register"' in text


def test_parallel_of_reads_vllms_parallel_config() -> None:
    from vllm.config import ParallelConfig

    plugin = load_plugin()

    class VC:
        parallel_config = ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True)

    assert plugin.parallel_of(VC) == {"tp": 4, "ep": 4}
    VC.parallel_config = ParallelConfig(tensor_parallel_size=2)
    assert plugin.parallel_of(VC) == {"tp": 2, "ep": 1}
