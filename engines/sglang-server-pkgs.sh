#!/usr/bin/env bash
# The package folder of the live SGLang server (engines/tests/live/test_live_sglang.py): what
# `python -m sglang.launch_server` imports beyond the real-engine venv (uvicorn, fastapi, ...),
# pinned in engines/requirements-sglang-server.lock and installed without dependencies into
# $AWEX_ENGINES_CACHE/sglang-server-<lock sha256> (default $HOME/.cache/awex), once per machine and
# reused while the lock is unchanged. The folder goes on the server's PYTHONPATH over the
# real-engine venv (engines/venv.sh). Prints the folder's path on stdout; progress goes to stderr.
#
#   engines/sglang-server-pkgs.sh VENV   VENV: the real-engine venv engines/venv.sh prints
#   AWEX_SGLANG_SERVER_PKGS  the folder's path (default $AWEX_ENGINES_CACHE/sglang-server-<hash>)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOCK="$ROOT/engines/requirements-sglang-server.lock"
log() { echo "engines/sglang-server-pkgs.sh: $*" >&2; }

if [ $# -ne 1 ] || [ ! -x "$1/bin/python" ]; then
  log "usage: engines/sglang-server-pkgs.sh VENV (the real-engine venv engines/venv.sh prints)"
  exit 2
fi
PY="$1/bin/python"
hash=$(sha256sum "$LOCK" | cut -c1-16)
DIR=${AWEX_SGLANG_SERVER_PKGS:-${AWEX_ENGINES_CACHE:-$HOME/.cache/awex}/sglang-server-$hash}
mkdir -p "$(dirname "$DIR")"

# one builder at a time per folder; a folder is usable once its marker holds the lock's hash
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
