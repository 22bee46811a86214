#!/usr/bin/env python3
"""The prompt flash attention over decompressed MLA heads (engine.flash_attn.flash_attn_rows, the
-mla 2/3 prompt path) with its f32 products through numpy's BLAS and through quant.simd_sgemm,
in turns on the same inputs (a shared machine's load hits both alike):

    python scripts/bench_prompt_attention.py [--threads 2] [--cells 4096] [--queries 512] [--tiles 2048,128]

DeepSeek-V2-Lite-like heads: 16 heads, keys 192, values 128.  Prints the best time of each, then
numpy's own matmul (OpenBLAS, one thread) on the two products' shapes: run it again with
OPENBLAS_CORETYPE set otherwise (e.g. SkylakeX, or unset) to compare OpenBLAS's kernel sets.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numba  # noqa: E402
import numpy as np  # noqa: E402

import quant.gemm as qg  # noqa: E402
from engine.flash_attn import flash_attn_rows  # noqa: E402
from quant.blas_threads import blas_core, set_blas_threads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cells", type=int, default=4096)
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiles", default="", help="Q_TILE_ROWS,CELL_TILE of engine.flash_attn to time instead "
                    "of its own (e.g. 4096,256 against 2048,128)")
    a = ap.parse_args()
    if a.tiles:
        import engine.flash_attn as fa
        fa.Q_TILE_ROWS, fa.CELL_TILE = (int(v) for v in a.tiles.split(","))
    numba.set_num_threads(a.threads)
    set_blas_threads(1)
    rng = np.random.default_rng(0)
    H, dk, dv, n, T = 16, 192, 128, a.cells, a.queries
    q = rng.standard_normal((T, H, dk)).astype(np.float32)
    k = rng.standard_normal((n, H, dk)).astype(np.float32)
    v = rng.standard_normal((n, H, dv)).astype(np.float32)
    cell_pos = np.arange(n, dtype=np.int32)
    q_pos = np.arange(n - T, n, dtype=np.int32)
    best = {}
    outs = {}
    for r in range(a.rounds + 1):
        for own in (False, True):
            qg.OWN = own
            t = time.perf_counter()
            outs[own] = flash_attn_rows(q, k, v, cell_pos, q_pos, 1 / np.sqrt(dk))
            dt = time.perf_counter() - t
            if r:           # round 0 compiles
                best[own] = min(best.get(own, 1e9), dt)
    d = np.abs(outs[True] - outs[False]).max() / np.abs(outs[False]).max()
    print(f"{T} queries x {n} cells x {H} heads, {a.threads} threads, OpenBLAS core {blas_core()}: "
          f"BLAS {best[False] * 1e3:.1f} ms, quant.simd_sgemm {best[True] * 1e3:.1f} ms; largest difference {d:.1e}")
    for (m, kk, nn) in ((4096, 192, 256), (4096, 256, 128)):     # scores, values: numpy at one BLAS thread
        x = rng.standard_normal((m, kk)).astype(np.float32)
        y = rng.standard_normal((kk, nn)).astype(np.float32)
        x @ y
        t = time.perf_counter()
        for _ in range(20):
            x @ y
        dt = (time.perf_counter() - t) / 20
        print(f"numpy {m} x {kk} by {kk} x {nn}: {2 * m * kk * nn / dt / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
