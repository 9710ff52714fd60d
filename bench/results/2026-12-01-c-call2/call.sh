# second device call: largest-first issue as the default, confirmed against submission order;
# piece sizes for the one-buffer sender; the MoE demo against bench
set -u
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-per-tensor 8b-per-tensor-sub-g moe-per-tensor 8b-contiguous 8b-contiguous-p64-g 8b-contiguous-p128-g 8b-contiguous-p1024-g demo-moe" timeout 420 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -40
