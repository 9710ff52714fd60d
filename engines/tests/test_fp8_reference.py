"""The torch block-FP8 references of engines/fp8_refs.py: SGLang's are its own functions'
bytes, and the digests awex's Rust test checks (awex-core/tests/fixtures/fp8_reference.json)
are what these references give on the CPU now (vLLM's are checked in vllm/)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8_refs  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "awex-core", "tests", "fixtures", "fp8_reference.json")


def _same(a, b) -> None:
    assert a[0].view(torch.uint8).equal(b[0].view(torch.uint8))
    assert a[1].float().view(torch.int32).equal(b[1].float().view(torch.int32))


@pytest.mark.parametrize("rows,cols,seed", fp8_refs.CASES[:5])
def test_sglang_requant_and_ue8m0_cast_are_sglangs_own(rows, cols, seed):
    from sglang.srt.layers.quantization import fp8_utils

    x = fp8_refs.matrix(rows, cols, seed)
    # SGLang's copy of DeepGEMM's UE8M0 cast equals the transcription of DeepGEMM's
    _same(fp8_utils.per_block_cast_to_fp8(x), fp8_refs.ref_deepgemm(x, use_ue8m0=True))
    # its dequantisation, and the whole requantisation before the scale packing
    q, s = fp8_refs.ref_vllm(x)
    deq = fp8_utils.block_quant_dequant(q, s, [128, 128], torch.bfloat16)
    assert deq.view(torch.int16).equal(fp8_refs.block_quant_dequant(q, s, [128, 128], torch.bfloat16).view(torch.int16))
    w, sf = fp8_utils.quant_weight_ue8m0(deq, [128, 128])
    _same((w, sf), fp8_refs.ref_sglang_ue8m0(x))


def test_the_committed_cpu_digests_are_torchs_bytes_now():
    with open(FIXTURE) as f:
        doc = json.load(f)
    assert doc["cpu"]["cases"] == fp8_refs.digests("cpu")


def test_the_matrices_hold_the_edge_cases_the_rust_test_relies_on():
    x = fp8_refs.matrix(300, 520, 1).float()
    assert x[:128, 128:256].abs().max().item() == 0.0  # a zero block
    assert 0 < x[:128, 256:384].abs().max().item() < 2.0**-126  # subnormals only
    assert x[:128, 384:512].abs().max().item() < 1e-4  # below the clamp
    assert x[:128, 512:].abs().max().item() > 1e30  # huge
