#!/usr/bin/env python3
"""Generation attention kernels side by side: one token of DeepSeek's latent heads (16 rows of
576/512, V a view of K) over a cache of --n-kv cells, through engine.flash_attn's kernel path
with each kernel forced in turn:

    python scripts/bench_gen_attention.py [--threads 1] [--n-kv 3584] [--type f16] [--rounds 3] [--heads 16]
                                          [--sgemm]

Kernels: portable (engine.flash_attn's own), f32 and bf16 (engine.flash_lanes; bf16 only where
the CPU has AVX512-BF16); with --type q8_0 on a CPU with VNNI also f32-int8, the f32 kind with
integer scores (the default there; "f32" is then the same kernel with f32 scores).  Each round
times every kernel warm (best of 15) and with the cache cold (best of 15): a 320 MiB buffer
(more than the 260 MiB L3 of the Intel VM it was written on) is written, then one call over a
separate 16-cell cache warms the code and the Python path, as the layers before it do in a model.
Called right after the write, a 64-cell call took ~0.25-0.3 ms more than warm there (code and
interpreter state, not cache rows), while in the model a layer's call took what its immediate
repeat did to within 0.03-0.07 ms.  Random q and cache: the bf16 kind refines more scores here than
on a model's data.  The machine is shared and noisy: compare within a round.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np

from engine import flash_attn as fa
from engine.kv_cache import CACHE_TYPES, RowStore
from quant.matmul import set_num_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-kv", type=int, default=3584)
    ap.add_argument("--type", default="f16", choices=sorted(CACHE_TYPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", type=int, default=16, help="query heads (DeepSeek-V3: 128)")
    ap.add_argument("--sgemm", action="store_true",
                    help="first print numpy's one-thread sgemm rate and the f32 kind's FMA work at that rate")
    a = ap.parse_args()
    set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    n = a.n_kv
    k = RowStore(n, 576, CACHE_TYPES[a.type])
    k.write(0, rng.standard_normal((n, 576), dtype=np.float32))
    q = rng.standard_normal((1, a.heads, 576)).astype(np.float32)
    cp = np.arange(n, dtype=np.int64)
    fa._lanes_kind(a.heads, 576, 512)                 # loads engine.flash_lanes, reads the host
    kinds = ["portable", "f32"] + (["bf16"] if fa._HOST[0] else [])
    if a.type == "q8_0" and fa._FL.HAS_VNNI:
        kinds.insert(2, "f32-int8")                 # integer scores (the default there); f32: f32 scores

    small = RowStore(16, 576, CACHE_TYPES[a.type])
    small.write(0, rng.standard_normal((16, 576), dtype=np.float32))

    def run(kind: str, cache: RowStore = k) -> np.ndarray:
        fa._FL.Q8_SCORES = kind == "f32-int8"
        fa.USE_BF16 = kind == "bf16"
        fa.USE_LANES = kind != "portable"
        fa._HOST = (fa._HOST[0], fa._HOST[1], True)  # f32 lanes even without AVX-512
        m = cache.data.shape[0]
        return fa.flash_attn(q, cache, None, m, 1, 576, 512, cp[:m], np.array([m - 1], np.int64), 0.04,
                             path="kernel")

    ref = run("portable")
    for kind in kinds[1:]:
        out = run(kind)
        print(f"{kind}: relative L2 difference from portable {np.linalg.norm(out - ref) / np.linalg.norm(ref):.2e}")
    if a.sgemm:
        sgemm_floor(n, a.heads)
    junk = np.ones(320 << 20, np.uint8)
    print(f"{n} {a.type} cells, {a.heads} rows of 576/512, {a.threads} thread(s): ms, warm / cache cold (320 MiB "
          "written, then a 16-cell call)")
    for _ in range(a.rounds):
        cols = []
        for kind in kinds:
            best = []
            for flush in (False, True):
                b = 1e9
                for _ in range(15):
                    if flush:
                        junk[::64] += 1
                        run(kind, small)
                    t = time.perf_counter()
                    run(kind)
                    b = min(b, time.perf_counter() - t)
                best.append(b * 1e3)
            cols.append(f"{kind} {best[0]:.3f} / {best[1]:.3f}")
        print("  ".join(cols))


def sgemm_floor(n: int, heads: int) -> None:
    """The f32 kind does (576 + 512) 16-lane FMAs per cell and 16 rows; numpy's sgemm (2048^2, one
    BLAS thread, best of 8) is the practical FMA rate of the core to set that against."""
    from quant.blas_threads import get_blas_threads, set_blas_threads
    old = get_blas_threads()
    set_blas_threads(1)
    x = np.random.default_rng(1).random((2, 2048, 2048), dtype=np.float32)
    best = 1e9
    for _ in range(8):
        t = time.perf_counter()
        x[0] @ x[1]
        best = min(best, time.perf_counter() - t)
    if old:
        set_blas_threads(old)
    rate = 2048 ** 3 / 16 / best                  # 16-lane FMAs a second
    work = -(-n // 16) * 16 * (576 + 512) * -(-heads // 16)
    print(f"numpy sgemm, one thread: {rate / 1e9:.2f} G 16-lane FMAs/s; the f32 kind's {work / 1e6:.2f} M FMAs "
          f"at that rate: {work / rate * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
