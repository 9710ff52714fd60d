#!/usr/bin/env bash
# Conversions on the GPU, in one call: the element-wise kernel's GPU tests (its conversions
# against awex_core::dtype::convert, every bf16/f16 value and 16M f32 ones; converting and
# transposed boxes against the CPU copy), the nccl programs on one GPU (the sender's converting
# pack, sent by copy, as deltas), then `awex-cli bench ipc` and
# `awex-cli demo` of plans that convert (FSDP's bf16 `A_log` of Qwen3.5 into SGLang's fp32,
# every byte verified), regressions of plans that do not (gpt-oss's transposed experts,
# qwen3-8b), and the Qwen3.5-MoE shape in bf16: its 17 layers (30.6 GB) on any card, 34 layers
# (59.2 GB, about 30B parameters) where two copies fit (an H200).
#
# Expects prebuilt x86-64 binaries in .gpu/ (built on the development machine):
#   cargo build --release -p awex-cli --features cuda && cp target/release/awex-cli .gpu/ && strip .gpu/awex-cli
#   cargo test --release -p awex-gpu --features cuda --lib --no-run   # the binary -> .gpu/awex-gpu-tests
#   cargo test --release -p awex-runtime --features cuda --test nccl_program --no-run   # -> .gpu/nccl_program
# Env: RUNS picks the runs (default below); logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
G=${AWEX_GPU_DIR:-.gpu}
BIN=${AWEX_CLI:-$G/awex-cli}
R=bench/results/2026-12-06-ipc-convert
RUNS=${RUNS:-"tests nccl tiny-bench tiny-demo gptoss-bench e8b q17 q17b q34 q34b"}
export NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1
status=0
{
  date -u '+%Y-%m-%dT%H:%M:%SZ'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc
} 2>&1 | tee "$OUT/env.txt"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)

summary() { # the bench's JSON as one line
  python3 - "$1" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
    f = {x["name"]: x["ms"] for x in j["floors"]}
    fl = f.get("one copy, from the sender's memory")
    st = j["steady_median_ms"]
    print(f"  steady {st:.2f} ms, floor from the sender's memory {fl:.2f} ms, x {st/fl:.3f}, verified {j.get('verified')}")
except Exception as e:
    print(f"  no result ({e})")
PY
}
bench() { # name timeout args...
  local name=$1 limit=$2
  shift 2
  echo "== bench $name: awex-cli bench ipc $*"
  local t0=$SECONDS
  timeout "$limit" "$BIN" bench ipc "$@" --json >"$OUT/bench_$name.json" 2>"$OUT/bench_$name.err"
  local rc=$?
  echo "exit $rc after $((SECONDS - t0)) s"
  summary "$OUT/bench_$name.json"
  [ $rc = 0 ] || { status=1; tail -c 2000 "$OUT/bench_$name.err"; }
}
QP="--train fsdp:dp=1 --infer sglang:tp=1,fused_shared_experts=0 --sender-alloc per-tensor --updates 5"
for r in $RUNS; do
  case $r in
    tests) echo "== GPU tests"
      timeout 300 "$G/awex-gpu-tests" --ignored --test-threads=1 gpu_conversions gpu_transpose gpu_descriptors gpu_tile \
        >"$OUT/gpu_tests.txt" 2>&1 || status=1
      tail -n 8 "$OUT/gpu_tests.txt" ;;
    nccl) echo "== nccl programs on one GPU: converted pieces packed by the kernel, transposed, FP8"
      timeout 300 "$G/nccl_program" --ignored --test-threads=1 --nocapture gpu_ \
        >"$OUT/nccl_program.txt" 2>&1 || status=1
      tail -n 12 "$OUT/nccl_program.txt" ;;
    tiny-bench) bench $r 180 --model qwen3.5-moe-tiny $QP ;;
    tiny-demo) echo "== demo: qwen3.5-moe-tiny, fsdp bf16 -> sglang over cuda-ipc"
      timeout 300 "$BIN" demo --transport cuda-ipc --gpu 0 --model qwen3.5-moe-tiny --train fsdp:dp=1 \
        --infer sglang:tp=1 --json >"$OUT/demo_tiny.json" 2>"$OUT/demo_tiny.err" || { status=1; tail -c 2000 "$OUT/demo_tiny.err"; }
      python3 -c "import json; j=json.load(open('$OUT/demo_tiny.json')); print({k: j[k] for k in j if k in ('verified','updates','ok','checked')})" 2>&1 | head -3 ;;
    gptoss-bench) bench $r 180 --model gpt-oss-tiny --train fsdp:dp=1 --infer sglang:tp=1 --updates 5 ;;
    e8b) bench $r 240 --model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1 --sender-alloc per-tensor --updates 7 ;;
    q17|q17b) bench $r 400 --model $R/config-17.json $QP ;;
    q34|q34b) if [ "$mem" -gt 130000 ]; then bench $r 500 --model $R/config-34.json $QP; else echo "== $r: skipped ($mem MiB: two copies of 59 GB do not fit)"; fi ;;
    *) echo "unknown run $r"; status=1 ;;
  esac
done
exit $status
