#!/usr/bin/env bash
# FP8 rollouts over cuda-ipc on one GPU, in one call: the receiver's kernel quantises the blocks
# one training rank holds whole straight out of that rank's memory into the engine's e4m3
# tensors and scales (AWEX_IPC_FP8=fused, the default), or copies every FP8 tensor into a bf16
# device staging first and quantises that (staged). Runs, in order (RUNS picks; the default is
# all):
#   test      the ignored GPU tests of awex-runtime/tests/fp8_receive.rs, if .gpu/fp8_receive is
#             there (device staging quantised into the CPU reference's bytes for the four GPU
#             recipes; a NaN fails the update naming the tensor), and of
#             awex-runtime/tests/nccl_program.rs, if .gpu/nccl_program is there (nccl's FP8 path
#             without NCCL: training buckets packed by the kernel equal tcp's, unpacked into the
#             CPU reference's bytes)
#   kernel    awex-cli bench fp8: the single and the batch kernel against the CPU reference
#             (whole blocks, and edges: 300x520, DeepSeek-V3's 2112x7168) and a device copy
#   bench-8b  awex-cli bench ipc --infer-quant fp8, qwen3-8b, Megatron tp 1 -> SGLang tp 1,
#             per-tensor sender: every e4m3 byte and scale checked against the CPU reference,
#             the kernel alone and the in-run FP8 floor (read the bf16 once, write the e4m3 and
#             scales once, at the local device copy's rate) and the ratio
#   bench-8b-staged  the same with AWEX_IPC_FP8=staged (the kernel alone over the staging)
#   bench-moe the same for qwen3-30b-a3b into SGLang tp 1 (fused: the sender's 61 GB and the
#             receiver's 30 GB of e4m3; staged, the 60 GB of bf16 staging would pass the H200's
#             141 GB); bench-moe-one: the same out of a sender holding its tensors back to back
#             in one buffer (`--sender-alloc contiguous`: a layer's experts join into one kernel
#             job); bench-moe-tp2 (not in the default): into SGLang tp 2, rank 0/0
#   demo-8b   awex-cli demo --transport cuda-ipc --infer-quant fp8, qwen3-8b, 3 updates: the real
#             gateway flow, every byte of every update checked against the CPU reference
# and prints a short table last. The time limits (60 + 120 + 120 + 120 + 280 + 280 + 240 s) pass
# one device call's 10 minutes: run it in calls (e.g. RUNS="test kernel bench-8b bench-8b-staged",
# RUNS="bench-moe bench-moe-one", RUNS=demo-8b).
#
# Expects binaries built on the development machine:
#   cargo build --release -p awex-cli --features cuda && mkdir -p .gpu && cp target/release/awex-cli .gpu/
#   cp "$(cargo test --release -p awex-runtime --features cuda --test fp8_receive --no-run 2>&1 \
#        | sed -n 's/.*(\(.*fp8_receive-[0-9a-f]*\)).*/\1/p')" .gpu/fp8_receive      (optional)
#   the same for --test nccl_program into .gpu/nccl_program                          (optional)
# Logs and JSON go to $OUT (a temporary folder when unset), packed into $OUT/all.tar.gz.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
G=${AWEX_GPU_DIR:-.gpu}
BIN=${AWEX_CLI:-$G/awex-cli}
RUNS=${RUNS:-"test kernel bench-8b bench-8b-staged bench-moe bench-moe-one demo-8b"}
export NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1
status=0

echo "== environment"
{
  date -u '+%Y-%m-%dT%H:%M:%SZ'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc
  "$BIN" --version
} 2>&1 | tee "$OUT/env.txt"

