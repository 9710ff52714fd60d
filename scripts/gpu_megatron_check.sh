#!/usr/bin/env bash
# A real Megatron-Core GPTModel (TP=1, local spec) on one GPU updates SGLang-layout torch CUDA
# tensors through the `awex` Python package over the colocated cuda-ipc transport, verified
# bit for bit (scripts/gpu_megatron_check.py says how).
#
# Expects the wheels in .whl/ (built and downloaded on the development machine):
#   target/awex-py-venv/bin/maturin build --release -m awex-py/Cargo.toml --features cuda \
#     -i target/awex-py-venv/bin/python --out .whl         # awex-...-cp310-abi3-manylinux_2_34
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2
# Logs go to $OUT (a temporary folder when unset).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1 AWEX_CHECK_DIR=${AWEX_CHECK_DIR:-/tmp/awex-megatron-check}

echo "== environment"
{
  date -u '+%Y-%m-%dT%H:%M:%SZ'
  nvidia-smi -L
  python3 --version
  ls -1 .whl
} 2>&1 | tee "$OUT/env.txt"

echo "== install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import torch, awex, megatron.core as m; from awex import _awex; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "| megatron-core", m.__version__, "| awex", awex.__version__, "cuda build", _awex.CUDA)' 2>&1 | tee -a "$OUT/env.txt"

echo "== check"
t0=$SECONDS
timeout 360 python3 scripts/gpu_megatron_check.py 2>&1 | tee "$OUT/check.log"
rc=${PIPESTATUS[0]}
echo "exit $rc after $((SECONDS - t0)) s"
cp "$AWEX_CHECK_DIR/result.json" "$OUT/" 2>/dev/null
echo "== shared memory left behind"
ls /dev/shm | grep '^awex-' || echo none
exit $rc
