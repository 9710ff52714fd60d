"""SGLang: the named tensors of an inference rank, and ``receive``, the custom weight loader that
runs awex inside an unmodified ``sglang.launch_server``.

Launch every SGLang server of a pair with the loader allowed and its engine named::

    AWEX_GATEWAY=http://10.0.0.1:7480 AWEX_PAIR=rl AWEX_ENGINE=0 \\
      python -m sglang.launch_server --model-path /models/Qwen3-8B --tp 4 \\
      --custom-weight-loader awex.sglang.receive

The gateway then calls ``POST /update_weights_from_tensor`` with ``load_format:
"awex.sglang.receive"``: SGLang calls ``receive(model, named_tensors)`` in every TP scheduler
process at once, and the bytes travel over awex's own transport straight into SGLang's
parameters. The payload carries no weights: at connect it is empty (the warm-up: join the pair),
during an update it names the work, one entry ``("awex.work/<version>/<attempt>/<phase>",
<empty int64 tensor>)`` (see ``work_of``), so that the loader needs no question to the gateway
to know what to receive.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger("awex.sglang")

#: The name of the one payload entry of an update's trigger (``awex-sglang``'s ``WORK_PREFIX``).
WORK_PREFIX = "awex.work/"

#: Phases a trigger names: ``receive`` (into the live parameters).
_PHASES = ("receive",)

#: What ``receive`` does with a failure it can report instead (``$AWEX_SGLANG_ON_ERROR``).
_ON_ERROR = ("report", "raise")


def _on_error() -> str:
    """``report`` (the default) or ``raise``, from ``$AWEX_SGLANG_ON_ERROR``.

    SGLang 0.5.23 calls a custom loader without a ``try``
    (``model_executor/model_runner_components/weight_updater.py``:376, in
    ``update_weights_from_tensor``; nothing above it catches: ``managers/
    scheduler_components/weight_updater.py``:246, ``utils.py`` ``TypeBasedDispatcher.__call__``,
    ``managers/scheduler.py`` ``process_input_requests``), so an exception ends the scheduler's
    event loop and ``run_scheduler_process`` sends SIGQUIT to the server
    (``managers/scheduler.py``:6372): a raise costs a server restart. ``report`` logs the failure,
    tells the gateway (which then fails the version and keeps generation paused) and returns.
    """
    v = os.environ.get("AWEX_SGLANG_ON_ERROR", "report").strip().lower() or "report"
    if v not in _ON_ERROR:
        logger.error("AWEX_SGLANG_ON_ERROR=%r is neither `report` nor `raise`; using `report`", v)
        return "report"
    return v


def _module(model: Any) -> Any:
    """The model module of ``model``: itself, or a ``ModelRunner``'s ``.model``."""
    if hasattr(model, "named_parameters"):
        return model
    module = getattr(model, "model", None)
    if module is None or not hasattr(module, "named_parameters"):
        raise TypeError(
            f"expected an SGLang model (an nn.Module) or a ModelRunner with `.model`, not {type(model).__name__}"
        )
    return module


def named_tensors(model: Any) -> list[tuple[str, Any]]:
    """``[(name, tensor)]`` of an SGLang model, ready for ``Reader.register``.

    ``model`` is the model module (``model_runner.model``, e.g. ``Qwen3ForCausalLM``) or the
    ``ModelRunner`` holding it. Tied embeddings appear once (``model.embed_tokens.weight``), as
    ``named_parameters()`` lists a shared parameter once and as awex's layout expects.

    Left out: the parameters SGLang marks ``_skip_weight_check``, which are no model weights.
    In SGLang 0.5.23 they are the FP8 KV-cache scales ``k_scale`` / ``v_scale`` that
    ``BaseKVCacheMethod.create_weights`` (``layers/quantization/kv_cache.py``) adds to an
    attention layer built with a quantisation config (DeepSeek's MLA ``attn_mqa`` / ``attn_mha``
    in a block-FP8 model): a trainer has no such tensor, SGLang's own post-load sets them (1.0
    when the checkpoint has none) and its weight checker skips them
    (``utils/weight_checker.py``); awex leaves them as SGLang set them.
    """
    out: list[tuple[str, Any]] = []
    for name, p in _module(model).named_parameters():
        if getattr(p, "_skip_weight_check", False):
            continue
        out.append((name.replace("_orig_mod.", ""), p))
    return out


