#!/usr/bin/env bash
# The planner on the largest preset of issue 41 (Qwen3.5-397B, FSDP2 dp 256 with fused experts
# into 8 SGLang engines of tp 16 / ep 16), in one process per run, with the example
# `plan_timing` (awex-sim/examples/plan_timing.rs): for each build in BINS, alternated, REPS
# cold runs (the first plan of a process, as `awex-cli plan` and a connecting rank make it) of
# `infer:0/0` on 1 and 4 threads, the best of 10 in one process, and every inference rank once
# in one process (the slowest five). Each line has the plan's page faults: a page touched for
# the first time costs microseconds in a VM, and these machines are VMs.
#   cargo build --release -p awex-sim --example plan_timing
#   mkdir -p .gpu && cp target/release/examples/plan_timing .gpu/ && strip .gpu/plan_timing
#   BINS=".gpu/plan_timing-before .gpu/plan_timing" bash scripts/gpu_planner_timing.sh
set -uo pipefail
BINS=${BINS:-.gpu/plan_timing}
REPS=${REPS:-3}
M=${PAIR:-"qwen3.5-397b-a17b fsdp:dp=256,fused_experts=1 sglang:tp=16,ep=16,engines=8"}
echo "== $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%FT%TZ); load $(cut -d' ' -f1-3 /proc/loadavg)"
line() { grep -v "Transfer values" | sed 's/minor page faults while planning, per repetition/faults/' | tr '\n' ' '; }
for _ in $(seq "$REPS"); do
  for b in $BINS; do
    for t in 1 4; do
      echo "$(basename "$b") cold, $t thread(s): $("$b" $M 1 one 0/0 $t 2>&1 | line)"
    done
  done
done
for b in $BINS; do
  for t in 1 4; do
    echo "$(basename "$b") best of 10, $t thread(s): $("$b" $M 10 one 0/0 $t 2>&1 | line)"
  done
done
for b in $BINS; do
  echo "$(basename "$b"), every inference rank once in one process (default threads), slowest five:"
  "$b" $M 1 each 0/0 2>&1 | head -5
done
