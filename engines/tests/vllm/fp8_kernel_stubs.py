"""vLLM 0.33's FP8 kernel choices, stubbed for a machine without a GPU (and without vLLM's CPU
build): only which GEMM / MoE kernel the layers get is replaced, never a parameter, a weight
loader or a post-load step of vLLM's.

- ``Fp8LinearMethod.create_weights`` (``vllm/model_executor/layers/quantization/fp8.py``, lines
  282-356) registers ``weight`` (e4m3) and ``weight_scale_inv`` (fp32 blocks), then calls
  ``init_fp8_linear_kernel`` (``vllm/model_executor/kernels/linear/__init__.py``, line 746),
  which picks from ``_POSSIBLE_FP8_BLOCK_KERNELS[current_platform]`` (line 494) and raises
  here: this platform has no entry. The stub returns :class:`PostLoadOnlyBlockKernel`, a
  ``Fp8BlockScaledMMLinearKernel`` whose post-load step is vLLM's own base class's
  (``BlockScaledMMLinearKernel.py``: ``process_fp8_weight_block_strategy`` then
  ``replace_parameter``), which is what the CUDA block kernels an H100 / H200 picks run
  (``CutlassFp8BlockScaledMMKernel`` and ``TritonFp8BlockScaledMMKernel`` inherit it;
  ``DeepGemmFp8BlockScaledMMKernel`` adds a UE8M0 requantisation on Blackwell only). Its GEMM
  (``apply_block_scaled_mm``) raises: these tests load, they never run a forward pass.
- ``Fp8MoEMethod.__init__`` (same file, lines 480-528) calls ``select_fp8_moe_backend``
  (``vllm/model_executor/layers/fused_moe/oracle/fp8.py``, line 398), which finds no backend
  here. The stub returns ``Fp8MoeBackend.TRITON`` with its experts class (``TritonExperts``,
  ``backend_to_kernel_cls``): what a Hopper GPU picks for block FP8 at EP 1 (``_get_priority_
  backends``: "On Hopper for Block Fp8, prefer Triton for TP"), whose weight format is the
  checkpoint's (``convert_to_fp8_moe_kernel_format`` leaves TRITON's tensors as they are).
  At EP > 1 a Hopper GPU prefers FLASHINFER_CUTLASS, whose conversion
  (``prepare_fp8_moe_layer_for_fi``) needs FlashInfer's GPU kernels: the EP cases run the
  TRITON format too. vLLM's ``Fp8MoEMethod.process_weights_after_loading`` and
  ``_setup_kernel`` run unchanged, ``make_fp8_moe_kernel`` included.
"""

from __future__ import annotations


def install() -> None:
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend, backend_to_kernel_cls

    class PostLoadOnlyBlockKernel(Fp8BlockScaledMMLinearKernel):
        """vLLM's block-FP8 kernel base: its ``process_weights_after_loading``, no GEMM."""

        @classmethod
        def is_supported(cls, compute_capability=None):  # noqa: ANN001
            return True, None

        def apply_block_scaled_mm(self, A, B, As, Bs):  # noqa: ANN001, N803
            raise RuntimeError("the FP8 GEMM is stubbed on this machine (fp8_kernel_stubs.py): loading only")

    def init_fp8_linear_kernel(activation_quant_key, weight_quant_key, input_dtype, out_dtype,  # noqa: ANN001
                               weight_shape, force_kernel=None, module_name=None):  # noqa: ANN001
        from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
            FP8ScaledMMLinearLayerConfig,
        )

        if not activation_quant_key.scale.group_shape.is_per_group():
            raise NotImplementedError("fp8_kernel_stubs: only block FP8 (per-group activations) is stubbed")
        return PostLoadOnlyBlockKernel(FP8ScaledMMLinearLayerConfig(
            weight_quant_key=weight_quant_key, activation_quant_key=activation_quant_key,
            input_dtype=input_dtype, out_dtype=out_dtype, weight_shape=weight_shape))

    def select_fp8_moe_backend(config, weight_key, activation_key, allow_vllm_cutlass=False):  # noqa: ANN001
        return Fp8MoeBackend.TRITON, backend_to_kernel_cls(Fp8MoeBackend.TRITON)[0]

    fp8.init_fp8_linear_kernel = init_fp8_linear_kernel
    fp8.select_fp8_moe_backend = select_fp8_moe_backend
