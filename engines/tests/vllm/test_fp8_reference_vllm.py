"""vLLM 0.33's block quantiser and its vendored DeepGEMM give the bytes of the transcriptions in
engines/fp8_refs.py, whose digests awex's Rust quantiser is checked against."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fp8_refs  # noqa: E402


def _same(a, b) -> None:
    assert a[0].view(torch.uint8).equal(b[0].view(torch.uint8))
    assert a[1].float().view(torch.int32).equal(b[1].float().view(torch.int32))


@pytest.mark.parametrize("rows,cols,seed", fp8_refs.CASES[:5])
@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("block", [(128, 128), (64, 96)])
def test_vllm_per_block_cast_to_fp8_is_the_transcription(rows, cols, seed, use_ue8m0, block):
    from vllm.utils import deep_gemm

    # the eager function under vLLM's torch.compile wrapper (compiled and eager give the same
    # bytes on CUDA: scripts/gpu_fp8_check.sh checks both)
    f = getattr(deep_gemm.per_block_cast_to_fp8, "_torchdynamo_orig_callable", deep_gemm.per_block_cast_to_fp8)
    x = fp8_refs.matrix(rows, cols, seed)
    _same(f(x, block_size=list(block), use_ue8m0=use_ue8m0), fp8_refs.ref_vllm(x, block, use_ue8m0=use_ue8m0))


@pytest.mark.parametrize("rows,cols,seed", fp8_refs.CASES[:5])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_vendored_deepgemm_per_block_cast_to_fp8_is_the_transcription(rows, cols, seed, use_ue8m0):
    import importlib.util

    import vllm

    path = os.path.join(os.path.dirname(vllm.__file__), "third_party", "deep_gemm", "utils", "math.py")
    spec = importlib.util.spec_from_file_location("awex_deepgemm_math", path)
    math = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(math)
    x = fp8_refs.matrix(rows, cols, seed)
    _same(math.per_block_cast_to_fp8(x, use_ue8m0=use_ue8m0), fp8_refs.ref_deepgemm(x, use_ue8m0))
