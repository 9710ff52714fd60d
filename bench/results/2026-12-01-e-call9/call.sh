# ninth device call: the new default for spans (large linear copies through the driver's copy),
# the expandable sender for qwen3-8b and qwen3-30b-a3b, and qwen3-8b per tensor beside it
set -u
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-expandable moe-expandable 8b-per-tensor" timeout 200 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -10
