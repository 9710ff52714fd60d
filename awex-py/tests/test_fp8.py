"""FP8 inference sides from Python: ``Controller.connect`` takes the inference side's FP8 config
as ``awex-cli`` does, and every rank takes the pair's encoding (the real-engine check is
``engines/tests/test_fp8_sglang_real.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import awex
from conftest import TINY_F32

QKV = "model.layers.0.self_attn.qkv_proj.weight"


def test_an_fp8_pair_gives_every_reader_sglangs_fp8_tensors(gateway, pair_name):
    ctl = awex.Controller(gateway)
    st = ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=2",
                     infer_quant="fp8", fp8_block=(16, 16))
    try:
        fp8 = st["inference"]["fp8"]
        assert fp8["recipe"] == "vllm" and fp8["config"]["encoding"]["block"] == [16, 16], fp8
        with awex.Reader(gateway, pair_name, 1) as r:
            layout = {t["name"]: t for t in r.layout()}
        # 4 heads of 16 over 2 KV heads: q 32 + k 16 + v 16 rows per rank, 64 columns
        assert (layout[QKV]["shape"], layout[QKV]["dtype"]) == ([64, 64], "f8e4m3")
        assert (layout[QKV + "_scale_inv"]["shape"], layout[QKV + "_scale_inv"]["dtype"]) == ([4, 4], "f32")
        assert layout["model.embed_tokens.weight"]["dtype"] == "f32"
        assert layout["model.layers.0.input_layernorm.weight"]["dtype"] == "f32"
        # the training side is the trainer's, untouched
        with awex.Writer(gateway, pair_name, 0) as w:
            assert all(t["dtype"] == "f32" for t in w.layout())
    finally:
        ctl.disconnect()


def test_a_plain_pair_has_no_fp8_tensors(gateway, pair_name):
    ctl = awex.Controller(gateway)
    st = ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=2")
    try:
        assert "fp8" not in st["inference"]
        with awex.Reader(gateway, pair_name, 0) as r:
            assert all(t["dtype"] == "f32" for t in r.layout())
    finally:
        ctl.disconnect()


def test_the_checkpoints_quantization_config_gives_the_encoding(gateway, pair_name, tmp_path):
    cfg = {**TINY_F32, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                               "weight_block_size": [32, 16]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ctl = awex.Controller(gateway)
    for given in (str(tmp_path), tmp_path / "config.json", cfg):
        st = ctl.connect(pair_name, model=TINY_F32, train="fsdp:dp=1", infer="sglang:tp=1", infer_config=given)
        assert st["inference"]["fp8"]["config"]["encoding"]["block"] == [32, 16], given
        ctl.disconnect()


def test_a_model_whose_config_is_fp8_needs_infer_config_to_be_planned_fp8(gateway, pair_name, tmp_path):
    cfg = {**TINY_F32, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                               "weight_block_size": [32, 16]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ctl = awex.Controller(gateway)
    for model in (cfg, str(tmp_path)):
        with pytest.raises(ValueError, match="pass the same config as infer_config"):
            ctl.connect(pair_name, model=model, train="fsdp:dp=1", infer="sglang:tp=1")
    st = ctl.connect(pair_name, model=cfg, train="fsdp:dp=1", infer="sglang:tp=1", infer_config=cfg)
    assert st["inference"]["fp8"]["config"]["encoding"]["block"] == [32, 16]
    ctl.disconnect()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"infer_quant": "int4"}, 'infer_quant must be "fp8"'),
        ({"fp8_block": (16, 16)}, 'fp8_block and fp8_recipe need infer_quant="fp8" or infer_config'),
        ({"infer_quant": "fp8", "fp8_block": (0, 16)}, "block edges go from 1 to"),
        ({"infer_quant": "fp8", "fp8_recipe": "nope"}, "fp8_recipe"),
        ({"infer_config": TINY_F32}, "has no quantization_config"),
        ({"infer_config": {**TINY_F32, "hidden_size": 128, "quantization_config": {
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}}},
         "differs from the pair's model"),
        # SGLang refuses the same split: 64 rows of q over tp 4 is 16, not a multiple of 32
        ({"infer_quant": "fp8", "fp8_block": (32, 32)}, "not divisible by weight quantization block"),
    ],
)
def test_bad_fp8_settings_are_refused_naming_what_to_change(gateway, pair_name, kwargs, message):
    ctl = awex.Controller(gateway)
    with pytest.raises((ValueError, awex.AwexError)) as e:
        ctl.connect(pair_name, model=TINY_F32, train="fsdp:dp=1", infer="sglang:tp=4", **kwargs)
    assert message in str(e.value), str(e.value)


def test_fp8_block_must_be_two_edges(gateway, pair_name):
    with pytest.raises(TypeError, match="two block edges"):
        awex.Controller(gateway).connect(pair_name, model=TINY_F32, train="fsdp:dp=1", infer="sglang:tp=1",
                                         infer_quant="fp8", fp8_block="16x16")


def test_registering_across_the_fp8_boundary_says_how_to_connect(gateway, pair_name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    ctl = awex.Controller(gateway)
    # an FP8 engine's weight into a plain pair
    ctl.connect(pair_name, model=TINY_F32, train="fsdp:dp=1", infer="sglang:tp=1")
    try:
        with awex.Reader(gateway, pair_name, 0) as r:
            shape = next(t["shape"] for t in r.layout() if t["name"] == QKV)
            with pytest.raises(awex.LayoutError) as e:
                r.register({QKV: np.zeros(shape, ml_dtypes.float8_e4m3fn)})
            assert str(e.value).startswith(f"`{QKV}` is f8e4m3 but inference rank 0/0's layout needs f32; ")
            assert "connect it with the FP8 checkpoint's config" in str(e.value), str(e.value)
    finally:
        ctl.disconnect()
    # an unquantised engine's weight into an FP8 pair
    ctl.connect(pair_name, model=TINY_F32, train="fsdp:dp=1", infer="sglang:tp=1", infer_quant="fp8",
                fp8_block=(16, 16))
    try:
        with awex.Reader(gateway, pair_name, 0) as r:
            shape = next(t["shape"] for t in r.layout() if t["name"] == QKV)
            with pytest.raises(awex.LayoutError) as e:
                r.register({QKV: np.zeros(shape, np.float32)})
            assert str(e.value).startswith(f"`{QKV}` is f32 but inference rank 0/0's layout needs f8e4m3; ")
            assert "launch the engine from the FP8 checkpoint" in str(e.value), str(e.value)
            # SGLang's FP8 tensors register
            assert r.register({QKV: np.zeros(shape, ml_dtypes.float8_e4m3fn)}) == 1
    finally:
        ctl.disconnect()


def test_a_fifo_named_as_model_or_infer_config_is_refused_not_waited_on(tmp_path):
    """A FIFO in place of a config.json is refused by name, as awex-cli refuses it. Run in a child
    process killed after a deadline: a read that waits on the FIFO would never return."""
    (tmp_path / "m").mkdir()
    os.mkfifo(tmp_path / "m" / "config.json")
    m = str(tmp_path / "m")
    script = textwrap.dedent(f"""
        import awex
        from awex import _testing
        ctl = awex.Controller(_testing.start_gateway())
        for kwargs in ({{"model": {m!r}}}, {{"model": "qwen3-tiny", "infer_config": {m!r}}},
                       {{"model": "qwen3-tiny", "infer_config": {m + "/config.json"!r}}}):
            try:
                ctl.connect("fifo", train="fsdp:dp=1", infer="sglang:tp=1", **kwargs)
            except (ValueError, awex.AwexError) as e:
                assert "it is a FIFO, not a regular file" in str(e), (kwargs, str(e))
            else:
                raise SystemExit(f"{{kwargs}} was taken")
        print("refused")
    """)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("connect waited on a FIFO instead of refusing it")
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stdout + out.stderr
