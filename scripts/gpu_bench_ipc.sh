#!/usr/bin/env bash
# `awex-cli bench ipc` on the product's path (the rank runtime's cuda-ipc transport on both
# ends, real plans, two processes) and `awex-cli demo --transport cuda-ipc` (the real gateway
# flow) on one GPU, in one call, for qwen3-8b and qwen3-30b-a3b; the table is printed last.
#
# Expects a prebuilt x86-64 binary in .gpu/ (built on the development machine):
#   cargo build --release -p awex-cli --features cuda && mkdir -p .gpu && cp target/release/awex-cli .gpu/
# Env: RUNS="8b-per-tensor 8b-contiguous 8b-expandable moe-contiguous moe-per-tensor moe-expandable
# mla-per-tensor mla-contiguous demo-8b demo-moe demo-mla torch"
# picks the runs; CUBIN=1 also compiles the copy kernel for sm_90 with the machine's ptxas
# (written to $OUT/copy_rows.sm_90.cubin). Logs and JSON go to $OUT (a temporary folder when unset).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
G=${AWEX_GPU_DIR:-.gpu}
BIN=${AWEX_CLI:-$G/awex-cli}
RUNS=${RUNS:-"8b-per-tensor 8b-contiguous moe-contiguous moe-per-tensor demo-8b demo-moe"}
export NCCL_NVLS_ENABLE=0 RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
status=0

echo "== environment"
{
  date -u '+%Y-%m-%dT%H:%M:%SZ'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nproc
} 2>&1 | tee "$OUT/env.txt"

if [ "${CUBIN:-0}" = 1 ]; then
  echo "== ptxas: the copy kernel for sm_90"
  P=$(command -v ptxas || ls /usr/local/cuda*/bin/ptxas 2>/dev/null | head -1)
  echo "ptxas: ${P:-none}"
  [ -n "$P" ] && "$P" --version | tail -1 && \
    "$P" -arch=sm_90 -O3 ${PTX:-awex-gpu/src/cuda/copy_rows.ptx} -o "$OUT/copy_rows.sm_90.cubin" && \
    ls -l "$OUT/copy_rows.sm_90.cubin"
