"""A tiny model made on the spot, nothing downloaded: a byte-level BPE tokenizer trained with
``tokenizers`` on a local text (``TEXT``), and a ``Qwen3ForCausalLM`` (or, with ``family``
``"qwen3.5"``, a hybrid linear-attention ``Qwen3_5ForCausalLM``: ``QWEN3_5``; with ``"qwen3.5-moe"``,
its MoE variant ``Qwen3_5MoeForCausalLM``: ``QWEN3_5_MOE``; with ``"qwen3-next"``, a
``Qwen3NextForCausalLM`` of the same sizes) with random weights
(seeded; float32, the Qwen3.5 ones bf16: ``DTYPE``) saved with transformers, the way a served model
directory looks.

    python tiny_model.py OUT_DIR [FAMILY]
"""

from __future__ import annotations

import os
import sys

#: the tokenizer's training text and the live tests' training and prompt text
TEXT = (
    "awex moves fresh model weights from a running training job into running inference engines "
    "between reinforcement learning steps, in seconds or less, whatever the two sides' parallel "
    "layouts are. A training rank holds local tensors in its engine's own names and layout; an "
    "inference rank holds other local tensors; both are views of the same canonical model. "
    "Once both sides are described as boxes of canonical tensors, the exchange is pure geometry: "
    "intersect source boxes with destination boxes, pick one source per destination byte, and "
    "move the bytes. The gateway pairs a training job with inference engines, starts each "
    "version, and commits it only when every rank received it. "
)
VOCAB = 384
#: the families ``make`` builds
FAMILIES = ("qwen3", "qwen3.5", "qwen3.5-moe", "qwen3-next")
#: the tiny Qwen3.5's own fields (dense ``Qwen3_5ForCausalLM``, the rest as the Qwen3 one):
#: layer 0 Gated DeltaNet (linear attention; 2 key heads and 4 value heads, so tp 2 holds one
#: key-head group per rank: vLLM's Gated DeltaNet splits by key head; heads of 64, the smallest
#: its CPU kernel ``torch.ops._C.chunk_gated_delta_rule_cpu`` takes: 16 stops with "expect
#: head_dim to be multiples of 32", 32 with "Unexpected head dim size, 32"), layer 1 gated full
#: attention. Saved in bf16 (``DTYPE``).
QWEN3_5 = dict(
    layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)
#: the tiny Qwen3.5-MoE's own fields: the Qwen3.5 layers above with Qwen3-Next's MoE block on
#: both (4 routed experts and a shared expert with its gate); the experts' intermediate size 64
#: is 32 a rank at tp 2, a multiple of the alignment of vLLM's CPU MoE kernel
#: (``CPUUnquantizedExperts.output_alignment``, ``fused_moe/experts/cpu_moe.py``), as is the
#: hidden size 64. Every token goes to all 4 experts, weighted by the router's softmax: with
#: fewer a token, the second and third experts' router probabilities are at times within bf16's
#: rounding (seen: 2 of 4, a margin below 1e-4 at one position of a 16-token check), and a bf16
#: server then takes another expert than float32 transformers, 2 nats apart
QWEN3_5_MOE = dict(QWEN3_5, num_experts=4, num_experts_per_tok=4, moe_intermediate_size=64,
                   shared_expert_intermediate_size=64)
#: the weights' dtype by family: vLLM's CPU build runs Gated DeltaNet in bf16 only
#: (``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``, ``cpu_gdn_attention_core``:
#: "CPU GDN attention requires BF16."), so the Qwen3.5 model is bf16 and so is its trainer
#: (``trainer.py`` loads the saved dtype)
DTYPE = {"qwen3": "float32", "qwen3.5": "bfloat16", "qwen3.5-moe": "bfloat16", "qwen3-next": "bfloat16"}
#: by family: (config class, model class, the family's own config fields), in transformers
CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
           "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5),
           "qwen3.5-moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", QWEN3_5_MOE),
           # the same fields: Qwen3-Next's Gated DeltaNet (its own input projections, grouped by
           # key head) and MoE block on both layers
           "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", QWEN3_5_MOE)}


def make(out: str, seed: int = 29, family: str = "qwen3") -> str:
    """Writes the model directory ``out`` (config, safetensors, tokenizer) of ``family`` (one of
    ``FAMILIES``) and returns it."""
    if family not in FAMILIES:
        raise ValueError(f"no tiny model of family {family!r}: one of {FAMILIES}")
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")
    config_name, cls_name, own = CLASSES[family]
    config, cls = getattr(transformers, config_name), getattr(transformers, cls_name)
    cfg = config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        head_dim=32,  # the smallest vLLM's CPU attention serves (CPUAttentionBackend.get_supported_head_sizes)
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
        initializer_range=0.25,  # logits far apart: greedy decoding has no near-ties
        bos_token_id=None, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        **own)
    torch.manual_seed(seed)
    model = cls(cfg).to(getattr(torch, DTYPE[family])).eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return out


def prompt_ids(model_dir: str) -> list[int]:
    """The token ids of the live tests' prompt."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)("The gateway pairs a training job")["input_ids"]


def train_ids(model_dir: str) -> list[int]:
    """The token ids the live tests' training job learns (what follows the prompt in ``TEXT``)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)(
        "The gateway pairs a training job with inference engines, starts each version, and commits it")["input_ids"]


if __name__ == "__main__":
    print(make(sys.argv[1], family=sys.argv[2] if len(sys.argv) > 2 else "qwen3"))
