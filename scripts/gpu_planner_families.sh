#!/usr/bin/env bash
# The new families' largest presets from FSDP2 at dp 256 (issue 41's planner goal: the slowest
# rank within 15 ms), and the 1T Megatron pair, on the machine this runs on: RUNS runs each of
# `plan --rank infer:0/0` and `--rank train:0` (plan_ms), alternated over the pairs and over
# the binaries in CLI (space-separated: a before and an after build compare in the same
# seconds), then a table of medians per binary.
#   CLI=".gpu/awex-cli-before .gpu/awex-cli" RUNS=5 bash scripts/gpu_planner_families.sh
set -uo pipefail
CLI=${CLI:-.gpu/awex-cli}
RUNS=${RUNS:-5}
pairs=(
  "qwen3.5-397b-a17b|fsdp:dp=256,fused_experts=1|sglang:tp=16,ep=16,engines=8"
  "qwen3.5-397b-a17b|fsdp:dp=256,fused_experts=1|vllm:tp=16,ep=16,engines=8"
  "qwen3-next-80b-a3b|fsdp:dp=256,fused_experts=1|sglang:tp=16,ep=16,engines=8,fused_shared_experts=1"
  "gpt-oss-120b|fsdp:dp=256|sglang:tp=16,engines=8"
  "gpt-oss-120b|fsdp:dp=256|vllm:tp=16,ep=16,engines=8"
  "qwen3.5-9b|fsdp:dp=256|sglang:tp=16,engines=8"
  "moe-1t|megatron:tp=8,pp=8,dp=16,ep=32,etp=1|sglang:tp=16,ep=16,engines=8"
)
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u '+%Y-%m-%dT%H:%M:%SZ'); load $(cut -d' ' -f1-3 /proc/loadavg)"
tmp=$(mktemp)
for _ in $(seq "$RUNS"); do
  for p in "${pairs[@]}"; do
    IFS='|' read -r model train infer <<<"$p"
    for rank in infer:0/0 train:0; do
      for cli in $CLI; do
        # the first line of the text output: "... 103488 transfers, ... (planned in 61.30 ms, fingerprint 801a...)"
        "$cli" plan --model "$model" --train "$train" --infer "$infer" --rank "$rank" | head -n 1 |
          sed -E "s#.* ([0-9]+) transfers?,.*planned in ([0-9.]+) ms, fingerprint ([0-9a-f]+).*#$(basename "$cli") $model ${infer%%:*} $rank \1 \2 \3#" >>"$tmp"
      done
    done
  done
done
python3 - "$tmp" <<'PY'
import statistics, sys, collections
runs, fps, n = collections.OrderedDict(), collections.defaultdict(set), {}
clis = []
for line in open(sys.argv[1]):
    cli, model, infer, rank, transfers, ms, fp = line.split()
    key = (model, infer, rank)
    runs.setdefault(key, collections.OrderedDict()).setdefault(cli, []).append(float(ms))
    fps[key].add(fp)
    n[key] = transfers
    if cli not in clis:
        clis.append(cli)
print("| model | inference | rank | transfers | " + " | ".join(f"{c}: median (min-max)" for c in clis) + " | fingerprint |")
print("|---" * (5 + len(clis)) + "|")
for k, per in runs.items():
    cells = [f"{statistics.median(per[c]):.2f} ({min(per[c]):.2f}-{max(per[c]):.2f})" if c in per else "-" for c in clis]
    print(f"| {k[0]} | {k[1]} | `{k[2]}` | {n[k]} | " + " | ".join(cells) + f" | {' '.join(sorted(fps[k]))} |")
PY
rm -f "$tmp"
