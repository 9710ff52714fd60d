#!/usr/bin/env bash
# `awex-cli bench ipc` of the ~30B Qwen3.5-MoE shape (bench/results/2026-12-05-qwen3.5-moe/config.json,
# fp32, 61 GB; QCONFIG=config-7-layers.json beside this script for an 80 GB GPU) and qwen3-8b,
# with the experts' 4 MiB copies through the driver (AWEX_IPC_DRIVER_MIN_MIB=4, the default
# before) or the copy kernel (16, the default now, or `-`: no setting), alternated.
# RUNS: name:setting pairs, q-* the Qwen3.5-MoE shape, e-* qwen3-8b.
# Run on one H200 from the repository root with a stripped awex-cli in .gpu/; outputs to $OUT.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
BIN=${AWEX_CLI:-.gpu/awex-cli}
export NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1
{ date -u '+%Y-%m-%dT%H:%M:%SZ'; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; } | tee "$OUT/env.txt"
Q="--model ${QCONFIG:-bench/results/2026-12-05-qwen3.5-moe/config.json} --train fsdp:dp=1 --infer sglang:tp=1,fused_shared_experts=0"
P8="--model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1"
run() { # name driver_min_mib(or -) args...
  local name=$1 dm=$2; shift 2
  local t0=$SECONDS
  if [ "$dm" = - ]; then
    timeout 400 "$BIN" bench ipc "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.err"
  else
    AWEX_IPC_DRIVER_MIN_MIB=$dm timeout 400 "$BIN" bench ipc "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.err"
  fi
  local rc=$?
  python3 - "$OUT/$name.json" "$name" "$rc" "$((SECONDS - t0))" <<'PY'
import json, sys
p, name, rc, s = sys.argv[1:]
try:
    j = json.load(open(p))
    f = {x["name"]: x["ms"] for x in j["floors"]}
    fl = f.get("one copy, from the sender's memory")
    st = j["steady_median_ms"]
    print(f"{name}: rc {rc} {s}s steady {st:.2f} ms floor {fl:.2f} x {st/fl:.3f} driver {j['join']['driver_copies']} tiled {j['join']['tiled_copies']} verified {j.get('verified')}")
except Exception as e:
    print(f"{name}: rc {rc} {s}s no result ({e})")
PY
  if [ $rc = 0 ]; then rm -f "$OUT/$name.err"; else tail -c 1500 "$OUT/$name.err"; fi
}
for r in ${RUNS:-"q-dm4:4 q-dm16:16 q-dm4b:4 q-dm16b:16 q-dmoff:off e-dm4:4 e-dm16:16 e-dm4b:4 e-dm16b:16"}; do
  name=${r%%:*} dm=${r#*:}
  case $name in
    q-*) run "$name" "$dm" $Q --sender-alloc per-tensor --updates 5 ;;
    e-*) run "$name" "$dm" $P8 --sender-alloc per-tensor --updates 7 ;;
  esac
done
