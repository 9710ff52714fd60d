import json, sys, torch
kind = sys.argv[1]; d = sys.argv[2]
cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           intermediate_size=128, vocab_size=1000, max_position_embeddings=256, rms_norm_eps=1e-6,
           rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32", hidden_act="silu")
if kind == "qwen3":
    cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
elif kind == "llama":
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=True)
elif kind == "glm":
    # GLM-4.5: q/k/v biases, q/k norms, layer 0 dense, layer 1 MoE with a shared expert
    cfg.update(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", n_routed_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
               n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, attention_bias=True,
               use_qk_norm=True, partial_rotary_factor=0.5, num_nextn_predict_layers=0)
elif kind in ("deepseek", "deepseek_no_q_lora"):
    # DeepSeek-V3: MLA (with q_lora_rank, or a plain q_proj), layer 0 dense, layer 1 MoE with a
    # shared expert and the fp32 router bias (topk_method noaux_tc); yarn rope as the real configs
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=4, head_dim=8,
               n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
               first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, norm_topk_prob=True,
               routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
               q_lora_rank=32 if kind == "deepseek" else None, kv_lora_rank=16, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0,
               rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
else:
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True)
import os; os.makedirs(d, exist_ok=True)
json.dump(cfg, open(f"{d}/config.json", "w"))
