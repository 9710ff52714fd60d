"""One TP rank of vLLM 0.33's own hybrid linear-attention model on CPU (``vllm_rank.build``:
vLLM's ``initialize_model`` with its parallel groups over gloo), loaded from an identity
checkpoint (``identity.py``) with the class's own ``load_weights``; writes every parameter as
``[name, shape, dtype, runs]`` to OUT_DIR/params{RANK}.json.

    python vllm_hybrid_rank.py CASE_JSON RANK OUT_DIR
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
        params = [[n, list(p.shape), str(p.dtype).removeprefix("torch."), identity.runs_of(p.detach().float().numpy())]
                  for n, p in model.named_parameters()]
        with open(os.path.join(out, f"params{rank}.json"), "w") as f:
            json.dump(params, f)
    except BaseException:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
