import json, sys, torch
d = sys.argv[1]; cfg = json.load(open(f"{d}/config.json"))
g = torch.Generator().manual_seed(0)
H, L, nh, kv, hd, I, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]
r = lambda *s: torch.randn(*s, generator=g)
t = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H)}
if not cfg.get("tie_word_embeddings"): t["lm_head.weight"] = r(V, H)
mla = cfg["model_type"] == "deepseek_v3"
glm = cfg["model_type"] in ("glm4_moe", "deepseek_v3")  # shared experts and the router bias
if glm:  # GLM-4.5's names for the same sizes: routed experts, dense first layers
    cfg["num_experts"] = cfg["n_routed_experts"]
    cfg["mlp_only_layers"] = list(range(cfg["first_k_dense_replace"]))
moe = "num_experts" in cfg
for l in range(L):
    p = f"model.layers.{l}."
    t[p+"input_layernorm.weight"] = r(H); t[p+"post_attention_layernorm.weight"] = r(H)
    if mla:  # DeepSeek-V3's MLA (transformers' modeling_deepseek_v3.py names and shapes)
        ql, kvl, nope, rope, vd = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        if ql is None:
            t[p+"self_attn.q_proj.weight"] = r(nh*(nope+rope), H)
        else:
            t[p+"self_attn.q_a_proj.weight"] = r(ql, H); t[p+"self_attn.q_a_layernorm.weight"] = r(ql)
            t[p+"self_attn.q_b_proj.weight"] = r(nh*(nope+rope), ql)
        t[p+"self_attn.kv_a_proj_with_mqa.weight"] = r(kvl+rope, H); t[p+"self_attn.kv_a_layernorm.weight"] = r(kvl)
        t[p+"self_attn.kv_b_proj.weight"] = r(nh*(nope+vd), kvl); t[p+"self_attn.o_proj.weight"] = r(H, nh*vd)
    else:
        t[p+"self_attn.q_proj.weight"] = r(nh*hd, H); t[p+"self_attn.k_proj.weight"] = r(kv*hd, H); t[p+"self_attn.v_proj.weight"] = r(kv*hd, H)
        t[p+"self_attn.o_proj.weight"] = r(H, nh*hd)
    if cfg.get("attention_bias"):  # GLM: q/k/v biases, no o bias
        t[p+"self_attn.q_proj.bias"] = r(nh*hd); t[p+"self_attn.k_proj.bias"] = r(kv*hd); t[p+"self_attn.v_proj.bias"] = r(kv*hd)
    if cfg["model_type"] not in ("llama", "deepseek_v3") and cfg.get("use_qk_norm", True):
        t[p+"self_attn.q_norm.weight"] = r(hd); t[p+"self_attn.k_norm.weight"] = r(hd)
    if moe and l not in cfg["mlp_only_layers"]:
        E, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
        t[p+"mlp.gate.weight"] = r(E, H)
        for e in range(E):
            t[p+f"mlp.experts.{e}.gate_proj.weight"] = r(mi, H); t[p+f"mlp.experts.{e}.up_proj.weight"] = r(mi, H); t[p+f"mlp.experts.{e}.down_proj.weight"] = r(H, mi)
        if glm:  # the router's fp32 score-correction bias and the shared expert
            t[p+"mlp.gate.e_score_correction_bias"] = r(E)
            s = cfg["n_shared_experts"] * mi
            t[p+"mlp.shared_experts.gate_proj.weight"] = r(s, H); t[p+"mlp.shared_experts.up_proj.weight"] = r(s, H)
            t[p+"mlp.shared_experts.down_proj.weight"] = r(H, s)
    else:
        t[p+"mlp.gate_proj.weight"] = r(I, H); t[p+"mlp.up_proj.weight"] = r(I, H); t[p+"mlp.down_proj.weight"] = r(H, I)
torch.save(t, sys.argv[2])
