#!/usr/bin/env bash
# The vLLM package folder of the vLLM real-code tests (engines/tests/vllm/): vLLM 0.33.0 and the
# few packages its CPU import chain needs, installed without their dependencies (vLLM's pins
# conflict with SGLang's) from engines/requirements-vllm.lock, hashes required, into
# $AWEX_ENGINES_CACHE/vllm-<lock sha256> (default $HOME/.cache/awex), once per machine and reused
# while the lock is unchanged. The folder goes on PYTHONPATH over the real-engine venv
# (engines/venv.sh), which supplies torch, transformers and the rest. Prints the folder's path
# on stdout; progress goes to stderr.
#
#   engines/vllm-pkgs.sh VENV     VENV: the real-engine venv whose pip installs (and whose
#                                 Python 3.12 the wheels are for)
#   AWEX_VLLM_PKGS      the folder's path (default $AWEX_ENGINES_CACHE/vllm-<hash>)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOCK="$ROOT/engines/requirements-vllm.lock"
log() { echo "engines/vllm-pkgs.sh: $*" >&2; }

if [ $# -ne 1 ] || [ ! -x "$1/bin/python" ]; then
  log "usage: engines/vllm-pkgs.sh VENV (the real-engine venv engines/venv.sh prints)"
  exit 2
fi
PY="$1/bin/python"
hash=$(sha256sum "$LOCK" | cut -c1-16)
DIR=${AWEX_VLLM_PKGS:-${AWEX_ENGINES_CACHE:-$HOME/.cache/awex}/vllm-$hash}
mkdir -p "$(dirname "$DIR")"

# one builder at a time per folder; a folder is usable once its marker holds the lock's hash
exec 9>"$DIR.lock"
flock 9
if [ "$(cat "$DIR/.awex-lock-sha256" 2>/dev/null)" != "$hash" ]; then
  start=$(date +%s)
  log "building $DIR from $LOCK"
  rm -rf "$DIR"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes \
    --only-binary=:all: --target "$DIR" -r "$LOCK" >&2
  echo "$hash" >"$DIR/.awex-lock-sha256"
  log "built in $(($(date +%s) - start)) s"
fi
echo "$DIR"