def tp_rank() -> int:
    """This scheduler process's TP rank, from SGLang's own parallel state.

    SGLang 0.5.23 publishes it as ``sglang.srt.runtime_context.get_parallel().tp_rank`` (what its
    own ``update_weights_from_tensor`` reads; ``sglang.srt.distributed`` no longer exports
    ``get_tensor_model_parallel_rank``), older servers as
    ``sglang.srt.distributed.get_tensor_model_parallel_rank()``. Without SGLang, or outside an
    SGLang scheduler process (a stand-in server), ``$AWEX_TP_RANK`` names it.
    """
    env = os.environ.get("AWEX_TP_RANK")
    unset: Exception | None = None
    try:
        from sglang.srt.runtime_context import get_parallel  # type: ignore[import-not-found]

        try:
            return int(get_parallel().tp_rank)
        except RuntimeError as e:  # SGLang importable, but this is no SGLang scheduler process
            unset = e
    except ImportError:
        try:
            from sglang.srt.distributed import (  # type: ignore[import-not-found]
                get_tensor_model_parallel_rank,
            )

            return int(get_tensor_model_parallel_rank())
        except ImportError:
            pass
    if env is not None:
        try:
            return int(env)
        except ValueError:
            raise ValueError(f"AWEX_TP_RANK={env!r} is not an integer TP rank") from None
    if unset is not None:
        raise RuntimeError(f"SGLang has no TP rank in this process ({unset}) and AWEX_TP_RANK is not set")
    raise RuntimeError(
        "cannot tell this process's TP rank: SGLang's parallel state is not importable "
        "(sglang.srt.runtime_context.get_parallel / sglang.srt.distributed."
        "get_tensor_model_parallel_rank) and AWEX_TP_RANK is not set"
    )


class _Config:
    """The loader's settings, from the environment of the SGLang server."""

    def __init__(self) -> None:
        gateway = os.environ.get("AWEX_GATEWAY")
        pair = os.environ.get("AWEX_PAIR")
        missing = [k for k, v in (("AWEX_GATEWAY", gateway), ("AWEX_PAIR", pair)) if not v]
        if missing:
            raise RuntimeError(
                f"{' and '.join(missing)} not set in the SGLang server's environment; launch it with "
                "AWEX_GATEWAY=http://HOST:PORT AWEX_PAIR=NAME [AWEX_ENGINE=N] [AWEX_TOKEN=...]"
            )
        engine = os.environ.get("AWEX_ENGINE", "0")
        try:
            self.engine = int(engine)
        except ValueError:
            raise RuntimeError(f"AWEX_ENGINE={engine!r} is not an engine index (0, 1, ...)") from None
        if self.engine < 0:
            raise RuntimeError(f"AWEX_ENGINE={engine!r} is not an engine index (0, 1, ...)")
        self.gateway: str = gateway  # type: ignore[assignment]
        self.pair: str = pair  # type: ignore[assignment]
        self.token = os.environ.get("AWEX_TOKEN") or None
        deltas = os.environ.get("AWEX_SGLANG_DELTAS", "1")
        if deltas not in ("0", "1"):
            raise RuntimeError(f"AWEX_SGLANG_DELTAS={deltas!r}: 1 (take delta updates, the default) or 0")
        self.deltas = deltas == "1"

    def key(self) -> tuple[str, str, int, str | None, bool]:
        return (self.gateway, self.pair, self.engine, self.token, self.deltas)


def _storage(t: Any) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype, data pointer) of a tensor's storage as registered."""
    return tuple(int(d) for d in t.shape), str(t.dtype), int(t.data_ptr())


