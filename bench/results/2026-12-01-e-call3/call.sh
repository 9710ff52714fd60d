# third device call, on the final binaries: the moe-1t planner; bench ipc and demo --transport
# cuda-ipc (the demo now reporting each update's data plane beside start-to-commit), both
# senders, both models, and the PyTorch baseline; the GPU-only tests; the Python Writer into
# SGLang-layout tensors over cuda-ipc, and a Writer on PyTorch's expandable segments
set -u
mkdir -p "$OUT/planner" "$OUT/ipc" "$OUT/tests" "$OUT/loader"
echo "== planner"; CLI=.gpu/awex-cli N=11 timeout 90 bash scripts/gpu_planner.sh 2>&1 | tee "$OUT/planner/planner.txt"
echo "== ipc"
OUT="$OUT/ipc" RUNS="8b-per-tensor 8b-contiguous moe-per-tensor moe-contiguous demo-tiny demo-8b demo-moe torch" timeout 400 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -24
echo "== GPU tests"
timeout 40 .gpu/awex-gpu-tests --ignored --test-threads=1 cuda:: > "$OUT/tests/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"; grep "test result" "$OUT/tests/gpu_tests.txt"
echo "== loader"
DIR=.gpu OUT="$OUT/loader" timeout 60 bash scripts/gpu_pynccl.sh > "$OUT/loader/run.txt" 2>&1; echo "loader rc=$?"; grep -E "VERIFIED|MISMATCH|EXPANDABLE|expandable segments:" "$OUT/loader/run.txt" | cut -c1-1500 | head -8
