#!/usr/bin/env bash
# Create .venv with Python 3.12 (jax >= 0.11 needs it) and install deepseek41 into it.
#   bash scripts/setup.sh          # the package
#   bash scripts/setup.sh test     # the package + test extras
#   bash scripts/setup.sh test,tpu # + libtpu, the TPU compiler (CI: deviceless TPU compiles)
# The machine's default python3 may be older: we look for 3.12 on PATH, then through pyenv.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

find_python312() {
  local cand
  for cand in python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
      command -v "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for cand in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -V -r); do
      if [ -x "$(pyenv root)/versions/$cand/bin/python3.12" ]; then
        echo "$(pyenv root)/versions/$cand/bin/python3.12"; return 0
      fi
    done
  fi
  for cand in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if [ -x "$cand" ]; then echo "$cand"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
  if ! py=$(find_python312); then
    echo "error: Python 3.12 not found (tried python3.12, python3, pyenv versions, ~/.pyenv," \
         "/usr/bin/python3.12). jax >= 0.11 needs Python 3.12: install it (e.g. 'pyenv install 3.12')" \
         "and run this again." >&2
    exit 1
  fi
  echo "using $py ($("$py" --version 2>&1))"
  rm -rf .venv
  "$py" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e "$spec"
