# eighth device call: the expandable sender with linear copies of at least 4 MiB through the
# driver's copy (AWEX_IPC_DRIVER_MIN_MIB=4), against the default for a span over 4 GiB (kernel)
set -u
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-expandable-dm4-g 8b-expandable moe-expandable-dm4-g" timeout 300 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -10
