"""One TP rank of a vLLM 0.33 model built on CPU with vLLM's own parallel groups over gloo.

    python vllm_rank.py CASE_JSON RANK OUT_DIR

Builds the model class (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `LlamaForCausalLM`,
`Glm4MoeForCausalLM`, `DeepseekV3ForCausalLM`) with
vLLM's `initialize_model`, loads the canonical checkpoint with the class's own `load_weights`,
and saves `named_parameters()` (names, shapes, bytes) to OUT_DIR/rank{R}.pt.
"""

from __future__ import annotations

import json
import os
import sys

import torch


class _NoAttention(torch.nn.Module):
    """Stands in for `vllm.model_executor.layers.attention.Attention`: its constructor selects a
    GPU attention kernel (`get_attn_backend`, `vllm/v1/attention/selector.py`; "Invalid attention
    backend" on a machine without one); it holds no parameters and is never called while loading."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()


def stub_gpu_kernels() -> None:
    import vllm.model_executor.models.glm4_moe as glm4_moe
    import vllm.model_executor.models.llama as llama
    import vllm.model_executor.models.qwen3 as qwen3
    import vllm.model_executor.models.qwen3_moe as qwen3_moe

    import vllm.model_executor.models.qwen3_next as qwen3_next
    # gpt-oss: `OAIAttention.__init__` creates its `sinks` itself (`make_attention_sink`) and
    # hands them to the `Attention` it builds, which holds no parameter
    import vllm.model_executor.models.gpt_oss as gpt_oss

    for m in (qwen3, qwen3_moe, llama, glm4_moe, qwen3_next, gpt_oss):
        m.Attention = _NoAttention
    # The hybrid models' Gated DeltaNet (`QwenGatedDeltaNetAttention.__init__`,
    # `model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py`) builds its gated norm on
    # `current_platform.current_device()`; without a GPU vLLM's platform is
    # `UnspecifiedPlatform`, whose `__getattr__` answers None for it ("'NoneType' object is not
    # callable"). Answering the CPU creates that norm weight on the CPU like every other
    # parameter; its weight path (the layers' own `weight_loader`s) is untouched.
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        current_platform.current_device = lambda: "cpu"
    # DeepSeek's MLA: `MultiHeadLatentAttentionWrapper` (`model_executor/layers/mla.py`) builds an
    # `MLAAttention`, which selects an MLA attention backend (none on CPU); it creates no
    # parameter (it keeps a reference to `kv_b_proj`, registered first under `self_attn`) and is
    # not called by `load_weights`. Its post-load step (absorbing `kv_b_proj` into W_UK/W_UV)
    # does not run here: the parameters are compared, not what the backend derives.
    import vllm.model_executor.layers.mla as mla

    mla.MLAAttention = _NoAttention

    # `select_unquantized_moe_backend` (`model_executor/layers/fused_moe/oracle/unquantized.py`)
    # picks a GPU MoE kernel from the platform (none here: `_AVAILABLE_BACKENDS` is unbound). OOT,
    # what the function picks on an out-of-tree platform, pads nothing, like TRITON (what a
    # Hopper GPU picks; `unquantized_round_up_hidden_size_and_intermediate_size`), and leaves
    # the kernel's set-up to the platform, so that the post-load step
    # (`UnquantizedFusedMoEMethod.process_weights_after_loading`) runs on a machine without a
    # GPU kernel class; the kernel itself runs in `forward` only.
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as um
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    um.select_unquantized_moe_backend = lambda moe_config: (UnquantizedMoeBackend.OOT, None)


def build(case: dict, rank: int):
    """``(model, vllm_config)``: TP rank ``rank`` of the case's vLLM model class, built on CPU by
    vLLM's ``initialize_model`` (``vllm/model_executor/model_loader/utils.py``) with vLLM's
    parallel groups over gloo, its parameters as the class's constructor left them."""
    tp, ep = case["tp"], case.get("ep", 1)
    from vllm.config import (CacheConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig,
                             VllmConfig, set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    dtype = case.get("dtype", "float32")
    model_config = ModelConfig(model=case["hf_dir"], skip_tokenizer_init=True, dtype=dtype,
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
        from vllm.model_executor.model_loader.utils import initialize_model

        stub_gpu_kernels()

        torch.set_default_dtype(getattr(torch, dtype))
        # what vLLM's model loaders call: the class's constructor, then
        # `record_metadata_for_reloading` (what layerwise reload restores the model to)
        model = initialize_model(vllm_config=vc)
    return model, vc


def main() -> None:
    case = json.loads(sys.argv[1])
    rank, out = int(sys.argv[2]), sys.argv[3]
    from vllm.config import set_current_vllm_config

    model, vc = build(case, rank)
    canon = torch.load(case["canonical"])
    with set_current_vllm_config(vc):
        model.load_weights(iter(canon.items()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(params, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
