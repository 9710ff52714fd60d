"""Imported once by the forkserver the vLLM tests fork their rank and checkpoint scripts from
(``forked.popen(..., preload="vllm_preload")``): torch, transformers, safetensors and the vLLM
0.33 modules those scripts import, so that a rank does not import them again (10-20 s a process
on a 2-core machine).

Only imports: nothing here initialises torch.distributed, a vLLM config, a platform or a
plugin; each forked script still does all of that itself, as a fresh process would. A module
that fails to import is left to the script (which then reports the error itself).
"""

from __future__ import annotations

import importlib

for _name in (
    "torch",
    "safetensors.torch",
    "transformers",
    "vllm.config",
    "vllm.distributed",
    "vllm.model_executor.model_loader.utils",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.qwen3_moe",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.glm4_moe",
    "vllm.model_executor.models.deepseek_v2",
    "vllm.model_executor.layers.mla",
    "vllm.distributed.weight_transfer.factory",
    "vllm.v1.worker.gpu_worker",
):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 (the script imports it again and reports the error)
        pass
