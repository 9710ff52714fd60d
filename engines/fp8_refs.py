"""The torch block-FP8 quantisers awex reproduces, the shared test matrices, and their digests.

Each ``ref_*`` function transcribes one reference's torch code, operation for operation (the
fp32 rounding order is the point), with the file it comes from; ``engines/tests`` checks the
transcriptions against the installed engines' own functions where those are importable
(SGLang 0.5.23, vLLM 0.33 and its vendored DeepGEMM). Matrices come from a generator that
``awex-core/tests/fp8_reference.rs`` repeats bit for bit, so that the committed digests
(``awex-core/tests/fixtures/fp8_reference.json``, written by ``python engines/fp8_refs.py``)
pin awex's CPU quantiser to torch's bytes on each device.

    python engines/fp8_refs.py [--device cpu|cuda ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

FP8 = torch.float8_e4m3fn

# ---------------------------------------------------------------------------------------------
# inputs: xorshift64* bf16 matrices, block-wise patterns (awex-core/tests/fp8_reference.rs)

MASK = (1 << 64) - 1

# (rows, cols, seed); partial blocks on both edges, a one-row matrix, one whole block
CASES = [(300, 520, 1), (257, 130, 2), (128, 128, 3), (1, 1000, 4), (640, 384, 5), (1024, 1024, 6)]

# per 128 x 128 block, by (block_row * 7 + block_col) % 8: (exponent low, exponent span) of
# the bf16 elements; span 0 means an all-zero block
PATTERNS = [
    (127 - 14, 17),  # ordinary weights, 2^-14 .. 2^3
    (0, 0),  # an all-zero block: the amax clamp
    (0, 1),  # bf16 subnormals only
    (127 - 40, 20),  # every |x| below the 1e-4 clamp
    (200, 54),  # huge, up to 2^127
    (0, 130),  # subnormals to 2^3 mixed
    (127 - 8, 9),  # 2^-8 .. 2^0
    (127 - 3, 2),  # a narrow range: many ties after power-of-two scales
]


def matrix_bits(rows: int, cols: int, seed: int) -> list[int]:
    """The bf16 bits of one test matrix, row-major."""
    s = seed * 0x9E3779B97F4A7C15 & MASK or 1
    out = []
    for r in range(rows):
        for c in range(cols):
            s ^= s >> 12
            s ^= (s << 25) & MASK
            s ^= s >> 27
            x = (s * 0x2545F4914F6CDD1D) & MASK
            lo, span = PATTERNS[((r // 128) * 7 + c // 128) % 8]
            if span == 0:
                out.append(0)
                continue
            sign = (x >> 63) & 1
            exp = lo + ((x >> 8) % span)
            mant = x & 0x7F
            out.append((sign << 15) | (exp << 7) | mant)
    return out


def matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    bits = torch.tensor(matrix_bits(rows, cols, seed), dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).view(rows, cols)


def fnv1a(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & MASK
    return f"{h:016x}"


# ---------------------------------------------------------------------------------------------
# the references


def _align(x: int, y: int) -> int:
    return (x + y - 1) // y * y


def _pad_view(x: torch.Tensor, bm: int, bn: int):
    m, n = x.shape
    xp = torch.zeros((_align(m, bm), _align(n, bn)), dtype=x.dtype, device=x.device)
    xp[:m, :n] = x
    return xp, xp.view(-1, bm, xp.size(1) // bn, bn)


def ref_vllm(x, block=(128, 128), use_ue8m0=False):
    """vLLM 0.33 vllm/utils/deep_gemm.py::per_block_cast_to_fp8 (online/fp8.py:345 calls it)."""
    m, n = x.shape
    xp, xv = _pad_view(x, *block)
    x_amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = x_amax / torch.finfo(FP8).max
    if use_ue8m0:  # _ceil_to_ue8m0
        sf = torch.pow(2.0, torch.ceil(torch.log2(sf.abs())))
    x_scaled = (xv * (1.0 / sf)).to(FP8)
    return x_scaled.view_as(xp)[:m, :n].contiguous(), sf.view(xv.size(0), xv.size(2))


def ref_vllm_cuda(x, block=(128, 128)):
    """``ref_vllm`` as CUDA torch evaluates it, on any device: aten's ``div_true_kernel_cuda``
    computes ``x_amax / 448.0`` (a tensor divided by a Python float) as ``x_amax * fl32(1 /
    448)``, where the CPU divides (``awex_core::encoding::TorchDevice``); the reciprocal, the
    product and the e4m3 cast (of values within +-448) are the same on both. What awex's
    default (``vllm`` recipe, CUDA arithmetic) must write, checked on a CPU-only machine."""
    m, n = x.shape
    xp, xv = _pad_view(x, *block)
    x_amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = x_amax * torch.tensor(1.0 / torch.finfo(FP8).max, dtype=torch.float32)
    x_scaled = (xv * (1.0 / sf)).to(FP8)
    return x_scaled.view_as(xp)[:m, :n].contiguous(), sf.view(xv.size(0), xv.size(2))


def ceil_to_ue8m0(x):
    """DeepGEMM deep_gemm/utils/math.py::ceil_to_ue8m0 (also SGLang fp8_utils.py's copy)."""
    bits = x.abs().float().view(torch.int)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
    return (exp.clamp(1, 254) << 23).view(torch.float)


def ref_deepgemm(x, use_ue8m0, gran_k=128):
    """DeepGEMM deep_gemm/utils/math.py::per_block_cast_to_fp8 (vendored in vLLM 0.33 at
    vllm/third_party/deep_gemm/utils/math.py)."""
    m, n = x.shape
    xp, xv = _pad_view(x, gran_k, gran_k)
    x_amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = x_amax / 448.0
    sf = ceil_to_ue8m0(sf) if use_ue8m0 else sf
    x_scaled = (xv * (1.0 / sf)).to(FP8)
    return x_scaled.view_as(xp)[:m, :n].contiguous(), sf.view(xv.size(0), xv.size(2))


def ref_deepgemm_legacy(x, block=(128, 128)):
    """DeepGEMM's first tests/test_core.py::per_block_cast_to_fp8 (2025-02)."""
    m, n = x.shape
    xp, xv = _pad_view(x, *block)
    x_amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    x_scaled = (xv * (448.0 / x_amax)).to(FP8)
    return x_scaled.view_as(xp)[:m, :n].contiguous(), (x_amax / 448.0).view(xv.size(0), xv.size(2))


def ref_awex_python(x, scale_ue8m0, block=(128, 128)):
    """inclusionAI/Awex awex/converter/weights_converter.py::per_block_cast_to_fp8."""
    m, n = x.shape
    xp, xv = _pad_view(x, *block)
    x_scale = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / 448.0
    if scale_ue8m0:
        x_scale = x_scale.maximum(torch.tensor(1e-10, device=x.device)).log2().ceil().exp2()
    x_scaled = (xv / x_scale).to(FP8)
    return x_scaled.view_as(xp)[:m, :n].contiguous(), x_scale.view(xv.size(0), xv.size(2))


def ref_slime(x, force_pow_2_scale, block=(128, 128)):
    """THUDM/slime slime/utils/fp8_kernel.py::_blockwise_cast_to_fp8_triton, its arithmetic in
    torch (the kernel is Triton; finite input, so its inf/NaN branches do not apply). The
    compiled kernel divides ``_absmax / fp8_max`` as ``_absmax * fl(1/448)`` and takes an IEEE
    ``1.0 / x_s``: on CUDA this transcription gives the Triton kernel's bytes (checked on an
    H200 with the kernel itself); on the CPU it is torch's true division."""
    m, n = x.shape
    xp, xv = _pad_view(x, *block)
    absmax = torch.maximum(xv.abs().float().amax(dim=(1, 3), keepdim=True), torch.tensor(1e-10, device=x.device))
    x_s = absmax / 448.0
    if force_pow_2_scale:
        x_s = torch.exp2(torch.ceil(torch.log2(x_s)))
    s_inv = torch.reciprocal(x_s)
    y = torch.clamp(xv.float() * s_inv, -448.0, 448.0).to(FP8)
    return y.view_as(xp)[:m, :n].contiguous(), x_s.view(xv.size(0), xv.size(2))


def block_quant_dequant(x_q, x_s, block_size, dtype):
    """SGLang 0.5.23 sglang/srt/layers/quantization/fp8_utils.py::block_quant_dequant."""
    block_n, block_k = block_size
    *_, n, k = x_q.shape
    rep = x_s.repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)[..., :n, :k]
    return (x_q.to(torch.float32) * rep).to(dtype)


