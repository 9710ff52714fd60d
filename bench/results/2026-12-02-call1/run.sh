#!/usr/bin/env bash
# One device call on one H200 (2026-12-02): the GPU checks of this day's changes, in priority
# order, each under its own timeout, logs in $OUT/log.txt (a tarball of every output beside it):
#   1. the copy engine's GPU tests (among them the peers' graphs replayed on lanes at once);
#   2. `demo --transport cuda-ipc` qwen3-8b, 3 updates (the refactored transport end to end);
#   3. `bench ipc` qwen3-8b from Megatron tp=2 (two peers): the old peer order (pseq) against
#      the new (pcon) in the same run, alternated;
#   4. scripts/gpu_fp8_check.sh for the vllm recipe (the FP8 kernel through awex-cli's launch
#      path: bytes against the CPU reference and torch on CUDA, bandwidth against a device copy).
# Binaries in .gpu/ (release, --features cuda, stripped): awex-cli, awex-gpu-tests.
set -u
LOG=$OUT/log.txt
exec > >(tee "$LOG") 2>&1
G=.gpu
export NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
echo "== 1. copy engine GPU tests"; t0=$SECONDS
timeout 120 "$G/awex-gpu-tests" --ignored --test-threads=1 gpu_graphs_replayed_on_lanes gpu_tile_kernel gpu_descriptors_copy gpu_fp8 2>&1 | tail -12
echo "rc ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
echo "== 2. demo cuda-ipc qwen3-8b"; t0=$SECONDS
timeout 150 "$G/awex-cli" demo --transport cuda-ipc --gpu 0 --model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1 --updates 3 >"$OUT/demo.txt" 2>"$OUT/demo.err"
echo "rc $? in $((SECONDS - t0)) s"; tail -25 "$OUT/demo.txt"; tail -5 "$OUT/demo.err"
echo "== 3. bench ipc, two peers, old order vs new"; t0=$SECONDS
mkdir -p "$OUT/ipc"
OUT="$OUT/ipc" RUNS="8b-tp2-per-tensor-pseq-g 8b-tp2-per-tensor-pcon-g 8b-tp2-per-tensor-pseq-r2 8b-tp2-per-tensor-pcon-r2" \
  timeout 200 bash scripts/gpu_bench_ipc.sh 2>&1 | grep -v "^== bench\|^== demo" | tail -30
echo "in $((SECONDS - t0)) s"
echo "== 4. fp8 kernel (vllm)"; t0=$SECONDS
mkdir -p "$OUT/fp8"
CLI="$G/awex-cli"
timeout 120 "$CLI" bench fp8 --recipe vllm --shapes 4096x4096,qwen3-8b --dump "$OUT/fp8/d" 2>&1 | tail -20
echo "rc ${PIPESTATUS[0]}"
timeout 100 python3 scripts/gpu_fp8_check.py "$OUT/fp8/d" 2>&1 | tail -15
echo "rc ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
find "$OUT/fp8/d" -type f ! -name manifest.json -delete
tar czf "$OUT/all.tgz" -C "$OUT" --exclude=all.tgz --exclude=log.txt . 2>/dev/null
echo "== done"
