"""Whole pairs through a real gateway: numpy arrays on both sides, every byte verified."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import awex
from conftest import (
    TINY_F32,
    canonical_shapes,
    expected_local,
    fill_from_canonical,
    np_dtype,
    run_all,
    same_bits,
    shm_segments,
)


def finite_f32(rng: np.random.Generator, shape) -> np.ndarray:
    """Random float32 bit patterns with the top exponent bit cleared: finite, all mantissas."""
    bits = rng.integers(0, 2**32, size=shape, dtype=np.uint32) & np.uint32(~0x40000000 & 0xFFFFFFFF)
    return bits.view(np.float32)


class Pair:
    """A connected pair with one Writer/Reader per rank, all in this process."""

    def __init__(self, gateway: str, name: str, model: Any, train: str, infer: str, transport: str,
                 delta_engines: tuple[int, ...] = (), **connect: Any) -> None:
        self.ctl = awex.Controller(gateway)
        st = self.ctl.connect(name, model=model, train=train, infer=infer, transport=transport, **connect)
        self.name = name
        self.status = st
        n_train = st["training"]["world_size"]
        engines = st["inference"]["engines"]
        per_engine = st["inference"]["world_size"] // engines
        # ranks need only (gateway, pair, rank): the rest comes from the gateway
        self.writers = [awex.Writer(gateway, name, r) for r in range(n_train)]
        # `delta_engines`: the engines whose Readers say their tensors hold what they received
        self.readers = [awex.Reader(gateway, name, r, engine=e, deltas=True if e in delta_engines else None)
                        for e in range(engines) for r in range(per_engine)]

    def all(self):
        return self.writers + self.readers

    def join(self) -> None:
        run_all([lambda x=x: x.join(timeout=60) for x in self.all()])

    def update(self, version: int) -> list[dict[str, Any]]:
        """Every rank's update(version) in its own thread, the controller's in this one."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(self.all())) as ex:
            futures = [ex.submit(x.update, version, timeout=60) for x in self.all()]
            self.ctl.update(version, timeout=60)
            return [f.result(timeout=60) for f in futures]

    def close(self) -> None:
        for x in self.all():
            x.close()


def run_and_verify(gateway: str, pair_name: str, model, train: str, infer: str, transport: str,
                   versions: int = 2, checksums: bool = False) -> None:
    rng = np.random.default_rng(7)
    p = Pair(gateway, pair_name, model, train, infer, transport, checksums=checksums)
    try:
        w_layouts = [w.layout() for w in p.writers]
        shapes = canonical_shapes(w_layouts)
        w_arrays = []
        canonical = {}
        for w in p.writers:
            assert w.uses_mirror == (transport == "shm")
        r_arrays = []
        for r in p.readers:
            arrays = {t["name"]: np.zeros(t["shape"], dtype=np_dtype(t["dtype"])) for t in r.layout()}
            assert r.register(arrays) == len(arrays)
            r_arrays.append(arrays)
        for version in range(1, versions + 1):
            canonical = {n: finite_f32(rng, s) for n, s in shapes.items()}
            if version == 1:
                for w, layout in zip(p.writers, w_layouts):
                    arrays = fill_from_canonical(layout, canonical, np_dtype, rng)
                    assert w.register(list(arrays.items())) == len(arrays)
                    assert w.missing() == []
                    w_arrays.append(arrays)
                p.join()
            else:
                # new weights written in place into the registered arrays
                for arrays, layout in zip(w_arrays, w_layouts):
                    fresh = fill_from_canonical(layout, canonical, np_dtype, rng)
                    for n, a in arrays.items():
                        a[...] = fresh[n]
            results = p.update(version)
            assert [r["version"] for r in results] == [version] * len(results)
            assert all(r["state"] == "committed" for r in results)
            sent = sum(r["bytes"] for r in results[: len(p.writers)])
            received = sum(r["bytes"] for r in results[len(p.writers):])
            assert sent == received > 0
            if checksums:
                sums = [sum(r["checksum"] for r in part) % 2**64
                        for part in (results[: len(p.writers)], results[len(p.writers):])]
                assert sums[0] == sums[1] != 0
            for reader, arrays in zip(p.readers, r_arrays):
                for t in reader.layout():
                    want = expected_local(t, canonical, np_dtype(t["dtype"]))
                    assert same_bits(arrays[t["name"]], want), (
                        f"version {version}: {reader!r} `{t['name']}` differs")
        status = p.ctl.status()
        assert status["serving_version"] == versions
        p.ctl.disconnect()
        with pytest.raises(awex.Disconnected, match="disconnected"):
            p.readers[0].update(timeout=30)
    finally:
        p.close()
    assert shm_segments(pair_name) == []


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize(
    "train,infer",
    [
        ("megatron:tp=2,pp=2", "sglang:tp=2,engines=2"),
        ("megatron:tp=2,pp=2,vpp=2,local_spec=1", "sglang:tp=4"),
        ("fsdp:dp=3", "sglang:tp=1,engines=2"),
    ],
)
def test_numpy_pair_moves_every_byte_exactly(gateway, pair_name, transport, train, infer):
    # the FSDP pairs also run with per-bucket checksums, verified by the receivers
    run_and_verify(gateway, pair_name, TINY_F32, train, infer, transport,
                   checksums=train.startswith("fsdp"))


