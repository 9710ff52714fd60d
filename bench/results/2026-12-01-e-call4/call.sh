# fourth device call: qwen3-8b per-tensor sender, the defaults against other splits between the
# driver's copy and the tile kernel (dmN, dmoff), tile size and stream count, interleaved
set -u
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-per-tensor 8b-per-tensor-dm64-g 8b-per-tensor-dm256-g 8b-per-tensor-dmoff-g 8b-per-tensor-t32-g 8b-per-tensor-s8-g 8b-per-tensor-s32-g 8b-per-tensor-dm16-g 8b-per-tensor" timeout 500 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -24
