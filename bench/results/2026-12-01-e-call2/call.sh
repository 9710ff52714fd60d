# second device call: the GPU-only tests (the capture split by tiles) and the Python Writer into
# SGLang-layout tensors over cuda-ipc (awex.sglang.receive, bit-exact), on the same build
set -u
mkdir -p "$OUT/tests" "$OUT/loader"
timeout 200 .gpu/awex-gpu-tests --ignored --test-threads=1 cuda:: > "$OUT/tests/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"; tail -14 "$OUT/tests/gpu_tests.txt"
DIR=.gpu OUT="$OUT/loader" timeout 250 bash scripts/gpu_pynccl.sh > "$OUT/loader/run.txt" 2>&1; echo "loader rc=$?"; grep -E "VERIFIED|MISMATCH|Error|exit|ms" "$OUT/loader/run.txt" | head -20
