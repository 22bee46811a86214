#!/usr/bin/env python3
"""Cold compile time of a type's products, library by library: LLVM's module optimization and
machine-code generation of every Numba library the first product of a few rows (and then of
many rows) compiles, with the size of its optimized IR.  Numba copies a callee's code into each
caller's library and optimizes it there again, so a kernel that shows up in several libraries
was paid for several times (quant.fnptr).

    python scripts/bench_compile.py Q2_K [--what few,many,dequantize]
    python scripts/bench_compile.py F16 --what flash,flash-portable      (the type: the KV cache's)

Runs in a fresh, empty cache directory (NUMBA_CACHE_DIR is set before numba loads), so every
figure is a cold compile; another type of an already compiled group in the same process shows
what one more type of that group costs.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("types", help="comma-separated type names, e.g. Q2_K,Q4_K")
    ap.add_argument("--what", default="few,many",
                    help="few, many, dequantize, flash, flash-portable (comma-separated)")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="ikcli-cold-")

    import numpy as np
    from numba.core import codegen as cg

    rows: list[tuple[str, str, float, int]] = []
    opt0, fin0 = cg.CPUCodeLibrary._optimize_final_module, cg.JITCodeLibrary._finalize_specific

    def opt(self):
        t = time.perf_counter()
        opt0(self)
        rows.append(("opt", self.name, time.perf_counter() - t, len(str(self._final_module))))

    def fin(self):
        t = time.perf_counter()
        fin0(self)
        rows.append(("mc", self.name, time.perf_counter() - t, 0))

    cg.CPUCodeLibrary._optimize_final_module = opt
    cg.JITCodeLibrary._finalize_specific = fin

    from quant import matmul as M
    from quant.types import type_info
    rng = np.random.default_rng(0)
    for name in a.types.split(","):
        w = M.quantize_tensor(rng.standard_normal((64, 512)).astype(np.float32), type_info(name).id)
        for what in a.what.split(","):
            rows.clear()
            t0 = time.perf_counter()
            if what == "dequantize":
                M.dequantize(w)
            elif what.startswith("flash"):     # the type names the cache: one generated token's attention
                _flash(name, what)
            else:
                M.matmul(w, rng.standard_normal((2 if what == "few" else 64, 512)).astype(np.float32))
            dt = time.perf_counter() - t0
            agg: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0])
            for kind, lib, sec, size in rows:
                e = agg[lib]
                e[0 if kind == "opt" else 1] += sec
                e[2] = max(e[2], size)
            llvm = sum(e[0] + e[1] for e in agg.values())
            print(f"{name} {what}: {dt:.1f} s, of which LLVM {llvm:.1f} s in {len(agg)} libraries")
            for lib, e in sorted(agg.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:a.top]:
                print(f"  opt {e[0]:6.2f} s  machine code {e[1]:6.2f} s  IR {e[2] / 1e3:7.0f} kB  {lib[:70]}")


def _flash(cache_type: str, what: str) -> None:
    """One generated token of DeepSeek's latent heads (16 of 576/512) over 64 cells of the cache
    type: `flash` with the engine's choice of kernel, `flash-portable` with engine.flash_attn's own."""
    import numpy as np
    from engine import flash_attn as fa
    from engine.kv_cache import CACHE_TYPES, RowStore
    if what == "flash-portable":
        fa.USE_LANES, fa.USE_BF16 = False, False
    n = 64
    k = RowStore(n, 576, CACHE_TYPES[cache_type.lower()])
    k.write(0, np.random.default_rng(0).standard_normal((n, 576), dtype=np.float32))
    q = np.random.default_rng(1).standard_normal((1, 16, 576)).astype(np.float32)
    fa.flash_attn(q, k, None, n, 1, 576, 512, np.arange(n), np.array([n - 1]), 0.04, path="kernel")


if __name__ == "__main__":
    main()
