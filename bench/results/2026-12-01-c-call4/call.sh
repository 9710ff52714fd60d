# fourth device call: 16 and 32 copy streams against the default 8, qwen3-8b and qwen3-30b-a3b
set -u
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-per-tensor-s16-g 8b-per-tensor 8b-contiguous-s16-g moe-per-tensor-s16-g moe-per-tensor-s32-g" timeout 450 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -24