fi

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
P8="--model qwen3-8b --train megatron:tp=1 --infer sglang:tp=1"
PM="--model qwen3-30b-a3b --train megatron:tp=1 --infer sglang:tp=1"
# an MLA + MoE model of 30B (DeepSeek-V3's shape; SGLang fuses the shared expert at ep 1 on H200)
PL="--model mla-moe-30b --train megatron:tp=1 --infer sglang:tp=1,fused_shared_experts=1"
for r in $RUNS; do
  case $r in
    8b-per-tensor) bench 8b-per-tensor 120 $P8 --sender-alloc per-tensor --updates 7 ;;
    8b-contiguous) bench 8b-contiguous 120 $P8 --sender-alloc contiguous --updates 7 ;;
    # 8b-<alloc>-<opts> with opts among dmN (linear copies of at least N MiB through the driver's
    # device copy, AWEX_IPC_DRIVER_MIN_MIB; dmoff: never), sN (N copy streams, AWEX_IPC_STREAMS),
    # g (every batch in a CUDA graph, AWEX_IPC_GRAPH_MIN=1), lpt / sub (copies issued largest
    # first, the default, or in submission order: AWEX_IPC_ORDER), pN (linear copies cut into
    # N MiB pieces, AWEX_IPC_SPLIT_MIB), np (no pitched copies: AWEX_IPC_MERGE_PITCHED=0),
    # ktiles / kcopies (a graph's kernel copies in one launch of the tile kernel, or a launch
    # per copy: AWEX_IPC_KERNEL), tN (tiles of N KiB, AWEX_IPC_TILE_KIB), pseq / pcon (a
    # receiver's peers one after the other, or all at once: AWEX_IPC_PEERS), rN (a repeat,
    # nothing set), e.g. 8b-per-tensor-dm1-g-s8, 8b-per-tensor-sub-g, 8b-contiguous-ktiles-t256;
    # 8b-tp2-<alloc>-<opts>: qwen3-8b from 2 training ranks (Megatron tp=2), so 2 peers
    8b-per-tensor-*-*|8b-contiguous-*-*|8b-expandable-*-*|moe-per-tensor-*-*|moe-contiguous-*-*|moe-expandable-*-*|8b-tp2-per-tensor-*-*|8b-tp2-contiguous-*-*)
      case $r in
        8b-tp2-*) base="--model qwen3-8b --train megatron:tp=2 --infer sglang:tp=1" n=7 lim=120 ;;
        8b-*) base=$P8 n=7 lim=120 ;;
        *) base=$PM n=5 lim=240 ;;
      esac
      case $r in *-per-tensor-*) alloc=per-tensor ;; *-expandable-*) alloc=expandable ;; *) alloc=contiguous ;; esac
      envs=()
      for o in $(echo "${r#*-$alloc-}" | tr - ' '); do
        case $o in
          dm*) envs+=("AWEX_IPC_DRIVER_MIN_MIB=${o#dm}") ;;
          sub) envs+=("AWEX_IPC_ORDER=submission") ;;
          pseq) envs+=("AWEX_IPC_PEERS=sequential") ;;
          pcon) envs+=("AWEX_IPC_PEERS=concurrent") ;;
          r[0-9]*) ;;
          s*) envs+=("AWEX_IPC_STREAMS=${o#s}") ;;
          g) envs+=("AWEX_IPC_GRAPH_MIN=1") ;;
          lpt) envs+=("AWEX_IPC_ORDER=largest") ;;
          np) envs+=("AWEX_IPC_MERGE_PITCHED=0") ;;
          ktiles) envs+=("AWEX_IPC_KERNEL=tiles") ;;
          kcopies) envs+=("AWEX_IPC_KERNEL=copies") ;;
          t*) envs+=("AWEX_IPC_TILE_KIB=${o#t}") ;;
          p*) envs+=("AWEX_IPC_SPLIT_MIB=${o#p}") ;;
        esac
      done
      ( [ ${#envs[@]} = 0 ] || export "${envs[@]}"; bench "$r" "$lim" $base --sender-alloc $alloc --updates $n ) || status=1 ;;
    # -dmN: linear copies of at least N MiB through the driver's device copy (AWEX_IPC_DRIVER_MIN_MIB)
    8b-per-tensor-dm*) AWEX_IPC_DRIVER_MIN_MIB=${r##*-dm} bench $r 120 $P8 --sender-alloc per-tensor --updates 7 ;;
    8b-contiguous-dm*) AWEX_IPC_DRIVER_MIN_MIB=${r##*-dm} bench $r 120 $P8 --sender-alloc contiguous --updates 7 ;;
    moe-per-tensor-dm*) AWEX_IPC_DRIVER_MIN_MIB=${r##*-dm} bench $r 240 $PM --sender-alloc per-tensor --updates 5 ;;
    moe-contiguous-dm*) AWEX_IPC_DRIVER_MIN_MIB=${r##*-dm} bench $r 240 $PM --sender-alloc contiguous --updates 5 ;;
    demo-8b-dm*) AWEX_IPC_DRIVER_MIN_MIB=${r##*-dm} demo $r 200 $P8 --updates 5 ;;
    demo-moe-dm*) AWEX_IPC_DRIVER_MIN_MIB=${r##*-dm} demo $r 300 $PM --updates 3 ;;
    8b-per-tensor-driver) AWEX_IPC_COPY=driver bench 8b-per-tensor-driver 120 $P8 --sender-alloc per-tensor --updates 7 --no-verify ;;
    8b-per-tensor-s8) AWEX_IPC_STREAMS=8 bench 8b-per-tensor-s8 120 $P8 --sender-alloc per-tensor --updates 7 --no-verify ;;
    8b-contiguous-driver) AWEX_IPC_COPY=driver bench 8b-contiguous-driver 120 $P8 --sender-alloc contiguous --updates 7 --no-verify ;;
    moe-contiguous) bench moe-contiguous 240 $PM --sender-alloc contiguous --updates 5 ;;
    # one buffer of 20 MiB cuMemCreate chunks (PyTorch's expandable segments), shared as spans
    8b-expandable) bench 8b-expandable 120 $P8 --sender-alloc expandable --updates 7 ;;
    moe-expandable) bench moe-expandable 240 $PM --sender-alloc expandable --updates 5 ;;
    moe-per-tensor) bench moe-per-tensor 240 $PM --sender-alloc per-tensor --updates 5 ;;
    mla-per-tensor) bench mla-per-tensor 240 $PL --sender-alloc per-tensor --updates 5 ;;
    mla-contiguous) bench mla-contiguous 240 $PL --sender-alloc contiguous --updates 5 ;;
    demo-mla) demo mla 300 $PL --updates 3 ;;
    moe-per-tensor-t8) AWEX_IPC_OPEN_THREADS=8 bench moe-per-tensor-t8 240 $PM --sender-alloc per-tensor --updates 3 --no-verify ;;
    demo-tiny) demo tiny 120 --model qwen3-tiny --train megatron:tp=1 --infer sglang:tp=1 --updates 7 ;;
    demo-8b) demo 8b 200 $P8 --updates 5 ;;
    demo-moe) demo moe 300 $PM --updates 3 ;;
    torch) echo "== torch baseline"
      timeout 200 python3 bench/torch_ipc_baseline.py --updates 7 --json >"$OUT/torch.json" 2>"$OUT/torch.err" || status=1 ;;
  esac
