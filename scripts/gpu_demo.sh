#!/usr/bin/env bash
# `awex-cli demo --transport cuda-ipc` on one GPU, in one call: every training and inference
# rank is its own process with its weights in GPU memory (all on GPU $GPU: the colocated case),
# updates go through the real gateway flow, and every inference rank downloads and checks
# every byte after every update.
#
# Expects a prebuilt x86-64 binary in .gpu/ (built on the development machine):
#   cargo build --release -p awex-cli --features cuda && mkdir -p .gpu && cp target/release/awex-cli .gpu/
# (AWEX_CLI=path runs another binary.)
# Runs the default model (qwen3-0.6b, megatron:tp=2,pp=2 -> sglang:tp=2,engines=2: 8
# processes), then qwen3-8b (megatron:tp=1 -> sglang:tp=1, 5 updates). Logs and JSON go to
# $OUT (a temporary folder when unset); a summary is printed last.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
G=${AWEX_GPU_DIR:-.gpu}
BIN=${AWEX_CLI:-$G/awex-cli}
GPU=${GPU:-0}
export RUST_BACKTRACE=1
status=0

echo "== environment"
{
  date -u '+%Y-%m-%dT%H:%M:%SZ'
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc
  "$BIN" --version
} 2>&1 | tee "$OUT/env.txt"

run() { # name timeout args...
  local name=$1 limit=$2
  shift 2
  echo "== demo $name: awex-cli demo --transport cuda-ipc --gpu $GPU $* --json"
  local t0=$SECONDS
  timeout "$limit" "$BIN" demo --transport cuda-ipc --gpu "$GPU" "$@" --json \
    >"$OUT/demo_$name.json" 2>"$OUT/demo_$name.err"
  local rc=$?
  echo "exit $rc after $((SECONDS - t0)) s"
  [ $rc = 0 ] || status=1
  tail -c 3000 "$OUT/demo_$name.err"
}

run small 150
run 8b 280 --model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1 --updates 5

echo "== shared memory left behind"
ls /dev/shm | grep '^awex-' || echo none

echo "== summary"
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
for name in ("small", "8b"):
    try:
        j = json.load(open(os.path.join(out, f"demo_{name}.json")))
    except Exception as e:
        print(f"{name}: no report ({e})")
        continue
    print(f"{j['model']} {j['training']} -> {j['inference']} over {j['transport']}: verified {j['verified']}, "
          f"device copy floor {j.get('device_copy_gbps', 0):.1f} GB/s, memcpy {j['memcpy_gbps']:.1f} GB/s, "
          f"ratio {j['ratio']:.4f}, leaked {j['leaked_segments']}, worker errors {j['worker_errors']}")
    for u in j["updates"]:
        print(f"  version {u['version']}: {u['seconds']:.4f} s, {u['bytes']/1e9:.3f} GB, {u['gbps']:.2f} GB/s, "
              f"verified {u['verified']}, attempts {u['attempts']}" + (f", error {u['error']}" if u.get("error") else ""))
EOF
exit $status
