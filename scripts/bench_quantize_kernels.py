#!/usr/bin/env python3
"""Single-thread quantizer throughput per IQK type: ikcli's quant.iqk_quantize against
ik_llama.cpp's ggml_quantize_chunk (through scripts/ik_oracle.py, when IK_GGML_LIB is set).

    python scripts/bench_quantize_kernels.py                       # ikcli only
    IK_GGML_LIB=/work/ik_build/ggml/src/libggml.so python scripts/bench_quantize_kernels.py
    ... --types IQ4_K,IQ2_K --rows 64 --cols 4096 --repeat 5 --imatrix --cpu

Input: rows x cols Gaussian f32 (default 64 x 4096 = 1 MiB); MB/s = f32 input bytes / best
time over --repeat runs (after one warm-up run, which also compiles the Numba kernels).
Both run in this process on one thread.  --cpu times with the thread's CPU clock instead of
the wall clock: steadier on a machine shared with other jobs.  --imatrix passes random
column importances to both.  Prints one table; the bytes of both are compared too (a
mismatch is flagged, not an error: this is a benchmark, tests/test_quantize_iqk.py checks).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from quant import iqk_quantize  # noqa: E402
from quant.types import type_info  # noqa: E402

DEFAULT_TYPES = "IQ4_K,IQ2_K,IQ3_K,IQ5_K,IQ6_K,IQ4_KS,IQ4_KSS,IQ2_KS"


def best_time(fn, repeat: int, clock) -> float:
    fn()                                   # warm-up (Numba compile / ik's table init)
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=DEFAULT_TYPES, help=f"comma-separated (default {DEFAULT_TYPES})")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--imatrix", action="store_true", help="quantize with random column importances")
    ap.add_argument("--cpu", action="store_true", help="time with the thread CPU clock, not the wall clock")
    ap.add_argument("--no-ik", action="store_true", help="skip ik even when IK_GGML_LIB is set")
    a = ap.parse_args()
    if a.cols % 256 or a.rows < 1 or a.repeat < 1:
        sys.exit("error: --cols must be a multiple of 256, --rows and --repeat at least 1")
    try:
        tis = [type_info(t.strip()) for t in a.types.split(",") if t.strip()]
    except (KeyError, ValueError) as e:
        sys.exit(f"error: {e.args[0] if e.args else e}")
    bad = [t.name for t in tis if t.id not in iqk_quantize.QUANTIZE_TYPES]
    if bad:
        sys.exit(f"error: no IQK quantizer for {', '.join(bad)}")
    ik = None
    if os.environ.get("IK_GGML_LIB") and not a.no_ik:
        from ik_oracle import IkGgml
        ik = IkGgml()
    clock = time.thread_time if a.cpu else time.perf_counter
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.rows, a.cols)).astype(np.float32)
    im = rng.random(a.cols).astype(np.float32) if a.imatrix else None
    mb = x.nbytes / 1e6
    print(f"# {a.rows} x {a.cols} f32 ({mb:.2f} MB), {'imatrix' if a.imatrix else 'no imatrix'}, "
          f"best of {a.repeat}, {'thread CPU' if a.cpu else 'wall'} clock, one thread")
    head = f"{'type':8s} {'ikcli MB/s':>11s}"
    if ik:
        head += f" {'ik MB/s':>9s} {'ikcli/ik':>9s}  bytes"
    print(head)
    for ti in tis:
        ours = iqk_quantize.quantize(x, ti.id, im)
        t_ours = best_time(lambda: iqk_quantize.quantize(x, ti.id, im), a.repeat, clock)
        line = f"{ti.name:8s} {mb / t_ours:11.1f}"
        if ik:
            ref = ik.quantize(ti.name, x, im)
            t_ik = best_time(lambda: ik.quantize(ti.name, x, im), a.repeat, clock)
            same = "same" if np.array_equal(ours, ref.reshape(-1)) else "DIFFER"
            line += f" {mb / t_ik:9.1f} {t_ik / t_ours:9.2f}  {same}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