bench() { # name timeout args...
  local name=$1 limit=$2
  shift 2
  echo "== bench $name: awex-cli bench ipc $* --json"
  local t0=$SECONDS
  timeout "$limit" "$BIN" bench ipc "$@" --json >"$OUT/bench_$name.json" 2>"$OUT/bench_$name.err"
  local rc=$?
  echo "exit $rc after $((SECONDS - t0)) s"
  [ $rc = 0 ] || { status=1; tail -c 2000 "$OUT/bench_$name.err"; }
}
demo() { # name timeout args...
  local name=$1 limit=$2
  shift 2
  echo "== demo $name: awex-cli demo --transport cuda-ipc --gpu 0 $* --json"
  local t0=$SECONDS
  timeout "$limit" "$BIN" demo --transport cuda-ipc --gpu 0 "$@" --json \
    >"$OUT/demo_$name.json" 2>"$OUT/demo_$name.err"
  local rc=$?
  echo "exit $rc after $((SECONDS - t0)) s"
  [ $rc = 0 ] || { status=1; tail -c 2000 "$OUT/demo_$name.err"; }
}
Q="--infer-quant fp8"
for r in $RUNS; do
  case $r in
    test)
      if [ -x "$G/fp8_receive" ]; then
        echo "== test: fp8_receive --ignored"
        timeout 60 "$G/fp8_receive" --ignored --test-threads=1 2>&1 | tee "$OUT/test.txt" | tail -12
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      else
        echo "== test: no $G/fp8_receive, skipped"
      fi
      if [ -x "$G/nccl_program" ]; then
        echo "== test: nccl_program --ignored"
        timeout 60 "$G/nccl_program" --ignored --test-threads=1 2>&1 | tee "$OUT/test_nccl.txt" | tail -12
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      else
        echo "== test: no $G/nccl_program, skipped"
      fi ;;
    kernel)
      echo "== kernel: awex-cli bench fp8"
      timeout 120 "$BIN" bench fp8 --shapes 4096x4096,qwen3-8b,300x520,2112x7168 --json \
        >"$OUT/kernel.json" 2>"$OUT/kernel.err" || { status=1; tail -c 2000 "$OUT/kernel.err"; }
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(s['name'], s['rows'], s['cols'], 'single', s['gpu_ms'], s['gpu_over_copy'], s['e4m3_mismatches'], s['scale_mismatches'], 'batch', s.get('batch_ms'), s.get('batch_over_copy'), s.get('batch_mismatches'), 'copy', s['copy_ms'], s['copy_gbps']) for s in r['shapes']]" "$OUT/kernel.json" | tee "$OUT/kernel.txt" ;;
    bench-8b) bench 8b 120 --model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1 \
      --sender-alloc per-tensor --updates 7 $Q ;;
    bench-8b-staged) AWEX_IPC_FP8=staged bench 8b-staged 120 --model qwen3-8b --train megatron:tp=1 \
      --infer sglang:tp=1 --sender-alloc per-tensor --updates 7 $Q ;;
    bench-moe) bench moe 280 --model qwen3-30b-a3b --train megatron:tp=1 --infer sglang:tp=1 \
      --sender-alloc per-tensor --updates 5 $Q ;;
    bench-moe-one) bench moe-one 280 --model qwen3-30b-a3b --train megatron:tp=1 --infer sglang:tp=1 \
      --sender-alloc contiguous --updates 5 $Q ;;
    bench-moe-tp2) bench moe-tp2 150 --model qwen3-30b-a3b --train megatron:tp=1 --infer sglang:tp=2 \
      --rank 0/0 --sender-alloc per-tensor --updates 5 $Q ;;
    demo-8b) demo 8b 240 --model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1 --updates 3 $Q ;;
  esac
done

echo "== shared memory left behind (then removed by awex-cli gc: segments of killed runs)"
ls /dev/shm | grep '^awex-' || echo none
"$BIN" gc

echo "== summary"
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys, glob
out = sys.argv[1]
t = os.path.join(out, "test.txt")
if os.path.exists(t):
    print("test:", " ".join(l.strip() for l in open(t) if l.startswith("test result")))
print("| run | bf16 in / e4m3 out GB | steady ms | FP8 floor ms | x floor | kernel alone ms | kernel x copy rate | local copy floor ms | verified |")
print("|---|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(os.path.join(out, "bench_*.json"))):
    try:
        b = json.load(open(f)); q = b["fp8"]
        print(f"| {b['model']} ({b['inference']} rank {b['rank']}) | {q['bf16_bytes']/1e9:.2f} / {q['e4m3_bytes']/1e9:.2f} "
              f"| {b['steady_median_ms']:.2f} | {q['floor_ms']:.2f} | {q['ratio']:.3f} | {q['kernel_ms']:.2f} | {q['kernel_vs_copy']:.2f} "
              f"| {b['floor_ms']:.2f} | {b['verified']} |")
        print(f"  fused tensors {q.get('fused_tensors')} staged {q.get('staged_tensors')} fused blocks {q.get('fused_blocks')} jobs {q.get('fused_jobs')} staging bytes {q.get('staging_bytes')}")
        print("  runs", " ".join(f"{x:.2f}" for x in b["steady_ms"]), "| kernel runs", " ".join(f"{x:.2f}" for x in q["kernel_runs_ms"]),
              "|", b["verify_detail"][:300])
    except Exception as e:
        print(f"| {os.path.basename(f)} | unreadable ({e}) |")
med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")
for f in sorted(glob.glob(os.path.join(out, "demo_*.json"))):
    try:
        d = json.load(open(f))
        ms = [u["seconds"] * 1e3 for u in d["updates"]]
        moved = [u["transfer_ms"] for u in d["updates"][1:] if u.get("transfer_ms") is not None]
        print(f"| {d['model']} demo, {len(ms)} updates | | {med(ms[1:]):.2f} (data plane {med(moved):.2f}) | | | | | | {d['verified']} |")
        print("  updates ms", " ".join(f"{x:.2f}" for x in ms), "| checks", json.dumps(d.get("checks"))[:400])
    except Exception as e:
        print(f"| {os.path.basename(f)} | unreadable ({e}) |")
PY
tar -C "$OUT" -czf "$OUT/all.tar.gz" --exclude all.tar.gz . 2>/dev/null
exit $status
