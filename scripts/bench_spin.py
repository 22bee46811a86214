#!/usr/bin/env python3
"""Prompt processing and generation speed in one process, for comparing OpenMP spin settings:

    GOMP_SPINCOUNT=1000  python scripts/bench_spin.py [--model /work/bench/ds-1b-q4_0.gguf]
    GOMP_SPINCOUNT=30000 python scripts/bench_spin.py ...

Each repeat: clear the cache, one 512-token batch (PP), then --tokens single-token decodes (TG).
quant.kernels sets GOMP_SPINCOUNT=30000 unless the environment has one.  Longer spins keep
numba's workers awake between a token's ~100 small kernels (faster TG); they used to fight
OpenBLAS's threads during prompt processing (slower PP), until quant.gemm moved those GEMMs
into numba's pool: see the README's performance section.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.context import Context  # noqa: E402
from engine.model import load_model, quiet_log  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/bench/ds-1b-q4_0.gguf")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    ctx = Context(load_model(a.model, quiet_log, mla=3),
                  EngineConfig(a.model, n_ctx=2048, n_threads=a.threads, mla=3), quiet_log)
    rng = np.random.default_rng(0)
    spin = os.environ.get("GOMP_SPINCOUNT", "30000 (default)")
    for _ in range(a.repeats):
        ctx.clear()
        t = time.perf_counter()
        ctx.decode(rng.integers(0, ctx.model.n_vocab, 512).astype(np.int32), logits_from=511)
        pp = 512 / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(a.tokens):
            ctx.decode(rng.integers(0, ctx.model.n_vocab, 1).astype(np.int32))
        tg = a.tokens / (time.perf_counter() - t)
        print(f"GOMP_SPINCOUNT={spin}: PP512 {pp:7.1f} t/s  TG {tg:6.1f} t/s")


if __name__ == "__main__":
    main()
