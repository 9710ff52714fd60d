#!/usr/bin/env bash
# The moe-1t planner on this machine's CPU (issue goal: the busiest inference rank plans in
# <= 15 ms): N runs each of `plan --rank infer:0/0` and `--rank infer:7/15` (plan_ms), then the
# whole pair three times (plan_ms_max, plan_ms_total, fingerprints_agree, exact). Prints a table.
#   CLI=.gpu/awex-cli N=15 bash scripts/gpu_planner.sh
set -uo pipefail
CLI=${CLI:-.gpu/awex-cli}
N=${N:-15}
P="--model moe-1t --train megatron:tp=8,pp=8,dp=16,ep=32,etp=1 --infer sglang:tp=16,ep=16,engines=8"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u '+%Y-%m-%dT%H:%M:%SZ'); load $(cut -d' ' -f1-3 /proc/loadavg)"
for rank in infer:0/0 infer:7/15; do
  ms=()
  for _ in $(seq "$N"); do
    ms+=("$("$CLI" plan $P --rank "$rank" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["plan_ms"])')")
  done
  printf '%s\n' "${ms[@]}" | python3 -c '
import statistics, sys
v = sorted(float(x) for x in sys.stdin.read().split())
print(f"'"$rank"': plan_ms median {statistics.median(v):.2f} (min {v[0]:.2f}, max {v[-1]:.2f}) over {len(v)} runs")'
done
for _ in 1 2 3; do
  "$CLI" plan $P --json | python3 -c '
import json, sys
r = json.load(sys.stdin)
print("whole pair:", {k: r.get(k) for k in ("plan_ms_max", "plan_ms_total", "fingerprints_agree", "exact")})'
done
