#!/usr/bin/env bash
# On a 2-GPU machine: the nccl demo (verified, with checksums), a qwen3-8b timing run, and the
# raw NCCL send/recv floor, all in one call. Build first (here, not there):
#   cargo build --release -p awex-cli --features cuda && cp target/release/awex-cli .gpu/awex-cli-nccl
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
B=${AWEX_CLI:-.gpu/awex-cli-nccl}
export NCCL_NVLS_ENABLE=0
NCCL=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
[ -f "$NCCL" ] || NCCL=/usr/lib/x86_64-linux-gnu/libnccl.so.2
export AWEX_NCCL_LIBRARY=$NCCL
{ date -u; nvidia-smi -L; echo "AWEX_NCCL_LIBRARY=$NCCL"; } | tee "$OUT/env.txt"
echo "== tiny, checksums"
timeout 150 "$B" demo --transport nccl --model qwen3-tiny --train megatron:tp=1 --infer sglang:tp=1 \
  --train-gpus 0 --infer-gpus 1 --checksums --updates 2 --json 2>&1 | tee "$OUT/tiny.json"
echo "== qwen3-8b, timing"
timeout 200 "$B" demo --transport nccl --model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1 \
  --train-gpus 0 --infer-gpus 1 --updates 5 --json 2>&1 | tee "$OUT/8b.json"
echo "== raw NCCL floor"
timeout 120 python3 scripts/nccl_floor.py 4 2>&1 | tee "$OUT/floor.txt"
