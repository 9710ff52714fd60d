#!/usr/bin/env bash
# The CUDA IPC data path on one GPU, in one call: the GPU-only tests, `awex-cli bench ipc`
# (small model first, then qwen3-8b with the stream/mode sweep), and the PyTorch baseline.
#
# Expects prebuilt x86-64 binaries in .gpu/ (built on the development machine):
#   cargo build --release -p awex-cli --features cuda && cp target/release/awex-cli .gpu/
#   cargo test --release -p awex-gpu --features cuda --lib --no-run   # prints the test binary
#   cp target/release/deps/awex_gpu-<hash> .gpu/awex-gpu-tests
# Logs and JSON go to $OUT (a temporary folder when unset); a summary is printed last.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
G=${AWEX_GPU_DIR:-.gpu}
MODEL=${MODEL:-qwen3-8b}
export PYTHONUNBUFFERED=1
status=0

echo "== environment"
{
  date -u '+%Y-%m-%dT%H:%M:%SZ'
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee "$OUT/env.txt"

echo "== GPU tests (ignored unless asked)"
timeout 180 "$G/awex-gpu-tests" --ignored --test-threads=1 cuda:: 2>&1 | tee "$OUT/gpu_tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== bench ipc, qwen3-0.6b (smoke)"
timeout 120 "$G/awex-cli" bench ipc --path copies --model qwen3-0.6b --updates 5 2>&1 | tee "$OUT/bench_small.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== bench ipc, $MODEL"
timeout 300 "$G/awex-cli" bench ipc --path copies --model "$MODEL" --train megatron:tp=1 --infer sglang:tp=1 \
  --updates 7 --gpu 0 --sweep --json >"$OUT/bench_ipc.json" 2>"$OUT/bench_ipc.err"
if [ $? != 0 ]; then
  status=1
  tail -5 "$OUT/bench_ipc.err"
  echo "== bench ipc, $MODEL, one copy per box (after the failure above)"
  timeout 300 "$G/awex-cli" bench ipc --path copies --model "$MODEL" --no-coalesce --sweep --json \
    >"$OUT/bench_ipc.json" 2>>"$OUT/bench_ipc.err"
fi
tail -5 "$OUT/bench_ipc.err"

echo "== bench ipc, $MODEL, sender with one allocation per tensor"
timeout 300 "$G/awex-cli" bench ipc --path copies --model "$MODEL" --sender-alloc per-tensor 2>&1 | tee "$OUT/bench_per_tensor.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== torch baseline"
timeout 300 python3 bench/torch_ipc_baseline.py --updates 7 --json \
  >"$OUT/torch_baseline.json" 2>"$OUT/torch_baseline.err"
[ $? = 0 ] || status=1
tail -5 "$OUT/torch_baseline.err"

echo "== summary"
python3 - "$OUT" <<'EOF'
import json, sys, os
out = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception as e:
        print(f"{n}: unreadable ({e})")
        return None
b, t = load("bench_ipc.json"), load("torch_baseline.json")
if b:
    d = b["descriptors"]
    print(f"awex  {b['model']} {b['training']} -> {b['inference']} on {b['device']}: {b['bytes']/1e9:.2f} GB, "
          f"{b['transfers']} transfers, {d['linear']}+{d['pitched_2d']}+{d['pitched_3d']} copies, {b['streams']} streams {b['mode']} {b['method']}, split {b['split_mb']} MiB")
    print(f"awex  first {b['first_update_ms']:.1f} ms (open {b['open_ms']:.1f}, copy {b['first_copy_ms']:.1f}); "
          f"steady {b['steady_median_ms']:.2f} ms ({b['steady_gbps']:.0f} GB/s); floor {b['floor_ms']:.2f} ms "
          f"({b['floor_gbps']:.0f} GB/s); ratio {b['ratio']:.3f} (x IPC one copy {b['ipc_ratio']:.3f}); verified {b['verified']}")
    print("awex  steady runs", " ".join(f"{x:.2f}" for x in b["steady_ms"]))
    for p in b["sweep"]:
        print(f"sweep {p['streams']} streams {p['mode']} {p['method']}{'' if p['coalesced'] else ' unmerged'} split {p['split_mb']} MiB: {p['median_ms']:.2f} ms")
for f in (b or {}).get("floors", []):
    print(f"floor {f['ms']:.2f} ms {f['gbps']:.0f} GB/s  {f['name']}")
if t:
    print(f"torch first {t['first_update_ms']:.1f} ms; steady {t['steady_median_ms']:.2f} ms; verified {t['verified']}")
if b and t:
    print(f"speed-up over torch: steady {t['steady_median_ms']/b['steady_median_ms']:.1f}x, "
          f"first {t['first_update_ms']/b['first_update_ms']:.1f}x")
EOF
exit $status
