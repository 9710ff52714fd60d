"""``Writer`` (a training rank) and ``Reader`` (an inference rank)."""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from . import _awex
from ._spec import model_args, parallel_config


class _Rank:
    """What Writer and Reader share; see their docstrings."""

    _SIDE = ""

    def __init__(
        self,
        gateway: str,
        pair: str,
        rank: int,
        *,
        engine: int = 0,
        model: Any = None,
        backend: str | None = None,
        parallel: Mapping[str, int] | None = None,
        peer_backend: str | None = None,
        peer_parallel: Mapping[str, int] | None = None,
        train: str | None = None,
        infer: str | None = None,
        transport: str | None = None,
        token: str | None = None,
        bucket_mib: int | None = None,
        host: str | None = None,
        timeout: float | None = 60.0,
        deltas: bool | None = None,
    ) -> None:
        own = {"backend": backend, "parallel": parallel_config(parallel, "parallel")}
        peer = {"backend": peer_backend, "parallel": parallel_config(peer_parallel, "peer_parallel")}
        mine, theirs = ("train", "infer") if self._SIDE == "train" else ("infer", "train")
        sides = {
            f"{mine}_backend": own["backend"],
            f"{mine}_parallel": own["parallel"],
            f"{theirs}_backend": peer["backend"],
            f"{theirs}_parallel": peer["parallel"],
        }
        if token is None:
            token = os.environ.get("AWEX_TOKEN")
        self._rank = _awex._Endpoint(
            self._SIDE,
            gateway,
            pair,
            rank,
            engine,
            token=token,
            train=train,
            infer=infer,
            transport=transport,
            bucket_mib=bucket_mib,
            host=host,
            timeout=timeout,
            deltas=deltas,
            **model_args(model),
            **sides,
        )

    def register(
        self,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        skip_unknown: bool = False,
    ) -> int:
        """Registers ``(name, tensor)`` pairs (a dict, or e.g. ``model.named_parameters()``).

        Tensors are numpy arrays or CPU torch tensors -- or, with the ``cuda-ipc`` transport and a
        wheel built with the ``cuda`` feature, torch CUDA tensors -- (anything exposing ``__dlpack__``,
        ``__array_interface__`` or torch's ``data_ptr()``/``shape``/``stride()``/``dtype``/
        ``device``), C-contiguous, with the name, shape and dtype of the rank's layout. awex
        addresses their memory in place (no copy) and keeps them referenced until ``close()``.
        Each tensor is checked as it arrives; on the first mismatch an ``awex.LayoutError``
        names it and nothing of this call is registered. With ``skip_unknown`` names that are
        not in the layout are ignored instead (an engine's extra parameters). Returns how many
        tensors were registered.
        """
        items: Any = named_tensors
        if skip_unknown:
            known = {t["name"] for t in self._rank.layout()}
            pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
            items = [(n, t) for n, t in pairs if n in known]
        return self._rank.register(items)

    def join(self, timeout: float | None = None) -> "_Rank":
        """Checks that every tensor of the layout is registered, connects the transport and
        joins the pair, waiting (with the GIL released) until every rank of both sides joined."""
        self._rank.join(timeout)
        return self

    def update(
        self,
        version: int | None = None,
        *,
        timeout: float | None = None,
        wait_commit: bool = True,
        attempt: int | None = None,
    ) -> dict[str, Any] | None:
        """Waits for the controller to start ``version`` (the next version when ``None``),
        moves this rank's bytes and, with ``wait_commit``, waits until every rank finished and
        the gateway committed the version. Blocks with the GIL released.

        Returns ``{"version", "attempt", "bytes", "buckets", "checksum", "seconds", "state"}``,
        or ``None`` when no update started within the default wait (``timeout=None``: the
        pair's update deadline plus as much again, at most 30 s more): "no update yet", call again (``while True: r.update()``
        idles that way). Raises ``awex.UpdateFailed`` (this rank or another failed; retry with
        the same version once the controller restarts it), ``awex.Disconnected`` (the pair is
        gone), ``awex.GatewayError`` (the gateway does not know the pair, or stayed unreachable
        past ``AWEX_GATEWAY_LOST_S``) or ``TimeoutError`` (no update started within an explicit
        ``timeout`` seconds).

        ``attempt`` (with ``version``): the caller knows the live attempt of ``version`` (an
        engine's trigger names it, as for ``awex.sglang.receive``), so the update event is not
        waited for and this rank's part starts at once.
        """
        return self._rank.update(version, timeout, wait_commit, attempt)

    def close(self) -> None:
        """Tears the transport down (shared memory unlinked, sockets closed) and releases the
        registered tensors. Idempotent; also done by ``with``. Called from another thread while
        this rank waits (in ``join``, or in ``update`` for an update or its commit), that wait
        gives up at once and raises ``awex.AwexError`` saying the rank was closed; a transfer
        in progress is not interrupted (``close`` then raises after 10 s, try again)."""
        self._rank.close()

    def layout(self) -> list[dict[str, Any]]:
        """The rank's computed layout: ``[{"name", "shape", "dtype", "placements"}]``, in the
        engine's parameter order; each placement says which box of which canonical (HF) tensor
        sits where in the local tensor."""
        return self._rank.layout()

    def missing(self) -> list[str]:
        """Names of the layout that are not registered yet."""
        return self._rank.missing()

    side = property(lambda self: self._rank.side, doc="``train`` or ``infer``.")
    rank = property(lambda self: self._rank.rank, doc="The rank (within its engine for a Reader).")
    engine = property(lambda self: self._rank.engine, doc="The inference engine (0 for a Writer).")
    pair = property(lambda self: self._rank.pair, doc="The pair's name.")
    transport = property(lambda self: self._rank.transport, doc="``shm``, ``tcp`` or ``cuda-ipc``.")
    train = property(lambda self: self._rank.train, doc="The training layout spec.")
    infer = property(lambda self: self._rank.infer, doc="The inference layout spec.")
    model = property(lambda self: self._rank.model, doc="The model's name.")
    joined = property(lambda self: self._rank.joined, doc="Whether join() succeeded.")
    closed = property(lambda self: self._rank.closed, doc="Whether close() was called.")
    plan_bytes = property(lambda self: self._rank.plan_bytes, doc="Bytes this rank moves per update.")
    uses_mirror = property(
        lambda self: self._rank.uses_mirror,
        doc="Whether updates copy the registered tensors into a shared-memory mirror first (Writer, shm).",
    )

    def __enter__(self) -> "_Rank":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._rank).replace("<", f"<awex.{type(self).__name__}: ", 1)


