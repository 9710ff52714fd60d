"""A tiny Qwen3 model made on the spot, nothing downloaded: a byte-level BPE tokenizer
trained with ``tokenizers`` on a local text (``TEXT``), and a ``Qwen3ForCausalLM`` with random
float32 weights (seeded) saved with transformers, the way a served model directory looks.

    python tiny_model.py OUT_DIR
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


def make(out: str, seed: int = 29) -> str:
    """Writes the model directory ``out`` (config, safetensors, tokenizer) and returns it."""
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
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        head_dim=32,  # the smallest vLLM's CPU attention serves (CPUAttentionBackend.get_supported_head_sizes)
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
        initializer_range=0.25,  # logits far apart: greedy decoding has no near-ties
        bos_token_id=None, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.float32).eval()
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
    print(make(sys.argv[1]))
