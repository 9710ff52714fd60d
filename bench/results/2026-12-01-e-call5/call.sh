mkdir -p $OUT && timeout 250 python3 scripts/gpu_vmm_probe.py > $OUT/probe.json 2> $OUT/probe.err
