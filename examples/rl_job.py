"""A training job that keeps two live inference servers, one vLLM and one SGLang, on its weights
through the awex gateway: docs/quickstart-rl.md runs it (and so does CI, from that page).

    torchrun --nproc-per-node 2 examples/rl_job.py --gateway URL --model DIR \\
        --vllm URL --sglang URL [--versions 3]

FSDP2 (``fully_shard`` per decoder layer, data parallel over every rank) on CPU over gloo, AdamW
on a few tokens. Rank 0 is also the controller: it connects one pair per server (``rl-vllm``,
``rl-sglang``: the names the servers were started with, ``AWEX_PAIR``), and for each version
starts the update while every rank sends its shards (``Writer.update``). After the last version
rank 0 asks each server for a greedy completion and checks it against transformers' own greedy
decoding on the trainer's weights: the servers generate with the weights just trained.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

#: what the job learns and the prompt the servers complete
TRAIN_TEXT = "The gateway pairs a training job with inference engines, starts each version, and commits it"
PROMPT = "The gateway pairs a training job"
TOKENS = 16


def main() -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import awex

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateway", required=True, help="the gateway's URL (awex-cli serve)")
    ap.add_argument("--model", required=True, help="the served model's directory")
    ap.add_argument("--vllm", required=True, help="the vLLM server's URL (started with AWEX_PAIR=rl-vllm)")
    ap.add_argument("--sglang", required=True, help="the SGLang server's URL (started with AWEX_PAIR=rl-sglang)")
    ap.add_argument("--versions", type=int, default=3, help="how many versions to train and send")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor([tok(TRAIN_TEXT)["input_ids"]])

    # the pairs: the training side is this job (FSDP2, dp = world), the inference side each
    # server (tp 2, one engine), reached by its URL; awex moves the bytes over TCP
    servers = {"rl-vllm": ("vllm:tp=2", args.vllm), "rl-sglang": ("sglang:tp=2,engines=1", args.sglang)}
    ctl = awex.Controller(args.gateway)
    if rank == 0:
        for pair, (infer, url) in servers.items():
            ctl.connect(pair, model=args.model, train=f"fsdp:dp={world}", infer=infer, transport="tcp",
                        urls=[url], atomic=True, join_deadline_s=600, update_deadline_s=120)
    dist.barrier()
    writers = {pair: awex.Writer.attach(model, args.gateway, pair, timeout=600) for pair in servers}
    for pair, w in writers.items():
        w.join(600)
    if rank == 0:
        for pair in servers:
            ctl.wait_ready(600, pair=pair)
        print(f"joined {', '.join(servers)}: {world} training ranks and each server's 2 TP ranks", flush=True)

    for version in range(1, args.versions + 1):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for pair, w in writers.items():
            t0, done = time.monotonic(), []
            # rank 0 starts the version and waits for the commit while every rank sends
            driver = threading.Thread(target=lambda p=pair, v=version: done.append(ctl.update(v, pair=p)))
            if rank == 0:
                driver.start()
            w.update(version, timeout=600)
            if rank == 0:
                driver.join()
                if not done or done[0]["state"] != "committed":
                    raise RuntimeError(f"{pair}: version {version} did not commit: {done}")
                print(f"version {version} (loss {loss.item():.4f}): {pair} committed in "
                      f"{time.monotonic() - t0:.1f} s", flush=True)

    # the servers' greedy completions against transformers' on the trainer's weights (a gather)
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        check(args, full, tok, {"rl-vllm": args.vllm, "rl-sglang": args.sglang}, args.versions)
    dist.barrier()
    for w in writers.values():
        w.close()
    if rank == 0:
        for pair in servers:
            ctl.disconnect(pair=pair)
    dist.destroy_process_group()


def check(args, full, tok, urls: dict[str, str], version: int) -> None:
    import json
    import urllib.request

    import torch
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ref.load_state_dict(full)
    prompt = tok(PROMPT)["input_ids"]
    ids, want = list(prompt), []
    with torch.no_grad():
        for _ in range(TOKENS):
            t = int(torch.argmax(ref(torch.tensor([ids])).logits[0, -1]))
            want.append(t)
            ids.append(t)
    for pair, url in urls.items():
        body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            got = [int(t) for t in json.loads(r.read())["choices"][0]["token_ids"]]
        if got != want:
            raise SystemExit(f"{pair}: the server generates {got}, transformers on the trainer's version "
                             f"{version} weights {want}")
        print(f"{pair}: the server's greedy completion equals transformers' on the trainer's version {version} "
              f"weights: {tok.decode(got)!r}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
