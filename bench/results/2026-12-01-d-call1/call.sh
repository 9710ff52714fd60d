# device call of 2026-12-01 (20:45 UTC): the tile kernel (AWEX_IPC_KERNEL=tiles) against a launch
# per copy, on the product's path. Binaries built on the development machine:
#   cargo build --release -p awex-cli --features cuda && cp target/release/awex-cli .gpu/
#   cargo test --release -p awex-gpu --features cuda --lib --no-run   # -> .gpu/awex-gpu-tests
set -u
G=${AWEX_GPU_DIR:-.gpu}
echo "== GPU tests of the copy engine (the tile kernel's exactness first)"
timeout 60 "$G/awex-gpu-tests" --ignored --test-threads=1 gpu_tile_kernel gpu_descriptors_copy 2>&1 \
  | tail -8 | tee "$OUT/gpu_tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "the tile kernel failed its tests: no benchmark"; exit 1; }
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-contiguous-ktiles-g 8b-contiguous-kcopies-g 8b-per-tensor-ktiles-g \
  8b-contiguous-ktiles-t256 8b-per-tensor-kcopies-g 8b-contiguous-ktiles-t1024 moe-per-tensor-ktiles-g" \
  bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^== bench\|^== demo" | tail -40
echo "== the other GPU tests"
timeout 60 "$G/awex-gpu-tests" --ignored --test-threads=1 cuda::gpu_tests 2>&1 | tail -20 | tee "$OUT/gpu_tests_all.txt"
