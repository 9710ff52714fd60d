# third device call: qwen3-30b-a3b per-tensor, the default against 16 streams and the driver's
# copy for linear copies of at least 2 MiB (the 3 MiB experts)
set -u
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="moe-per-tensor moe-per-tensor-s16-g moe-per-tensor-dm2-g" timeout 400 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -20
