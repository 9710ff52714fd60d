"""One TP rank of one of vLLM 0.33's own model classes on CPU (``vllm_rank.build``: vLLM's
``initialize_model`` with its parallel groups over gloo), loaded from the case's checkpoint with
the class's own ``load_weights``. Writes every parameter to OUT_DIR: as ``[name, shape, dtype,
runs]`` (``identity.runs_of``, for identity checkpoints) in params{RANK}.json, or with the case's
``"dump": "npz"`` as float32 arrays in params{RANK}.npz and their dtypes in dtypes{RANK}.json.

    python vllm_load_rank.py CASE_JSON RANK OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import identity  # noqa: E402
import vllm_rank  # noqa: E402


def main() -> None:
    case, rank, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    try:
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config

        model, vc = vllm_rank.build(case, rank)
        with set_current_vllm_config(vc):
            model.load_weights(iter(load_file(os.path.join(case["hf_dir"], "model.safetensors")).items()))
        if case.get("dump") == "npz":
            import numpy as np

            params = dict(model.named_parameters())
            np.savez(os.path.join(out, f"params{rank}.npz"), **{n: p.detach().float().numpy() for n, p in params.items()})
            with open(os.path.join(out, f"dtypes{rank}.json"), "w") as f:
                json.dump({n: str(p.dtype).removeprefix("torch.") for n, p in params.items()}, f)
            return
        params = [[n, list(p.shape), str(p.dtype).removeprefix("torch."), identity.runs_of(p.detach().float().numpy())]
                  for n, p in model.named_parameters()]
        with open(os.path.join(out, f"params{rank}.json"), "w") as f:
            json.dump(params, f)
    except BaseException:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
