"""Megatron-Core 0.19.2 on CPU over gloo: the shims for its CUDA-only calls, and the builders
the conformance tests use (a Qwen-shaped ``GPTModel`` from an HF config, pipeline forward).

Each shim names the Megatron file whose call it works around:

- ``torch.cuda.current_device`` returns ``"cpu"``:
  ``megatron/core/models/common/embeddings/rotary_pos_embedding.py`` (``RotaryEmbedding.get_emb``
  moves ``inv_freq`` to ``torch.cuda.current_device()``) and
  ``megatron/core/distributed/param_and_grad_buffer.py`` (``_ParamAndGradBuffer`` allocates the
  grad buffers of Megatron's ``DistributedDataParallel`` there).
- ``torch.Tensor.cuda`` returns the tensor itself:
  ``megatron/core/models/common/language_module/language_module.py``
  (``setup_embeddings_and_output_layer`` runs ``weight.data = weight.data.cuda()`` before the
  all-reduce that makes the first and last stages' tied embeddings equal, pp > 1).
- the RNG tracker's ``fork()`` is a no-op context: ``megatron/core/tensor_parallel/random.py``
  (``CudaRNGStatesTracker.fork`` saves and restores CUDA RNG state, and raises
  ``cuda rng state model-parallel-rng is not added`` unless ``model_parallel_cuda_manual_seed``
  ran, which needs CUDA); dropout is 0 here, so no random stream is consumed.
- the global memory buffer allocates on CPU through the first shim: ``megatron/core/utils.py``
  (``GlobalMemoryBuffer.get_tensor`` allocates with ``device=torch.cuda.current_device()``;
  ``parallel_state.get_global_memory_buffer()`` serves sequence-parallel gathers).
- the causal mask is passed explicitly: ``megatron/core/transformer/utils.py``
  (``get_default_causal_mask`` builds it with ``device="cuda"``) -- no shim, an argument.

The fusions are off in the config (``bias_activation_fusion``, ``masked_softmax_fusion``,
``persist_layer_norm``, ``gradient_accumulation_fusion``, ``apply_rope_fusion``,
``bias_dropout_fusion``), ``use_cpu_initialization=True``, and the layer spec is
``get_gpt_layer_local_spec`` (no Transformer Engine on CPU).

DeepSeek-V3's multi-latent attention (MLA) with the local spec does not build as is: the local
``DotProductAttention`` (``megatron/core/transformer/dot_product_attention.py``) takes no
``k_channels`` / ``v_channels``, which ``MultiLatentAttention.__init__``
(``megatron/core/transformer/multi_latent_attention.py``) passes to its core attention.
``MlaCoreAttention`` below stands in for it: it holds no parameter or buffer (so the model's
parameters are exactly Megatron's) and computes what ``DotProductAttention.forward`` computes
(softmax(q k^T * softmax_scale, causal mask) v per head, probabilities in fp32), with MLA's
value head size. MLA without ``q_lora_rank`` (``linear_q_proj``) does not build with the local
spec in Megatron-Core 0.19.2: ``QKNormConfigResolver`` (``transformer/mla_qk_norm_config.py``)
refuses the spec's ``q_layernorm`` without ``q_lora_rank`` and, with it taken out, asks for a
fused norm + linear ``linear_q_proj``, which only Transformer Engine provides (and whose
``layer_norm_weight`` no HF checkpoint has): awex-megatron refuses that model.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def install_shims() -> None:
    """Makes Megatron-Core's CUDA-only calls work on CPU (see the module docstring)."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]


class MlaCoreAttention(torch.nn.Module):
    """A parameter-free core attention for MLA on CPU (see the module docstring): the math of
    ``DotProductAttention.forward`` for ``[s, b, heads, k]`` queries/keys and ``[s, b, heads, v]``
    values, the boolean mask True where attention is masked; returns ``[s, b, heads * v]``."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, **_: Any) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or 1) ** -0.5

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        assert packed_seq_params is None and attention_bias is None
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        ctx = torch.matmul(probs, v)  # [b, n, s, v]
        s, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(s, b, -1)


def _use_mla_core_attention(spec: Any) -> Any:
    """The layer spec(s) with ``MlaCoreAttention`` as every MLA layer's core attention."""
    layers = getattr(spec, "layer_specs", None)
    for layer in layers if layers is not None else [spec]:
        layer.submodules.self_attention.submodules.core_attention = MlaCoreAttention
    return spec


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """The vocabulary Megatron's training script builds the model with
    (``megatron/training/tokenizer``'s ``_vocab_size_with_padding``: a multiple of 128 * tp)."""
    m = divisible_by * tp
    return (vocab + m - 1) // m * m


