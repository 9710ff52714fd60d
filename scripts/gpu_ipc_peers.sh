#!/usr/bin/env bash
# One device call on one H200: the cuda-ipc receiver's peer order, old against new in the same
# run. `AWEX_IPC_PEERS=sequential` replays a receiver's peers one after the other (the order
# before); `concurrent` (the default now) replays every peer's captured graph at once, each on
# its own stream. Runs alternate old / new, twice, so that a drift of the machine shows:
#   qwen3-8b and qwen3-30b-a3b per-tensor senders (one peer each: the order cannot matter, the
#   runs check that the new path is no slower), and qwen3-8b from Megatron tp=2 (two peers).
# The copy engine's GPU tests run first (the lanes' test among them); every bench verifies every
# destination byte after its first and last update.
#
# Binaries, built on the development machine at the commit under test:
#   cargo build --release -p awex-cli --features cuda && mkdir -p .gpu && cp target/release/awex-cli .gpu/ && strip .gpu/awex-cli
#   cargo test --release -p awex-gpu --features cuda --lib --no-run   # the binary it prints -> .gpu/awex-gpu-tests
# Call (the device tool; .gpu/ carried): OUT=$OUT bash scripts/gpu_ipc_peers.sh
set -u
OUT=${OUT:-$(mktemp -d)}
G=${AWEX_GPU_DIR:-.gpu}
echo "== GPU tests of the copy engine"
timeout 120 "$G/awex-gpu-tests" --ignored --test-threads=1 gpu_graphs_replayed_on_lanes gpu_tile_kernel gpu_descriptors_copy 2>&1 \
  | tail -8 | tee "$OUT/gpu_tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "the copy engine failed its tests: no benchmark"; exit 1; }
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-per-tensor-pseq-g 8b-per-tensor-pcon-g moe-per-tensor-pseq-g moe-per-tensor-pcon-g \
  8b-tp2-per-tensor-pseq-g 8b-tp2-per-tensor-pcon-g \
  8b-per-tensor-pcon-r2 8b-per-tensor-pseq-r2 moe-per-tensor-pcon-r2 moe-per-tensor-pseq-r2 \
  8b-tp2-per-tensor-pcon-r2 8b-tp2-per-tensor-pseq-r2" \
  bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^== bench\|^== demo" | tail -60
