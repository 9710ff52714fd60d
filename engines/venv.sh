#!/usr/bin/env bash
# The real-engine virtualenv (SGLang, Megatron-Core, torch on CPU), shared by every real-engine
# test: created once per machine from engines/requirements.lock and reused while the lock is
# unchanged (the directory name carries the lock's sha256), then the awex wheel
# (target/awex-py-wheels/awex-*.whl, built by .ci/python; built here with maturin if missing)
# is reinstalled into it. Prints the venv's path on stdout; progress goes to stderr.
#
#   AWEX_ENGINES_VENV   the venv's path (default $AWEX_ENGINES_CACHE/engines-<hash>)
#   AWEX_ENGINES_CACHE  where keyed venvs live (default $HOME/.cache/awex)
#   AWEX_ENGINES_PYTHON the Python 3.12 interpreter (default: the first of python3.12, pyenv's,
#                       uv's, /usr/bin/python3.12 that runs; engines/python312.sh)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOCK="$ROOT/engines/requirements.lock"
log() { echo "engines/venv.sh: $*" >&2; }
# shellcheck source=engines/python312.sh
. "$ROOT/engines/python312.sh"
PY=$(awex_python312) || exit 1

hash=$(sha256sum "$LOCK" | cut -c1-16)
VENV=${AWEX_ENGINES_VENV:-${AWEX_ENGINES_CACHE:-$HOME/.cache/awex}/engines-$hash}
mkdir -p "$(dirname "$VENV")"

# one builder at a time per venv; a venv is usable once its marker holds the lock's hash
exec 9>"$VENV.lock"
flock 9
if [ "$(cat "$VENV/.awex-lock-sha256" 2>/dev/null)" != "$hash" ]; then
  start=$(date +%s)
  log "building $VENV from $LOCK"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$LOCK" >&2
  echo "$hash" >"$VENV/.awex-lock-sha256"
  log "built in $(($(date +%s) - start)) s"
fi

shopt -s nullglob
wheels=("$ROOT"/target/awex-py-wheels/awex-*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  log "no awex wheel in target/awex-py-wheels; building it with maturin (release)"
  TOOLS="$ROOT/target/awex-build-venv"
  if [ ! -x "$TOOLS/bin/maturin" ]; then
    "$PY" -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install --quiet --disable-pip-version-check "maturin>=1.9.4,<2" >&2
  fi
  "$TOOLS/bin/maturin" build --release --quiet -m "$ROOT/awex-py/Cargo.toml" -i "$TOOLS/bin/python" \
    --out "$ROOT/target/awex-py-wheels" >&2
  wheels=("$ROOT"/target/awex-py-wheels/awex-*.whl)
fi
if [ ${#wheels[@]} -ne 1 ]; then
  log "expected one awex wheel in target/awex-py-wheels, found ${#wheels[@]}: ${wheels[*]}"
  exit 1
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "${wheels[0]}" >&2
echo "$VENV"