def build_gpt(hf: dict[str, Any], case: dict[str, Any]) -> list[Any]:
    """This rank's model chunks of a Qwen2/Qwen3/Qwen3-MoE/GLM-4.5 HF config, local spec, fp32,
    on CPU. GLM-4.5 as Megatron-Core trains it: q/k/v biases, q/k norms (``use_qk_norm``),
    rotary embedding on ``partial_rotary_factor`` of each head, dense first
    ``first_k_dense_replace`` layers (``moe_layer_freq``), a sigmoid router with its expert bias
    choosing the experts, top-k weights renormalised and scaled by ``routed_scaling_factor``,
    shared experts."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    p = case["parallel"]
    tp, pp, vpp = p.get("tp", 1), p.get("pp", 1), p.get("vpp", 1)
    qwen2 = hf["architectures"][0].startswith("Qwen2")
    glm = hf["architectures"][0] == "Glm4MoeForCausalLM"
    deepseek = hf["architectures"][0] == "DeepseekV3ForCausalLM"
    moe = "num_experts" in hf and hf.get("num_experts", 0) > 0
    kw: dict[str, Any] = {}
    qkv_bias, qk_norm = qwen2, not qwen2
    dense = set(hf.get("mlp_only_layers", []))
    rotary_percent = 1.0
    if deepseek:
        # multi-latent attention with its latent norms (q_layernorm / kv_layernorm with the local
        # spec), plain rope on the rope dims (softmax scale 1/sqrt(nope + rope): no yarn mscale)
        qk_norm = True
        dense = set(range(hf["first_k_dense_replace"]))
        kw.update(
            multi_latent_attention=True,
            q_lora_rank=hf["q_lora_rank"],
            kv_lora_rank=hf["kv_lora_rank"],
            qk_head_dim=hf["qk_nope_head_dim"],
            qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_type="rope",
            rotary_base=(hf.get("rope_parameters") or {}).get("rope_theta", 10000),
            rotary_scaling_factor=1.0,
            moe_shared_expert_intermediate_size=hf["n_shared_experts"] * hf["moe_intermediate_size"],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=hf.get("routed_scaling_factor", 1.0),
            moe_router_dtype="fp32",
        )
    if glm:
        qkv_bias, qk_norm = bool(hf["attention_bias"]), bool(hf["use_qk_norm"])
        dense = set(range(hf["first_k_dense_replace"]))
        # transformers 5 writes it into rope_parameters
        rotary_percent = hf.get("partial_rotary_factor") or (hf.get("rope_parameters") or {}).get(
            "partial_rotary_factor", 0.5)
        kw.update(
            moe_shared_expert_intermediate_size=hf["n_shared_experts"] * hf["moe_intermediate_size"],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=hf.get("routed_scaling_factor", 1.0),
            moe_router_dtype="fp32",
        )
    if moe:
        kw.update(
            num_moe_experts=hf["num_experts"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_router_pre_softmax=False,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_layer_freq=[0 if l in dense else 1 for l in range(hf["num_hidden_layers"])],
            expert_model_parallel_size=p.get("ep", 1),
            expert_tensor_parallel_size=p.get("etp", tp),
        )
    if "first_stage_layers" in p:
        kw["num_layers_in_first_pipeline_stage"] = p["first_stage_layers"]
    if "last_stage_layers" in p:
        kw["num_layers_in_last_pipeline_stage"] = p["last_stage_layers"]
    if vpp > 1:
        kw["virtual_pipeline_model_parallel_size"] = vpp
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    cfg = (MLATransformerConfig if deepseek else TransformerConfig)(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]),
        ffn_hidden_size=hf["intermediate_size"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_norm,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        **kw,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=hf.get("num_experts") if moe else None,
        moe_grouped_gemm=False,
        qk_layernorm=qk_norm,
        multi_latent_attention=deepseek,
        normalization="RMSNorm",
    )
    if moe and dense:
        # dense layers beside MoE ones: one local spec per layer, by moe_layer_freq
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        assert vpp == 1, "dense and MoE layers are built with vpp 1 here"
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    if deepseek:
        spec = _use_mla_core_attention(spec)
    tied = bool(hf.get("tie_word_embeddings", False))
    chunks = []
    for v in range(vpp):
        if vpp > 1:
            ps.set_virtual_pipeline_model_parallel_rank(v)
        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v) if vpp > 1 else ps.is_pipeline_first_stage()
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v) if vpp > 1 else ps.is_pipeline_last_stage()
        extra = {"vp_stage": v} if vpp > 1 else {}
        chunks.append(
            GPTModel(
                config=cfg,
                transformer_layer_spec=spec,
                vocab_size=padded_vocab(hf["vocab_size"], tp),
                max_sequence_length=hf.get("max_position_embeddings", 128),
                pre_process=first,
                post_process=last,
                share_embeddings_and_output_weights=tied,
                position_embedding_type="rope",
                rotary_percent=rotary_percent,
                rotary_base=int(hf.get("rope_theta", 10000)),
                **extra,
            ).eval()
        )
    if vpp > 1:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    return chunks


def forward(chunks: list[Any], tokens: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """Runs the whole pipeline (every stage and virtual chunk in order, hidden states passed with
    gloo send/recv) and returns the full-vocabulary logits on the last stage's ranks, else None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    s = tokens.shape[1]
    pos = torch.arange(s).unsqueeze(0)
    mask = torch.triu(torch.ones(s, s), diagonal=1).bool().view(1, 1, s, s)
    hidden_shape = (s, tokens.shape[0], chunks[0].config.hidden_size)
    out = None
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            if not (v == 0 and stage == 0):
                buf = torch.empty(hidden_shape)
                dist.recv(buf, src=ps.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(buf)
            out = chunk(tokens, pos, attention_mask=mask)
            last = v == len(chunks) - 1 and stage == pp - 1
            if not last:
                dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    if stage != pp - 1:
        return None
    tpg = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(tpg))]
    dist.all_gather(parts, out.contiguous(), group=tpg)
    return torch.cat(parts, dim=-1)[..., :vocab]