def ref_sglang_ue8m0(x):
    """SGLang 0.5.23 fp8_utils.py::requant_weight_ue8m0 (before transform_scale_ue8m0 packs the
    scales for DeepGEMM) applied to a vLLM quantisation: block_quant_dequant to bf16, then its
    per_block_cast_to_fp8 (DeepGEMM's, UE8M0)."""
    q, s = ref_vllm(x)
    deq = block_quant_dequant(q, s, [128, 128], torch.bfloat16)
    return ref_deepgemm(deq, use_ue8m0=True)


# recipes whose reference takes a block shape, with a matrix quantised in [64, 96] blocks
BLOCK_RECIPES = {
    "vllm": lambda x, b: ref_vllm(x, b),
    "vllm-ue8m0": lambda x, b: ref_vllm(x, b, use_ue8m0=True),
    "deepgemm-legacy": lambda x, b: ref_deepgemm_legacy(x, b),
    "awex-python": lambda x, b: ref_awex_python(x, False, b),
    "awex-python-ue8m0": lambda x, b: ref_awex_python(x, True, b),
    "slime": lambda x, b: ref_slime(x, False, b),
    "slime-pow2": lambda x, b: ref_slime(x, True, b),
}
BLOCK_CASES = [(300, 520, 7, (64, 96))]

