"""What one SGLang TP rank process does in the real-engine tests (run with multiprocessing spawn).

Every job builds SGLang's real model class on CPU with ``sglang_cpu`` and reports through a queue
``(rank, result)``, where ``result`` is a dict or ``{"error": traceback}``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # engines/, for sglang_cpu

import sglang_cpu  # noqa: E402


def wait_running(gateway: str, pair: str, version: int, timeout: float = 120.0, attempt: int | None = None,
                 states: tuple[str, ...] = ("pending", "running")) -> None:
    """Polls the gateway until ``version`` (``attempt`` of it, when given) of ``pair`` is the
    current update in one of ``states`` (running, by default)."""
    import awex

    ctl = awex.Controller(gateway)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        cur = ctl.status(pair).get("current_update") or {}
        if (cur.get("version") == version and cur.get("state") in states
                and attempt in (None, cur.get("attempt"))):
            return
        time.sleep(0.02)
    raise TimeoutError(f"update {version} of {pair} did not start within {timeout} s")


def work(version: int, attempt: int = 1) -> list[tuple[str, Any]]:
    """A TP rank's payload of the gateway's trigger of ``version``/``attempt``, as SGLang hands
    it to the loader (``awex-sglang``'s ``work_payload``, deserialised and moved to the device)."""
    import torch

    return [(f"awex.work/{version}/{attempt}/receive", torch.LongTensor([]))]


def compare(model: Any, want: dict[str, Any]) -> list[str]:
    """Every parameter of ``model``, and every tensor SGLang derives after loading (buffers and
    module attributes such as MLA's ``w_kc`` / ``w_vc``, ``sglang_cpu.derived``), against
    SGLang's own load of the same checkpoint."""
    got = {n: p.detach() for n, p in model.named_parameters()}
    got.update({n: t.detach() for n, t in sglang_cpu.derived(model).items()})
    for name, w in want.items():
        if name in got and w.dim() > 0 and w.shape[0] < got[name].shape[0]:  # compare only the first rows
            got[name] = got[name][: w.shape[0]]
    diffs = []
    if sorted(got) != sorted(want):
        diffs.append(f"parameter names differ: {sorted(set(got) ^ set(want))}")
    for name in sorted(set(got) & set(want)):
        d = sglang_cpu.first_difference(got[name], want[name])
        if d is not None:
            diffs.append(f"`{name}`: {d}")
    return diffs


def _point_at(gateway: str, pair: str, engine: int = 0) -> None:
    os.environ["AWEX_GATEWAY"] = gateway
    os.environ["AWEX_PAIR"] = pair
    os.environ["AWEX_ENGINE"] = str(engine)


def load_job(rank: int, q: Any, tp: int, ep: int, port: int, ckpt: str) -> None:
    """(a) only: SGLang's own load; reports parameter names, shapes and dtypes."""
    try:
        sa = sglang_cpu.init_rank(ckpt, tp=tp, ep=ep, rank=rank, port=port)
        model = sglang_cpu.load_model(sa)
        q.put((rank, {"params": [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]}))
    except BaseException:
        q.put((rank, {"error": traceback.format_exc()}))


def tensors_job(rank: int, q: Any, tp: int, ep: int, port: int, ckpt: str, dtype: str, names: list[str]) -> None:
    """(a) only: SGLang's own load of ``ckpt`` by a ``--dtype dtype`` server; reports the named
    parameters as ``(dtype, bytes)``."""
    try:
        import torch

        sa = sglang_cpu.init_rank(ckpt, tp=tp, ep=ep, rank=rank, port=port, dtype=dtype)
        params = dict(sglang_cpu.load_model(sa).named_parameters())
        q.put((rank, {n: (str(params[n].dtype), params[n].detach().contiguous().reshape(-1).view(torch.uint8)
                          .numpy().tobytes()) for n in names}))
    except BaseException:
        q.put((rank, {"error": traceback.format_exc()}))


def receive_job(rank: int, q: Any, tp: int, ep: int, port: int, ckpts: dict[int, str], gateway: str,
                pairs: list[str], versions: list[int], untied_head: bool = False,
                fused_shared: str | None = None, dtype: str = "float32") -> None:
    """For every pair in turn: the server's model loaded from version 0 by SGLang, the warm-up
    call, then one ``receive`` per version; after each, every parameter is compared byte for byte
    with SGLang's own ``load_weights`` of that version's checkpoint. With ``untied_head`` (a tied
    checkpoint on a class with its own ``lm_head``), ``lm_head.weight`` is compared with the
    embedding instead. With ``fused_shared`` (a class name), SGLang fuses that class's shared
    experts into the routed experts as on a GPU (``sglang_cpu.fuse_shared_experts_as_on_gpu``).
    ``dtype`` is the server's ``--dtype``."""
    try:
        import awex.sglang as aws

        sa = sglang_cpu.init_rank(ckpts[0], tp=tp, ep=ep, rank=rank, port=port, dtype=dtype)
        if fused_shared:
            sglang_cpu.fuse_shared_experts_as_on_gpu(fused_shared)
        want = {v: sglang_cpu.snapshot(sglang_cpu.load_model(sa, ckpts[v])) for v in versions}
        result: dict[str, Any] = {"checked": 0, "diffs": [], "params": len(want[versions[0]]),
                                  "head_is_embedding": [],
                                  "derived": sorted(n for n in want[versions[0]] if n.startswith("derived:"))}
        if untied_head:
            w = want[versions[0]]
            # SGLang never writes this lm_head: its vocabulary padding rows hold whatever memory
            # torch.empty gave them, and awex does not write padding either; compare the real rows
            import json

            with open(os.path.join(ckpts[0], "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            per = w["lm_head.weight"].shape[0]
            real = max(0, min(per, vocab - rank * per))
            result["sglang_head_is_embedding"] = sglang_cpu.first_difference(
                w["lm_head.weight"][:real], w["model.embed_tokens.weight"][:real]) is None
            for v in versions:
                want[v]["lm_head.weight"] = want[v]["model.embed_tokens.weight"][:real]
        for pair in pairs:
            model = sglang_cpu.load_model(sa, ckpts[0])
            before = compare(model, want[versions[0]])
            if not before:
                raise AssertionError("version 0 equals the first update's weights: the test cannot fail")
            _point_at(gateway, pair)
            t = time.monotonic()
            aws.receive(model, [])  # warm-up: returns at once, joins in the background
            result.setdefault("warmup_s", []).append(time.monotonic() - t)
            ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
            for v in versions:
                wait_running(gateway, pair, v)
                aws.receive(model, work(v))
                diffs = compare(model, want[v])
                if untied_head:
                    result["head_is_embedding"].append(not any("`lm_head.weight`" in d for d in diffs))
                result["diffs"] += [f"{pair} v{v} rank {rank}: {d}" for d in diffs]
                result["checked"] += 1
                if {n: p.data_ptr() for n, p in model.named_parameters()} != ptrs:
                    result["diffs"].append(f"{pair} v{v} rank {rank}: a parameter was rebound")
        aws._reset()
        q.put((rank, result))
    except BaseException:
        q.put((rank, {"error": traceback.format_exc()}))


def faults_job(rank: int, q: Any, tp: int, port: int, ckpts: dict[int, str], gateway: str, pair: str,
               returned: Any) -> None:
    """The loader's edge cases on a real model: configuration errors, a moved pointer, a
    changed shape (rank 0 only). After each update call it puts ``(rank, version)`` on
    ``returned``: the gateway starts the next version only after SGLang's HTTP call returned."""
    try:
        import torch

        import awex.sglang as aws

        result: dict[str, Any] = {}
        sa = sglang_cpu.init_rank(ckpts[0], tp=tp, rank=rank, port=port)
        want = {v: sglang_cpu.snapshot(sglang_cpu.load_model(sa, ckpts[v])) for v in (1, 2)}
        model = sglang_cpu.load_model(sa, ckpts[0])
        for k in ("AWEX_GATEWAY", "AWEX_PAIR", "AWEX_ENGINE", "AWEX_SGLANG_ON_ERROR"):
            os.environ.pop(k, None)
        # by default a failure is logged (and reported) and the call returns: SGLang 0.5.23
        # ends the server on a loader exception
        result["no_env_report"] = repr(aws.receive(model, []))
        os.environ["AWEX_SGLANG_ON_ERROR"] = "raise"
        try:
            aws.receive(model, [])
        except RuntimeError as e:
            result["no_env"] = str(e)
        os.environ.update(AWEX_GATEWAY=gateway, AWEX_PAIR=pair, AWEX_ENGINE="zero")
        try:
            aws.receive(model, [])
        except RuntimeError as e:
            result["bad_engine"] = str(e)
        try:
            aws.receive(model, [("x", torch.zeros(1))])
        except RuntimeError as e:
            result["payload"] = str(e)
        _point_at(gateway, pair)
        aws.receive(model, [])  # warm-up
        wait_running(gateway, pair, 1)
        aws.receive(model, work(1))
        returned.put((rank, 1))
        result["v1"] = compare(model, want[1])
        # SGLang (begin_weight_update, memory release/resume) may rebind storage: a new pointer
        name = "model.layers.0.self_attn.qkv_proj.weight"
        p = dict(model.named_parameters())[name]
        p.data = p.data.clone()
        result["moved"] = p.data_ptr()
        wait_running(gateway, pair, 2)
        aws.receive(model, work(2))
        returned.put((rank, 2))
        result["v2"] = compare(model, want[2])
        result["recreated"] = aws._receiver.recreated if aws._receiver else None
        result["moved_still"] = dict(model.named_parameters())[name].data_ptr() == result["moved"]
        # a changed shape is refused, with the engine, rank and cause named: raised with
        # AWEX_SGLANG_ON_ERROR=raise (rank 0), reported to the gateway and returned by default
        # (rank 1 learns that the version failed and returns too)
        if rank == 0:
            p = dict(model.named_parameters())["model.norm.weight"]
            p.data = torch.zeros(p.shape[0] * 2)
        else:
            os.environ.pop("AWEX_SGLANG_ON_ERROR")
        wait_running(gateway, pair, 3)
        try:
            result["v3"] = f"returned {aws.receive(model, work(3))!r}"
        except RuntimeError as e:
            result["v3"] = str(e)
        # version 3 again, by default on both ranks: rank 0 reports its refusal and returns
        # (which may fail the attempt before rank 1 sees it running; rank 1 then returns at once)
        os.environ.pop("AWEX_SGLANG_ON_ERROR", None)
        wait_running(gateway, pair, 3, attempt=2, states=("pending", "running", "failed"))
        try:
            result["v3_retry"] = f"returned {aws.receive(model, work(3, 2))!r}"
        except RuntimeError as e:
            result["v3_retry"] = str(e)
        aws._reset()
        q.put((rank, result))
    except BaseException:
        q.put((rank, {"error": traceback.format_exc()}))


def session_updater(model: Any, rank: int) -> Any:
    """SGLang 0.5.23's own ``WeightUpdater`` of a model runner (``model_executor/
    model_runner_components/weight_updater.py``) over ``model``, with awex's loader allowed: what
    a scheduler process runs for the gateway's ``begin_weight_update``, its trigger
    (``update_weights_from_tensor`` with ``load_format="awex.sglang.receive"``) and
    ``end_weight_update``. Only the fields those three calls read are set; the CUDA-graph and
    model-runner callbacks are never called by them."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    def never(*_: Any, **__: Any) -> None:
        raise AssertionError("not called by a weight-update session")

    return WeightUpdater(tp_rank=rank, device="cpu", gpu_id=0, model_config=None,
                         custom_weight_loaders=["awex.sglang.receive"], get_model=lambda: model,
                         update_model_fields=never, recapture_cuda_graph=never, get_model_runner=never)


def session(updater: Any, payload: list) -> None:
    """One weight-update session as SGLang's scheduler runs it for the gateway
    (``managers/scheduler_components/weight_updater.py``): ``begin_weight_update`` (restores
    in-place-packed weights), the trigger through SGLang's own dispatch to the custom loader,
    ``end_weight_update(run_post_load=False)`` (the trigger loaded weights, so SGLang skips
    ``post_load_weights`` and runs every quant method's ``process_weights_after_loading``)."""
    updater.begin_weight_update()
    ok, message = updater.update_weights_from_tensor(payload, load_format="awex.sglang.receive")
    assert ok, message
    updater.end_weight_update(run_post_load=False)


def fp8_receive_job(rank: int, q: Any, tp: int, ep: int, port: int, fp8: dict[int, str], gateway: str,
                    pairs: list[str], versions: list[int]) -> None:
    """An SGLang server's TP rank holding block-FP8 weights: the model built by SGLang from the
    FP8 checkpoint of version 0; for every pair, the warm-up session, then one session per
    version, each compared byte for byte (e4m3 weights, fp32 scales, every other parameter and
    derived tensor) with SGLang's own load of that version's FP8 checkpoint, which the reference
    quantiser wrote from the bf16 weights the Writers send."""
    try:
        import awex.sglang as aws

        sa = sglang_cpu.init_rank(fp8[0], tp=tp, ep=ep, rank=rank, port=port, dtype="bfloat16")
        # DeepSeek's MLA: the GPU's w_kc / w_vc, for SGLang's own loads and for awex's updates alike
        sglang_cpu.derive_mla_as_on_gpu()
        want = {v: sglang_cpu.snapshot(sglang_cpu.load_model(sa, fp8[v])) for v in versions}
        result: dict[str, Any] = {"checked": 0, "diffs": [], "params": len(want[versions[0]]),
                                  "fp8": sorted(n for n, t in want[versions[0]].items()
                                                if str(t.dtype) == "torch.float8_e4m3fn"),
                                  "derived": sorted(n for n in want[versions[0]] if n.startswith("derived:")),
                                  "derived_dtypes": sorted({str(t.dtype) for n, t in want[versions[0]].items()
                                                            if n.endswith((".w_kc", ".w_vc"))})}
        for pair in pairs:
            model = sglang_cpu.load_model(sa, fp8[0])
            if not compare(model, want[versions[0]]):
                raise AssertionError("version 0 equals the first update's weights: the test cannot fail")
            updater = session_updater(model, rank)
            _point_at(gateway, pair)
            os.environ["AWEX_SGLANG_ON_ERROR"] = "raise"  # a failure shows its cause here
            session(updater, [])  # warm-up: joins in the background
            ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
            for v in versions:
                wait_running(gateway, pair, v)
                session(updater, work(v))
                diffs = compare(model, want[v])
                result["diffs"] += [f"{pair} v{v} rank {rank}: {d}" for d in diffs]
                result["checked"] += 1
                if {n: p.data_ptr() for n, p in model.named_parameters()} != ptrs:
                    result["diffs"].append(f"{pair} v{v} rank {rank}: a parameter was rebound")
        aws._reset()
        q.put((rank, result))
    except BaseException:
        q.put((rank, {"error": traceback.format_exc()}))
