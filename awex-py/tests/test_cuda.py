"""GPU tensors: what register accepts depends on the transport and on the build's `cuda` feature.

CI builds awex without CUDA, so these tests pin the refusals; the accepting paths (torch CUDA
tensors over cuda-ipc and nccl) are exercised on a GPU by scripts/gpu_megatron_check.sh and
scripts/gpu_pynccl.sh, and by the GPU tests at the end of this file, which skip without a CUDA
build and a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import awex
from awex import _awex
from conftest import TINY_F32


class CudaLike:
    """Torch's protocol (data_ptr/shape/stride/dtype/device) claiming to live on `cuda:1`."""

    class _Device:
        type = "cuda"
        index = 1

        def __str__(self) -> str:
            return "cuda:1"

    class _DType:
        def __str__(self) -> str:
            return "torch.float32"

    def __init__(self, shape: list[int]) -> None:
        self.shape = tuple(shape)
        self.dtype = self._DType()
        self.device = self._Device()

    def data_ptr(self) -> int:
        return 0x7F00_0000_0000

    def stride(self) -> tuple[int, ...]:
        out, step = [], 1
        for n in reversed(self.shape):
            out.append(step)
            step *= n
        return tuple(reversed(out))


def writer(gateway: str, pair_name: str, transport: str) -> awex.Writer:
    ctl = awex.Controller(gateway)
    ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=1", infer="sglang:tp=1", transport=transport)
    return awex.Writer(gateway, pair_name, 0)


def test_default_build_reports_no_cuda():
    assert _awex.CUDA is False


@pytest.mark.parametrize("transport", ["tcp", "cuda-ipc", "nccl"])
def test_cuda_tensor_without_cuda_build_is_refused_naming_the_feature(gateway, pair_name, transport):
    if _awex.CUDA:
        pytest.skip("this build has CUDA")
    w = writer(gateway, pair_name, transport)
    try:
        t = w.layout()[0]
        with pytest.raises(ValueError) as e:
            w.register([(t["name"], CudaLike(t["shape"]))])
        assert str(e.value) == (
            f"`{t['name']}` lives on `cuda:1`, but awex was built without CUDA (the `cuda` feature of "
            "awex-py); rebuild it with `maturin build --features cuda` to register GPU tensors over "
            "the cuda-ipc or nccl transport, or register CPU tensors"
        )
        assert w.missing()[0] == t["name"], "a refused call registers nothing"
    finally:
        w.close()


@pytest.mark.parametrize("transport", ["cuda-ipc", "nccl"])
def test_host_array_over_a_gpu_transport_is_refused_naming_the_transport(gateway, pair_name, transport):
    w = writer(gateway, pair_name, transport)
    try:
        assert w.transport == transport
        t = w.layout()[0]
        with pytest.raises(ValueError) as e:
            w.register([(t["name"], np.zeros(t["shape"], dtype=np.float32))])
        assert str(e.value) == (
            f"`{t['name']}` lives in host memory, but the {transport} transport moves GPU memory; "
            "register CUDA tensors (tensor.cuda()), or use the shm or tcp transport"
        )
    finally:
        w.close()


def test_cpu_torch_tensor_over_nccl_is_refused_naming_the_transport(gateway, pair_name):
    torch = pytest.importorskip("torch")
    w = writer(gateway, pair_name, "nccl")
    try:
        t = w.layout()[0]
        with pytest.raises(ValueError) as e:
            w.register([(t["name"], torch.zeros(t["shape"], dtype=torch.float32))])
        assert str(e.value) == (
            f"`{t['name']}` lives in host memory, but the nccl transport moves GPU memory; "
            "register CUDA tensors (tensor.cuda()), or use the shm or tcp transport"
        )
        assert w.missing()[0] == t["name"]
    finally:
        w.close()


def _gpus() -> int:
    if not _awex.CUDA:
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_cuda_tensors_register_over_nccl_on_the_gpu_they_live_on(gateway, pair_name):
    """With a CUDA build and a GPU: torch CUDA tensors register over nccl (the rank's GPU is
    theirs); a two-rank NCCL pair needs two GPUs and runs in scripts/gpu_pynccl.sh."""
    if _gpus() < 1:
        pytest.skip("needs awex built with --features cuda, torch and a GPU")
    import torch

    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    w = writer(gateway, pair_name, "nccl")
    try:
        named = [(t["name"], torch.zeros(t["shape"], dtype=torch.float32, device=dev)) for t in w.layout()]
        assert w.register(named) == len(named)
        assert w.missing() == []
    finally:
        w.close()
