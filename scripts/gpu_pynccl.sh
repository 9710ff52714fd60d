#!/usr/bin/env bash
# One GPU: the Python Writer over cuda-ipc into SGLang-layout tensors through awex.sglang.receive
# (bit-exact), and the Python NCCL path as far as one GPU allows (scripts/gpu_pynccl.py says how).
#
# Expects in $DIR (default .gpu/): the awex wheel built with the cuda feature,
#   maturin build --release -m awex-py/Cargo.toml --features cuda --out .gpu
# and, optionally, sglang_receive.py: an awex/sglang.py carrying `receive` (when the wheel's
# lacks it). Logs go to $OUT (a temporary folder when unset).
set -uo pipefail
DIR=${DIR:-.gpu}
OUT=${OUT:-$(mktemp -d)}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 RUST_BACKTRACE=1 AWEX_CHECK_DIR=${AWEX_CHECK_DIR:-/tmp/awex-pynccl-check}
{
  date -u '+%Y-%m-%dT%H:%M:%SZ'
  nvidia-smi -L
  python3 --version
} 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$DIR"/awex-*.whl || exit 1
if [ -f "$DIR/sglang_receive.py" ] && ! grep -q "def receive" /tmp/site/awex/sglang.py; then
  cp "$DIR/sglang_receive.py" /tmp/site/awex/sglang.py
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# NCCL: the library torch ships (nvidia-nccl wheel), unless AWEX_NCCL_LIBRARY is set
if [ -z "${AWEX_NCCL_LIBRARY:-}" ]; then
  lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  [ -f "$lib" ] && export AWEX_NCCL_LIBRARY=$lib
fi
python3 -c 'import torch, awex; from awex import _awex; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "| awex", awex.__version__, "cuda build", _awex.CUDA, "| nccl", __import__("os").environ.get("AWEX_NCCL_LIBRARY"))' 2>&1 | tee -a "$OUT/env.txt"
t0=$SECONDS
timeout 400 python3 "$(dirname "$0")/gpu_pynccl.py" 2>&1 | tee "$OUT/check.log"
rc=${PIPESTATUS[0]}
echo "exit $rc after $((SECONDS - t0)) s"
cp "$AWEX_CHECK_DIR"/*.json "$OUT/" 2>/dev/null
exit $rc
