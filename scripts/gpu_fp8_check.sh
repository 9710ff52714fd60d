#!/usr/bin/env bash
# The block-FP8 quantising kernel on a GPU machine, in one call of a few minutes; builds
# nothing (it needs a release awex-cli built with `--features cuda`, python3 with torch + CUDA):
#
#   1. `awex-cli bench fp8` for each recipe the kernel runs: the kernel's e4m3 bytes and scales
#      against awex's CPU reference on 4096x4096 and Qwen3-8B's layer shapes (fused qkv, o,
#      gate_up, down; vllm) or 4096x4096 and a 300x520 matrix with partial blocks (the others),
#      and its bandwidth (bytes read + written) against a device-to-device copy of the same
#      bf16 bytes measured in the same run;
#   2. scripts/gpu_fp8_check.py: the same matrices through the torch references on CUDA
#      (engines/fp8_refs.py; vLLM's eager and under torch.compile), byte for byte against both;
#   3. engines/fp8_refs.py --device cpu --device cuda: the digests awex-core's
#      tests/fp8_reference.rs checks (copy $OUT/fp8_reference.json over
#      awex-core/tests/fixtures/fp8_reference.json to refresh them).
#
#   scripts/gpu_fp8_check.sh [AWEX_CLI]     (default target/release/awex-cli)
#   OUT=DIR keeps the dumps and digests (default: a temporary directory); PYTHON=python3.
# Exits non-zero when any byte differs or a step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
CLI=${1:-target/release/awex-cli}
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
status=0
"$PY" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))' || exit 1
for recipe in vllm deepgemm-ue8m0 deepgemm-legacy awex-python; do
  shapes=4096x4096,300x520
  [ "$recipe" = vllm ] && shapes=4096x4096,qwen3-8b
  echo "-- awex-cli bench fp8 --recipe $recipe --shapes $shapes"
  "$CLI" bench fp8 --recipe "$recipe" --shapes "$shapes" --dump "$OUT/fp8-$recipe" || status=1
  echo "-- torch references on CUDA ($recipe)"
  "$PY" scripts/gpu_fp8_check.py "$OUT/fp8-$recipe" || status=1
  # the dumps are large; keep only the manifest
  find "$OUT/fp8-$recipe" -type f ! -name manifest.json -delete
done
echo "-- digests of the shared test matrices (engines/fp8_refs.py)"
"$PY" engines/fp8_refs.py --device cpu --device cuda --out "$OUT/fp8_reference.json" || status=1
echo "-- results in $OUT (status $status)"
exit "$status"
