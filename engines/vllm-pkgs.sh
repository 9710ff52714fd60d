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
#   engines/vllm-pkgs.sh VENV --newest
#                                 the newest-release lane's folder (.ci/engines-newest): vLLM at
#                                 its newest release on the package index, the lock's other
#                                 packages at the lock's versions (no hashes: the newest wheel's
#                                 are not known in advance), in $AWEX_ENGINES_CACHE/vllm-newest-<hash>
#                                 keyed by the lock and the release, so a new release makes a new one
#   AWEX_VLLM_PKGS      the folder's path (default $AWEX_ENGINES_CACHE/vllm-<hash>)
#   AWEX_NEWEST_VLLM    with --newest: this vLLM release instead of asking the index
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOCK="$ROOT/engines/requirements-vllm.lock"
log() { echo "engines/vllm-pkgs.sh: $*" >&2; }

if [ $# -lt 1 ] || [ $# -gt 2 ] || [ ! -x "$1/bin/python" ] || { [ $# -eq 2 ] && [ "$2" != --newest ]; }; then
  log "usage: engines/vllm-pkgs.sh VENV [--newest] (VENV: the real-engine venv engines/venv.sh prints)"
  exit 2
fi
PY="$1/bin/python"
CACHE=${AWEX_ENGINES_CACHE:-$HOME/.cache/awex}
INSTALL=(--require-hashes -r "$LOCK")
if [ "${2:-}" = --newest ]; then
  version=${AWEX_NEWEST_VLLM:-}
  if [ -z "$version" ]; then
    line=$("$PY" -m pip index versions --disable-pip-version-check vllm 2>/dev/null | head -1 || true)
    version=$(echo "$line" | sed -n 's/^[^ ]* (\([^)]*\))$/\1/p')
    if [ -z "$version" ]; then
      log "cannot ask the package index for the newest release of vllm (pip index versions vllm: '${line}'); set AWEX_NEWEST_VLLM=X to run offline"
      exit 1
    fi
  fi
  log "newest vLLM release: $version"
  # the lock's requirements without their hashes, vllm's pin replaced by the newest release
  reqs=$(sed -e 's/#.*//' -e 's/--hash=[^ ]*//g' -e 's/\\$//' "$LOCK" | tr -s ' ' | grep -v '^[[:space:]]*$' |
    sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' -e "s/^vllm==.*/vllm==$version/")
  hash=$( { cat "$LOCK"; echo "$version"; } | sha256sum | cut -c1-16)
  DIR=${AWEX_VLLM_PKGS:-$CACHE/vllm-newest-$hash}
  # shellcheck disable=SC2206
  INSTALL=($reqs)
else
  hash=$(sha256sum "$LOCK" | cut -c1-16)
  DIR=${AWEX_VLLM_PKGS:-$CACHE/vllm-$hash}
fi
mkdir -p "$(dirname "$DIR")"

# one builder at a time per folder; a folder is usable once its marker holds the lock's hash
exec 9>"$DIR.lock"
flock 9
if [ "$(cat "$DIR/.awex-lock-sha256" 2>/dev/null)" != "$hash" ]; then
  start=$(date +%s)
  log "building $DIR from $LOCK${2:+ (vLLM $version)}"
  rm -rf "$DIR"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --target "$DIR" "${INSTALL[@]}" >&2
  echo "$hash" >"$DIR/.awex-lock-sha256"
  log "built in $(($(date +%s) - start)) s"
fi
echo "$DIR"
