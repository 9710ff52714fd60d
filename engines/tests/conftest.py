"""Fixtures of the real-engine tests: tiny checkpoints, an in-process gateway, rank processes."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import checkpoints  # noqa: E402
from ports import free_port  # noqa: E402,F401  (re-exported to the tests)
import forked  # noqa: E402

_names = itertools.count()


@pytest.fixture(scope="session")
def gateway() -> str:
    from awex import _testing

    return _testing.start_gateway()


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[int, str]]:
    """``ckpts(arch, tied, config_dtype=None)`` -> ``{version: checkpoint dir}`` for versions 0,
    1, 2 of one config (``config_dtype``: ``checkpoints.write``'s)."""
    made: dict[tuple[str, bool, str | None], dict[int, str]] = {}

    def get(arch: str, tied: bool, config_dtype: str | None = None) -> dict[int, str]:
        key = (arch, tied, config_dtype)
        if key not in made:
            base = tmp_path_factory.mktemp(f"{arch}-{'tied' if tied else 'untied'}-{config_dtype or 'f32'}")
            kw = dict(tied=tied, config_dtype=config_dtype)
            v0 = checkpoints.write(str(base / "v0"), arch, seed=100, **kw)
            made[key] = {
                0: v0,
                1: checkpoints.write(str(base / "v1"), arch, seed=101, config_of=v0, **kw),
                2: checkpoints.write(str(base / "v2"), arch, seed=102, config_of=v0, **kw),
            }
        return made[key]

    return get


def pair_name(tag: str) -> str:
    return f"eng-{os.getpid()}-{next(_names)}-{tag}"[:60]




def rank_context() -> Any:
    """The multiprocessing context of SGLang rank processes: a forkserver that imported SGLang
    once (``engines/sglang_preload.py``, ``forked.context``), so a rank starts in a fraction of a
    second instead of importing it again; each rank is still a new process with its own
    torch.distributed and SGLang state. ``AWEX_RANKS_SPAWN=1`` spawns every rank afresh."""
    return forked.context("sglang_preload") or mp.get_context("spawn")


class Ranks:
    """``n`` processes (``rank_context``) running ``target(rank, queue, *args)``."""

    def __init__(self, n: int, target: Callable[..., None], *args: Any) -> None:
        ctx = rank_context()
        self.q = ctx.Queue()
        self.procs = [ctx.Process(target=target, args=(r, self.q, *args), daemon=True) for r in range(n)]
        for p in self.procs:
            p.start()

    def results(self, timeout: float = 240.0) -> list[dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        try:
            while len(out) < len(self.procs):
                rank, res = self.q.get(timeout=timeout)
                out[rank] = res
        except queue.Empty:
            raise TimeoutError(f"ranks {sorted(set(range(len(self.procs))) - set(out))} did not report") from None
        finally:
            self.stop()
        errors = [f"rank {r}:\n{res['error']}" for r, res in sorted(out.items()) if "error" in res]
        if errors:
            raise AssertionError("\n".join(errors))
        return [out[r] for r in range(len(self.procs))]

    def stop(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def boxes(t: dict[str, Any]):
    """(canonical name, canonical slices, local slices) of every placement of a layout tensor."""
    for p in t["placements"]:
        if p.get("transposed"):
            # (an inference engine holding the box with its last two dims swapped: gpt-oss's
            # experts); these helpers slice boxes as they are
            raise NotImplementedError(f"`{t['name']}` holds `{p['canonical']}` transposed; boxes() does not slice transposed placements")
        off, ext = p["region"]["offset"], p["region"]["extent"]
        loc = p["local_offset"]
        lead = len(loc) - len(ext)
        canon = tuple(slice(o, o + e) for o, e in zip(off, ext))
        local = tuple(slice(l, l + 1) if i < lead else slice(l, l + ext[i - lead]) for i, l in enumerate(loc))
        yield p["canonical"], canon, local


def fill(layout: list[dict[str, Any]], canonical: dict[str, np.ndarray], out: dict[str, np.ndarray] | None = None,
         rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """A training rank's local arrays in awex's training layout: the canonical values at every
    placement ``Writer.layout()`` lists, junk elsewhere (padding, which must never travel).
    With ``out``, written in place into those arrays."""
    rng = rng or np.random.default_rng(0)
    res = {}
    for t in layout:
        assert t["dtype"] == "f32", t
        a = out[t["name"]] if out is not None else np.empty(t["shape"], np.float32)
        a[...] = rng.standard_normal(t["shape"], dtype=np.float32) * 1e3
        for name, canon, local in boxes(t):
            a[local] = canonical[name][canon].reshape(a[local].shape)
        res[t["name"]] = a
    return res


def run_threads(calls: list[Callable[[], Any]], timeout: float = 240.0) -> list[Any]:
    with ThreadPoolExecutor(max_workers=len(calls)) as ex:
        futures = [ex.submit(c) for c in calls]
        return [f.result(timeout=timeout) for f in futures]


def fill_bf16(layout: list[dict[str, Any]], canonical: dict[str, Any], out: dict[str, Any] | None = None) -> dict[str, Any]:
    """``fill`` for a bf16 training side: torch tensors of the layout's dtype (bf16; fp32 for
    the tensors a bf16 model keeps in fp32, such as DeepSeek's router bias) holding the
    canonical values at every placement, junk elsewhere."""
    import torch

    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    g = torch.Generator().manual_seed(0)
    res = {}
    for t in layout:
        assert t["dtype"] in dtypes, t
        a = out[t["name"]] if out is not None else torch.empty(t["shape"], dtype=dtypes[t["dtype"]])
        a.copy_(torch.randn(t["shape"], generator=g) * 1e3)
        for name, canon, local in boxes(t):
            a[local] = canonical[name][canon].reshape(a[local].shape)
        res[t["name"]] = a
    return res


def drive(gateway: str, name: str, canon: dict[int, dict], versions: list[int],
          fill_rank: Callable[..., dict[str, Any]] = fill, timeout: float = 120.0) -> list[dict]:
    """The training side of one pair: Writers filled from the canonical weights in awex's
    training layout (``fill_rank``: ``fill`` for f32 numpy, ``fill_bf16`` for bf16 torch),
    joined, then one update per version (new weights written in place)."""
    import awex

    ctl = awex.Controller(gateway)
    n = ctl.status(name)["training"]["world_size"]
    writers = [awex.Writer(gateway, name, r) for r in range(n)]
    try:
        arrays = [fill_rank(w.layout(), canon[versions[0]]) for w in writers]
        for w, a in zip(writers, arrays):
            assert w.register(list(a.items())) == len(a)
        run_threads([lambda w=w: w.join(timeout=120) for w in writers])
        out = []
        for v in versions:
            if v != versions[0]:
                for w, a in zip(writers, arrays):
                    fill_rank(w.layout(), canon[v], out=a)
            with ThreadPoolExecutor(max_workers=n) as ex:
                futures = [ex.submit(w.update, v, timeout=timeout) for w in writers]
                out.append(ctl.update(v, timeout=timeout, pair=name))
                for f in futures:
                    assert f.result(timeout=timeout)["state"] == "committed"
        return out
    finally:
        for w in writers:
            w.close()


#: Cases whose class has shared experts: SGLang 0.5.23 on CPU keeps them apart
#: (``shared_experts_fusion_disable_reason``: not CUDA), which awex must be told at ep=1
#: (``fused_shared_experts=0``); a fused case fuses them as on a GPU.
SHARED = {"Glm4MoeForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM-no-q-lora",
          "DeepseekV2ForCausalLM"}

#: Cases with multi-head latent attention: SGLang derives ``w_kc`` / ``w_vc`` of every layer
#: after loading (``post_load_weights``), which the comparison must have seen.
MLA = {"DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM-no-q-lora", "DeepseekV2ForCausalLM"}


def sglang_infer(arch: str, tp: int, ep: int, fused: bool = False) -> str:
    """The inference spec of an SGLang case (``sglang:tp=..,ep=..``, plus whether its shared
    experts are fused for a class that has them)."""
    extra = f",fused_shared_experts={int(fused)}" if arch in SHARED else ""
    return f"sglang:tp={tp},ep={ep}{extra}"


def assert_mla_derived(results: list[dict[str, Any]], layers: int = 2) -> None:
    """Every rank compared every layer's MLA absorption tensors (``w_kc`` / ``w_vc``, derived by
    ``post_load_weights``), not just the parameters."""
    for res in results:
        for layer in range(layers):
            for w in ("w_kc", "w_vc"):
                assert f"derived:model.layers.{layer}.self_attn.{w}" in res["derived"], res["derived"]
