#!/usr/bin/env bash
# The new families' largest presets from FSDP2 at dp 256 (issue 41's planner goal: the slowest
# rank within 15 ms) on the machine this runs on: RUNS runs each of `plan --rank infer:0/0` and
# `--rank train:0` (plan_ms), alternated over the pairs, then a table of medians.
#   CLI=.gpu/awex-cli RUNS=5 bash scripts/gpu_planner_families.sh
set -uo pipefail
CLI=${CLI:-.gpu/awex-cli}
RUNS=${RUNS:-5}
pairs=(
  "qwen3.5-397b-a17b|fsdp:dp=256,fused_experts=1|sglang:tp=16,ep=16,engines=8"
  "qwen3.5-397b-a17b|fsdp:dp=256,fused_experts=1|vllm:tp=16,ep=16,engines=8"
  "qwen3-next-80b-a3b|fsdp:dp=256,fused_experts=1|sglang:tp=16,ep=16,engines=8"
  "gpt-oss-120b|fsdp:dp=256|sglang:tp=16,engines=8"
  "qwen3.5-9b|fsdp:dp=256|sglang:tp=16,engines=8"
  "moe-1t|megatron:tp=8,pp=8,dp=16,ep=32,etp=1|sglang:tp=16,ep=16,engines=8"
)
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u '+%Y-%m-%dT%H:%M:%SZ'); load $(cut -d' ' -f1-3 /proc/loadavg)"
tmp=$(mktemp)
for _ in $(seq "$RUNS"); do
  for p in "${pairs[@]}"; do
    IFS='|' read -r model train infer <<<"$p"
    for rank in infer:0/0 train:0; do
      # the first line of the text output: "... (planned in 61.30 ms, fingerprint 801a...)"
      "$CLI" plan --model "$model" --train "$train" --infer "$infer" --rank "$rank" | head -n 1 |
        sed -E "s#.*planned in ([0-9.]+) ms, fingerprint ([0-9a-f]+).*#$model $infer $rank \1 \2#" >>"$tmp"
    done
  done
done
python3 - "$tmp" <<'PY'
import statistics, sys, collections
runs, fps = collections.OrderedDict(), {}
for line in open(sys.argv[1]):
    *key, ms, fp = line.split()
    runs.setdefault(" ".join(key), []).append(float(ms))
    fps.setdefault(" ".join(key), set()).add(fp)
print("| model, inference, rank | plan_ms median | min | max | runs | fingerprint |")
print("|---|---|---|---|---|---|")
for k, v in runs.items():
    print(f"| {k} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} | {' '.join(f'{x:.1f}' for x in v)} | {' '.join(sorted(fps[k]))} |")
PY
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
