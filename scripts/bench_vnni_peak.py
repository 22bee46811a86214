#!/usr/bin/env python3
"""The host's vpdpbusd (512-bit) rate on one thread: loops of N independent accumulator chains,
the ceiling for quant.simd_gemm's tile GEMM (one vpdpbusd = 64 int8 multiply-adds); then the
GEMM's own pattern: T tokens, each quad of 4 activation bytes broadcast from memory, times V
tile vectors (16 weight rows each), 8 quads (32 values) a step, integer sums kept across steps
(V = 1: 16-row tiles, V = 2: quant.simd_gemm's 32-row tiles).

    python scripts/bench_vnni_peak.py

Needs AVX512-VNNI.  Compare with scripts/bench_matmul.py --n-many 512 --threads 1: a GEMM of
rows x cols x n does rows * cols * n / 64 vpdpbusd.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from quant.simd import HAS_VNNI, _I8, _I32, _const_i64, _vec, dpbusd  # noqa: E402
from quant.simd_blocks import _cv  # noqa: E402

V16I, V64B = _vec(_I32, 16), _vec(_I8, 64)


def _lane0_sum(b, accs):
    """Lane 0 of the accumulators' sum as an i64 (the loops' result, so they are not dropped)."""
    tot = ir.Constant(V16I, [0] * 16)
    for a in accs:
        tot = b.add(tot, b.load(a))
    return b.sext(b.extract_element(tot, ir.Constant(_I32, 0)), ir.IntType(64))


def chains(nchain: int):
    """spin(n, a): n rounds of nchain independent vpdpbusd on two vectors loaded from a."""
    @intrinsic
    def spin(typingctx, n, a):
        sig = types.int64(types.int64, a)

        def codegen(context, b, sig, args):
            p = context.make_array(sig.args[1])(context, b, args[1]).data
            w = b.load(b.bitcast(p, V64B.as_pointer()), align=1)
            x = b.load(b.bitcast(b.gep(p, [_const_i64(64)]), V64B.as_pointer()), align=1)
            accs = [cgutils.alloca_once_value(b, ir.Constant(V16I, [k] * 16)) for k in range(nchain)]
            with cgutils.for_range(b, args[0]):
                for a in accs:
                    b.store(dpbusd(b, b.load(a), w, x, True), a)
            return _lane0_sum(b, accs)
        return sig, codegen
    return spin


def pattern(ntok: int, nvec: int):
    """spin(n, w, q): n steps of the tile GEMM's inner pattern, ntok tokens x nvec tile vectors."""
    @intrinsic
    def spin(typingctx, n, w, q):
        sig = types.int64(types.int64, w, q)

        def codegen(context, b, sig, args):
            wp = context.make_array(sig.args[1])(context, b, args[1]).data
            qp = b.bitcast(context.make_array(sig.args[2])(context, b, args[2]).data, _I32.as_pointer())
            accs = [cgutils.alloca_once_value(b, ir.Constant(V16I, [0] * 16)) for _ in range(ntok * nvec)]
            with cgutils.for_range(b, args[0]) as lp:
                st = b.and_(lp.index, _const_i64(63))           # 64 steps: the tile stays in L1
                ws = [[b.load(b.bitcast(b.gep(wp, [b.add(b.mul(st, _const_i64(512 * nvec)),
                                                          _const_i64(64 * j + 512 * v))]), V64B.as_pointer()), align=1)
                       for j in range(8)] for v in range(nvec)]
                for t in range(ntok):
                    base = b.add(_const_i64(t * 512), b.mul(st, _const_i64(8)))
                    sums = [b.load(accs[t * nvec + v]) for v in range(nvec)]
                    for j in range(8):
                        x = b.load(b.gep(qp, [b.add(base, _const_i64(j))]))
                        x = b.insert_element(ir.Constant(V16I, None), x, ir.Constant(_I32, 0))
                        a = b.bitcast(b.shuffle_vector(x, x, _cv([0] * 16)), V64B)
                        sums = [dpbusd(b, sums[v], ws[v][j], a, True) for v in range(nvec)]
                    for v in range(nvec):
                        b.store(sums[v], accs[t * nvec + v])
            return _lane0_sum(b, accs)
        return sig, codegen
    return spin


def main() -> None:
    if not HAS_VNNI:
        sys.exit("no AVX512-VNNI on this CPU")
    buf = np.ones(128, np.int8)
    for nc in (1, 4, 8, 12, 16, 24):
        sp = chains(nc)
        f = njit(lambda n, a, sp=sp: sp(n, a))
        f(10, buf)
        n = 20_000_000 // nc
        t = time.perf_counter()
        f(n, buf)
        dt = time.perf_counter() - t
        print(f"{nc:3d} chains: {n * nc / dt / 1e9:5.2f} G vpdpbusd/s ({n / dt / 1e9:.2f} G/s a chain)")
    w = np.ones(2 * 64 * 512, np.int8)
    q = np.ones(16 * 2048, np.int8)
    for ntok, nvec in ((8, 1), (6, 2), (5, 2), (4, 2)):
        sp = pattern(ntok, nvec)
        f = njit(lambda n, w, q, sp=sp: sp(n, w, q))
        f(10, w, q)
        n = 2_000_000 // (ntok * nvec)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            f(n, w, q)
            best = min(best, time.perf_counter() - t)
        print(f"GEMM pattern, {ntok} tokens x {nvec} tile vectors: {n * 8 * ntok * nvec / best / 1e9:5.2f} G vpdpbusd/s")


if __name__ == "__main__":
    main()
