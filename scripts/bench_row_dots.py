#!/usr/bin/env python3
"""The row-dot kernels alone: quant.simd_blocks.row_dot (plain block types) and quant.simd_r4.group_dot
(_R4 layouts) over a weight matrix in cache, one thread, --tokens activation rows, GFLOP/s.

    python scripts/bench_row_dots.py [--types IQ4_XS,Q4_K,Q6_K,IQ2_K_R4] [--rows 2048] [--cols 4096]
                                     [--tokens 1] [--tree CHECKOUT]

No matmul around it (no Python, no thread pool, no row runs): what the compiled loop does per block.
--tree runs another checkout's kernels (a `git worktree` of an older commit) for before / after pairs;
run both in turns on this noisy machine.  Each kernel compiles for its type alone (a one-type tag).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="IQ4_XS,Q4_K,Q6_K,IQ4_K,IQ2_K_R4,IQ3_K_R4,Q4_K_R4")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=1, help="activation rows (<= quant.simd_blocks.TMAX)")
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.tree))
    import numpy as np
    from numba import njit

    from quant import kernels as K
    from quant import simd_blocks as B
    from quant import simd_r4 as R
    from quant.matmul import _quantize_act, quantize_tensor
    from quant.typetag import make_tag
    from quant.types import type_info

    @njit
    def plain(qt, buf, stride, q, s, bs, b16, out, reps):
        for _ in range(reps):
            B.row_dot(qt, buf, 0, stride, out.shape[1], q, s, bs, b16, q.shape[1], 0, q.shape[0], out, 0)

    @njit
    def group4(qt, buf, stride, q, s, bs, b16, out, reps):
        for _ in range(reps):
            R.group_dot(qt, buf, 0, stride, out.shape[1] // 4, q, s, bs, b16, q.shape[1], 0, q.shape[0], out, 0)

    if not 1 <= a.tokens <= B.TMAX:
        sys.exit(f"bench_row_dots.py: --tokens must be 1..{B.TMAX} (the kernels' activation rows a call)")
    if a.cols % 256 or a.rows % 4:
        sys.exit("bench_row_dots.py: --cols must be a multiple of 256 and --rows of 4")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.tokens, a.cols), dtype=np.float32)
    q, s, bs, b16, _ = _quantize_act(x)
    for name in a.types.split(","):
        ti = type_info(name)
        r4 = ti.id in R.R4_DOTS
        if not r4 and ti.id not in B.BLOCK_DOTS:
            print(f"{name}: no row-dot record (quant.simd_blocks / simd_r4)")
            continue
        w = quantize_tensor(rng.standard_normal((a.rows, a.cols), dtype=np.float32), ti.id, np.ones(a.cols, np.float32))
        buf = w.data.reshape(-1)
        stride = buf.size // (a.rows // 4 if r4 else a.rows)
        out = np.zeros((a.tokens, a.rows), np.float32)
        fn = group4 if r4 else plain
        tag = make_tag(ti.id, {ti.id})
        qr = q if r4 else K.row_dot_act(tag, q)      # the order the type's row dot reads (planes records)
        fn(tag, buf, stride, qr, s, bs, b16, out, 1)
        best = 1e9
        for _ in range(7):
            t0 = time.perf_counter()
            fn(tag, buf, stride, qr, s, bs, b16, out, 20)
            best = min(best, (time.perf_counter() - t0) / 20)
        print(f"{name:9s} {a.rows}x{a.cols} tokens={a.tokens}: {best * 1e6:8.1f} us "
              f"{2 * a.rows * a.cols * a.tokens / best / 1e9:7.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
