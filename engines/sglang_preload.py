"""Imported once by a forkserver that SGLang rank processes on CPU are started from (the
real-engine tests' ``conftest.rank_context``, the stand-in server's ranks): every rank is forked
from a process that already imported torch, SGLang's model loader and model classes, and awex,
instead of importing them again (about 20 s a process on a 2-core machine, most of a test
case's time).

Only imports happen here: nothing initialises torch.distributed, SGLang's runtime context or a
thread pool, so each forked rank starts from the state a fresh import leaves; each rank still runs
``sglang_cpu.init_rank`` and ``load_model`` itself, and the patches a test asks for
(``fuse_shared_experts_as_on_gpu``, ``derive_mla_as_on_gpu``) land in that rank alone.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # engines/, for sglang_cpu

import sglang_cpu  # noqa: E402

sglang_cpu.install_stubs()

import torch  # noqa: E402,F401  (before SGLang, as its entry points do)
import sglang.srt.model_loader  # noqa: E402,F401
import sglang.srt.models.deepseek_v2  # noqa: E402,F401
import sglang.srt.models.glm4_moe  # noqa: E402,F401
import sglang.srt.models.llama  # noqa: E402,F401
import sglang.srt.models.qwen2  # noqa: E402,F401
import sglang.srt.models.qwen3  # noqa: E402,F401
import sglang.srt.models.qwen3_moe  # noqa: E402,F401
import sglang.srt.server_args  # noqa: E402,F401

import awex.sglang  # noqa: E402,F401
