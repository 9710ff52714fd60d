"""Raw NCCL send/recv bandwidth between GPU 0 and GPU 1 (the floor of awex's nccl transport).

Two processes, torch.distributed with the NCCL backend; rank 0 sends one large buffer to rank 1.
Prints the best and median GB/s over several repetitions.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GIB = 1 << 30


def run(rank: int, nbytes: int, reps: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(reps + 2):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
        else:
            dist.recv(buf, src=0)
        torch.cuda.synchronize()
        dist.barrier()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    if rank == 1:
        gbps = [nbytes / t / 1e9 for t in times]
        print(f"raw NCCL send/recv GPU0->GPU1, {nbytes / GIB:.0f} GiB: best {max(gbps):.1f} GB/s, "
              f"median {statistics.median(gbps):.1f} GB/s over {reps} reps (NCCL {torch.cuda.nccl.version()})",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    nbytes = int(float(sys.argv[1]) * GIB) if len(sys.argv) > 1 else 4 * GIB
    mp.spawn(run, args=(nbytes, 5), nprocs=2)
