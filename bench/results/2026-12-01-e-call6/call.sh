# sixth device call (branch vmm-export): the Python Writer over cuda-ipc into SGLang-layout
# tensors, with the writer on cuMemAlloc memory and on PyTorch's expandable segments (shared as
# spans of cuMemMap chunks through file descriptors); the GPU tests; bench ipc and the demo on
# the changed control segment
set -u
mkdir -p "$OUT/loader" "$OUT/tests" "$OUT/ipc"
DIR=.gpu OUT="$OUT/loader" timeout 120 bash scripts/gpu_pynccl.sh > "$OUT/loader/run.txt" 2>&1; echo "loader rc=$?"; grep -E "VERIFIED|MISMATCH|Error|rank exited|expandable" "$OUT/loader/run.txt" | cut -c1-600 | head -12
python3 -c "import json; s=json.load(open('$OUT/loader/summary.json')); print(json.dumps(s.get('expandable_segments'), indent=1))" 2>&1 | head -40
timeout 40 .gpu/awex-gpu-tests --ignored --test-threads=1 cuda:: > "$OUT/tests/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"; grep "test result\|FAILED\|panicked" "$OUT/tests/gpu_tests.txt" | head
OUT="$OUT/ipc" RUNS="8b-per-tensor 8b-contiguous demo-tiny demo-8b" timeout 200 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -10
