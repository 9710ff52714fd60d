#!/usr/bin/env bash
# The transformers-4 folder of the FSDP2 cases that check transformers 4's names
# (engines/tests/train/test_fsdp.py, `*_tf4`: per-expert Qwen3-MoE parameters): transformers
# 4.57 and the few packages it needs beyond the real-engine venv, pinned in
# engines/requirements-train-tf4.txt and installed without their dependencies into
# $AWEX_ENGINES_CACHE/tf4-<file sha256> (default $HOME/.cache/awex), once per machine and reused
# while the file is unchanged. The worker of those cases puts the folder first on its sys.path
# (AWEX_TRANSFORMERS4=DIR); the venv itself keeps transformers 5. Prints the folder's path on
# stdout; progress goes to stderr.
#
#   engines/tf4-pkgs.sh VENV   VENV: the real-engine venv engines/venv.sh prints
#   AWEX_TF4_PKGS              the folder's path (default $AWEX_ENGINES_CACHE/tf4-<hash>)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOCK="$ROOT/engines/requirements-train-tf4.txt"
log() { echo "engines/tf4-pkgs.sh: $*" >&2; }

if [ $# -ne 1 ] || [ ! -x "$1/bin/python" ]; then
  log "usage: engines/tf4-pkgs.sh VENV (the real-engine venv engines/venv.sh prints)"
  exit 2
fi
PY="$1/bin/python"
hash=$(sha256sum "$LOCK" | cut -c1-16)
DIR=${AWEX_TF4_PKGS:-${AWEX_ENGINES_CACHE:-$HOME/.cache/awex}/tf4-$hash}
mkdir -p "$(dirname "$DIR")"

# one builder at a time per folder; a folder is usable once its marker holds the file's hash
exec 9>"$DIR.lock"
flock 9
if [ "$(cat "$DIR/.awex-lock-sha256" 2>/dev/null)" != "$hash" ]; then
  start=$(date +%s)
  log "building $DIR from $LOCK"
  rm -rf "$DIR"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: --target "$DIR" \
    -r "$LOCK" >&2
  echo "$hash" >"$DIR/.awex-lock-sha256"
  log "built in $(($(date +%s) - start)) s"
fi
echo "$DIR"
