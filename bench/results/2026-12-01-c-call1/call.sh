# one device call: planner, loader check over cuda-ipc, IPC benchmarks (with and without
# largest-first issue), demo kill drills over cuda-ipc (in place and atomic)
set -u
mkdir -p "$OUT/planner" "$OUT/loader" "$OUT/ipc" "$OUT/drill"
echo "== planner"; CLI=.gpu/awex-cli N=15 timeout 120 bash scripts/gpu_planner.sh 2>&1 | tee "$OUT/planner/planner.txt"
echo "== loader"; DIR=.gpu OUT="$OUT/loader" timeout 150 bash scripts/gpu_pynccl.sh > "$OUT/loader/run.txt" 2>&1; echo "loader rc=$?"; grep -E "VERIFIED|MISMATCH|Error|exit" "$OUT/loader/run.txt" | head -8
echo "== drills"
for m in in-place atomic; do
  extra=""; [ $m = atomic ] && extra="--atomic"
  timeout 150 .gpu/awex-cli demo --transport cuda-ipc --gpu 0 --model qwen3-0.6b --train megatron:tp=2 --infer sglang:tp=1,engines=2 \
    --bucket-mib 1 --fault-kill-train-rank 1 --fault-version 2 --deadline-s 5 --json $extra > "$OUT/drill/$m.json" 2> "$OUT/drill/$m.err"
  echo "drill $m rc=$?"; python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('verified', r.get('verified'), [(u.get('version'), u.get('attempts'), u.get('verified')) for u in r.get('updates',[])])" "$OUT/drill/$m.json" 2>&1 | tail -1
done
echo "== ipc"
OUT="$OUT/ipc" RUNS="8b-per-tensor 8b-per-tensor-lpt-g moe-per-tensor moe-per-tensor-lpt-g 8b-contiguous 8b-contiguous-lpt-g" timeout 300 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -30
