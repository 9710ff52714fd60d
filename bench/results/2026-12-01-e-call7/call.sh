# seventh device call: bench ipc with the sender on 20 MiB cuMemCreate chunks (PyTorch's
# expandable segments), shared as spans through file descriptors, against cuMemAlloc buffers;
# qwen3-8b and qwen3-30b-a3b; the GPU tests
set -u
mkdir -p "$OUT/ipc" "$OUT/tests"
ulimit -n; ulimit -Hn
timeout 40 .gpu/awex-gpu-tests --ignored --test-threads=1 cuda:: > "$OUT/tests/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"; grep "test result\|FAILED\|panicked" "$OUT/tests/gpu_tests.txt" | head
OUT="$OUT/ipc" RUNS="8b-expandable 8b-contiguous 8b-per-tensor moe-expandable" timeout 400 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^exit 0\|^== bench\|^== demo" | tail -14
