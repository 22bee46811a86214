#!/usr/bin/env python3
"""Speed of the activation quantization every integer matmul starts with (quant.kernels):
int8 values and scales alone, then with the per-16 sums the block types need, per 32 values
(ik's Q8_2 rule) and per 256 (its Q8_K rule), in ns a value, best of 10.

    python scripts/bench_act_quant.py [--rows 3072] [--cols 1536] [--threads 1] [--tree OTHER_CHECKOUT]

3072 x 1536 is the experts' down product input of a 512-token batch of the 2B DeepSeek-shaped model.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=3072)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.tree))
    import numba
    import numpy as np
    from quant import kernels as K

    numba.set_num_threads(a.threads)
    x = np.random.default_rng(0).standard_normal((a.rows, a.cols)).astype(np.float32)
    n, c = x.shape

    def best(f) -> float:
        f()
        t = float("inf")
        for _ in range(10):
            t0 = time.perf_counter()
            f()
            t = min(t, time.perf_counter() - t0)
        return t / x.size * 1e9

    for qk in (32, 256):
        q, s, bs = np.empty((n, c), np.int8), np.empty((n, c // 32), np.float32), np.empty((n, c // 32), np.int32)
        i16, b16, c16 = (np.empty((n, c // 16), np.int32), np.empty((n, c // 16), np.float32),
                         np.empty((n, c // 16), np.int32))
        alone = best(lambda: K.quantize_act_q8(x, qk, q, s, bs))
        sums = best(lambda: K.quantize_act_q8_sums(x, qk, q, s, i16, b16, c16))
        print(f"per {qk:3d}: {alone:.3f} ns a value, with the per-16 sums {sums:.3f} "
              f"({a.rows} x {a.cols}, {a.threads} thread(s))")


if __name__ == "__main__":
    main()
