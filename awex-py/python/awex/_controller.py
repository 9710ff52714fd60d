"""``Controller``: drives a pair from a Python RL loop (connect, update, status, disconnect)."""

from __future__ import annotations

import os
from typing import Any, Sequence

from . import _awex
from ._spec import fp8_args, model_args


class Controller:
    """A client of the gateway (``awex-cli serve``) that connects a training job to inference
    engines and runs weight updates. No tensor passes through it.

    ``connect`` remembers the pair, so ``update``, ``status`` and ``disconnect`` need no name;
    ``pair=`` acts on another one. ``token`` defaults to ``$AWEX_TOKEN``.
    """

    def __init__(self, gateway: str, token: str | None = None, pair: str | None = None) -> None:
        if token is None:
            token = os.environ.get("AWEX_TOKEN")
        self._c = _awex._Controller(gateway, token, pair)

    def connect(
        self,
        pair: str,
        *,
        model: Any,
        train: str,
        infer: str,
        transport: str = "shm",
        urls: Sequence[str] | None = None,
        checksums: bool = False,
        bucket_mib: int = 64,
        join_deadline_s: float = 60.0,
        update_deadline_s: float = 120.0,
        atomic: bool = False,
        commit: str = "all",
        infer_quant: str | None = None,
        infer_config: Any = None,
        fp8_block: Sequence[int] | None = None,
        fp8_recipe: str | None = None,
        deltas: bool = False,
        check_finite: bool = False,
        spare: int = 0,
    ) -> dict[str, Any]:
        """Connects ``pair``: ``train``/``infer`` are layout specs (``"megatron:tp=2,pp=2"``,
        ``"sglang:tp=2,engines=2"``), ``model`` a preset, config.json, HF directory or config
        dict, ``urls`` the engines' servers (SGLang or vLLM, one per engine) that the gateway pauses,
        triggers and resumes around updates (under ``quorum:K``/``available`` each engine's calls
        are its own: a server that fails or dies is left out, a torn one stays paused, a restarted
        one is warmed up again and catches up). The model is stored on the
        gateway so that ranks need only ``(gateway, pair, rank)``. With ``atomic``, inference
        ranks receive into staging and copy into their live tensors only once every rank
        received (one extra copy of each shard; a failure before that leaves the live weights
        at the last committed version). ``commit`` says when a version commits across engines:
        ``"all"`` (every engine applied it), ``"quorum:K"`` (at least K engines did) or
        ``"available"`` (at least one did); engines left out are reported per engine in the
        status's ``engines`` (``state``, ``serving_version``, ``behind_since_unix_ms``,
        ``torn_version``, ``catching_up``, ``last_error``) and catch up in the next update.
        Route requests only to engines whose ``state`` is ``"serving"``.

        FP8 rollouts (``docs/fp8.md``), as ``awex-cli``'s ``--infer-quant`` / ``--infer-config`` /
        ``--fp8-block`` / ``--fp8-recipe``: ``infer_quant="fp8"`` stores the inference side's
        linear weights as block FP8 (128 x 128 blocks unless ``fp8_block=(bn, bk)``);
        ``infer_config`` (the FP8 checkpoint's ``config.json`` path, HF directory or config
        dict) takes the encoding from its ``quantization_config`` instead; ``fp8_recipe`` names
        the quantiser (default ``vllm``, ``vllm-ue8m0`` for ``scale_fmt: ue8m0``). Every rank
        takes the encoding from the pair.

        ``deltas`` (``docs/deltas.md``): each update moves only the elements that changed since
        the version an inference rank provably holds; ranks that hold none (new, restarted,
        failed) get every byte. Training ranks keep a host copy of what they last sent (2 bytes
        per parameter of their shard in bf16).

        ``check_finite``: before an update moves anything, each training rank reads every
        tensor it sends for infinity and NaN and fails the update naming the tensor and
        element (one read of its shard per update; shm and tcp). FP8 pairs check their
        quantised tensors without it.

        ``spare``: how many of the last engines of ``infer`` start out of the pair; their
        slots wait for engines added at run time (``add_engine``). Every rank plans against
        every slot, so no plan changes when an engine joins or leaves; needs ``commit`` other
        than ``"all"``. Returns the pair's status."""
        return self._c.connect(
            pair,
            train,
            infer,
            transport=transport,
            urls=list(urls) if urls is not None else None,
            checksums=checksums,
            bucket_mib=bucket_mib,
            join_deadline_s=join_deadline_s,
            update_deadline_s=update_deadline_s,
            atomic=atomic,
            deltas=deltas,
            check_finite=check_finite,
            commit=commit,
            spare=spare,
            **fp8_args(infer_quant, infer_config, fp8_block, fp8_recipe),
            **model_args(model),
        )

    def wait_ready(self, timeout: float = 60.0, pair: str | None = None) -> dict[str, Any]:
        """Waits until every rank of both sides joined; returns the status."""
        return self._c.wait_ready(timeout, pair)

    def update(self, version: int, timeout: float = 600.0, pair: str | None = None) -> dict[str, Any]:
        """Starts ``version`` and waits until it committed and the gateway resumed the engines
        after it (they serve ``version`` when this returns); returns the update's status.
        Raises ``awex.UpdateFailed`` (with the gateway's reason and the failed ranks) when it
        did not commit, ``TimeoutError`` when it is still running after ``timeout`` seconds."""
        return self._c.update(version, timeout, pair)

    def start_update(self, version: int, pair: str | None = None) -> dict[str, Any]:
        """Starts ``version`` and returns at once."""
        return self._c.start_update(version, pair)

    def wait_update(self, version: int, timeout: float = 600.0, pair: str | None = None) -> dict[str, Any]:
        """Waits for a started ``version`` as ``update`` does."""
        return self._c.wait_update(version, timeout, pair)

    def add_engine(self, engine: int | None = None, pair: str | None = None) -> dict[str, Any]:
        """Adds an engine to the running pair, in slot ``engine`` or the lowest free one (a
        spare slot, or one whose engine was removed). Returns ``{"pair", "engine", "ranks",
        "status"}``: start the engine's ranks as inference ranks ``(engine, 0..ranks)``. Its
        status is ``"joining"`` until they all joined; it takes part in the first update that
        starts after that, which moves every byte to it, and is ``"serving"`` once that version
        committed. Needs a commit policy other than ``"all"``."""
        return self._c.add_engine(engine, pair)

    def remove_engine(self, engine: int, pair: str | None = None) -> dict[str, Any]:
        """Removes engine ``engine`` from the pair: an update under way goes on without it,
        its ranks are told to stop (their ``update`` raises ``awex.Disconnected``) and their
        slots are freed; the other engines' plans do not change. Refused when the engines left
        could not meet the commit policy. Returns ``{"pair", "engine", "ranks", "status"}``."""
        return self._c.remove_engine(engine, pair)

    def status(self, pair: str | None = None) -> dict[str, Any]:
        """The pair's status document (state, both sides, roster, current update)."""
        return self._c.status(pair)

    def resume(self, accept_torn: bool = False, pair: str | None = None) -> dict[str, Any]:
        """Lets the engines serve again outside an update. After a failed version whose ranks
        had started writing, the engines stay paused on partially written weights (the status
        says ``torn_version``) until a retry of that version commits; ``accept_torn=True``
        resumes them on those weights anyway (the status then says ``serving_torn_version``).
        Returns the pair's status."""
        return self._c.resume(accept_torn, pair)

    def disconnect(self, pair: str | None = None) -> dict[str, Any]:
        """Disconnects the pair; its ranks' ``update`` raises ``awex.Disconnected``."""
        return self._c.disconnect(pair)

    @property
    def pair(self) -> str | None:
        """The pair ``update``/``status``/``disconnect`` act on by default."""
        return self._c.pair

    @property
    def gateway(self) -> str:
        """The gateway's URL."""
        return self._c.gateway

    def __repr__(self) -> str:
        return f"<awex.Controller of {self.gateway} pair={self.pair!r}>"
