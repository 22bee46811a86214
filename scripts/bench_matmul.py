"""Rough speed of quant.matmul: n=1 (integer-dot path) and a many-token (tile + BLAS) case.

    python scripts/bench_matmul.py [--rows 4096] [--cols 4096] [--n-many 512] [--types q8_0,q4_0,f16|all]
                                   [--threads 1,2] [--passive]

--types all: every type quant.matmul computes with (quant.registry.COMPUTE_TYPES), plain and _R4/_R8
(that ikcli can write).  --quant-rows R (default 512): only R distinct rows are quantized and
repeated to --rows (the trellis / i-quant searches take 5-40 s per 4096^2; the kernels' speed does
not depend on which rows repeat, the weights still stream from memory); the types that need an
importance matrix get a uniform one.

--passive sets OMP_WAIT_POLICY=PASSIVE before numba starts its OpenMP pool, so idle numba
threads sleep instead of spinning while OpenBLAS works (see quant/matmul.py).

Prints time per call, weight GB/s (bytes of packed weights read per second) and GFLOP/s
(2*n*rows*cols / time) for thread counts 1 and 2 (numba and OpenBLAS set alike).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if "--passive" in sys.argv:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import numpy as np  # noqa: E402

from quant.matmul import matmul, quantize_tensor, set_num_threads  # noqa: E402
from quant.registry import COMPUTE_TYPES, traits  # noqa: E402
from quant.tensor import QTensor  # noqa: E402
from quant.types import type_info  # noqa: E402


def bench(fn, min_time=1.0, min_reps=3):
    fn()  # warm-up (compilation, page faults)
    reps, t0 = 0, time.perf_counter()
    best = float("inf")
    while reps < min_reps or time.perf_counter() - t0 < min_time:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        reps += 1
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--n-many", type=int, default=512)
    ap.add_argument("--types", default="q8_0,q4_0,f16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--passive", action="store_true", help="OMP_WAIT_POLICY=PASSIVE")
    ap.add_argument("--quant-rows", type=int, default=512, help="distinct rows quantized (repeated to --rows)")
    a = ap.parse_args()
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((a.rows, a.cols), dtype=np.float32)
    names = a.types.split(",")
    if a.types == "all":
        names = [type_info(t).name for t in sorted(COMPUTE_TYPES) if a.cols % type_info(t).block_size == 0
                 and traits(t).quantize is not None]
    for tname in names:
        ti = type_info(tname)
        qr = max(1, min(a.rows, a.quant_rows))
        qr = -(-qr // max(1, ti.interleave)) * max(1, ti.interleave)
        im = np.ones(a.cols, np.float32) if traits(ti.id).needs_imatrix else None
        part = quantize_tensor(w32[:qr], ti.id, im)
        reps = -(-a.rows // qr)
        w = QTensor(np.ascontiguousarray(np.tile(part.data, (reps, 1))[:a.rows]), ti.id, (a.rows, a.cols))
        for nt in [int(t) for t in a.threads.split(",")]:
            set_num_threads(nt)   # numba and OpenBLAS both
            for n in (1, a.n_many):
                x = rng.standard_normal((n, a.cols), dtype=np.float32)
                out = np.empty((n, a.rows), dtype=np.float32)
                t = bench(lambda: matmul(w, x, out))
                gflops = 2.0 * n * a.rows * a.cols / t / 1e9
                gbs = w.nbytes / t / 1e9
                print(f"{ti.name:9s} {a.rows}x{a.cols} n={n:4d} threads={nt}: {t * 1e3:8.2f} ms "
                      f"{gflops:7.1f} GFLOP/s {gbs:6.2f} GB/s(weights)", flush=True)


if __name__ == "__main__":
    main()
