#!/usr/bin/env python3
"""quant.simd_gemm alone: pack every 16-row tile of one weight matrix and multiply it by n activation
rows (an expert's share of a prompt is ~48 rows), one thread, in cache, best of --rounds; with
--against OTHER (a copy of quant/simd_gemm.py from another commit, e.g. `git show REV:quant/simd_gemm.py
> /tmp/old_gemm.py`) both versions run in turns on the same inputs, and their outputs are compared.

    python scripts/bench_tile_gemm.py --types IQ4_XS,Q4_K,Q6_K [--rows 1536] [--cols 2048] [-n 48]
                                      [--against /tmp/old_gemm.py] [--rounds 15] [--pack-only | --gemm-only]
                                      [--workers 2]

--workers N runs N threads at once, each packing and multiplying its own copy of the matrix: a
matrix that fits each core's L2 shows whether the cores slow each other down (past L2 they did,
10-25 % on the 2-core test VM; in L2 they did not).

GFLOP/s counts 2 * rows * cols * n per pass (packing included).  Needs AVX512-VNNI for the form the
engine uses (else both run the generic IR).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import numba  # noqa: E402
from numba import njit, prange  # noqa: E402

import quant.simd_gemm as G  # noqa: E402
from quant.kernels import _GEMM_ACT256, _GEMM_SCALE32, tag  # noqa: E402
from quant.matmul import quantize_tensor  # noqa: E402
from quant.types import type_info  # noqa: E402


def _load(path: str, i: int):
    """A simd_gemm module from a file, as a sibling of quant's modules (its relative imports)."""
    spec = importlib.util.spec_from_file_location(f"quant._bench_gemm_{i}", path)
    m = importlib.util.module_from_spec(spec)
    m.__package__ = "quant"
    sys.modules[spec.name] = m
    spec.loader.exec_module(m)
    return m


