#!/usr/bin/env bash
# Device call 2 (2026-12-02, one H200): the FP8 kernel's GPU test with each layout named, and
# `bench fp8` + the torch comparison for deepgemm-ue8m0 (the recipe the test found differing).
set -u
exec > >(tee "$OUT/log.txt") 2>&1
G=.gpu
timeout 90 "$G/awex-gpu-tests" --ignored --test-threads=1 gpu_fp8 2>&1 | grep -v "^\s*[0-9, ]*$" | grep -o ".\{0,300\}" | grep -v "^ *left\|^ *right" | tail -15
mkdir -p "$OUT/d"
timeout 90 "$G/awex-cli" bench fp8 --recipe deepgemm-ue8m0 --shapes 1024x1024,300x520,4096x4096 --dump "$OUT/d" 2>&1 | tail -8
timeout 90 python3 scripts/gpu_fp8_check.py "$OUT/d" 2>&1 | tail -12
find "$OUT/d" -type f ! -name manifest.json -delete