class _Receiver:
    """One process-wide Reader and what it registered."""

    def __init__(self, cfg: _Config, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.reader: Any = None
        self.storage: dict[str, tuple[tuple[int, ...], str, int]] = {}
        # the same with the tensors' own shape and dtype objects, compared without conversion
        self.raw: dict[str, tuple[tuple[int, ...], Any, int]] = {}
        self.join_thread: threading.Thread | None = None
        self.join_error: BaseException | None = None
        self.recreated = 0
        self.aliases: dict[str, Any] = {}

    def where(self) -> str:
        return f"awex.sglang.receive (engine {self.cfg.engine}, TP rank {self.rank}, pair `{self.cfg.pair}`)"

    def start(self, model: Any) -> None:
        """Creates the Reader, registers the model's parameters and joins in the background.

        What is registered are aliases of the parameters' storage (``p.detach()``): they keep
        the registered memory alive even if SGLang later rebinds a parameter to new storage."""
        from ._rank import Reader

        tensors = [(n, t.detach()) for n, t in named_tensors(model)]
        # SGLang's loader path writes the registered parameters only through awex (a rebound
        # parameter is detected at the next update and gets a new Reader, which holds no
        # base): the storage holds what was received, so deltas apply to it
        reader = Reader(self.cfg.gateway, self.cfg.pair, self.rank, engine=self.cfg.engine, token=self.cfg.token,
                        deltas=self.cfg.deltas)
        try:
            reader.register(tensors)
        except BaseException:
            reader.close()
            raise
        self.reader = reader
        self.aliases = dict(tensors)
        self.storage = {n: _storage(t) for n, t in tensors}
        self.raw = {n: (tuple(t.shape), t.dtype, int(t.data_ptr())) for n, t in tensors}
        self.join_error = None

        def join() -> None:
            try:
                reader.join()
            except BaseException as e:  # reported by the next update call
                self.join_error = e

        self.join_thread = threading.Thread(target=join, name="awex-sglang-join", daemon=True)
        self.join_thread.start()

    def wait_joined(self) -> None:
        if self.join_thread is not None:
            self.join_thread.join()
        if self.join_error is not None:
            raise RuntimeError(f"joining the pair failed: {self.join_error}") from self.join_error

    def check_storage(self, model: Any) -> list[str]:
        """Compares the model's parameters with what was registered. Refuses a changed shape or
        dtype; returns the names whose data pointer moved."""
        now = dict(named_tensors(model))
        missing = sorted(set(self.storage) - set(now))
        extra = sorted(set(now) - set(self.storage))
        if missing or extra:
            raise RuntimeError(
                "the model's parameters changed since they were registered: "
                + "; ".join(
                    part
                    for part in (
                        f"gone: {', '.join(missing[:5])}" if missing else "",
                        f"new: {', '.join(extra[:5])}" if extra else "",
                    )
                    if part
                )
            )
        moved = []
        raw = self.raw
        for name, t in now.items():
            shape, dtype, ptr = raw[name]
            if t.data_ptr() == ptr and t.dtype == dtype and t.shape == shape:
                continue  # the common case, without building strings
            shape, dtype, ptr = self.storage[name]
            s, d, p = _storage(t)
            if s != shape or d != dtype:
                raise RuntimeError(
                    f"parameter `{name}` changed from {dtype} {list(shape)} to {d} {list(s)} since it was "
                    "registered; awex writes in place into the registered storage and cannot follow a "
                    "changed shape or dtype (restart the server, or keep the storage's shape and dtype)"
                )
            if p != ptr:
                moved.append(name)
        return moved

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.reader = None
        self.storage = {}
        self.raw = {}
        self.aliases = {}


_lock = threading.Lock()
_receiver: _Receiver | None = None

#: Timings of this process's last ``receive`` call that received a version (seconds):
#: ``version``, ``entry_s`` (from the call to the start of the receive: configuration, the
#: work the trigger names, the parameter check; of which ``status_s`` reading the work and
#: ``check_s`` checking the parameters), ``receive_s`` (``Reader.update``),
#: ``transfer_s`` (its part moving bytes), ``exit_s`` (from the end of the receive to the return:
#: device synchronisation, ``post_load_weights``), ``bytes``, and the process's CPU time in each
#: part (``entry_cpu_s``, ``receive_cpu_s``, ``exit_cpu_s``). For measuring the adapter's
#: overhead; empty until a version was received.
last_call: dict[str, Any] = {}


def _reset() -> None:
    """Closes the process-wide Reader (tests, or a server shutting down)."""
    global _receiver
    with _lock:
        if _receiver is not None:
            _receiver.close()
        _receiver = None


def work_of(named_tensors_: Any) -> dict[str, Any] | None:
    """What a trigger asks of this rank: ``None`` for the gateway's warm-up (an empty payload),
    else ``{"version", "attempt", "phase"}`` from the payload's one entry, named
    ``awex.work/<version>/<attempt>/<phase>`` (its tensor is empty; SGLang moves every entry's
    tensor to the device before calling the loader, ``weight_updater.py`` ``_unwrap_tensor``).
    Anything else is refused: awex's bytes never travel in the HTTP payload."""
    items = list(named_tensors_ or [])
    if not items:
        return None
    first = items[0]
    name = first[0] if isinstance(first, (tuple, list)) and len(first) == 2 else None
    if len(items) != 1 or not isinstance(name, str) or not name.startswith(WORK_PREFIX):
        raise RuntimeError(
            "awex.sglang.receive takes its bytes from awex, not from the HTTP payload, but this rank "
            f"received {len(items)} tensors"
            + (f" (first `{str(name)[:80]}`)" if isinstance(name, str) else "")
            + "; the gateway's trigger sends an empty payload or one `awex.work/...` entry per TP rank"
        )
    parts = name[len(WORK_PREFIX):].split("/")
    try:
        version, attempt, phase = int(parts[0]), int(parts[1]), parts[2]
        if (
            len(parts) != 3
            or not 0 <= version < 2**64
            or not 1 <= attempt < 2**32
            or phase not in _PHASES
        ):
            raise ValueError
    except (IndexError, ValueError):
        raise RuntimeError(
            f"the trigger's work entry `{name[:120]}` is not `{WORK_PREFIX}<version>/<attempt>/<phase>` "
            f"with phase one of {', '.join(_PHASES)}"
        ) from None
    return {"version": version, "attempt": attempt, "phase": phase}


def _claim(reader: Any) -> str | None:
    """The claim id of ``reader``'s process on its slot once it joined (``None`` otherwise)."""
    try:
        return reader._rank.incarnation if reader is not None else None
    except Exception:  # a call of the Reader still running, or it is closed
        return None


def _report_failure(
    cfg: _Config, rank: int, update: dict[str, Any], error: str, claim: str | None = None
) -> None:
    """Tells the gateway at once that this rank failed ``update`` before its Reader took part in
    it (so the version fails now, not at its deadline). The gateway accepts it only with the
    claim id of the slot's holder (``claim``, the Reader's once it joined). Best effort: the
    HTTP answer of SGLang and the deadline still catch it when the gateway cannot be reached or
    refuses it."""
    import json
    import urllib.request

    body = {
        "side": "inference",
        "rank": {"engine": cfg.engine, "rank": rank},
        "ok": False,
        "error": error[:4000],
        "attempt": int(update["attempt"]),
    }
    if claim is not None:
        body["incarnation"] = claim
    url = f"{cfg.gateway.rstrip('/')}/v1/pairs/{cfg.pair}/updates/{int(update['version'])}/report"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if cfg.token:
        req.add_header("Authorization", f"Bearer {cfg.token}")
    try:
        with urllib.request.urlopen(req, timeout=5):
            pass
    except Exception as e:  # the raise that follows carries the cause
        logger.warning("awex.sglang.receive: could not report the failure to the gateway: %s", e)


def _synchronize(model: Any) -> None:
    """Waits for the device when SGLang's parameters live on CUDA (the first parameter says)."""
    first = next(iter(_module(model).named_parameters()), None)
    if first is not None and getattr(first[1], "is_cuda", False):
        import torch

        torch.cuda.synchronize(first[1].device)


def receive(model: Any, named_tensors_: Any = None) -> None:
    """SGLang's custom weight loader (``--custom-weight-loader awex.sglang.receive``).

    Called by SGLang in every TP scheduler process with the live model and that rank's
    deserialised payload (the bytes travel over awex; the payload names the work, ``work_of``).
    Configured by ``AWEX_GATEWAY``, ``AWEX_PAIR``, ``AWEX_ENGINE`` (default 0) and
    ``AWEX_TOKEN``; ``AWEX_SGLANG_DELTAS=0`` makes the rank refuse delta updates (a pair
    connected with ``deltas`` then sends it every byte; by default it takes them: the
    parameters hold what awex wrote, ``docs/deltas.md``).

    - An empty payload (the gateway's warm-up trigger at connect): the first call creates the
      process-wide ``awex.Reader``, registers ``model.named_parameters()`` and joins the pair in
      a background thread, and returns at once.
    - A payload naming version ``v``, attempt ``a``: it waits for that join, checks every parameter's storage
      against what was registered (a changed shape or dtype is refused), receives the version in
      place into SGLang's storage (not waiting for the commit, which the gateway does after this
      call returned), synchronises the device and calls ``model.post_load_weights()`` when the
      model defines it. A parameter whose storage moved (SGLang rebound it) receives this
      version in its registered storage, kept alive by the Reader, and is copied into the new
      one; the Reader is then closed and recreated on the new storage for the next update
      (logged as a warning: a Reader created during an update would miss it).

    A block-FP8 server (a pair connected with the FP8 checkpoint's ``infer_config``): the
    registered parameters are SGLang's ``float8_e4m3fn`` weights and fp32 ``weight_scale_inv``;
    the Reader receives bf16 into host staging and quantises into them. SGLang's own FP8
    post-load (``process_weights_after_loading``) is not run here: SGLang 0.5.23 runs it at the
    ``end_weight_update`` that closes the gateway's session (``DefaultModelLoader.
    postprocess_weights``), and running it twice would repack twice.

    Failures (``AWEX_SGLANG_ON_ERROR``, default ``report``): a failure before or while this
    rank receives is logged with the engine, the TP rank and the cause, reported to the gateway
    (which fails the version; generation stays paused until a retry commits or the controller
    accepts the torn weights) and the call returns, because SGLang 0.5.23 ends the whole server
    on a loader exception; SGLang then records ``weight_version`` although the version failed,
    until the retry. With ``AWEX_SGLANG_ON_ERROR=raise`` (servers that turn a loader exception
    into ``success: false``) it raises ``RuntimeError`` naming the same. A failure after this
    rank reported its bytes received (copying into moved storage, synchronising the device,
    ``post_load_weights``) always raises: only SGLang's failed HTTP answer can then stop the
    gateway from committing.
    """
    global _receiver
    t_enter, cpu_enter = time.perf_counter(), time.process_time()
    rank = -1
    engine = os.environ.get("AWEX_ENGINE", "0")
    received = False
    try:
        rank = tp_rank()
        t_status = time.perf_counter()
        work = work_of(named_tensors_)
        t_status = time.perf_counter() - t_status
        cfg = _Config()
        with _lock:
            rx = _receiver
            if rx is not None and rx.cfg.key() != cfg.key():
                rx.close()
                rx = None
            if rx is None:
                rx = _Receiver(cfg, rank)
            update = None
            moved_bytes = False
            try:
                update = work
                if update is None:
                    if rx.reader is None:
                        rx.start(model)
                    _receiver = rx
                    return
                version = int(update["version"])
                _receiver = rx
                if rx.reader is None:
                    # A Reader joining now would not see the update already running: join for
                    # the next attempt and fail this one.
                    rx.start(model)
                    rx.wait_joined()
                    raise RuntimeError(
                        f"this TP process had not joined pair `{cfg.pair}` before version {version} "
                        "started (no warm-up trigger reached it); it has joined now: retry the version"
                    )
                rx.wait_joined()
                t_check = time.perf_counter()
                moved = rx.check_storage(model)
                t_check = time.perf_counter() - t_check
                moved_bytes = True
                t_recv, cpu_recv = time.perf_counter(), time.process_time()
                got = rx.reader.update(version, attempt=int(update["attempt"]), wait_commit=False)
                t_recvd, cpu_recvd = time.perf_counter(), time.process_time()
                received = True
                if moved:
                    # The Reader received into the registered storage, which its aliases kept
                    # alive; copy it into the parameters' new storage, then recreate the Reader
                    # on that storage for the next update (a Reader created now would not see
                    # the update that is already running).
                    logger.warning(
                        "%s: %d parameters moved to new storage since registration (e.g. `%s`); "
                        "version %d was received into the registered storage and copied over; "
                        "the Reader is recreated on the new storage for the next update",
                        rx.where(), len(moved), moved[0], version,
                    )
                    now = dict(named_tensors(model))
                    for name in moved:
                        now[name].data.copy_(rx.aliases[name])
                    rx.close()
                    rx.recreated += 1
                    rx.start(model)
                    # joined before SGLang's HTTP call returns, hence before the gateway can
                    # commit this version and start the next one, whose event it must see
                    rx.wait_joined()
                _synchronize(model)
                post = getattr(model, "post_load_weights", None)
                if callable(post):
                    post()
                t_exit, cpu_exit = time.perf_counter(), time.process_time()
                last_call.clear()
                last_call.update(
                    version=version,
                    entry_s=t_recv - t_enter,
                    status_s=t_status,
                    check_s=t_check,
                    receive_s=t_recvd - t_recv,
                    transfer_s=float(got.get("seconds", 0.0)),
                    exit_s=t_exit - t_recvd,
                    entry_cpu_s=cpu_recv - cpu_enter,
                    receive_cpu_s=cpu_recvd - cpu_recv,
                    exit_cpu_s=cpu_exit - cpu_recvd,
                    bytes=int(got.get("bytes", 0)),
                )
            except BaseException as e:
                if update is not None and not moved_bytes:
                    _report_failure(cfg, rank, update, f"{rx.where()}: {e}", _claim(rx.reader))
                # a failed join (or a Reader that could not be built) leaves nothing usable:
                # the next call starts over
                if rx.join_error is not None or rx.reader is None:
                    rx.close()
                    _receiver = None
                raise
    except Exception as e:
        where = f"awex.sglang.receive (engine {engine}, TP rank {rank if rank >= 0 else '?'})"
        error = RuntimeError(f"{where}: {e}")
        if received or _on_error() == "raise":
            raise error from e
        logger.error(
            "%s (not raised: SGLang 0.5.23 ends the server on a loader exception; the gateway fails "
            "the version, set AWEX_SGLANG_ON_ERROR=raise to raise instead)", error,
        )
        return None


__all__ = ["named_tensors", "receive", "tp_rank"]
