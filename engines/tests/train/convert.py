"""Independent conversions for the conformance tests, written from the engines' own semantics
(not from awex's layout code): Megatron-Core rank shards -> HF tensors, HF tensors -> SGLang
rank tensors, and HF models -> a canonical per-expert checkpoint.

Megatron facts used (megatron/core): ``linear_qkv`` rows are ``[q of group g][k of g][v of g]``
per query group (``transformer/attention.py`` ``SelfAttention.get_query_key_value_tensors``
splits ``[ng, (nq/ng + 2) * hd]``), TP rank r holds rows ``[r/tp, (r+1)/tp)``
(``tensor_parallel/layers.py`` ``ColumnParallelLinear``); gated ``linear_fc1`` on rank r is
``[gate_r; up_r]`` (``transformer/mlp.py`` ``glu``: ``torch.chunk(x, 2, dim=-1)``);
``linear_proj`` / ``linear_fc2`` split dim 1 (``RowParallelLinear``); embeddings split the padded
vocabulary on dim 0 (``VocabParallelEmbedding``). Multi-latent attention
(``transformer/multi_latent_attention.py`` ``MLASelfAttention``, local spec): ``linear_q_down_proj``,
``linear_kv_down_proj``, ``linear_q_up_proj`` and ``linear_kv_up_proj`` are
``ColumnParallelLinear``s, rank r holding rows ``[r/tp, (r+1)/tp)`` (the down projections' outputs
are gathered after), ``q_layernorm`` / ``kv_layernorm`` whole; the rows keep HF's order (per head
``[nope | rope]`` for q and ``[nope | v]`` for kv up, ``[latent | rope]`` for kv down:
``torch.split`` in ``get_query_key_value_tensors``), and the rope dims are de-interleaved at run
time on both sides (``apply_rotary_pos_emb(mla_rotary_interleaved=True)``, transformers'
``apply_rotary_pos_emb_interleave``), so no weight is permuted. SGLang facts: see the awex design notes
(``qkv_proj = [q_r; k_r; v_r]``, kv heads replicated when tp > kv heads, vocab padded to 64).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch


def hf_canonical(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of an HF model, per-expert names (transformers 5's fused
    ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` split: expert e's first I rows are gate_proj,
    the next I up_proj, as ``Qwen3MoeExperts.forward`` chunks them)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone().contiguous()
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if m is None:
            out[name] = t
            continue
        base, which = m.groups()
        for e in range(t.shape[0]):
            if which == "down_proj":
                out[f"{base}.{e}.down_proj.weight"] = t[e].clone()
            else:
                i = t.shape[1] // 2
                out[f"{base}.{e}.gate_proj.weight"] = t[e, :i].clone()
                out[f"{base}.{e}.up_proj.weight"] = t[e, i:].clone()
    if getattr(model.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def megatron_to_hf(ranks: list[dict[str, Any]], hf: dict[str, Any], p: dict[str, int]) -> dict[str, torch.Tensor]:
    """Rebuilds the HF tensors from every rank's Megatron parameters (``ranks[g]`` is global
    rank g's ``{name: tensor}``), reading the first DP replica of each shard."""
    tp, pp, dp, cp = p.get("tp", 1), p.get("pp", 1), p.get("dp", 1), p.get("cp", 1)
    ep = p.get("ep", 1)
    etp = p.get("etp", tp)
    vpp = p.get("vpp", 1)
    L = hf["num_hidden_layers"]
    nq, ng = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim", hf["hidden_size"] // nq)
    stage = tp * cp * dp
    # layers of each (stage, chunk)
    first, last = p.get("first_stage_layers"), p.get("last_stage_layers")
    sizes = [L // (pp * vpp)] * (pp * vpp)
    if first is not None or last is not None:
        others = pp - (first is not None) - (last is not None)
        rest = L - (first or 0) - (last or 0)
        sizes = [rest // others if others else 0] * pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
    starts = np.cumsum([0] + sizes).tolist()

    def chunk_of(c: int) -> tuple[int, int]:
        return c % pp, c // pp  # stage, virtual chunk

    out: dict[str, torch.Tensor] = {}

    def tp_shards(st: int, name: str) -> list[torch.Tensor]:
        return [ranks[st * stage + r][name] for r in range(tp)]

    def expert_shard(st: int, ep_r: int, etp_r: int, name: str) -> torch.Tensor:
        # expert mesh inside a stage: etp fastest, then ep
        return ranks[st * stage + etp_r + etp * ep_r][name]

    def mlp_of(st: int, b: str, h: str, l: int) -> None:
        """Layer l's norm before the MLP and its MLP (dense, or router, experts, shared experts)."""
        r0 = ranks[st * stage]
        out[h + "post_attention_layernorm.weight"] = r0[b + "pre_mlp_layernorm.weight"]
        if b + "mlp.router.weight" in r0:
            out[h + "mlp.gate.weight"] = r0[b + "mlp.router.weight"]
            if b + "mlp.router.expert_bias" in r0:  # GLM-4.5: the router bias buffer
                out[h + "mlp.gate.e_score_correction_bias"] = r0[b + "mlp.router.expert_bias"]
            if b + "mlp.shared_experts.linear_fc1.weight" in r0:  # shared experts, over tp
                fc1 = tp_shards(st, b + "mlp.shared_experts.linear_fc1.weight")
                n = fc1[0].shape[0] // 2
                out[h + "mlp.shared_experts.gate_proj.weight"] = torch.cat([s[:n] for s in fc1], 0)
                out[h + "mlp.shared_experts.up_proj.weight"] = torch.cat([s[n:] for s in fc1], 0)
                out[h + "mlp.shared_experts.down_proj.weight"] = torch.cat(
                    tp_shards(st, b + "mlp.shared_experts.linear_fc2.weight"), 1)
            per = hf["num_experts"] // ep
            for ep_r in range(ep):
                for j in range(per):
                    e = ep_r * per + j
                    x = f"{b}mlp.experts.local_experts.{j}."
                    fc1 = [expert_shard(st, ep_r, t, x + "linear_fc1.weight") for t in range(etp)]
                    n = fc1[0].shape[0] // 2
                    out[f"{h}mlp.experts.{e}.gate_proj.weight"] = torch.cat([s[:n] for s in fc1], 0)
                    out[f"{h}mlp.experts.{e}.up_proj.weight"] = torch.cat([s[n:] for s in fc1], 0)
                    out[f"{h}mlp.experts.{e}.down_proj.weight"] = torch.cat(
                        [expert_shard(st, ep_r, t, x + "linear_fc2.weight") for t in range(etp)], 1
                    )
        else:
            fc1 = tp_shards(st, b + "mlp.linear_fc1.weight")
            n = fc1[0].shape[0] // 2
            out[h + "mlp.gate_proj.weight"] = torch.cat([s[:n] for s in fc1], 0)
            out[h + "mlp.up_proj.weight"] = torch.cat([s[n:] for s in fc1], 0)
            out[h + "mlp.down_proj.weight"] = torch.cat(tp_shards(st, b + "mlp.linear_fc2.weight"), 1)
    for c in range(pp * vpp):
        st, v = chunk_of(c)
        pre = f"model{v}." if vpp > 1 else ""
        for local, l in enumerate(range(starts[c], starts[c + 1])):
            b = f"{pre}decoder.layers.{local}."
            h = f"model.layers.{l}."
            r0 = ranks[st * stage]
            out[h + "input_layernorm.weight"] = r0[b + "input_layernorm.weight"]
            if b + "self_attention.linear_kv_up_proj.weight" in r0:  # DeepSeek-V3's MLA
                sa, ha = b + "self_attention.", h + "self_attn."

                def rows(n: str, st: int = st, sa: str = sa) -> torch.Tensor:
                    return torch.cat(tp_shards(st, sa + n), 0)

                # with q_lora_rank: Megatron-Core builds MLA only so (awex-megatron refuses the other)
                out[ha + "q_a_proj.weight"] = rows("linear_q_down_proj.weight")
                out[ha + "q_a_layernorm.weight"] = r0[sa + "q_layernorm.weight"]
                out[ha + "q_b_proj.weight"] = rows("linear_q_up_proj.weight")
                out[ha + "kv_a_proj_with_mqa.weight"] = rows("linear_kv_down_proj.weight")
                out[ha + "kv_a_layernorm.weight"] = r0[sa + "kv_layernorm.weight"]
                out[ha + "kv_b_proj.weight"] = rows("linear_kv_up_proj.weight")
                out[ha + "o_proj.weight"] = torch.cat(tp_shards(st, sa + "linear_proj.weight"), 1)
                mlp_of(st, b, h, l)
                continue
            qkv = torch.cat(tp_shards(st, b + "self_attention.linear_qkv.weight"), 0)
            qkv = qkv.view(ng, nq // ng + 2, hd, -1)
            out[h + "self_attn.q_proj.weight"] = qkv[:, : nq // ng].reshape(nq * hd, -1)
            out[h + "self_attn.k_proj.weight"] = qkv[:, nq // ng].reshape(ng * hd, -1)
            out[h + "self_attn.v_proj.weight"] = qkv[:, nq // ng + 1].reshape(ng * hd, -1)
            if b + "self_attention.linear_qkv.bias" in r0:
                qb = torch.cat(tp_shards(st, b + "self_attention.linear_qkv.bias"), 0).view(ng, nq // ng + 2, hd)
                out[h + "self_attn.q_proj.bias"] = qb[:, : nq // ng].reshape(-1)
                out[h + "self_attn.k_proj.bias"] = qb[:, nq // ng].reshape(-1)
                out[h + "self_attn.v_proj.bias"] = qb[:, nq // ng + 1].reshape(-1)
            out[h + "self_attn.o_proj.weight"] = torch.cat(tp_shards(st, b + "self_attention.linear_proj.weight"), 1)
            if b + "self_attention.q_layernorm.weight" in r0:
                out[h + "self_attn.q_norm.weight"] = r0[b + "self_attention.q_layernorm.weight"]
                out[h + "self_attn.k_norm.weight"] = r0[b + "self_attention.k_layernorm.weight"]
            mlp_of(st, b, h, l)
    vocab = hf["vocab_size"]
    first_pre = "model0." if vpp > 1 else ""
    last_pre = f"model{vpp - 1}." if vpp > 1 else ""
    out["model.embed_tokens.weight"] = torch.cat(tp_shards(0, first_pre + "embedding.word_embeddings.weight"), 0)[:vocab]
    out["model.norm.weight"] = ranks[(pp - 1) * stage][last_pre + "decoder.final_layernorm.weight"]
    if not hf.get("tie_word_embeddings", False):
        out["lm_head.weight"] = torch.cat(tp_shards(pp - 1, last_pre + "output_layer.weight"), 0)[:vocab]
    return {k: v.contiguous() for k, v in out.items()}


def sglang_expected(name: str, shape: list[int], hf_t: dict[str, torch.Tensor], hf: dict[str, Any],
                    tp: int, ep: int, r: int) -> np.ndarray:
    """What SGLang rank r (of tp, with ep for MoE) holds in `name` after loading the HF tensors."""
    nq, nkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim", hf["hidden_size"] // nq)
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        src = hf_t.get(name, hf_t["model.embed_tokens.weight"])
        full = torch.zeros(shape[0] * tp, src.shape[1])
        full[: src.shape[0]] = src
        return full[r * shape[0] : (r + 1) * shape[0]].numpy()
    if m is None:
        return hf_t[name].numpy()
    l, rest = m.groups()
    h = f"model.layers.{l}."
    qh = nq // tp
    kv_rep = tp > nkv
    kvh = 1 if kv_rep else nkv // tp
    kv_first = (r // (tp // nkv)) if kv_rep else r * kvh
    if "kv_lora_rank" in hf and rest in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight",
                                          "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight"):
        # multi-latent attention (SGLang's DeepseekV2AttentionMLA): the query (up) projection and
        # kv_b_proj column-parallel by heads (per head [nope | rope] and [nope | v] rows), o_proj
        # row-parallel by heads (v_head_dim columns each); the down projections replicated
        nope, rope, vd = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        t = hf_t[name]
        if rest == "self_attn.o_proj.weight":
            return t[:, r * qh * vd : (r + 1) * qh * vd].contiguous().numpy()
        per = nope + (vd if rest == "self_attn.kv_b_proj.weight" else rope)
        return t[r * qh * per : (r + 1) * qh * per].contiguous().numpy()
    if rest in ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"):
        suf = rest.rsplit(".", 1)[1]
        q = hf_t[f"{h}self_attn.q_proj.{suf}"][r * qh * hd : (r + 1) * qh * hd]
        k = hf_t[f"{h}self_attn.k_proj.{suf}"][kv_first * hd : (kv_first + kvh) * hd]
        v = hf_t[f"{h}self_attn.v_proj.{suf}"][kv_first * hd : (kv_first + kvh) * hd]
        return torch.cat([q, k, v], 0).numpy()
    if rest == "self_attn.o_proj.weight":
        return hf_t[f"{h}self_attn.o_proj.weight"][:, r * qh * hd : (r + 1) * qh * hd].contiguous().numpy()
    if rest in ("mlp.gate_up_proj.weight", "mlp.shared_experts.gate_up_proj.weight"):
        mod = rest[: -len("gate_up_proj.weight")]
        g, u = hf_t[f"{h}{mod}gate_proj.weight"], hf_t[f"{h}{mod}up_proj.weight"]
        n = g.shape[0] // tp
        return torch.cat([g[r * n : (r + 1) * n], u[r * n : (r + 1) * n]], 0).numpy()
    if rest in ("mlp.down_proj.weight", "mlp.shared_experts.down_proj.weight"):
        d = hf_t[f"{h}{rest}"]
        n = d.shape[1] // tp
        return d[:, r * n : (r + 1) * n].contiguous().numpy()
    if rest in ("mlp.experts.w13_weight", "mlp.experts.w2_weight"):
        tp_moe = tp // ep
        ep_r, mr = r // tp_moe, r % tp_moe
        per = hf["num_experts"] // ep
        parts = []
        for j in range(per):
            e = ep_r * per + j
            if rest.endswith("w13_weight"):
                g = hf_t[f"{h}mlp.experts.{e}.gate_proj.weight"]
                u = hf_t[f"{h}mlp.experts.{e}.up_proj.weight"]
                n = g.shape[0] // tp_moe
                parts.append(torch.cat([g[mr * n : (mr + 1) * n], u[mr * n : (mr + 1) * n]], 0))
            else:
                d = hf_t[f"{h}mlp.experts.{e}.down_proj.weight"]
                n = d.shape[1] // tp_moe
                parts.append(d[:, mr * n : (mr + 1) * n])
        return torch.stack(parts, 0).contiguous().numpy()
    return hf_t[name].numpy()


def hf_to_megatron(hf_t: dict[str, torch.Tensor], hf: dict[str, Any], tp: int, r: int,
                   padded_vocab: int) -> dict[str, torch.Tensor]:
    """TP rank r's Megatron-Core parameters (local spec, dense model, pp = 1) of the HF tensors:
    the inverse of ``megatron_to_hf`` for that case, from the same Megatron facts (module
    docstring); the vocabulary rows past the checkpoint's are zero (``padded_vocab`` is what the
    model is built with)."""
    nq, ng = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim", hf["hidden_size"] // nq)

    def rows(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // tp
        return t[r * n : (r + 1) * n].clone().contiguous()

    def cols(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[1] // tp
        return t[:, r * n : (r + 1) * n].clone().contiguous()

    def padded(t: torch.Tensor) -> torch.Tensor:
        full = t.new_zeros(padded_vocab, t.shape[1])
        full[: t.shape[0]] = t
        return full

    def qkv(h: str, suf: str) -> torch.Tensor:
        q = hf_t[f"{h}self_attn.q_proj.{suf}"]
        rest = q.shape[1:]
        parts = [q.reshape(ng, nq // ng, hd, *rest)]
        parts += [hf_t[f"{h}self_attn.{x}_proj.{suf}"].reshape(ng, 1, hd, *rest) for x in "kv"]
        return rows(torch.cat(parts, 1).reshape(-1, *rest))

    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": rows(padded(hf_t["model.embed_tokens.weight"]))}
    for l in range(hf["num_hidden_layers"]):
        b, h = f"decoder.layers.{l}.", f"model.layers.{l}."
        out[b + "input_layernorm.weight"] = hf_t[h + "input_layernorm.weight"].clone()
        out[b + "self_attention.linear_qkv.weight"] = qkv(h, "weight")
        if h + "self_attn.q_proj.bias" in hf_t:
            out[b + "self_attention.linear_qkv.bias"] = qkv(h, "bias")
        out[b + "self_attention.linear_proj.weight"] = cols(hf_t[h + "self_attn.o_proj.weight"])
        if h + "self_attn.q_norm.weight" in hf_t:
            out[b + "self_attention.q_layernorm.weight"] = hf_t[h + "self_attn.q_norm.weight"].clone()
            out[b + "self_attention.k_layernorm.weight"] = hf_t[h + "self_attn.k_norm.weight"].clone()
        out[b + "pre_mlp_layernorm.weight"] = hf_t[h + "post_attention_layernorm.weight"].clone()
        out[b + "mlp.linear_fc1.weight"] = torch.cat(
            [rows(hf_t[h + "mlp.gate_proj.weight"]), rows(hf_t[h + "mlp.up_proj.weight"])], 0)
        out[b + "mlp.linear_fc2.weight"] = cols(hf_t[h + "mlp.down_proj.weight"])
    out["decoder.final_layernorm.weight"] = hf_t["model.norm.weight"].clone()
    if not hf.get("tie_word_embeddings", False):
        out["output_layer.weight"] = rows(padded(hf_t["lm_head.weight"]))
    return out
