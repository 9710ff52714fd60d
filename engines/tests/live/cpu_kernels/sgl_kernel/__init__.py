"""A pure-torch stand-in for ``sgl_kernel`` that lets SGLang 0.5.23's CPU engine start, for the
live SGLang test only (put on ``PYTHONPATH`` by ``engines/tests/live/test_live_sglang.py``).

Every ``sgl-kernel`` / ``sglang-kernel`` wheel on the package index is a CUDA build. With
``SGLANG_USE_CPU_ENGINE=1`` SGLang imports these names from ``sgl_kernel`` at module level (the
``torch.ops.sgl_kernel.*`` kernels are used only on CPUs with AMX; without AMX SGLang's layers
run in torch):

- ``assign_req_to_token_pool_cpu`` (``srt/mem_cache/allocation.py``): called for every batch,
  so it is implemented, in torch, after the Triton kernel ``assign_req_to_token_pool`` of the
  same file;
- ``copy_all_layer_kv_cache_cpu`` (``kernels/ops/kvcache/cache_move.py``),
  ``assign_draft_cache_locs_contiguous_cpu``, ``assign_extend_cache_locs_cpu``
  (``kernels/ops/speculative/cache_locs.py``),
  ``fill_accept_out_cache_loc_cpu``, ``fill_bonus_tokens_cpu`` (``kernels/ops/speculative/
  eagle.py``), ``rotate_input_ids_cpu`` (``kernels/ops/speculative/multi_layer_eagle.py``),
  ``build_tree_kernel_efficient_cpu``, ``verify_tree_greedy_cpu`` (``kernels/ops/speculative/
  spec_tree.py``): KV-cache moves and
  speculative decoding, which the test does not use; they raise ``NotImplementedError``;
- ``sgl_kernel.mamba``: see its docstring.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Writes each request's new KV slots into its row of the token pool: request ``i`` gets
    ``out_cache_loc[o_i : o_i + n_i]`` at ``req_to_token[req_pool_indices[i], start_i:end_i]``,
    where ``n_i = end_i - start_i`` and ``o_i`` is the sum of the earlier requests' ``n``."""
    del pool_len  # the row length, which the Triton kernel needs for its pointer arithmetic
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _missing(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not in awex's CPU test stand-in for sgl_kernel "
                                  "(engines/tests/live/cpu_kernels); the live SGLang test does not use it")

    missing.__name__ = name
    return missing


assign_draft_cache_locs_contiguous_cpu = _missing("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _missing("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _missing("build_tree_kernel_efficient_cpu")
copy_all_layer_kv_cache_cpu = _missing("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _missing("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _missing("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _missing("rotate_input_ids_cpu")
verify_tree_greedy_cpu = _missing("verify_tree_greedy_cpu")
