#!/usr/bin/env bash
# Delta updates over cuda-ipc on one GPU, in one call: the diff kernel's GPU test, then
# `awex-cli bench ipc` dense against `--deltas` on the same synthetic optimiser steps (`--step`:
# the training ranks change a fraction of their bf16 elements by one ulp on the GPU between
# updates, outside the timed window), then `awex-cli demo --transport cuda-ipc --deltas --lr`
# (versions made by the calibrated Adam-like step, every byte of every update verified), and
# the delta wire kernels (`kernel`: their GPU tests, then `awex-cli bench delta-kernel`, the
# encode's read rate against a device copy on a qwen3-8b-sized bf16 buffer at 0 to 100 % steps),
# and the nccl transport's programs on one GPU (`nccl`: FP8 buckets packed by the kernel, delta
# frames encoded, sent by copy, gathered, applied and unpacked, transposed boxes included).
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
RUNS=${RUNS:-"tests kernel nccl dense0 dense1 delta1 delta0 delta3 delta01 pt-dense1 pt-delta1 demo-tiny demo-06-dense demo-06-delta demo-gptoss-sglang demo-gptoss-vllm"}
export NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1
status=0

echo "== environment"
{
  date -u '+%Y-%m-%dT%H:%M:%SZ'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nproc
} 2>&1 | tee "$OUT/env.txt"

bench() { # name timeout args...
  local name=$1 limit=$2
  shift 2
  echo "== bench $name: awex-cli bench ipc $*"
  local t0=$SECONDS
  timeout "$limit" "$BIN" bench ipc "$@" --json >"$OUT/bench_$name.json" 2>"$OUT/bench_$name.err"
  local rc=$?
  echo "exit $rc after $((SECONDS - t0)) s"
  [ $rc = 0 ] || { status=1; tail -c 2000 "$OUT/bench_$name.err"; }
}
demo() { # name timeout args...
  local name=$1 limit=$2
  shift 2
  echo "== demo $name: awex-cli demo --transport cuda-ipc --gpu 0 $*"
  local t0=$SECONDS
  timeout "$limit" "$BIN" demo --transport cuda-ipc --gpu 0 "$@" --json \
    >"$OUT/demo_$name.json" 2>"$OUT/demo_$name.err"
  local rc=$?
  echo "exit $rc after $((SECONDS - t0)) s"
  [ $rc = 0 ] || { status=1; tail -c 2000 "$OUT/demo_$name.err"; }
}
P8="--model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1 --updates 7"
for r in $RUNS; do
  case $r in
    tests) echo "== GPU tests"
      timeout 300 "$G/awex-gpu-tests" --ignored --test-threads=1 gpu_diff gpu_tile gpu_descriptors gpu_transpose \
        >"$OUT/gpu_tests.txt" 2>&1 || status=1
      tail -n 15 "$OUT/gpu_tests.txt" ;;
    kernel) echo "== delta wire kernels: GPU tests, then awex-cli bench delta-kernel"
      timeout 300 "$G/awex-gpu-tests" --ignored --test-threads=1 gpu_wire \
        >"$OUT/gpu_wire_tests.txt" 2>&1 || status=1
      tail -n 8 "$OUT/gpu_wire_tests.txt"
      t0=$SECONDS
      timeout 420 "$BIN" bench delta-kernel --json >"$OUT/kernel.json" 2>"$OUT/kernel.err"
      rc=$?
      echo "exit $rc after $((SECONDS - t0)) s"
      [ $rc = 0 ] || { status=1; tail -c 2000 "$OUT/kernel.err"; } ;;
    nccl) echo "== nccl programs on one GPU: FP8 buckets packed by the kernel; FP8 delta frames"
      timeout 300 "$G/nccl_program" --ignored --test-threads=1 --nocapture gpu_ \
        >"$OUT/nccl_program.txt" 2>&1 || status=1
      tail -n 12 "$OUT/nccl_program.txt" ;;
    dense0) bench $r 180 $P8 ;;
    dense1) bench $r 240 $P8 --step 0.01 ;;
    delta1) bench $r 240 $P8 --step 0.01 --deltas ;;
    delta0) bench $r 180 $P8 --deltas ;;
    delta3) bench $r 240 $P8 --step 0.03 --deltas ;;
    delta01) bench $r 240 $P8 --step 0.001 --deltas ;;
    pt-dense1) bench $r 240 $P8 --step 0.01 --sender-alloc per-tensor ;;
    pt-delta1) bench $r 240 $P8 --step 0.01 --deltas --sender-alloc per-tensor ;;
    demo-tiny) demo $r 240 --model qwen3-tiny --train megatron:tp=2 --infer sglang:tp=2,engines=2 --deltas --lr 1e-6 --updates 4 --checksums --atomic ;;
    demo-06-dense) demo $r 300 --model qwen3-0.6b --train megatron:tp=1 --infer sglang:tp=1 --lr 1e-6 --updates 6 ;;
    demo-06-delta) demo $r 300 --model qwen3-0.6b --train megatron:tp=1 --infer sglang:tp=1 --lr 1e-6 --updates 6 --deltas ;;
    # gpt-oss: its experts are transposed boxes (the transpose kernel), deltas on the rest
    demo-gptoss-sglang) demo $r 300 --model gpt-oss-tiny --train fsdp:dp=2,fused_experts=1 --infer sglang:tp=2 --updates 3 --checksums ;;
    demo-gptoss-vllm) demo $r 300 --model gpt-oss-tiny --train fsdp:dp=2,fused_experts=1 --infer vllm:tp=2,ep=2 --deltas --lr 1e-6 --updates 4 ;;
  esac