RECIPES = {
    "vllm": lambda x: ref_vllm(x),
    "vllm-ue8m0": lambda x: ref_vllm(x, use_ue8m0=True),
    "deepgemm-ue8m0": lambda x: ref_deepgemm(x, True),
    "deepgemm-legacy": ref_deepgemm_legacy,
    "awex-python": lambda x: ref_awex_python(x, False),
    "awex-python-ue8m0": lambda x: ref_awex_python(x, True),
    "slime": lambda x: ref_slime(x, False),
    "slime-pow2": lambda x: ref_slime(x, True),
    "sglang-ue8m0": ref_sglang_ue8m0,
}


def digests(device: str) -> dict:
    """``{case: {recipe: [e4m3 digest, scale digest]}}`` of every case on ``device``."""
    out = {}
    for rows, cols, seed in CASES:
        x = matrix(rows, cols, seed).to(device)
        per = {}
        for name, f in RECIPES.items():
            q, s = f(x)
            qb = q.view(torch.uint8).cpu().contiguous().numpy().tobytes()
            sb = s.float().cpu().contiguous().numpy().tobytes()
            per[name] = [fnv1a(qb), fnv1a(sb)]
        out[f"{rows}x{cols}:{seed}"] = per
    for rows, cols, seed, block in BLOCK_CASES:
        x = matrix(rows, cols, seed).to(device)
        per = {}
        for name, f in BLOCK_RECIPES.items():
            q, s = f(x, block)
            qb = q.view(torch.uint8).cpu().contiguous().numpy().tobytes()
            sb = s.float().cpu().contiguous().numpy().tobytes()
            per[name] = [fnv1a(qb), fnv1a(sb)]
        out[f"{rows}x{cols}:{seed}:{block[0]}x{block[1]}"] = per
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", action="append", help="cpu (default) and/or cuda")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "awex-core", "tests", "fixtures", "fp8_reference.json"))
    a = ap.parse_args()
    doc = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            doc = json.load(f)
    doc["_about"] = "digests (FNV-1a 64 of the e4m3 bytes, of the fp32 scales) per torch device; written by engines/fp8_refs.py"
    for dev in a.device or ["cpu"]:
        doc[dev] = {"torch": torch.__version__, "cases": digests(dev)}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    print(a.out)


if __name__ == "__main__":
    main()
