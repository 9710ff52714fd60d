#!/usr/bin/env bash
# The newest-release virtualenv of .ci/engines-newest: the distributions named in
# engines/requirements-newest.txt at their newest release on the package index, over the pinned
# real-engine venv (engines/venv.sh) that supplies everything else (torch, the awex wheel, the
# rest of the lock). A venv of its own whose site-packages come first on sys.path and whose
# `.pth` file puts the base venv's after them, so the base venv is never modified. Created once
# per machine and reused while its key holds: the base venv's name (its lock's hash), this
# requirements file and the resolved releases, so a new release on the index makes a new venv.
# Prints the venv's path on stdout and `name==version` of each resolved release on stderr.
#
#   engines/venv-newest.sh BASE_VENV
#   AWEX_NEWEST_PINS   "name==version ..." instead of asking the index (reproducing a run)
#   AWEX_ENGINES_CACHE where keyed venvs live (default $HOME/.cache/awex)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REQS="$ROOT/engines/requirements-newest.txt"
log() { echo "engines/venv-newest.sh: $*" >&2; }

if [ $# -ne 1 ] || [ ! -x "$1/bin/python" ]; then
  log "usage: engines/venv-newest.sh BASE_VENV (the real-engine venv engines/venv.sh prints)"
  exit 2
fi
BASE=$(cd "$1" && pwd)
BASE_PY="$BASE/bin/python"
CACHE=${AWEX_ENGINES_CACHE:-$HOME/.cache/awex}

# the newest release of every listed distribution, from the index (pip's own client)
names=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$REQS" | grep -v '^$' || true)
if [ -n "${AWEX_NEWEST_PINS:-}" ]; then
  pins=$(echo "$AWEX_NEWEST_PINS" | tr ' ' '\n' | grep -v '^$' | sort)
else
  pins=""
  for name in $names; do
    line=$("$BASE_PY" -m pip index versions --disable-pip-version-check "$name" 2>/dev/null | head -1 || true)
    version=$(echo "$line" | sed -n 's/^[^ ]* (\([^)]*\))$/\1/p')
    if [ -z "$version" ]; then
      log "cannot ask the package index for the newest release of $name (pip index versions $name: '${line}'); set AWEX_NEWEST_PINS=\"$name==X ...\" to run offline"
      exit 1
    fi
    pins+="$name==$version"$'\n'
  done
  pins=$(echo "$pins" | grep -v '^$' | sort)
fi
log "newest releases: $(echo $pins)"

hash=$( { basename "$BASE"; cat "$REQS"; echo "$pins"; } | sha256sum | cut -c1-16)
VENV="$CACHE/engines-newest-$hash"
mkdir -p "$CACHE"
exec 9>"$VENV.lock"
flock 9
if [ "$(cat "$VENV/.awex-newest-key" 2>/dev/null)" != "$hash" ]; then
  start=$(date +%s)
  log "building $VENV over $BASE"
  rm -rf "$VENV"
  "$BASE_PY" -m venv --without-pip "$VENV"
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  base_site=$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$base_site" >"$site/_awex_base_venv.pth"
  # the base venv's pip, run by this venv's interpreter, installs here; what the base venv
  # already satisfies stays there (upgrade strategy only-if-needed)
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: --no-warn-conflicts \
    --upgrade-strategy only-if-needed $pins >&2
  echo "$pins" >"$VENV/.awex-newest-pins"
  echo "$hash" >"$VENV/.awex-newest-key"
  log "built in $(($(date +%s) - start)) s"
fi
# what the venv imports, checked against what was asked
# shellcheck disable=SC2086
"$VENV/bin/python" - $pins <<'PY' >&2
import importlib.metadata as md, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    got = md.version(name)
    if got != version:
        sys.exit(f"engines/venv-newest.sh: {name} imports as {got}, not the newest {version}")
    print(f"engines/venv-newest.sh: {name} {got}")
PY
echo "$VENV"
