# first device call: bench ipc and demo --transport cuda-ipc on the tile-kernel default, qwen3-8b
# and qwen3-30b-a3b, both senders, plus the PyTorch baseline (the demo/bench agreement of #16)
set -u
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-per-tensor 8b-contiguous moe-per-tensor moe-contiguous demo-tiny demo-8b demo-moe torch" timeout 560 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -40
