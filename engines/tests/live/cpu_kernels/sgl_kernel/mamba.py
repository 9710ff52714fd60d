"""``sgl_kernel.mamba`` of awex's CPU test stand-in (see ``sgl_kernel/__init__.py``): the
linear-attention kernels SGLang's CPU engine imports at module level
(``srt/layers/attention/linear/gdn_backend.py``, ``kda_backend.py``, ``kernels/gdn_triton.py``).
The tiny Qwen3 of the live test has no such layers; each raises ``NotImplementedError``."""

from __future__ import annotations

from . import _missing

causal_conv1d_fn_cpu = _missing("mamba.causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = _missing("mamba.causal_conv1d_update_cpu")
chunk_gated_delta_rule_cpu = _missing("mamba.chunk_gated_delta_rule_cpu")
