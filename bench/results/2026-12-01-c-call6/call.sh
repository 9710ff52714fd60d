# sixth device call: pitched 2-D copies (the regrouped qkv) against one linear copy per box
set -u
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-contiguous 8b-contiguous-np-g 8b-per-tensor-np-g 8b-per-tensor" timeout 300 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -20
