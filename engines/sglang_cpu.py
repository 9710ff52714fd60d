"""SGLang's real model classes on CPU, one process per TP rank, for awex's real-engine tests.

A rank process calls ``init_rank`` (SGLang's own ``ServerArgs`` -> ``runtime_context.publish``
-> ``init_distributed_environment`` over gloo -> ``initialize_model_parallel``, as
``sglang/srt/distributed/bootstrap.py:_init_parallel_groups`` does in a scheduler process) and
then ``load_model`` (SGLang's ``model_loader.get_model``: the model class built from the HF
config and filled by its own ``load_weights``, as ``ModelRunner.load_model`` does).

What is not SGLang's own code, and why:

- ``vllm._custom_ops`` is a stub module whose ``rotary_embedding`` raises when called.
  ``sglang/srt/layers/rotary_embedding/base.py`` (``RotaryEmbedding.__init__``) imports it as the
  fallback rotary kernel on a platform that is neither CUDA, HIP, SGLang's CPU engine nor
  another accelerator; it is only called by ``forward`` (never while building or loading).
- ``SGLANG_NCCL_SO_PATH`` names a missing library: ``PyNcclCommunicator``
  (``sglang/srt/distributed/device_communicators/pynccl.py``) then disables itself, the path
  SGLang takes "in a non-GPU environment"; the PyPI torch wheel ships libnccl, which would
  otherwise be loaded and fail on a CPU device.
- ``SGLANG_USE_CPU_ENGINE`` stays unset: SGLang's CPU engine pads heads for an unaligned TP
  (``configs/update_config.py:adjust_config_with_unaligned_cpu_tp``) and repacks weights, so its
  parameters differ from a GPU server's; these tests build the GPU server's parameters on CPU.

- ``fuse_shared_experts_as_on_gpu`` (only where a test asks for it): SGLang decides before it
  builds a model whether to fuse its shared experts into the routed experts
  (``layers/moe/utils.py:resolve_shared_experts_config``), asking the class's
  ``shared_experts_fusion_disable_reason``, which for GLM-4.5 says no on anything but CUDA of
  capability >= 8.0 or HIP gfx942+. The helper makes that platform gate answer as it does on an
  H100/H200 at ep=1 (no reason), so that the CPU build takes SGLang's own fused path: the
  ``FusedMoE`` of ``n_routed_experts + 1`` experts and ``load_weights``' renaming of
  ``mlp.shared_experts.*`` to that last expert.

- ``qwen2_moe_block_as_on_cuda`` (only where a test asks for it: Qwen3-Next, Qwen3.5-MoE): their
  MoE block, ``models/qwen2_moe.py`` ``Qwen2MoeSparseMoeBlock.__init__``, fuses the shared
  expert only where its module's platform flag ``_is_cuda`` (with the model's
  ``enable_cuda_shared_expert_fusion``) or ``_use_aiter`` says so. The helper sets that flag, so
  that the CPU build takes the block's and the loader's CUDA path (see its docstring).

- ``derive_mla_as_on_gpu`` (the FP8 tests): DeepSeek's ``post_load_weights``
  (``models/deepseek_common/deepseek_weight_loader.py``, SGLang 0.5.23 lines 690-712) derives
  MLA's ``w_kc`` / ``w_vc`` from an FP8 ``kv_b_proj`` with 128 x 128 blocks by
  ``block_quant_dequant`` to bf16 when the module's platform flag ``_is_cuda`` (or MUSA, XPU) is
  set, and otherwise by ``block_quant_to_tensor_quant`` (per-tensor FP8 ``w_kc`` / ``w_vc`` plus
  ``self_attn.w_scale``), a branch only a CPU server takes. The helper sets that module's
  ``_is_cuda`` so that the GPU's derivation runs; both are plain torch (no kernel), and the flag
  is read nowhere else in that module.

- ``cpu_device_module_at_construction`` (the hybrid linear-attention models: Qwen3-Next,
  Qwen3.5): their Gated DeltaNet layers create a norm on ``torch.get_device_module()``'s current
  device, the CUDA device whatever the server's ``device``; the helper makes that call answer the
  CPU (see its docstring).

Nothing on the weight-loading path is replaced: every parameter is created by SGLang's layers
and written by their own ``weight_loader``.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

#: The environment a rank process needs before importing SGLang (see the module docstring).
ENV = {
    "SGLANG_NCCL_SO_PATH": "/nonexistent/awex-no-nccl/libnccl.so.2",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


def install_stubs() -> None:
    """Installs the one GPU-kernel stub (``vllm._custom_ops.rotary_embedding``) and the env."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if "vllm._custom_ops" in sys.modules:
        return

    def rotary_embedding(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "vllm._custom_ops.rotary_embedding is a stub in awex's CPU tests: a GPU rotary kernel "
            "SGLang imports on this platform but calls only in forward()"
        )

    vllm = types.ModuleType("vllm")
    vllm.__path__ = []  # a package, so that `import vllm._custom_ops` resolves
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
    vllm._custom_ops = ops  # type: ignore[attr-defined]
    sys.modules["vllm"] = vllm
    sys.modules["vllm._custom_ops"] = ops


