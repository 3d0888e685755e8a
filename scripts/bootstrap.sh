#!/usr/bin/env bash
# Create .venv/ with a Python >= 3.12 and install hybrid-jax into it (editable), with the given extras.
#   scripts/bootstrap.sh          # runtime only
#   scripts/bootstrap.sh test     # plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

is_py312() { "$@" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  local cand
  for cand in "${PYTHON:-}" python3.14 python3.13 python3.12 python3; do
    [ -n "$cand" ] && is_py312 "$cand" && { echo "$cand"; return; }
  done
  if command -v pyenv >/dev/null 2>&1; then  # pyenv installs that are not the active version
    for cand in $(pyenv versions --bare | grep -E '^3\.(1[2-9])' | sort -rV); do
      is_py312 "$(pyenv root)/versions/$cand/bin/python3" && { echo "$(pyenv root)/versions/$cand/bin/python3"; return; }
    done
  fi
  echo "no Python >= 3.12 found; set PYTHON=/path/to/python3.12" >&2
  exit 1
}

if [ ! -x .venv/bin/python ] || ! is_py312 .venv/bin/python; then
  rm -rf .venv
  "$(find_python)" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# The install is editable, so only a changed pyproject.toml needs pip again (a stamp per set of extras).
stamp=".venv/.installed-${extras:-runtime}"
want=$(.venv/bin/python -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && exit 0
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install -q -e "$spec"
echo "$want" > "$stamp"