def _runner(mod):
    pack, gemm, trows = mod.tile_pack, mod.tile_gemm, mod.ROWS
    mins32 = getattr(mod, "MINS32", frozenset())
    typed = hasattr(mod, "FORMS")       # the GEMM takes the qtype (its forms) since 32-row tiles
    sized = hasattr(mod, "SMALL")       # ... and the small flag (levels within SMALL_LEVEL) since then

    @njit(nogil=True)
    def run(qtype, buf, stride, rows, cols, q, s, b16, b32, c16, out, reps, per32, act256, use32, multiply, repack,
            small):
        tu = np.empty(trows * cols, np.uint8)
        tdsc = np.empty(cols // 16 * trows, np.float32)
        tws = np.empty(cols // 16 * trows, np.float32)
        for _ in range(reps):
            for r0 in range(0, rows, trows):
                if repack or r0 == 0:
                    code = pack(qtype, buf, r0 * stride, stride, trows, cols, tu, tdsc, tws)
                m = code == G.PACKED_MINS
                bs = b32 if use32 and per32 and m else b16
                if not multiply:
                    continue
                if sized:
                    gemm(tu, tdsc, tws, cols // 16, q, s, bs, c16, 0, q.shape[0], out, r0, trows, per32, m, act256,
                         small, qtype)
                elif typed:
                    gemm(tu, tdsc, tws, cols // 16, q, s, bs, c16, 0, q.shape[0], out, r0, trows, per32, m, act256,
                         qtype)
                else:
                    gemm(tu, tdsc, tws, cols // 16, q, s, bs, c16, 0, q.shape[0], out, r0, trows, per32, m, act256)
    @njit(nogil=True, parallel=True)
    def workers(nw, qtype, bufs, stride, rows, cols, q, s, b16, b32, c16, outs, reps, per32, act256, use32, multiply,
                repack, small):
        for w in prange(nw):        # each worker its own copy of the matrix
            run(qtype, bufs[w], stride, rows, cols, q, s, b16, b32, c16, outs[w], reps, per32, act256, use32,
                multiply, repack, small)
    return run, mins32, workers, getattr(mod, "SMALL", frozenset())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="IQ4_XS,Q4_K,Q6_K,Q8_0")
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("-n", type=int, default=48, help="activation rows")
    ap.add_argument("--against", help="another simd_gemm.py to run in turns with this tree's")
    ap.add_argument("--rounds", type=int, default=15)
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--pack-only", action="store_true", help="time the packing alone (no products)")
    only.add_argument("--gemm-only", action="store_true", help="time the products alone (the first tile packed once)")
    ap.add_argument("--workers", type=int, default=1,
                    help="threads each packing and multiplying its own copy of the matrix at once (time per worker)")
    a = ap.parse_args()
    if a.rows % 16 or a.cols % 256:
        sys.exit("--rows must be a multiple of 16 and --cols of 256")
    mods = {"this tree": G} | ({os.path.basename(a.against): _load(a.against, 0)} if a.against else {})
    runners = {k: _runner(m) for k, m in mods.items()}
    nw = a.workers
    if not 1 <= nw <= numba.config.NUMBA_NUM_THREADS:
        sys.exit(f"--workers must be 1..{numba.config.NUMBA_NUM_THREADS} (numba's threads: each worker runs on its own)")
    numba.set_num_threads(nw)
    rng = np.random.default_rng(0)
    n, cols = a.n, a.cols
    q = rng.integers(-127, 128, (n, cols), dtype=np.int8)
    s = np.abs(rng.standard_normal((n, cols // 32))).astype(np.float32)
    b16 = rng.standard_normal((n, cols // 16)).astype(np.float32)
    b32 = b16[:, 0::2] + b16[:, 1::2]
    c16 = (-128 * q.reshape(n, -1, 16).astype(np.int32).sum(axis=2)).astype(np.int32)
    for name in a.types.split(","):
        ti = type_info(name)
        w = quantize_tensor(rng.standard_normal((a.rows, cols), dtype=np.float32), ti.id, None).data
        buf, stride, qt = np.ascontiguousarray(w).reshape(-1), w.shape[1], tag(ti.id)
        bufs = np.stack([buf] * nw)         # separate memory per worker
        p32, a256 = bool(_GEMM_SCALE32[ti.id]), bool(_GEMM_ACT256[ti.id])
        outs, best = {}, {}
        for k, (run, mins32, work, small) in runners.items():
            outs[k] = np.zeros((nw, n, a.rows), np.float32)
            work(nw, qt, bufs, stride, a.rows, cols, q, s, b16, b32, c16, outs[k], 1, p32, a256, ti.id in mins32,
                 True, True, ti.id in small)
            best[k] = float("inf")
        reps = max(2, -(-(8 << 20) // (a.rows * cols)))     # passes per timing: the pool's start-up well below 1 %
        for _ in range(a.rounds):
            for k, (run, mins32, work, small) in runners.items():
                t = time.perf_counter()
                work(nw, qt, bufs, stride, a.rows, cols, q, s, b16, b32, c16, outs[k], reps, p32, a256,
                     ti.id in mins32, not a.pack_only, not a.gemm_only, ti.id in small)
                best[k] = min(best[k], (time.perf_counter() - t) / reps)
        for k in runners:
            rate = ("packing only" if a.pack_only else "products only" if a.gemm_only
                    else f"{2 * a.rows * cols * n / best[k] / 1e9:5.0f} GFLOP/s")
            who = f", {nw} workers (ms each)" if nw > 1 else ""
            print(f"{name:8s} {a.rows}x{cols} n={n} {k:>16s}: {best[k] * 1e3:7.3f} ms  {rate}{who}")
        if len(outs) == 2:
            o = [v[0] for v in outs.values()]
            print(f"{'':8s} outputs: {'identical' if np.array_equal(o[0], o[1]) else 'max difference %.3g' % float(np.abs(o[0] - o[1]).max())}")


if __name__ == "__main__":
    main()
