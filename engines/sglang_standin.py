"""A stand-in SGLang HTTP server: the routes awex's gateway drives, as SGLang 0.5.23 defines them,
with one process per TP rank calling the custom weight loader on a model in SGLang's layout.

    python engines/sglang_standin.py --tp 2 --model-path DIR --custom-weight-loader awex.sglang.receive

prints one JSON line ``{"url": ..., "pid": ..., "tp": ..., "mode": ...}`` once every rank is ready.
Each TP rank is a process holding SGLang's real model class built on CPU (``--mode sglang``,
through ``engines/sglang_cpu.py``; needs the real-engine venv and a checkpoint) or plain torch
parameters with SGLang's names and shapes, zero-filled (``--mode torch``; dense Qwen3 / Qwen2 /
Llama), or the same as float32 numpy arrays without importing torch (``--mode numpy``: many rank
processes on a small machine, for benchmarks). ``--mode auto`` picks ``sglang`` when SGLang is
importable and the checkpoint has weights.

What each route copies (paths relative to ``python/sglang/srt/`` of SGLang 0.5.23):

- ``GET /get_server_info`` and ``GET /server_info`` -- ``entrypoints/http_server.py``
  ``get_server_info`` / ``server_info``: ``server_args.resolved_dict()`` (the fields awex reads:
  ``model_path``, ``tp_size``, ``ep_size``, ``dp_size``, ``pp_size``, ``custom_weight_loader``,
  ``weight_cache_mode``, ``load_format``, ``dtype``, ``quantization``, ``weight_version``, ...)
  plus ``version``, ``internal_states`` and ``frontend`` (``utils/common.py`` ``build_server_info``).
- ``GET /model_info`` (and ``/get_model_info``) -- ``http_server.py`` ``model_info``: the live
  ``weight_version`` a weight update records, and the served model's ``model_type`` and
  ``architectures`` (``model_config.hf_config``; here the checkpoint's ``config.json``).
- ``POST /pause_generation`` ``{"mode": "abort"|"retract"|"in_place"}`` (default ``abort``,
  ``managers/io_struct.py`` ``PauseGenerationReqInput``) -- ``http_server.py`` ``pause_generation``:
  200 ``{"message": "Generation paused successfully.", "status": "ok"}``. ``abort`` ends the
  running requests, ``retract`` moves them back to the waiting queue, ``in_place`` leaves them
  running (so a later cache flush fails).
- ``POST /continue_generation`` -- ``http_server.py`` ``continue_generation``: 200
  ``{"message": "Generation continued successfully.", "status": "ok"}``.
- ``POST /begin_weight_update`` / ``POST /end_weight_update`` (>= 0.5.21; ``--version`` below
  that: 404 as for any unknown route) -- ``http_server.py`` and
  ``managers/scheduler_components/weight_updater.py`` ``begin_weight_update`` /
  ``end_weight_update``: ``{"success", "message"}``, 400 when a session is already open / none
  is open, with SGLang's messages. ``end`` runs ``post_load_weights`` only when no update loaded
  weights in the session.
- ``POST /update_weights_from_tensor`` -- ``http_server.py`` ``update_weights_from_tensor``,
  ``managers/tokenizer_control_mixin.py`` ``update_weights_from_tensor``,
  ``scheduler_components/weight_updater.py`` ``update_weights_from_tensor`` and
  ``model_executor/model_runner_components/weight_updater.py`` ``update_weights_from_tensor``:
  ``serialized_named_tensors`` (one base64 ``MultiprocessingSerializer`` payload per TP rank;
  rank ``r`` deserialises entry ``r``, ``managers/tp_worker.py`` ``deserialize_own_rank``),
  ``load_format`` (a custom loader must be listed by ``--custom-weight-loader``, else
  ``Unknown load_format=...``), ``flush_cache`` (default true), ``weight_version``. >= 0.5.21
  refuses it outside a session. Every rank calls ``dynamic_import(load_format)(model,
  named_tensors)`` at once; on success the weight version is recorded and the cache flushed,
  which fails while requests are running (or queued, when generation is not paused):
  ``"Weights were updated, but the cache was not flushed because requests are still running or
  queued. Retract or finish them, then call /flush_cache."``. 200 ``{"success": true, "message":
  "Success Weight version updated to V."}`` or 400 ``{"success": false, ...}``.
- ``POST /update_weight_version`` ``{"new_version", "abort_all_requests"}`` (the latter
  default true: it ends every request first) -- ``http_server.py`` ``update_weight_version``,
  ``managers/io_struct.py`` ``UpdateWeightVersionReqInput``: records ``new_version`` (what
  ``/model_info`` reports; the weights are not touched), 200 ``{"success": true, "message":
  "Weight version updated to V", "new_version": V}``; 422 without ``new_version``.
- ``GET|POST /flush_cache`` -- ``http_server.py`` ``flush_cache``, ``managers/scheduler.py``
  ``flush_cache`` / ``is_fully_idle``: 200 ``Cache flushed...`` text, or 400.

Where SGLang 0.5.23 itself would not answer: an exception raised by a custom loader propagates
out of the scheduler's event loop (``TypeBasedDispatcher`` and ``process_input_requests`` catch
nothing), which kills the scheduler and the server (``run_scheduler_process``: "Scheduler hit an
exception", SIGQUIT to the parent). The stand-in answers ``{"success": false, "message": "TP rank
R: <exception>"}`` instead (``--loader-exception report``, the default), or exits like SGLang
(``--loader-exception crash``).

Faults, on the update calls that carry a ``weight_version`` (the gateway's per-update triggers,
not its warm-up): ``--fail-rank R`` (with ``--fail-times N``, default 1) makes rank R's loader
call raise after the loader ran; ``--reject-update MSG`` answers 400 with MSG without calling
the loaders; ``--hang-s S`` sleeps S seconds before handling the call; ``--running-requests N``
starts with N running requests (see ``pause_generation``).

``GET /standin/state`` (not SGLang) returns the stand-in's state and the log of routes called.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import io
import json
import multiprocessing as mp
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

#: ``MultiprocessingSerializer.serialize([], output_str=True)`` on Python 3.12 (pickle protocol 4):
#: the trigger payload awex's gateway sends for each TP rank.
EMPTY_PAYLOAD_B64 = "gARdlC4="

FLUSH_FAILED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:3])


class _LongTensor(list):
    """``torch.LongTensor(values)`` without torch (``--mode numpy``): the one tensor type an
    awex trigger's payload holds (an empty one, beside the work's name)."""

    def to(self, device: Any) -> "_LongTensor":
        return self


class _SafeUnpickler(pickle.Unpickler):
    """Plain containers and strings, and ``torch.LongTensor`` (SGLang's ``SafeUnpickler``,
    ``utils/common.py``, admits it among its tensor globals) as ``_LongTensor``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch", "LongTensor"):
            return _LongTensor
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a stand-in payload")


