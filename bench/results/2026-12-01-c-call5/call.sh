# fifth device call: the new defaults (largest first, 16 streams), qwen3-8b both senders and
# qwen3-30b-a3b per-tensor, plus the MoE demo
set -u
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-per-tensor 8b-contiguous moe-per-tensor demo-moe" timeout 450 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -24
