#!/usr/bin/env bash
# Finds a Python 3.12 interpreter that runs, for every script that builds an engine venv
# (engines/venv.sh, engines/vllm-server-venv.sh, .ci/engines, .ci/engines-newest): the lock
# files are for Python 3.12 (megatron-core 0.19.2 needs >= 3.12, vLLM's CPU wheels are cp312).
# Prints the interpreter's path on stdout; when there is none, says on stderr what it tried and
# what to install, and exits 1.
#
#   engines/python312.sh             run as a command
#   . engines/python312.sh; awex_python312   sourced: the same, as a function
#
# Tried in order, each one run (`-c 'import sys, venv'`) and kept only if it is 3.12 and
# works: a name on PATH can be a pyenv shim of an inactive version that prints
# "pyenv: python3.12: command not found" and exits 127, which `command -v` does not see.
#   1. $AWEX_ENGINES_PYTHON (when set, it must work: nothing else is tried)
#   2. python3.12 on PATH
#   3. pyenv's installed versions: $PYENV_ROOT/versions/3.12*/bin/python3.12 (PYENV_ROOT
#      defaults to ~/.pyenv), newest first
#   4. uv's managed interpreters: `uv python find 3.12` (uv on PATH), then
#      ${UV_PYTHON_INSTALL_DIR:-~/.local/share/uv/python}/cpython-3.12*/bin/python3.12
#   5. $AWEX_PYTHON312_SYSTEM (default "/usr/bin/python3.12 /usr/local/bin/python3.12")

# the interpreter's path if `$1` runs as a Python 3.12 with the venv module, else nothing
awex_python312_try() {
  local py=$1 path
  [ -n "$py" ] || return 1
  path=$(command -v "$py" 2>/dev/null) || return 1
  "$path" -c 'import sys, venv; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1 || return 1
  echo "$path"
}

awex_python312() {
  local c tried=() found
  if [ -n "${AWEX_ENGINES_PYTHON:-}" ]; then
    if found=$(awex_python312_try "$AWEX_ENGINES_PYTHON"); then
      echo "$found"
      return 0
    fi
    echo "engines/python312.sh: AWEX_ENGINES_PYTHON=$AWEX_ENGINES_PYTHON is not a Python 3.12 that runs" \
      "with the venv module ($("$AWEX_ENGINES_PYTHON" --version 2>&1 | head -1)); point it at one, or unset it" \
      "to have one looked for" >&2
    return 1
  fi
  local candidates=(python3.12)
  local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  # newest 3.12 patch release first (3.12.10 after 3.12.9: version sort)
  while IFS= read -r c; do
    [ -n "$c" ] && candidates+=("$c")
  done < <(ls -d "$pyenv_root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -rV)
  if command -v uv >/dev/null 2>&1; then
    c=$(uv python find --no-project 3.12 2>/dev/null || uv python find 3.12 2>/dev/null || true)
    [ -n "$c" ] && candidates+=("$c")
  fi
  while IFS= read -r c; do
    [ -n "$c" ] && candidates+=("$c")
  done < <(ls -d "${UV_PYTHON_INSTALL_DIR:-$HOME/.local/share/uv/python}"/cpython-3.12*/bin/python3.12 2>/dev/null | sort -rV)
  # shellcheck disable=SC2206
  candidates+=(${AWEX_PYTHON312_SYSTEM-/usr/bin/python3.12 /usr/local/bin/python3.12})
  for c in "${candidates[@]}"; do
    if found=$(awex_python312_try "$c"); then
      echo "$found"
      return 0
    fi
    tried+=("$c")
  done
  cat >&2 <<EOF
engines/python312.sh: no Python 3.12 that runs (tried: ${tried[*]}).
The engine venvs need Python 3.12 with its venv module. Install one of:
  uv python install 3.12                       (uv: https://docs.astral.sh/uv/)
  pyenv install 3.12                           (found under \$PYENV_ROOT/versions, no 'pyenv global' needed)
  apt-get install python3.12 python3.12-venv   (Debian/Ubuntu releases that ship 3.12)
or set AWEX_ENGINES_PYTHON to a Python 3.12 interpreter.
EOF
  return 1
}

# run as a command (not sourced): print the interpreter
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  awex_python312
fi
