"""A bounded fuzz of the GGUF loader (scripts/fuzz_gguf.py, full size: --cases 2000 and more):
300 seeded mutations of the header, metadata and tensor table of small models; each must load
(and get a context: --no-decode, so that a cold Numba cache compiles nothing here), or fail with
a one-line ModelFileError naming the file — no other exception, hang (20 s) or runaway memory
(3 GB address space).  The full-size runs (README) decode too."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mutated_files_fail_in_one_line_or_load():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fuzz_gguf.py"), "--cases", "300",
                        "--seed", "11", "--no-decode"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert summary.startswith("300 cases in ") and "finding" not in summary
    assert "'ok': " in summary and "'error': " in summary          # both kinds were exercised