def test_fp32_trainer_to_bf16_engine_rounds_like_ml_dtypes(gateway, pair_name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    model = dict(TINY_F32, torch_dtype="bfloat16", _name_or_path="tiny-bf16")
    rng = np.random.default_rng(3)
    p = Pair(gateway, pair_name, model, "megatron:tp=2,fp32=1", "sglang:tp=1", "shm")
    try:
        w_layouts = [w.layout() for w in p.writers]
        assert {t["dtype"] for layout in w_layouts for t in layout} == {"f32"}
        canonical = {n: rng.standard_normal(s).astype(np.float32) for n, s in canonical_shapes(w_layouts).items()}
        for w, layout in zip(p.writers, w_layouts):
            w.register(fill_from_canonical(layout, canonical, np_dtype, rng))
        (reader,) = p.readers
        arrays = {t["name"]: np.zeros(t["shape"], dtype=ml_dtypes.bfloat16) for t in reader.layout()}
        reader.register(arrays)
        p.join()
        p.update(1)
        for t in reader.layout():
            assert t["dtype"] == "bf16"
            want = expected_local(t, canonical, ml_dtypes.bfloat16)
            assert same_bits(arrays[t["name"]], want), t["name"]
    finally:
        p.close()


class TorchLike:
    """Exposes only torch's protocol (data_ptr/shape/stride/dtype/device) over a numpy array."""

    class _Device:
        type = "cpu"

        def __str__(self) -> str:
            return "cpu"

    class _DType:
        def __init__(self, name: str) -> None:
            self.name = name

        def __str__(self) -> str:
            return f"torch.{self.name}"

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.shape = a.shape
        self.dtype = self._DType(a.dtype.name)
        self.device = self._Device()

    def data_ptr(self) -> int:
        return self.a.ctypes.data

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.a.itemsize for s in self.a.strides)


