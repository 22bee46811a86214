#!/usr/bin/env python3
"""Milliseconds per generated token (one-token decodes of random tokens after a 64-token prompt, -mla 3 -fa on),
three timings of --tokens tokens each; --tree runs another checkout's engine (a `git worktree` of
an older commit) for A/B pairs on this noisy machine:

    git worktree add /tmp/old <commit>
    for i in 1 2 3; do for t in /tmp/old .; do python scripts/bench_token.py -m MODEL -t 2 --tree $t; done; done
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.tree))
    import numpy as np
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.model import load_model, quiet_log
    cfg = EngineConfig(a.model, n_ctx=1024, n_threads=a.threads, mla=3, flash_attn=True)
    ctx = Context(load_model(a.model, quiet_log, mla=3), cfg, quiet_log)
    ctx.decode(np.arange(1, 65, dtype=np.int32))
    # random tokens, as sweep-bench draws them: one token over and over routes to the same experts,
    # whose weights then partly stay in the caches (pure Q8_0 -rtr, -t 2: ~75 t/s in that loop
    # against 51-55 in sweep-bench in the same minutes)
    rng = np.random.default_rng(0)
    n_vocab = ctx.model.hp.n_vocab
    tok = lambda: rng.integers(1, n_vocab, size=1, dtype=np.int32)   # noqa: E731
    for _ in range(5):
        ctx.decode(tok())
    ms = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(a.tokens):
            ctx.decode(tok())
        ms.append((time.perf_counter() - t0) / a.tokens * 1e3)
    print(f"{a.tree} {os.path.basename(a.model)} -t {a.threads}: " + " ".join(f"{v:.2f}" for v in ms) + " ms/token")


if __name__ == "__main__":
    main()
