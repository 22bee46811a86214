#!/usr/bin/env bash
# Set up (once) and run the test suite: a virtual environment in .venv with ikcli and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e '.[test]'
# two workers: the 2-core CI box compiles the kernels of two test files at once (cold: 600 -> 410 s)
exec .venv/bin/python -m pytest -n 2 "$@"
