"""Bad inputs give clear Python exceptions carrying awex's message, and never crash."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

import awex
from conftest import TINY_F32

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


@pytest.fixture()
def connected(gateway, pair_name):
    ctl = awex.Controller(gateway)
    ctl.connect(pair_name, model=TINY_F32, train="megatron:tp=2", infer="sglang:tp=1", transport="shm")
    yield ctl
    ctl.disconnect()


@pytest.fixture()
def writer(gateway, pair_name, connected):
    with awex.Writer(gateway, pair_name, 0) as w:
        yield w


def spec_of(w, name):
    return next(t for t in w.layout() if t["name"] == name)


def test_qkv_shape_of_the_layout_is_megatrons(writer):
    # 4 heads over 2 groups of head_dim 16: one group of 64 rows per tp rank
    t = spec_of(writer, QKV)
    assert (t["shape"], t["dtype"]) == ([64, 64], "f32")


def test_wrong_shape_names_the_tensor_and_both_shapes(writer):
    with pytest.raises(awex.LayoutError) as e:
        writer.register({QKV: np.zeros((128, 64), np.float32)})
    assert str(e.value) == f"`{QKV}` has shape [128, 64] but training rank 0's layout needs [64, 64]"
    assert isinstance(e.value, ValueError)
    assert writer.missing()[0] == "embedding.word_embeddings.weight"


def test_wrong_dtype_names_the_tensor_and_both_dtypes(writer):
    with pytest.raises(awex.LayoutError, match=re.escape(f"`{QKV}` is f64 but training rank 0's layout needs f32")):
        writer.register([(QKV, np.zeros((64, 64), np.float64))])


def test_unknown_name_is_refused_with_examples_of_the_layout(writer):
    with pytest.raises(awex.LayoutError) as e:
        writer.register({"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32)})
    assert str(e.value).startswith(
        "`model.layers.0.self_attn.q_proj.weight` is not a tensor of training rank 0's layout "
        "(megatron:tp=2 tiny-f32); it has 35 tensors, e.g. `embedding.word_embeddings.weight`"
    )


def test_skip_unknown_ignores_names_outside_the_layout(writer):
    n = writer.register(
        {"not.a.param": np.zeros(3, np.float32), QKV: np.zeros((64, 64), np.float32)},
        skip_unknown=True,
    )
    assert n == 1
    assert QKV not in writer.missing()


def test_non_contiguous_array_is_refused(writer):
    strided = np.zeros((64, 128), np.float32)[:, ::2]
    for a, strides in [(np.asfortranarray(np.zeros((64, 64), np.float32)), "[4, 256]"), (strided, "[512, 8]")]:
        with pytest.raises(awex.LayoutError) as e:
            writer.register({QKV: a})
        assert str(e.value).startswith(f"`{QKV}` is not C-contiguous (shape [64, 64], strides {strides} bytes)")


def test_unsupported_dtype_is_refused(writer):
    with pytest.raises(awex.LayoutError, match=re.escape(
            f"`{QKV}` has dtype complex64 (type string `<c8`), which awex cannot move; awex moves float32")):
        writer.register({QKV: np.zeros((64, 64), np.complex64)})


def test_object_without_memory_is_a_type_error(writer):
    with pytest.raises(TypeError, match=re.escape(
            f"`{QKV}`: a `list` exposes neither `__dlpack__`, `__array_interface__` nor torch's `data_ptr()`")):
        writer.register({QKV: [[0.0] * 64] * 64})
    with pytest.raises(TypeError, match="tensor names are strings"):
        writer.register([(3, np.zeros(1))])
    with pytest.raises(TypeError, match=r"register takes \(name, tensor\) pairs"):
        writer.register(42)


def test_duplicate_registration_is_refused_and_a_failed_call_registers_nothing(writer):
    ok = np.zeros((64, 64), np.float32)
    with pytest.raises(awex.LayoutError, match=re.escape(f"`{QKV}` is registered twice")):
        writer.register([(QKV, ok), (QKV, ok)])
    assert QKV in writer.missing()
    writer.register({QKV: ok})
    with pytest.raises(awex.LayoutError, match="registered twice"):
        writer.register({QKV: ok})


def test_join_with_missing_tensors_names_the_first_one(writer):
    writer.register({QKV: np.zeros((64, 64), np.float32)})
    with pytest.raises(awex.LayoutError, match=re.escape(
            "rank 0/0 must register `embedding.word_embeddings.weight` (shape [512, 64], f32), but it was not registered")):
        writer.join(timeout=5)
    assert not writer.joined


def test_read_only_array_cannot_receive(gateway, pair_name, connected):
    with awex.Reader(gateway, pair_name, 0) as r:
        name = r.layout()[0]["name"]
        a = np.zeros(r.layout()[0]["shape"], np.float32)
        a.setflags(write=False)
        with pytest.raises(ValueError, match=re.escape(f"`{name}` is read-only; an inference rank writes into its tensors")):
            r.register({name: a})


def test_calls_out_of_order_are_refused(writer):
    with pytest.raises(awex.AwexError, match="training rank 0 has not joined; call join\\(\\) first"):
        writer.update(1)
    writer.close()
    with pytest.raises(awex.AwexError, match="training rank 0 is closed"):
        writer.register({QKV: np.zeros((64, 64), np.float32)})
    writer.close()  # idempotent


def test_a_rank_outside_the_pair_is_refused(gateway, pair_name, connected):
    with pytest.raises(awex.LayoutError, match=re.escape("training layout megatron:tp=2 has no rank 0/5 (world size 2)")):
        awex.Writer(gateway, pair_name, 5)


def test_a_layout_that_disagrees_with_the_pair_is_refused(gateway, pair_name, connected):
    with pytest.raises(awex.LayoutError, match=re.escape(
            f"this rank was given the training layout `megatron:tp=4` but pair `{pair_name}` was connected with `megatron:tp=2`")):
        awex.Writer(gateway, pair_name, 0, parallel={"tp": 4})
    # the same layout spelled with its defaults is accepted
    with awex.Writer(gateway, pair_name, 1, backend="megatron", parallel={"tp": 2, "pp": 1},
                     peer_parallel={"tp": 1}) as w:
        assert (w.train, w.infer) == ("megatron:pp=1,tp=2", "sglang:tp=1")


def test_a_different_model_is_refused(gateway, pair_name, connected):
    with pytest.raises(awex.LayoutError, match=r"model `qwen3-tiny` \(fingerprint [0-9a-f]{16}\) differs from the training model"):
        awex.Writer(gateway, pair_name, 0, model="qwen3-tiny")


def test_another_transport_is_refused(gateway, pair_name, connected):
    with pytest.raises(ValueError, match=re.escape(f"pair `{pair_name}` uses transport shm but this rank was given tcp")):
        awex.Reader(gateway, pair_name, 0, transport="tcp")


def test_unknown_pair_and_unreachable_gateway_are_gateway_errors(gateway):
    with pytest.raises(awex.GatewayError) as e:
        awex.Writer(gateway, "no-such-pair", 0)
    assert e.value.status == 404
    assert "no-such-pair" in str(e.value)
    with pytest.raises(awex.GatewayError) as e:
        awex.Writer("http://127.0.0.1:9", "p", 0, timeout=20)
    assert e.value.status is None
    assert str(e.value).startswith("cannot reach the gateway at http://127.0.0.1:9/")


def test_bad_arguments_are_value_and_type_errors(gateway, pair_name, connected):
    with pytest.raises(ValueError, match=r"parallel\['tp'\] must be a non-negative integer, not -1"):
        awex.Writer(gateway, pair_name, 0, parallel={"tp": -1})
    with pytest.raises(TypeError, match="model must be a preset name"):
        awex.Writer(gateway, pair_name, 0, model=3)
    with pytest.raises(ValueError, match="is neither a built-in preset nor an existing config.json"):
        awex.Writer(gateway, pair_name, 0, model="no-such-model")
    with pytest.raises(awex.GatewayError, match="is not a gateway URL"):
        awex.Controller("ftp://x")
    with pytest.raises(ValueError, match="no pair: call connect\\(\\) first"):
        awex.Controller(gateway).status()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_hidden_layers", 10**9, "model num_hidden_layers=1000000000 is above awex's limit of 1024"),
        ("vocab_size", 2**62, "model vocab_size=4611686018427387904 is above awex's limit of 4194304"),
        ("head_dim", 2**64 - 1, "model head_dim=18446744073709551615 is above awex's limit of 1024"),
    ],
)
def test_model_sizes_above_the_limits_are_refused_at_connect(gateway, pair_name, field, value, message):
    ctl = awex.Controller(gateway)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(message)):
        ctl.connect(pair_name, model=dict(TINY_F32, **{field: value}), train="megatron:tp=2", infer="sglang:tp=1")
    # refused before anything is sized by it: planning a billion ranks would take hours (a
    # bound a loaded machine never misses, far below what the refused work would cost)
    assert time.monotonic() - t0 < 30.0


@pytest.mark.parametrize(
    "train, infer, message",
    [
        ("megatron:dp=1000000000", "sglang:tp=1", "megatron dp=1000000000 is above awex's limit of 65536"),
        ("fsdp:tp=100000", "sglang:tp=1", "fsdp tp=100000 is above awex's limit of 1024"),
        ("megatron:tp=2", "sglang:engines=100000", "sglang engines=100000 is above awex's limit of 65536"),
        ("fsdp:tp=4", "sglang:tp=1", "model has 4 attention heads and 2 KV heads; fsdp tp=4 needs both divisible by tp"),
    ],
)
def test_parallel_sizes_the_backends_refuse_are_refused_at_connect(gateway, pair_name, train, infer, message):
    ctl = awex.Controller(gateway)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(message)):
        ctl.connect(pair_name, model=TINY_F32, train=train, infer=infer)
    # refused before anything is sized by it: planning a billion ranks would take hours (a
    # bound a loaded machine never misses, far below what the refused work would cost)
    assert time.monotonic() - t0 < 30.0


def _gateway_answering_503(queued: bool):
    """A stand-in gateway whose every request gets the 503 awex's gateway answers when it could
    not persist its state (awex-control/src/server/mod.rs, the persistence middleware): with
    ``"queued": true`` when the change was made, without it when nothing changed. Tests only
    the Python client's side; counts the requests it got."""
    import http.server
    import json
    import threading

    got = []

    class H(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)
            got.append((self.command, self.path))
            body = {"error": "the gateway could not persist its state in /state: No space left on device"}
            if queued:
                body["error"] += "; the change WAS MADE and is queued"
                body["queued"] = True
            data = json.dumps(body).encode()
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, got


@pytest.mark.parametrize("queued", [True, False])
def test_a_503_that_could_not_persist_says_whether_the_update_was_made(queued):
    srv, got = _gateway_answering_503(queued)
    try:
        ctl = awex.Controller(f"http://127.0.0.1:{srv.server_address[1]}", pair="p")
        with pytest.raises(awex.GatewayError) as e:
            ctl.start_update(2)
        assert e.value.status == 503
        assert e.value.queued is queued
        assert "could not persist its state" in str(e.value)
        # a started version is never sent twice: the queued one runs
        assert [m for m, _ in got] == ["POST"], got
    finally:
        srv.shutdown()
