#!/usr/bin/env python3
"""The host's vpdpbusd (512-bit) rate on one thread: loops of N independent accumulator chains,
the ceiling for quant.simd_gemm's tile GEMM (one vpdpbusd = 64 int8 multiply-adds).

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

V16I, V64B = _vec(_I32, 16), _vec(_I8, 64)


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
            tot = ir.Constant(V16I, [0] * 16)
            for a in accs:
                tot = b.add(tot, b.load(a))
            return b.sext(b.extract_element(tot, ir.Constant(_I32, 0)), ir.IntType(64))
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


if __name__ == "__main__":
    main()