done

echo "== shared memory left behind"
ls /dev/shm | grep '^awex-' || echo none

echo "== summary"
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys, glob
out = sys.argv[1]
print("| run | deltas | step | first ms | steady ms (median) | runs | local floor ms | x floor | written GB / update | vectors differing | verified |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(os.path.join(out, "bench_*.json"))):
    try:
        b = json.load(open(f))
    except Exception as e:
        print(f"| {os.path.basename(f)} | unreadable: {e} |")
        continue
    w = b.get("steady_written_bytes") or [0]
    dv, dw = b.get("delta_vectors", 0), b.get("delta_changed_vectors", 0)
    print(f"| {os.path.basename(f)[6:-5]} | {b.get('deltas')} | {b.get('step')} | {b['first_update_ms']:.2f} | "
          f"{b['steady_median_ms']:.2f} | {' '.join(f'{m:.2f}' for m in b['steady_ms'])} | {b['floor_ms']:.2f} | "
          f"{b['ratio']:.3f} | {sum(w)/len(w)/1e9:.3f} | {dw}/{dv} ({100*dw/max(dv,1):.2f} %) | {b['verified']} |")
print()
k = os.path.join(out, "kernel.json")
if os.path.exists(k):
    try:
        r = json.load(open(k))
        print(f"bench delta-kernel: {r['device']} ({r['image']}), {r['bytes']} bytes in {r['segments']} segments")
        print("| step | changed % | frame % | copy ms | encode ms | encode read GB/s | ratio | decode ms | verified |")
        print("|---|---|---|---|---|---|---|---|---|")
        for s in r["steps"]:
            print(f"| {s['step']} | {100 * s.get('changed_fraction', 0):.3f} | {100 * s['frame_fraction']:.3f} | {s['copy_ms']:.3f} | {s['encode_ms']:.3f} | "
                  f"{s['encode_read_gbps']:.0f} | {s['encode_over_copy']:.3f} | {s['decode_ms']:.3f} | {s['verified']} |")
        print()
    except Exception as e:
        print(f"kernel.json: unreadable: {e}")
for f in sorted(glob.glob(os.path.join(out, "demo_*.json"))):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f"{os.path.basename(f)}: unreadable: {e}")
        continue
    ups = d.get("updates", [])
    rows = [f"v{u.get('version')}: {u.get('seconds', 0) * 1e3:.1f} ms (transfer {u.get('transfer_ms') or 0:.2f} ms), {u.get('bytes')} of {u.get('dense_bytes')} B, density {u.get('density')}" for u in ups]
    print(f"{os.path.basename(f)}: verified {d.get('verified')}; " + "; ".join(rows))
PY
# the device returns only a few files from $OUT: everything also goes back as one archive
tar -C "$OUT" -czf "$OUT/all.tgz" --exclude=all.tgz . 2>/dev/null || true
exit $status
