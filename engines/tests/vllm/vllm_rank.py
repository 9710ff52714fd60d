"""One TP rank of a vLLM 0.33 model built on CPU with vLLM's own parallel groups over gloo.

    python vllm_rank.py CASE_JSON RANK OUT_DIR

Builds the model class (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `LlamaForCausalLM`) inside
`set_current_vllm_config`, loads the canonical checkpoint with the class's own `load_weights`,
and saves `named_parameters()` (names, shapes, bytes) to OUT_DIR/rank{R}.pt.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    case = json.loads(sys.argv[1])
    rank, out = int(sys.argv[2]), sys.argv[3]
    tp, ep = case["tp"], case.get("ep", 1)
    from vllm.config import (CacheConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig,
                             VllmConfig, set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    model_config = ModelConfig(model=case["hf_dir"], skip_tokenizer_init=True, dtype="float32",
                               enforce_eager=True)
    parallel = ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=ep > 1)
    vc = VllmConfig(model_config=model_config, parallel_config=parallel,
                    device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(),
                    cache_config=CacheConfig())
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{case['port']}",
                                     backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp)
        from vllm.model_executor.model_loader.utils import get_model_architecture

        cls, _ = get_model_architecture(model_config)
        torch.set_default_dtype(torch.float32)
        model = cls(vllm_config=vc, prefix="")
        canon = torch.load(case["canonical"])
        model.load_weights(iter(canon.items()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(params, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
