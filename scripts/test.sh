#!/usr/bin/env bash
# Set up (once) and run the test suite: a virtual environment in .venv with ikcli and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e '.[test]'
# tests/test_webui.py drives Debian's Chromium with Playwright (never `playwright install`): install
# it when missing and apt-get can run as root (~25 s, ~110 MB; IKCLI_NO_CHROMIUM_INSTALL=1 skips it);
# without it those tests skip
if [ ! -x /usr/bin/chromium ] && [ -z "${IKCLI_NO_CHROMIUM_INSTALL:-}" ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  t0=$(date +%s)
  log=$(mktemp)
  export DEBIAN_FRONTEND=noninteractive
  if apt-get install -y -q chromium >"$log" 2>&1 \
      || { apt-get update -q >>"$log" 2>&1 && apt-get install -y -q chromium >>"$log" 2>&1; }; then
    echo "scripts/test.sh: installed chromium with apt-get ($(( $(date +%s) - t0 )) s) for tests/test_webui.py"
    rm -f "$log"
  else
    echo "scripts/test.sh: could not install chromium (apt-get log: $log): tests/test_webui.py will skip its browser tests"
  fi
fi
# two workers: the 2-core CI box compiles the kernels of two test files at once (cold: 600 -> 410 s)
exec .venv/bin/python -m pytest -n 2 "$@"
