"""One rank of a live test's Megatron-Core training job: Megatron-Core 0.19.2 on CPU over gloo,
tensor parallel across the WORLD ranks (tp = WORLD, pp = dp = 1), the local layer spec, fp32
(``../train/megatron_cpu.py``'s shims and ``GPTModel`` builder, as the conformance tests use
them), learning a few tokens with AdamW and sending every version through awex's Megatron
backend (``awex.Writer.attach`` on the ``GPTModel``) to the pair the test connected with
``train="megatron:tp=WORLD,local_spec=1"``.

    python megatron_trainer.py RANK WORLD PORT GATEWAY PAIR MODEL_DIR OUT_DIR SPEC_JSON

The arguments, SPEC and the version loop are ``trainer.py``'s (``run_versions``). The model starts
from the saved HF model: ``convert.hf_to_megatron`` cuts this rank's shards (the padded
vocabulary rows zero), and the job checks that ``convert.megatron_to_hf`` of every rank's
parameters gives the checkpoint back bit for bit and that the loaded model's logits equal
transformers' on the saved model (within 1e-4) before it trains. A step is Megatron's own
loss (``GPTModel.forward`` with ``labels``: the vocabulary-parallel cross entropy) on the next
tokens, ``backward``, then the gradient reduction Megatron's ``finalize_model_grads`` does for
this layout (``megatron/core/distributed/finalize_model_grads.py``,
``_allreduce_non_tensor_model_parallel_grads``: the q/k layernorm weights see only the local
heads, their gradients are summed over the TP group; every other replicated parameter already
has the full gradient without sequence parallelism), then ``AdamW.step``. The HF reference
OUT_DIR/v{V}.pt is ``convert.megatron_to_hf`` of every rank's parameters (``all_gather_object``).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "train"))
TIMEOUT = 300.0
LR = 0.05


def main() -> None:
    import safetensors.torch
    import torch
    import torch.distributed as dist
    import transformers
    from megatron.core import parallel_state as ps

    import awex
    import convert
    import megatron_cpu
    import tiny_model
    import trainer

    rank, world, gateway, pair, model_dir, out, spec, say = trainer.start(sys.argv)
    megatron_cpu.install_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    hf = json.load(open(os.path.join(model_dir, "config.json")))
    parallel = {"tp": world}
    model = megatron_cpu.build_gpt(hf, {"parallel": parallel})[0].train()

    # the saved model's weights, cut into this rank's shards
    saved = safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors"))
    shards = convert.hf_to_megatron(saved, hf, world, rank, megatron_cpu.padded_vocab(hf["vocab_size"], world))
    params = dict(model.named_parameters())
    if sorted(shards) != sorted(params):
        raise RuntimeError(f"the converted checkpoint's names {sorted(shards)} differ from the model's {sorted(params)}")
    with torch.no_grad():
        for n, p in params.items():
            if shards[n].shape != p.shape:
                raise RuntimeError(f"`{n}`: the converted checkpoint has {tuple(shards[n].shape)}, the model {tuple(p.shape)}")
            p.copy_(shards[n])

    def full() -> dict[str, torch.Tensor] | None:
        mine = {n: p.detach().clone() for n, p in params.items()}
        ranks: list = [None] * world
        dist.all_gather_object(ranks, mine)
        return convert.megatron_to_hf(ranks, hf, parallel) if rank == 0 else None

    back = full()
    if rank == 0:
        bad = [n for n in saved if not torch.equal(back[n], saved[n])]
        if sorted(back) != sorted(saved) or bad:
            raise RuntimeError(f"the Megatron shards do not convert back to the saved model: {bad or sorted(back)}")

    ids = tiny_model.train_ids(model_dir)
    tokens, labels = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    # the loaded Megatron model computes what transformers does with the saved model
    got = megatron_cpu.forward([model], tokens, hf["vocab_size"])
    if rank == 0:
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(tokens).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"the loaded Megatron model's logits differ from transformers': {m}")
        say("the loaded model's logits equal transformers'")
    s = tokens.shape[1]
    pos = torch.arange(s).unsqueeze(0)
    mask = torch.triu(torch.ones(s, s), diagonal=1).bool().view(1, 1, s, s)  # True: masked out
    qk_norms = [p for n, p in params.items() if "q_layernorm" in n or "k_layernorm" in n]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def step() -> float:
        loss = model(tokens, pos, attention_mask=mask, labels=labels).mean()
        loss.backward()
        for p in qk_norms:
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    w = awex.Writer.attach(model, gateway, pair, timeout=TIMEOUT)
    trainer.run_versions(w, rank, out, spec, step, full, say)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    say("done")


if __name__ == "__main__":
    main()
