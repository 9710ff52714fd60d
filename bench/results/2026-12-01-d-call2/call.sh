# second device call of 2026-12-01 (20:42 UTC, the machine of call 1, same binaries): smaller
# tiles, a repeat of the one-buffer pair, and qwen3-30b-a3b out of one buffer with tiles
mkdir -p $OUT/ipc && OUT=$OUT/ipc RUNS="8b-contiguous-ktiles-t32 8b-contiguous-ktiles-g 8b-contiguous-kcopies-g 8b-per-tensor-ktiles-g moe-contiguous-ktiles-g" bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^== bench\|^== demo" | tail -30