def deserialize(data: bytes, sglang: bool = True) -> Any:
    """A rank's payload, as ``MultiprocessingSerializer.deserialize`` reads it (SGLang's own when
    importable and ``sglang``; it imports torch)."""
    if not sglang:
        return _SafeUnpickler(io.BytesIO(data)).load()
    try:
        from sglang.srt.utils.common import MultiprocessingSerializer  # type: ignore[import-not-found]
    except ImportError:
        return _SafeUnpickler(io.BytesIO(data)).load()
    return MultiprocessingSerializer.deserialize(data)


# ---------------------------------------------------------------- the TP rank processes


def dense_shapes(config: dict[str, Any], tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """The names and shapes of SGLang's dense Qwen3 / Qwen2 / Llama parameters on one TP rank of
    ``tp`` (``models/qwen3.py``, ``qwen2.py``, ``llama.py``; ``layers/linear.py``
    ``QKVParallelLinear`` replicates KV heads when tp > KV heads;
    ``layers/vocab_parallel_embedding.py`` pads the vocabulary to a multiple of 64)."""
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"):
        raise ValueError(f"--mode torch/numpy builds dense Qwen3/Qwen2/Llama only, not {arch}; use --mode sglang")
    h, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    kv = config.get("num_key_value_heads", heads)
    d = config.get("head_dim") or h // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    tied = config.get("tie_word_embeddings", False)
    if heads % tp or (kv % tp and tp % kv) or inter % tp:
        raise ValueError(f"tp={tp} does not divide heads={heads}, kv={kv} or intermediate={inter}")
    padded = -(-vocab // 64) * 64
    if padded % tp:
        raise ValueError(f"padded vocabulary {padded} is not divisible by tp={tp}")
    qkv = (heads // tp + 2 * max(1, kv // tp)) * d
    bias = arch == "Qwen2ForCausalLM" or config.get("attention_bias", False)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (padded // tp, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        if arch == "Qwen3ForCausalLM":
            shapes += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        shapes.append((p + "self_attn.qkv_proj.weight", (qkv, h)))
        if bias:
            shapes.append((p + "self_attn.qkv_proj.bias", (qkv,)))
        shapes += [
            (p + "self_attn.o_proj.weight", (h, heads // tp * d)),
            (p + "mlp.gate_up_proj.weight", (2 * inter // tp, h)),
            (p + "mlp.down_proj.weight", (h, inter // tp)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not tied:
        shapes.append(("lm_head.weight", (padded // tp, h)))
    return shapes


def torch_model(config: dict[str, Any], tp: int, rank: int) -> Any:
    """Zero-filled torch parameters with the names and shapes of SGLang's dense Qwen3 / Qwen2 /
    Llama classes for TP rank ``rank`` of ``tp`` (``dense_shapes``)."""
    import torch

    shapes = dense_shapes(config, tp)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        config.get("torch_dtype") or config.get("dtype") or "float32", torch.float32
    )

    root = torch.nn.Module()
    for name, shape in shapes:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
    return root


class _NumpyParam(np.ndarray):
    """A numpy array with the torch.Tensor members ``awex.sglang.receive`` uses (``detach``,
    ``data_ptr``, ``is_cuda``)."""

    is_cuda = False

    def detach(self) -> "_NumpyParam":
        return self

    def data_ptr(self) -> int:
        # an array's buffer never moves; cached, as cheap as torch's C-level data_ptr (numpy's
        # `.ctypes` builds an object per call, ten times torch's cost)
        ptr = self.__dict__.get("_ptr")
        if ptr is None:
            ptr = self.__dict__["_ptr"] = int(self.ctypes.data)
        return ptr


class NumpyModel:
    """Zero-filled float32 numpy parameters with SGLang's names and shapes (``dense_shapes``),
    behind ``named_parameters()``: ``--mode numpy`` runs many rank processes without importing
    torch (benchmarks of the adapter's overhead on a small machine)."""

    def __init__(self, config: dict[str, Any], tp: int) -> None:
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
        if dtype != "float32":
            raise ValueError(f"--mode numpy holds float32 parameters only, not {dtype}")
        self._params = {n: np.zeros(shape, np.float32).view(_NumpyParam) for n, shape in dense_shapes(config, tp)}

    def named_parameters(self) -> Any:
        return iter(list(self._params.items()))


def _rank_main(rank: int, conn: Any, opts: dict[str, Any]) -> None:
    """One TP rank: builds its model, then serves ``load`` / ``end`` / ``params`` requests."""
    try:
        tp = opts["tp"]
        if opts["mode"] == "sglang":
            sys.path.insert(0, HERE)
            import sglang_cpu

            sa = sglang_cpu.init_rank(opts["model_path"], tp=tp, ep=opts["ep"], rank=rank, port=opts["dist_port"])
            model = sglang_cpu.load_model(sa)
        else:
            os.environ["AWEX_TP_RANK"] = str(rank)
            if opts["mode"] == "numpy":
                # no SGLang in this process (importing it imports torch): the loader reads its
                # TP rank from AWEX_TP_RANK, as without SGLang
                sys.modules["sglang"] = None  # type: ignore[assignment]
            with open(os.path.join(opts["model_path"], "config.json")) as f:
                config = json.load(f)
            model = NumpyModel(config, tp) if opts["mode"] == "numpy" else torch_model(config, tp, rank)
        conn.send(("ready", rank))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    fails_left = opts["fail_times"] if opts["fail_rank"] == rank else 0
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        kind = msg[0]
        if kind == "stop":
            conn.send(("ok", ""))
            return
        try:
            if kind == "load":
                _, load_format, payload, versioned = msg
                named_tensors = deserialize(payload, sglang=opts["mode"] != "numpy")
                # every entry's tensor goes to the device first (`weight_updater.py`,
                # `update_weights_from_tensor`, `_unwrap_tensor`)
                named_tensors = [(n, t.to("cpu")) for n, t in named_tensors]
                loader = _dynamic_import(load_format)
                loader(model, named_tensors)
                if fails_left > 0 and versioned:
                    fails_left -= 1
                    raise RuntimeError(f"injected failure of TP rank {rank}'s loader (--fail-rank)")
                # the loader's own timings of this call, when it keeps them (awex.sglang.last_call)
                timing = getattr(sys.modules.get(getattr(loader, "__module__", "")), "last_call", None)
                conn.send(("ok", {"timing": dict(timing) if isinstance(timing, dict) else None}))
            elif kind == "end":
                post = getattr(model, "post_load_weights", None)
                if msg[1] and callable(post):
                    post()
                conn.send(("ok", ""))
            elif kind == "params":
                import torch

                digests = {}
                for name, p in model.named_parameters():
                    raw = p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    digests[name] = hashlib.sha256(raw).hexdigest()
                conn.send(("ok", digests))
            else:
                conn.send(("error", f"unknown request {kind!r}"))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _dynamic_import(path: str) -> Any:
    """``sglang.srt.utils.dynamic_import``: ``module.attr`` -> the attribute."""
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"load_format {path!r} is not a dotted path module.function")
    return getattr(importlib.import_module(module), attr)


# ---------------------------------------------------------------- the HTTP side


class Server:
    """The stand-in's state: server args, generation state, the weight-update session, ranks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.version = args.version
        self.sessions = _version_tuple(args.version) >= (0, 5, 21)
        self.lock = threading.Lock()
        self.update_lock = threading.Lock()
        self.paused = False
        self.pause_mode: str | None = None
        self.running = args.running_requests
        self.waiting = 0
        self.session: dict[str, Any] | None = None
        self.weight_version = args.weight_version
        self.log: list[dict[str, Any]] = []
        # per versioned update: every rank's loader timings (awex.sglang.last_call), by rank
        self.loader_timings: list[dict[str, Any]] = []
        self.ranks: list[Any] = []
        self.procs: list[Any] = []

    def start_ranks(self) -> None:
        ctx = mp.get_context("spawn")
        if self.args.mode == "sglang":
            # the ranks fork from a process that imported SGLang once (sglang_preload.py, next
            # to this file; tests/forked.py starts that forkserver)
            sys.path.insert(0, HERE)
            sys.path.insert(0, os.path.join(HERE, "tests"))
            import forked

            ctx = forked.context("sglang_preload") or ctx
        opts = {
            "tp": self.args.tp,
            "ep": self.args.ep,
            "mode": self.args.mode,
            "model_path": self.args.model_path,
            "dist_port": _free_port(),
            "fail_rank": self.args.fail_rank,
            "fail_times": self.args.fail_times,
        }
        for r in range(self.args.tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, child, opts), daemon=True)
            p.start()
            self.ranks.append(parent)
            self.procs.append(p)
        for r, conn in enumerate(self.ranks):
            kind, detail = conn.recv()
            if kind != "ready":
                raise RuntimeError(f"TP rank {r} failed to start:\n{detail}")

    def all_ranks(self, msgs: list[tuple]) -> list[tuple[str, Any]]:
        """Sends every rank its request at once, then collects every answer."""
        for conn, m in zip(self.ranks, msgs):
            conn.send(m)
        return [conn.recv() for conn in self.ranks]

    def stop(self) -> None:
        for conn in self.ranks:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()

    def server_info(self) -> dict[str, Any]:
        a = self.args
        return {
            "model_path": a.model_path,
            "served_model_name": a.model_path,
            "tp_size": a.tp,
            "ep_size": a.ep,
            "dp_size": a.dp,
            "pp_size": 1,
            "device": "cpu",
            "load_format": "auto",
            "dtype": "auto",
            "quantization": a.quantization,
            "custom_weight_loader": list(a.custom_weight_loader),
            "weight_cache_mode": a.weight_cache_mode,
            "weight_version": a.weight_version,
            "enable_memory_saver": False,
            "launch_command": None,
            "internal_states": [{}],
            "version": self.version,
            "frontend": "python",
        }

    def hf_config(self) -> dict[str, Any]:
        """The checkpoint's ``config.json`` ({} when unreadable)."""
        try:
            with open(os.path.join(self.args.model_path, "config.json")) as f:
                return json.load(f)
        except (OSError, ValueError, TypeError):
            return {}

    def flush(self) -> bool:
        """``Scheduler.flush_cache``: only when nothing runs (and nothing waits, unless paused)."""
        return self.running == 0 and (self.paused or self.waiting == 0)

    # each returns (status, body); body is a dict (JSON) or str (text/plain)
    def route(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """Handles one call, logged with its arrival (``t``) and answer (``done``) times."""
        entry = {"route": path, "method": method, "body": body, "t": time.time()}
        with self.lock:
            self.log.append(entry)
        try:
            return self._route(method, path, body)
        finally:
            entry["done"] = time.time()

    def _route(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path in ("/get_server_info", "/server_info") and method == "GET":
            return 200, self.server_info()
        if path in ("/get_model_info", "/model_info") and method == "GET":
            hf = self.hf_config()
            return 200, {"model_path": self.args.model_path, "served_model_name": self.args.model_path,
                         "weight_version": self.weight_version, "load_format": "auto", "is_generation": True,
                         "model_type": hf.get("model_type"), "architectures": hf.get("architectures")}
        if path == "/standin/state" and method == "GET":
            with self.lock:
                return 200, {"paused": self.paused, "pause_mode": self.pause_mode, "running": self.running,
                             "waiting": self.waiting, "session": self.session,
                             "weight_version": self.weight_version,
                             "loader_timings": list(self.loader_timings),
                             "routes": [e["route"] for e in self.log if e["route"] != "/standin/state"],
                             "log": [e for e in self.log if e["route"] != "/standin/state"]}
        if path == "/standin/params" and method == "GET":
            with self.update_lock:
                answers = self.all_ranks([("params",)] * len(self.ranks))
            return 200, {"ranks": [a[1] for a in answers]}
        if path == "/flush_cache" and method in ("GET", "POST"):
            with self.lock:
                if self.flush():
                    return 200, ("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")
                return 400, "Flush cache failed.\n"
        if method != "POST":
            return (405, {"detail": "Method Not Allowed"}) if path in _POST_ROUTES else (404, {"detail": "Not Found"})
        if path == "/pause_generation":
            mode = body.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                return 422, {"detail": f"mode must be one of 'abort', 'retract', 'in_place', not {mode!r}"}
            with self.lock:
                self.paused, self.pause_mode = True, mode
                if mode == "abort":
                    self.running = self.waiting = 0
                elif mode == "retract":
                    self.waiting += self.running
                    self.running = 0
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            with self.lock:
                self.paused, self.pause_mode = False, None
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/begin_weight_update" and self.sessions:
            with self.lock:
                if self.session is not None:
                    return 400, {"success": False, "message": "a weight-update session is already open; "
                                 "call end_weight_update() first"}
                self.session = {"selector": body.get("selector", "all"), "loaded_weights": False}
            return 200, {"success": True, "message": "Success"}
        if path == "/end_weight_update" and self.sessions:
            with self.lock:
                session, self.session = self.session, None
            if session is None:
                return 400, {"success": False, "message": "no weight-update session is open; "
                             "call begin_weight_update() first"}
            with self.update_lock:
                self.all_ranks([("end", not session["loaded_weights"])] * len(self.ranks))
            return 200, {"success": True, "message": "Success"}
        if path == "/update_weights_from_tensor":
            return self.update_weights_from_tensor(body)
        if path == "/update_weight_version":
            new_version = body.get("new_version")
            if not isinstance(new_version, str):
                return 422, {"detail": "new_version: a string is required"}
            with self.lock:
                if body.get("abort_all_requests", True):
                    self.running = self.waiting = 0
                self.weight_version = new_version
            return 200, {"success": True, "message": f"Weight version updated to {new_version}",
                         "new_version": new_version}
        return 404, {"detail": "Not Found"}

    def update_weights_from_tensor(self, body: dict[str, Any]) -> tuple[int, Any]:
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list):
            return 422, {"detail": "serialized_named_tensors: a list of base64 strings is required"}
        load_format = body.get("load_format")
        flush_cache = body.get("flush_cache", True)
        weight_version = body.get("weight_version")
        # faults hit the gateway's per-update triggers (with a weight_version), not its warm-up
        faulty = weight_version is not None
        if self.args.hang_s and faulty:
            time.sleep(self.args.hang_s)
        if self.sessions and self.session is None:
            return 400, {"success": False, "message": "update_weights_from_tensor must run between "
                         "begin_weight_update() and end_weight_update()"}
        if self.args.reject_update is not None and faulty:
            return 400, {"success": False, "message": self.args.reject_update}
        if len(payloads) != self.args.tp:
            return 400, {"success": False, "message": f"serialized_named_tensors has {len(payloads)} payloads; "
                         f"this server has tp_size={self.args.tp} and each TP rank reads its own entry"}
        if load_format not in self.args.custom_weight_loader:
            return 400, {"success": False, "message": f"Unknown load_format={load_format}"}
        try:
            raw = [base64.b64decode(p, validate=True) for p in payloads]
        except (ValueError, TypeError) as e:
            return 422, {"detail": f"serialized_named_tensors: not base64: {e}"}
        with self.update_lock:
            answers = self.all_ranks([("load", load_format, r, faulty) for r in raw])
        failed = [(r, detail) for r, (kind, detail) in enumerate(answers) if kind != "ok"]
        if failed:
            if self.args.loader_exception == "crash":
                sys.stderr.write(f"Scheduler hit an exception: {failed}\n")
                sys.stderr.flush()
                os._exit(1)
            return 400, {"success": False, "message": " | ".join(f"TP rank {r}: {d}" for r, d in failed)}
        with self.lock:
            if weight_version is not None:
                self.loader_timings.append({"weight_version": weight_version,
                                            "ranks": [d.get("timing") if isinstance(d, dict) else None
                                                      for _, d in answers]})
            if self.session is not None:
                self.session["loaded_weights"] = True
            if weight_version is not None:
                self.weight_version = weight_version
            if flush_cache and not self.flush():
                return 400, {"success": False, "message": FLUSH_FAILED}
        message = "Success"
        if weight_version is not None:
            message += f" Weight version updated to {weight_version}."
        return 200, {"success": True, "message": message}


_POST_ROUTES = {"/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update",
                "/update_weights_from_tensor", "/update_weight_version"}


def _handler(server: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # headers and body leave in two writes: without TCP_NODELAY the body waits for the
        # client's delayed ACK (~40 ms per call on Linux), a delay SGLang's server does not add
        disable_nagle_algorithm = True

        def _serve(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body = json.loads(raw) if raw.strip() else {}
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
            except ValueError as e:
                status, out = 422, {"detail": f"invalid JSON body: {e}"}
            else:
                try:
                    status, out = server.route(method, path, body)
                except Exception as e:  # a stand-in bug: answer, never hang the client
                    status, out = 500, {"detail": f"{type(e).__name__}: {e}"}
            data = out.encode() if isinstance(out, str) else json.dumps(out).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a deadline), as it may

        def do_GET(self) -> None:  # noqa: N802
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    return Handler


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The stand-in's command line (see the module docstring)."""
    p = argparse.ArgumentParser(description="A stand-in SGLang HTTP server for awex's tests")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp", "--tp-size", type=int, default=1, dest="tp")
    p.add_argument("--ep", "--ep-size", type=int, default=1, dest="ep")
    p.add_argument("--dp", "--dp-size", type=int, default=1, dest="dp", help="reported only")
    p.add_argument("--custom-weight-loader", nargs="*", action="extend", default=[])
    p.add_argument("--mode", choices=("auto", "sglang", "torch", "numpy"), default="auto")
    p.add_argument("--version", default="0.5.23", help="the SGLang version to act as (< 0.5.21: no begin/end)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--weight-cache-mode", default="off")
    p.add_argument("--quantization", default=None)
    p.add_argument("--running-requests", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-times", type=int, default=1)
    p.add_argument("--reject-update", default=None, metavar="MESSAGE")
    p.add_argument("--hang-s", type=float, default=0.0)
    p.add_argument("--loader-exception", choices=("report", "crash"), default="report")
    args = p.parse_args(argv)
    if args.mode == "auto":
        has_weights = any(f.endswith(".safetensors") for f in os.listdir(args.model_path))
        try:
            importlib.import_module("sglang.srt")
            args.mode = "sglang" if has_weights else "torch"
        except ImportError:
            args.mode = "torch"
    return args


def main(argv: list[str] | None = None) -> None:
    """Starts the ranks and serves until killed (SIGTERM / SIGINT)."""
    args = parse_args(argv)
    server = Server(args)
    server.start_ranks()
    httpd = ThreadingHTTPServer((args.host, args.port), _handler(server))
    httpd.daemon_threads = True
    host, port = httpd.server_address[:2]
    print(json.dumps({"url": f"http://{host}:{port}", "pid": os.getpid(), "tp": args.tp, "mode": args.mode}),
          flush=True)
    import signal

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        server.stop()


if __name__ == "__main__":
    main()
