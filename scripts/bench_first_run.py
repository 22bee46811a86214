#!/usr/bin/env python3
"""Where a model's first run goes: load, a 64-token prompt (or one 512-token batch with --pp), two
generated tokens, in an empty Numba cache, with each compiled function's own compile time
(Numba's compile events; a caller's time excludes the callees compiled for it).

    python scripts/bench_first_run.py -m model.gguf [--pp] [-t 2] [--top 30]

NUMBA_CACHE_DIR is set to a fresh directory before numba loads unless the environment has one.
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
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--pp", action="store_true", help="one 512-token batch instead of a 64-token prompt")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    os.environ.setdefault("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="ikcli-first-"))
    import numpy as np
    from numba.core import event

    stack: list[list[float]] = []
    own: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()

    class Listener(event.Listener):
        def on_start(self, ev):
            stack.append([time.perf_counter(), 0.0])

        def on_end(self, ev):
            t0, inner = stack.pop()
            dt = time.perf_counter() - t0
            d = ev.data.get("dispatcher")
            name = f"{d.py_func.__module__}.{d.py_func.__qualname__}" if d is not None else str(ev.data)
            own[name] += dt - inner
            count[name] += 1
            if stack:
                stack[-1][1] += dt

    event.register("numba:compile", Listener())
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.model import load_model, quiet_log
    t0 = time.perf_counter()
    ctx = Context(load_model(a.model, quiet_log, mla=3),
                  EngineConfig(a.model, n_ctx=1024, n_threads=a.threads, mla=3, flash_attn=True), quiet_log)
    t1 = time.perf_counter()
    ctx.decode(np.arange(1, 513 if a.pp else 65, dtype=np.int32))
    t2 = time.perf_counter()
    for _ in range(2):
        ctx.decode(np.array([5], np.int32))
    t3 = time.perf_counter()
    print(f"load {t1 - t0:.1f} s, prompt {t2 - t1:.1f} s, 2 tokens {t3 - t2:.1f} s; "
          f"compiling {sum(own.values()):.1f} s in all")
    for name, s in sorted(own.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"  {s:6.2f} s  x{count[name]:<3d} {name}")


if __name__ == "__main__":
    main()