class Writer(_Rank):
    """A training rank: registers its local tensors and sends them at every update.

    ``Writer(gateway, pair, rank)`` is enough when the pair was connected by ``awex.Controller``
    (or with a preset model): the rank reads the pair's layouts, transport and model from the
    gateway. Any of them can be given explicitly -- ``model=`` (preset, config.json, HF
    directory or config dict), ``backend=``/``parallel=`` for this side,
    ``peer_backend=``/``peer_parallel=`` for the inference side, or whole specs ``train=`` /
    ``infer=`` (``"megatron:tp=2,pp=2"``) -- and must then agree with the pair.

    With the ``shm`` transport the registered tensors are copied into an awex shared-memory
    mirror at the start of every update (one extra copy on the sender); ``tcp`` reads them in
    place. Do not modify registered tensors while an update runs.
    """

    _SIDE = "train"

    #: what ``attach`` found in the live model (backend, parallel, rank, world_size, layer_spec, dtype, spec)
    detected: dict[str, Any] | None = None

    @classmethod
    def attach(cls, model: Any, gateway: str, pair: str, **opts: Any) -> "Writer":
        """A Writer for this process's rank of a live training job, with its parameters registered.

        ``model`` is a Megatron-Core ``GPTModel`` / ``MegatronModule`` (possibly wrapped in
        ``DistributedDataParallel`` / ``Float16Module``, or the list of VPP chunks of this stage)
        or a module whose parameters are FSDP2 DTensors. The backend, the parallel config
        (``megatron.core.parallel_state``; the DTensors' meshes and placements), the rank
        (``torch.distributed``), the layer spec and the expert layout (from the parameter names)
        are read from the process; a pair whose training side says otherwise is refused with an
        ``awex.LayoutError`` naming every difference and the spec to connect with. Every local
        tensor's dtype and shape are compared with the pair's training layout, and the ones that
        differ are refused by name: the dtypes are those of the framework release in use (FSDP:
        from transformers 5.24 on, DeepSeek-V2/V3, Kimi-K2 and GLM-4.5 keep their routers in
        fp32, the fsdp spec's ``transformers=524``, which attach reads from the live routers);
        awex converts between the sides where the engine holds another dtype. ``opts`` are
        ``Writer``'s keyword arguments (``token=``, ``transport=``, ``timeout=``, ...).
        """
        from . import _attach

        found = _attach.inspect(model)
        w = cls(gateway, pair, found["rank"], **opts)
        try:
            layout = w.layout()
            moe = any(".mlp.experts." in t["name"] for t in layout)
            dtype = layout[0]["dtype"] if layout else None
            _attach.check_pair(found, pair, w.train, dtype, moe)
            _attach.check_tensors(found, pair, w.train, layout)
            w.register(found["tensors"])
        except BaseException:
            w.close()
            raise
        w.detected = {k: v for k, v in found.items() if k != "tensors"}
        return w


class Reader(_Rank):
    """An inference rank (rank ``rank`` of engine ``engine``): registers its local tensors
    (writable) and receives into them in place at every update. Same arguments as ``Writer``;
    ``backend``/``parallel`` describe the inference side, ``peer_*`` the training side.

    ``deltas=True`` (a pair connected with ``deltas``, ``docs/deltas.md``): the registered
    tensors hold exactly what this rank last received until the next update (nothing else
    writes them), so updates may move only the changed elements; without it (the default) the
    rank reports that it holds no base and gets every byte. A Writer takes part in deltas by
    default (``deltas=False`` saves its host copy of what it sent)."""

    _SIDE = "infer"
