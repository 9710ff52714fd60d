"""One TP rank of vLLM 0.33's real block-FP8 model on CPU (``vllm_rank.build``: vLLM's
``initialize_model`` and parallel groups over gloo), loaded from an FP8 checkpoint
(``quantization_config``: ``quant_method: fp8``, ``weight_block_size``) with the class's own
``load_weights`` and vLLM's own post-load pass (``process_weights_after_loading``, which runs
every ``Fp8LinearMethod`` / ``Fp8MoEMethod.process_weights_after_loading``).

    python vllm_fp8_rank.py params CASE_JSON RANK OUT_DIR
        every parameter's name, shape and dtype after vLLM's load of CASE["ckpt"]:
        OUT_DIR/params{R}.json
    python vllm_fp8_rank.py receive CASE_JSON RANK OUT_DIR
        the model of CASE["fp8"]["0"], updated through awex's registered ``WeightTransferEngine``
        (``vllm_receive.py``'s driving: vLLM's plugin loader, ``WeightTransferEngineFactory``,
        the ``Worker``'s own methods) to every version of CASE["versions"]; after each, every
        parameter compared byte for byte with a fresh model's load of that version's FP8
        checkpoint: OUT_DIR/result{R}.json
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_rank  # noqa: E402


def stub_fp8_kernels() -> None:
    """vLLM 0.33 picks its FP8 GEMM and MoE kernels from the platform; none is a CPU kernel.
    Only those choices are replaced (after the layers created their parameters); every
    ``create_weights``, weight loader and ``process_weights_after_loading`` is vLLM's own."""
    import fp8_kernel_stubs

    fp8_kernel_stubs.install()


def build(case: dict, rank: int):
    stub_fp8_kernels()
    return vllm_rank.build(case, rank)


def load(model, vc, ckpt: str) -> None:
    """vLLM's load of ``ckpt`` as its ``DefaultModelLoader.load_weights`` does it: the class's own
    ``load_weights`` over the checkpoint's tensors, then ``process_weights_after_loading``
    (``vllm/model_executor/model_loader/utils.py``)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    with set_current_vllm_config(vc):
        model.load_weights(iter(tensors.items()))
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))


def new_model(vc):
    """Another model of the same config, built as ``vllm_rank.build`` builds one (vLLM's
    ``initialize_model``). vLLM registers every MoE layer by name in the config's static forward
    context and refuses a second layer of the same name (``register_layer_for_moe_forward_op``,
    ``model_executor/layers/fused_moe/runner/moe_runner.py``): the registry is emptied first, so
    the model built last is the one registered."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    cc = vc.compilation_config
    cc.static_forward_context.clear()
    cc.static_all_moe_layers.clear()
    with set_current_vllm_config(vc):
        torch.set_default_dtype(vc.model_config.dtype)
        return initialize_model(vllm_config=vc)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)))


def compare(model, want: dict[str, torch.Tensor]) -> list[str]:
    got = dict(model.named_parameters())
    diffs = [f"names differ: {sorted(set(got) ^ set(want))}"] if set(got) != set(want) else []
    for n, w in want.items():
        g = got.get(n)
        if g is None:
            continue
        if g.dtype != w.dtype or g.shape != w.shape:
            diffs.append(f"`{n}`: {g.dtype} {list(g.shape)} vs vLLM's load {w.dtype} {list(w.shape)}")
        elif not same(g.detach(), w):
            n_bad = int((g.detach().contiguous().view(torch.uint8) != w.contiguous().view(torch.uint8)).sum())
            diffs.append(f"`{n}` ({w.dtype} {list(w.shape)}): {n_bad} bytes differ from vLLM's load")
    return diffs


def params(case: dict, rank: int, out: str) -> None:
    model, vc = build(case, rank)
    load(model, vc, case["ckpt"])
    res = [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in model.named_parameters()]
    with open(os.path.join(out, f"params{rank}.json"), "w") as f:
        json.dump(res, f)


def receive(case: dict, rank: int, out: str) -> None:
    import vllm_receive
    from vllm.config import WeightTransferConfig, set_current_vllm_config
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    fp8 = {int(v): d for v, d in case["fp8"].items()}
    versions = case["versions"]
    ref, vc = build(case, rank)
    want = {}
    for i, v in enumerate(versions):  # vLLM's own load of each version's FP8 checkpoint, in a model of its own
        if i:
            ref = new_model(vc)
        load(ref, vc, fp8[v])
        want[v] = snapshot(ref)
        del ref
    model = new_model(vc)  # the served model
    load(model, vc, fp8[0])
    result = {"checked": 0, "diffs": [], "params": len(want[versions[0]]), "params_names": sorted(want[versions[0]]),
              "fp8": sorted(n for n, t in want[versions[0]].items() if t.dtype == torch.float8_e4m3fn)}
    if not compare(model, want[versions[0]]):
        raise AssertionError("version 0 equals the first update's weights: the test cannot fail")

    load_general_plugins()
    if "awex" not in WeightTransferEngineFactory._registry:
        raise SystemExit("the awex wheel's vllm.general_plugins entry point did not register the `awex` backend")
    vc.weight_transfer_config = WeightTransferConfig(backend="awex")
    torch.accelerator.synchronize = lambda device=None: None  # as vllm_receive.py: nothing is async on CPU
    worker = vllm_receive.worker_for(vc, rank, model)
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        vc.weight_transfer_config, vc, torch.device("cpu"), model)
    timeout = case.get("timeout", 240.0)
    with set_current_vllm_config(vc):
        worker.init_weight_transfer_engine({"gateway": case["gateway"], "pair": case["pair"], "engine": 0,
                                            "timeout": timeout})
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    for v in versions:
        with set_current_vllm_config(vc):
            worker.start_weight_update()
            worker.update_weights({"version": v, "timeout": timeout})
            worker.finish_weight_update()
        result["diffs"] += [f"v{v} rank {rank}: {d}" for d in compare(model, want[v])]
        result["checked"] += 1
        if {n: p.data_ptr() for n, p in model.named_parameters()} != ptrs:
            result["diffs"].append(f"v{v} rank {rank}: a parameter moved to new storage")
    worker.shutdown_weight_transfer_engine()
    result["engine"] = type(worker.weight_transfer_engine).__name__ if worker.weight_transfer_engine else None
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    mode, case, rank, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        {"params": params, "receive": receive}[mode](case, rank, out)
    except BaseException:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