def init_rank(model_dir: str, *, tp: int, rank: int, port: int, ep: int = 1, dtype: str = "float32",
              **server: Any) -> Any:
    """Publishes SGLang's config for TP rank ``rank`` of ``tp`` (expert parallel ``ep``) and
    initialises SGLang's parallel groups over gloo. Returns the ``ServerArgs``; ``server`` are
    further ``ServerArgs`` fields (``mamba_radix_cache_strategy="no_buffer"`` for the hybrid
    linear-attention models: SGLang's default ``extra_buffer`` asserts platform support for
    Mamba cache snapshots, which a CPU build lacks; the strategy shapes the cache, not the
    weights)."""
    install_stubs()
    import torch  # noqa: F401  (before SGLang, as its entry points do)
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        tp_size=tp,
        ep_size=ep,
        dtype=dtype,
        skip_tokenizer_init=True,
        load_format="auto",
        **server,
    )
    rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank, gpu_id=0))
    init_distributed_environment(
        backend="gloo",
        world_size=tp,
        rank=rank,
        local_rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    initialize_model_parallel()
    return server_args


def load_model(server_args: Any, model_dir: str | None = None) -> Any:
    """SGLang's ``get_model`` on CPU: the model class for the checkpoint's architecture, its
    parameters filled by its own ``load_weights`` from ``model_dir`` (default: the server's)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model

    if model_dir is not None and model_dir != server_args.model_path:
        import copy

        server_args = copy.copy(server_args)
        server_args.model_path = model_dir
    model_config = ModelConfig.from_server_args(server_args)
    return get_model(
        model_config=model_config,
        load_config=LoadConfig(load_format="auto"),
        device_config=DeviceConfig(device="cpu", gpu_id=0),
    )


def cpu_device_module_at_construction() -> None:
    """``torch.get_device_module()`` without an argument answers ``torch.cpu``, so that SGLang's
    Gated DeltaNet layers can be built on CPU (see the module docstring's list).

    SGLang 0.5.23 builds the gated norm of every linear-attention layer on the accelerator's
    current device: ``models/qwen3_next.py`` ``Qwen3GatedDeltaNet.__init__`` and
    ``models/qwen3_5.py`` ``Qwen3_5GatedDeltaNet.__init__`` pass
    ``device=torch.get_device_module().current_device()`` to ``RMSNormGated`` /
    ``FusedRMSNormGated``; without an argument ``get_device_module`` is ``torch.cuda``, whose
    ``current_device()`` raises "Found no NVIDIA driver on your system" without a GPU. Answering
    ``torch.cpu`` (``current_device()`` is ``"cpu"``) creates that norm weight on the CPU like
    every other parameter; calls naming a device are unchanged, and nothing on the weight path
    is: every parameter is still created by SGLang's layers and written by their own
    ``weight_loader``."""
    import torch

    if getattr(torch.get_device_module, "_awex_cpu", False):
        return
    orig = torch.get_device_module

    def get_device_module(device: Any = None) -> Any:
        return torch.cpu if device is None else orig(device)

    get_device_module._awex_cpu = True  # type: ignore[attr-defined]
    torch.get_device_module = get_device_module


def fuse_shared_experts_as_on_gpu(class_name: str) -> None:
    """SGLang's shared-expert fusion gate of ``class_name`` answers as on an NVIDIA GPU of
    capability >= 8.0 at ep=1: nothing rules the fusion out (see the module docstring)."""
    from sglang.srt.models.registry import ModelRegistry

    cls = ModelRegistry.models[class_name]
    cls.shared_experts_fusion_disable_reason = classmethod(lambda cls, hf_config, quant_config: None)


def qwen2_moe_block_as_on_cuda() -> None:
    """SGLang 0.5.23's ``Qwen2MoeSparseMoeBlock`` (Qwen3-Next's and Qwen3.5-MoE's MoE block)
    decides as on an NVIDIA GPU whether to fuse the shared expert into the routed experts.

    ``models/qwen2_moe.py`` ``Qwen2MoeSparseMoeBlock.__init__`` fuses when
    ``support_shared_expert_fusion and (_use_aiter or (_is_cuda and
    enable_cuda_shared_expert_fusion))`` and ``can_fuse_shared_expert(config, quant_config)``
    (no ``--disable-shared-experts-fusion``, ``shared_expert_intermediate_size ==
    moe_intermediate_size``, no DeepEP / MoRI all-to-all), unless a per-rank-slot backend runs
    at ep > 1. ``_is_cuda`` is the module's ``is_cuda()`` at import: False on CPU. Setting it
    answers that platform question as on any CUDA device (the block asks for no compute
    capability); everything else in the decision, and the whole load, is SGLang's own: the
    ``FusedMoE`` of ``num_experts + 1`` experts, ``load_weights``' renaming of
    ``mlp.shared_expert.*`` to that last expert, every ``weight_loader``. In that module the flag
    is read besides only by ``Qwen2MoeSparseMoeBlock._forward_deepep`` (a stream overlap, not
    called here) and ``Qwen2MoeForCausalLM.__init__`` (another model); ``models/qwen3_next.py``
    and ``models/qwen3_5.py`` keep their own ``_is_cuda`` (False)."""
    from sglang.srt.models import qwen2_moe

    qwen2_moe._is_cuda = True


def derive_mla_as_on_gpu() -> None:
    """DeepSeek's ``post_load_weights`` derives ``w_kc`` / ``w_vc`` from a block-FP8
    ``kv_b_proj`` as on a CUDA GPU: bf16 from ``block_quant_dequant`` (see the module
    docstring). DeepGEMM's batched FP8 matmul path (``ENABLE_JIT_DEEPGEMM``) must be off, as it
    is without a GPU, or the branch would keep the FP8 bytes instead."""
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.models.deepseek_common import deepseek_weight_loader

    assert not deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM, "DeepGEMM is enabled on a CPU run"
    deepseek_weight_loader._is_cuda = True


def derived(model: Any) -> dict[str, Any]:
    """Every tensor the model holds besides its parameters: its buffers (``buffer:NAME``) and the
    tensors its modules keep as plain attributes (``derived:MODULE.ATTR``), which is where
    ``post_load_weights`` puts what it derives from the loaded weights (DeepSeek's MLA:
    ``self_attn.w_kc`` / ``w_vc`` from ``kv_b_proj.weight``, ``deepseek_weight_loader.py``)."""
    import torch

    out = {f"buffer:{n}": b for n, b in model.named_buffers()}
    for name, module in model.named_modules():
        for attr, v in vars(module).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                out[f"derived:{name}.{attr}"] = v
    return out


def snapshot(model: Any) -> dict[str, Any]:
    """A copy of every parameter (``named_parameters()`` order and names), then of every derived
    tensor and buffer (``derived``)."""
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({n: t.detach().clone() for n, t in derived(model).items()})
    return out


def first_difference(got: Any, want: Any) -> str | None:
    """None when two tensors are byte-identical, else where they first differ."""
    import torch

    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return f"{got.dtype} {list(got.shape)} vs {want.dtype} {list(want.shape)}"
    # reshape first: a 0-d tensor (an attention layer's k_scale) has no bytes view
    a = got.contiguous().reshape(-1).view(torch.uint8)
    b = want.contiguous().reshape(-1).view(torch.uint8)
    diff = (a != b).nonzero()
    if diff.numel() == 0:
        return None
    i = int(diff[0]) // got.element_size()
    flat_g, flat_w = got.reshape(-1), want.reshape(-1)
    return (
        f"{int((a != b).sum())} bytes differ; first at element {i}: "
        f"{flat_g[i].item()!r} vs {flat_w[i].item()!r}"
    )