class DLPackOnly:
    """Exposes only the DLPack protocol over a numpy array."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_torch_protocol_and_dlpack_objects_are_read_and_written_in_place(gateway, pair_name):
    rng = np.random.default_rng(11)
    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1", "tcp")
    try:
        (w,), (r,) = p.writers, p.readers
        layout = w.layout()
        canonical = {n: finite_f32(rng, s) for n, s in canonical_shapes([layout]).items()}
        w_arrays = fill_from_canonical(layout, canonical, np_dtype, rng)
        w.register([(n, TorchLike(a)) for n, a in w_arrays.items()])
        r_arrays = {t["name"]: np.zeros(t["shape"], dtype=np.float32) for t in r.layout()}
        r.register([(n, DLPackOnly(a)) for n, a in r_arrays.items()])
        p.join()
        p.update(1)
        for t in r.layout():
            assert same_bits(r_arrays[t["name"]], expected_local(t, canonical, np.float32)), t["name"]
    finally:
        p.close()


def test_update_failure_names_the_missing_rank(gateway, pair_name):
    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1,engines=2", "shm",
             update_deadline_s=1.0)
    try:
        for x in p.all():
            x.register({t["name"]: np.zeros(t["shape"], np.float32) for t in x.layout()})
        p.join()
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=2) as ex:
            # inference rank 1/0 never takes part in version 1
            futures = [ex.submit(x.update, 1, timeout=30) for x in (p.writers[0], p.readers[0])]
            with pytest.raises(awex.UpdateFailed) as failed:
                p.ctl.update(1, timeout=30)
            errors = []
            for f in futures:
                try:
                    f.result(timeout=30)
                except awex.UpdateFailed as e:
                    errors.append(e)
        assert failed.value.version == 1
        assert "inference rank 1/0" in failed.value.ranks
        assert str(failed.value).startswith(f"version 1 of pair `{pair_name}` failed: ")
        # the writer waited for a reader that never came; both ranks see the failure
        assert len(errors) == 2 and all(e.version == 1 for e in errors)
        # the controller retries the version; with every rank taking part it commits
        with ThreadPoolExecutor(max_workers=3) as ex:
            futures = [ex.submit(x.update, 1, timeout=30) for x in p.all()]
            assert p.ctl.update(1, timeout=30)["attempt"] == 2
            assert [f.result(timeout=30)["attempt"] for f in futures] == [2, 2, 2]
    finally:
        p.close()


def test_a_rank_told_its_attempt_runs_it_without_the_event_and_a_retry_ignores_the_old_abort(gateway, pair_name):
    # an engine's trigger names version and attempt (awex.sglang.receive): update(v, attempt=a)
    # does not wait for the event; attempt 1's abort, still in the event stream, must not stop
    # attempt 2
    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1", "shm", update_deadline_s=1.0)
    try:
        for x in p.all():
            x.register({t["name"]: np.zeros(t["shape"], np.float32) for t in x.layout()})
        p.join()
        (w,), (r,) = p.writers, p.readers
        from concurrent.futures import ThreadPoolExecutor

        # attempt 1 fails: the reader never takes part
        with ThreadPoolExecutor(max_workers=1) as ex:
            fw = ex.submit(w.update, 1, timeout=30)
            with pytest.raises(awex.UpdateFailed):
                p.ctl.update(1, timeout=30)
            with pytest.raises(awex.UpdateFailed):
                fw.result(timeout=30)
        # attempt 2: the reader is told its attempt and never reads the event stream first
        p.ctl.start_update(1)
        with ThreadPoolExecutor(max_workers=2) as ex:
            fw = ex.submit(w.update, 1, timeout=30)
            fr = ex.submit(r.update, 1, attempt=2, timeout=30)
            assert p.ctl.wait_update(1, timeout=30)["attempt"] == 2
            assert fw.result(timeout=30)["attempt"] == 2
            got = fr.result(timeout=30)
        assert (got["version"], got["attempt"], got["state"]) == (1, 2, "committed")
        with pytest.raises(ValueError, match=r"attempt 0 is not an attempt \(they count from 1\)"):
            r.update(2, attempt=0)
        with pytest.raises(ValueError, match=r"update\(attempt=\.\.\.\) needs the version too"):
            r.update(None, attempt=1)
    finally:
        p.close()


def test_close_from_another_thread_interrupts_a_waiting_update(gateway, pair_name):
    import threading
    import time

    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1", "shm")
    try:
        for x in p.all():
            x.register({t["name"]: np.zeros(t["shape"], np.float32) for t in x.layout()})
        p.join()
        r = p.readers[0]
        out: dict[str, Any] = {}

        def waiting() -> None:
            try:
                out["result"] = r.update(timeout=60)  # no update is ever started
            except Exception as e:
                out["error"] = e

        t = threading.Thread(target=waiting)
        t.start()
        time.sleep(0.5)
        start = time.monotonic()
        r.close()
        t.join(40)
        assert time.monotonic() - start < 30  # the wait was for 60 s: close ended it
        assert not t.is_alive()
        assert isinstance(out.get("error"), awex.AwexError), out
        assert "the rank was closed (close() from another thread) while waiting for an update" in str(out["error"])
        assert r.closed
        r.close()  # idempotent
    finally:
        p.close()


def test_rank_waiting_without_an_update_times_out(gateway, pair_name):
    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1", "tcp")
    try:
        for x in p.all():
            x.register({t["name"]: np.zeros(t["shape"], np.float32) for t in x.layout()})
        p.join()
        with pytest.raises(TimeoutError, match=r"waiting for update 1 of pair `.*` did not finish within 0\.3 s"):
            p.readers[0].update(1, timeout=0.3)
    finally:
        p.close()


def test_update_without_a_timeout_answers_none_after_the_pairs_deadline_and_idles_on(gateway, pair_name):
    import time
    from concurrent.futures import ThreadPoolExecutor

    # the default wait: the update deadline (2 s) plus as much again
    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1", "tcp",
             update_deadline_s=2.0)
    try:
        (w,), (r,) = p.writers, p.readers
        for x in (w, r):
            x.register({t["name"]: np.ones(t["shape"], np.float32) for t in x.layout()})
        p.join()
        t0 = time.monotonic()
        assert r.update() is None, "no update yet"
        waited = time.monotonic() - t0
        assert 3.9 <= waited < 10, waited

        def idle(x):
            # the documented idle loop: None means "no update yet", call again
            while True:
                res = x.update()
                if res is not None:
                    return res

        with ThreadPoolExecutor(max_workers=2) as ex:
            futures = [ex.submit(idle, x) for x in (w, r)]
            time.sleep(5.0)  # past one default wait: both loops went round at least once
            p.ctl.start_update(1)
            assert [f.result(timeout=60)["version"] for f in futures] == [1, 1]
        assert p.ctl.wait_update(1)["state"] == "committed"
    finally:
        p.close()


def test_update_takes_the_next_version_and_keeps_a_newer_one_for_later(gateway, pair_name):
    from concurrent.futures import ThreadPoolExecutor

    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1", "tcp")
    try:
        (w,), (r,) = p.writers, p.readers
        for x in (w, r):
            x.register({t["name"]: np.ones(t["shape"], np.float32) for t in x.layout()})
        p.join()
        p.ctl.start_update(1)
        with ThreadPoolExecutor(max_workers=2) as ex:
            futures = [ex.submit(x.update, timeout=30) for x in (w, r)]
            assert [f.result(timeout=30)["version"] for f in futures] == [1, 1]
        p.ctl.start_update(2)
        with pytest.raises(awex.AwexError, match=re.escape(
                "the gateway started version 2 while inference rank 0/0 waited for version 1; call update(2)")):
            r.update(1, timeout=10)
        with ThreadPoolExecutor(max_workers=1) as ex:
            f = ex.submit(w.update, 2, timeout=30)
            assert r.update(2, timeout=30)["version"] == 2
            assert f.result(timeout=30)["version"] == 2
        assert p.ctl.wait_update(2)["state"] == "committed"
        assert p.ctl.status()["serving_version"] == 2
    finally:
        p.close()


def test_ctrl_c_interrupts_a_rank_waiting_for_an_update_and_leaves_it_usable(gateway, pair_name):
    import _thread
    import signal
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    # Started in the background or under `nohup`, a process may inherit SIGINT ignored, and then
    # `interrupt_main` does nothing: install Python's handler for this test (restored after),
    # or skip when that is not possible. The wait below is bounded either way: a failure to
    # interrupt fails the test, it never hangs it.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT handlers can only be installed from the main thread")
    try:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, OSError) as e:
        pytest.skip(f"cannot install a SIGINT handler here: {e}")
    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1", "tcp")
    try:
        (w,), (r,) = p.writers, p.readers
        for x in (w, r):
            x.register({t["name"]: np.full(t["shape"], 2.0, np.float32) for t in x.layout()})
        p.join()
        assert p.ctl.wait_ready(timeout=10)["state"] == "ready"
        threading.Timer(0.3, _thread.interrupt_main).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            r.update(1, timeout=20)  # no update was started: only the interrupt ends this wait
        assert time.monotonic() - t0 < 15  # the wait was for 20 s: the interrupt ended it
        with ThreadPoolExecutor(max_workers=2) as ex:
            futures = [ex.submit(x.update, 1, timeout=30) for x in (w, r)]
            p.ctl.update(1, timeout=30)
            assert [f.result(timeout=30)["state"] for f in futures] == ["committed", "committed"]
    finally:
        p.close()
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_readers_that_hold_what_they_received_take_deltas_and_the_others_every_byte(gateway, pair_name, transport):
    # engine 0's Readers say nothing else writes their tensors (deltas=True), engine 1's do not
    # (the default): with the pair's deltas on, version 2 moves only the changed elements to
    # engine 0 and every byte to engine 1, and both end byte-equal to the trainer's version
    rng = np.random.default_rng(11)
    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=2", "sglang:tp=1,engines=2", transport,
             delta_engines=(0,), deltas=True)
    try:
        w_layouts = [w.layout() for w in p.writers]
        shapes = canonical_shapes(w_layouts)
        canonical = {n: finite_f32(rng, s) for n, s in shapes.items()}
        w_arrays = [fill_from_canonical(layout, canonical, np_dtype, rng) for layout in w_layouts]
        for w, arrays in zip(p.writers, w_arrays):
            w.register(list(arrays.items()))
        r_arrays = []
        for r in p.readers:
            arrays = {t["name"]: np.zeros(t["shape"], dtype=np_dtype(t["dtype"])) for t in r.layout()}
            r.register(arrays)
            r_arrays.append(arrays)
        p.join()
        first = p.update(1)
        for version in (2, 3):
            # an optimiser-like step: about 2 % of the elements change
            for n, a in canonical.items():
                flat = a.reshape(-1)
                hit = rng.random(flat.size) < 0.02
                flat[hit] = np.nextafter(flat[hit], np.float32(np.inf))
            for arrays, layout in zip(w_arrays, w_layouts):
                fresh = fill_from_canonical(layout, canonical, np_dtype, rng)
                for n, a in arrays.items():
                    a[...] = fresh[n]
            results = p.update(version)
            readers = results[len(p.writers):]
            delta_rx, dense_rx = readers[0]["bytes"], readers[1]["bytes"]
            # engine 1 gets what version 1 moved; engine 0 a few per cent of it
            assert dense_rx == first[len(p.writers) + 1]["bytes"], (version, readers)
            assert 0 < delta_rx < 0.15 * dense_rx, (version, delta_rx, dense_rx)
            for reader, arrays in zip(p.readers, r_arrays):
                for t in reader.layout():
                    want = expected_local(t, canonical, np_dtype(t["dtype"]))
                    assert same_bits(arrays[t["name"]], want), (
                        f"version {version}: {reader!r} `{t['name']}` differs")
        p.ctl.disconnect()
    finally:
        p.close()
    assert shm_segments(pair_name) == []


def test_a_reader_whose_engine_is_removed_stops_and_the_other_engine_takes_the_next_version(gateway, pair_name):
    import threading

    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1,engines=2", "shm", commit="available")
    try:
        for x in p.all():
            x.register({t["name"]: np.zeros(t["shape"], np.float32) for t in x.layout()})
        p.join()
        assert all(r["state"] == "committed" for r in p.update(1))
        gone = p.readers[1]
        out: dict[str, Any] = {}

        def waiting() -> None:
            try:
                out["result"] = gone.update(timeout=60)
            except Exception as e:
                out["error"] = e

        t = threading.Thread(target=waiting)
        t.start()
        assert p.ctl.remove_engine(1)["status"]["state"] == "absent"
        t.join(30)
        assert not t.is_alive()
        assert isinstance(out.get("error"), awex.Disconnected), out
        assert "this rank's engine was removed from pair" in str(out["error"])
        # the others' next version: the same plan, without engine 1
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=2) as ex:
            futures = [ex.submit(x.update, 2, timeout=60) for x in (p.writers[0], p.readers[0])]
            st = p.ctl.update(2, timeout=60)
            assert [f.result(timeout=60)["state"] for f in futures] == ["committed", "committed"]
        assert [e["engine"] for e in st["left_out"]] == [1], st
        engines = p.ctl.status()["engines"]
        assert [(e["state"], e["serving_version"]) for e in engines] == [("serving", 2), ("absent", None)]
    finally:
        p.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_check_finite_fails_a_version_whose_weights_hold_nan_naming_it_and_the_fixed_retry_commits(
        gateway, pair_name, transport):
    p = Pair(gateway, pair_name, TINY_F32, "megatron:tp=1", "sglang:tp=1", transport,
             update_deadline_s=5.0, check_finite=True)
    try:
        assert p.status["options"]["check_finite"] is True
        (w,), (r,) = p.writers, p.readers
        rng = np.random.default_rng(3)
        src = {t["name"]: finite_f32(rng, t["shape"]) for t in w.layout()}
        w.register(src)
        r.register({t["name"]: np.zeros(t["shape"], np.float32) for t in r.layout()})
        p.join()
        bad = "decoder.layers.0.self_attention.linear_qkv.weight"
        src[bad].reshape(-1)[7] = np.nan
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=2) as ex:
            futures = [ex.submit(x.update, 1, timeout=30) for x in (w, r)]
            with pytest.raises(awex.UpdateFailed) as failed:
                p.ctl.update(1, timeout=30)
            for f in futures:
                with pytest.raises(awex.UpdateFailed):
                    f.result(timeout=30)
        assert f"`{bad}` holds NaN (f32 bits 0x7fc00000) at element 7" in str(failed.value), failed.value
        assert "training rank 0" in failed.value.ranks
        # the step fixed, the retry commits
        src[bad].reshape(-1)[7] = 0.5
        assert [s["attempt"] for s in p.update(1)] == [2, 2]
    finally:
        p.close()