done

echo "== shared memory left behind (then removed by awex-cli gc: segments of killed runs)"
ls /dev/shm | grep '^awex-' || echo none
"$BIN" gc

echo "== summary"
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys, glob
out = sys.argv[1]
print("| run | sender | join ms | first ms | steady ms (median) | floor local / sender mem ms | x local / x sender | copies (unjoined) | extra MiB | verified |")
print("|---|---|---|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(os.path.join(out, "bench_*.json"))):
    try:
        b = json.load(open(f))
    except Exception as e:
        print(f"| {os.path.basename(f)} | unreadable ({e}) |"); continue
    j = b["join"]; n = lambda d: d["linear"] + d["pitched_2d"] + d["pitched_3d"]
    print(f"| {os.path.basename(f)[6:-5]} ({b['model']}) | {b['sender_alloc']}, {b['sender_allocations']} allocs | {b['join_ms']:.1f} "
          f"(open {j['open_ms']:.1f}/{j['open_threads']}t, engine {j['engine_ms']:.1f} {j['kernel_image']}, warm {j['warm_up_ms']:.1f}, descs {j['descs_ms']:.1f}"
          f"{', %d tiled in %d tiles, table %.1f MiB' % (j['tiled_copies'], j['tiles'], j['tile_table_bytes'] / 2**20) if j.get('tiles') else ''}) "
          f"| {b['first_update_ms']:.2f} | {b['steady_median_ms']:.2f} | {b['floor_ms']:.2f} / {b['ipc_floor_ms']:.2f} "
          f"| {b['ratio']:.3f} / {b['ipc_ratio']:.3f} | {n(j['descriptors'])} ({n(j['descriptors_unjoined'])}) "
          f"| {b['extra_device_bytes']/2**20:.1f} | {b['verified']} |")
    print("  runs", " ".join(f"{x:.2f}" for x in b["steady_ms"]), "| floors", "; ".join(f"{x['name']}: {x['ms']:.2f}" for x in b["floors"]))
# the per-tensor bench of each model: what the demo's data plane is compared with
bench_of = {}
for f in glob.glob(os.path.join(out, "bench_*.json")):
    try:
        b = json.load(open(f))
    except Exception:
        continue
    if os.path.basename(f)[6:-5] in ("8b-per-tensor", "moe-per-tensor"):
        bench_of[b["model"]] = b["steady_median_ms"]
med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")
for f in sorted(glob.glob(os.path.join(out, "demo_*.json"))):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f"| {os.path.basename(f)} | unreadable ({e}) |"); continue
    ms = [u["seconds"] * 1e3 for u in d["updates"]]
    moved = [u["transfer_ms"] for u in d["updates"][1:] if u.get("transfer_ms") is not None]
    b = bench_of.get(d["model"])
    vs = f"; data plane {med(moved):.2f} ms, {med(moved) / b - 1:+.1%} against bench {b:.2f}" if b and moved else ""
    print(f"| {d['model']} demo | per-tensor | {d.get('join_ms', float('nan')):.1f} (whole pair) | {d.get('first_update_ms', ms[0]):.2f} "
          f"| {med(ms[1:]):.2f} | device copy {d.get('device_copy_gbps', 0):.0f} GB/s{vs} | | | | {d['verified']} |")
    print("  updates ms", " ".join(f"{x:.2f}" for x in ms), "| data plane ms",
          " ".join("-" if u.get("transfer_ms") is None else f"{u['transfer_ms']:.2f}" for u in d["updates"]))
t = os.path.join(out, "torch.json")
if os.path.exists(t):
    try:
        t = json.load(open(t)); print(f"torch baseline: first {t['first_update_ms']:.1f} ms, steady {t['steady_median_ms']:.2f} ms, verified {t['verified']}")
    except Exception as e:
        print("torch: unreadable", e)
PY
# every log and report in one file (the device tool brings back few files)
tar -C "$OUT" -czf "$OUT/all.tar.gz" --exclude all.tar.gz --exclude '*.cubin' . 2>/dev/null
find "$OUT" -maxdepth 1 -type f ! -name all.tar.gz ! -name '*.cubin' ! -name summary.txt -delete
exit $status
