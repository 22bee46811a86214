#!/usr/bin/env python3
"""One MoE layer's expert products as a model makes them: the fused up/gate call of the first MoE
layer of a 512-token prompt batch is captured (its real weights, routing and activations), then
re-run alone, best of 5, with variants that say where its time goes; and the fused silu * up pass
on that call's shape.

    python scripts/bench_moe_layer.py -m ds2b-iq4_xs.gguf [-t 1] [--tree OTHER_CHECKOUT]

Variants: as in the model; the same pairs split evenly over the experts; gate only (unfused);
one expert given all 512 rows (no small groups); one expert repeated (its weights stay cached).
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
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.tree))
    import numba
    import numpy as np
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.model import load_model, quiet_log
    from quant import kernels as K

    ctx = Context(load_model(a.model, quiet_log, mla=3),
                  EngineConfig(a.model, n_ctx=1024, n_threads=a.threads, mla=3, flash_attn=True), quiet_log)
    orig, cap = K.matvec_int, []

    def grab(*args):
        if len(args[-4]) > 1 and args[7]:       # several experts, fused up/gate
            cap.append(args)
        return orig(*args)
    K.matvec_int = grab
    ctx.decode(np.random.default_rng(0).integers(1, ctx.model.n_vocab, 512).astype(np.int32), logits_from=511)
    K.matvec_int = orig
    if not cap:
        sys.exit("no fused expert product in this model's prompt batch")
    numba.set_num_threads(a.threads)
    args = cap[0]
    ge, gb, nrows, cols = args[-4], args[-3], args[8], args[9]

    def bench(label: str, v: tuple, flop: float) -> None:
        orig(*v)
        best = min(_timed(lambda: orig(*v)) for _ in range(5))
        print(f"{label:40s} {best * 1e3:8.2f} ms  {flop / best / 1e9:6.0f} GOPS")

    n, pairs = len(ge), int(gb[-1])
    print(f"{n} experts, {pairs} pairs, {nrows} x {cols} each of gate and up, {a.threads} thread(s)")
    bench("as in the model", args, 4.0 * pairs * nrows * cols)
    even = np.arange(n + 1, dtype=gb.dtype) * (pairs // n)
    bench(f"even split, {pairs // n} pairs an expert", _with(args, {-3: even}), 4.0 * even[-1] * nrows * cols)
    bench("gate only (unfused)", _with(args, {7: False}), 2.0 * pairs * nrows * cols)
    bench("one expert, 512 rows", _with(args, {-4: ge[:1].copy(), -3: np.array([0, 512], gb.dtype)}),
          4.0 * 512 * nrows * cols)
    bench("one expert repeated (cached weights)", _with(args, {-4: np.repeat(ge[:1], n), -3: even}),
          4.0 * even[-1] * nrows * cols)
    out = np.random.default_rng(1).standard_normal((pairs, nrows)).astype(np.float32)
    outb = out.copy()
    K._silu_mul_run(0, nrows, 0, pairs, out, outb)
    best = min(_timed(lambda: K._silu_mul_run(0, nrows, 0, pairs, out, outb)) for _ in range(5))
    print(f"{'silu * up over ' + str(pairs) + ' x ' + str(nrows):40s} {best * 1e3:8.2f} ms (one thread)")


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _with(args: tuple, repl: dict) -> tuple:
    v = list(args)
    for i, x in repl.items():
        v[i] = x
    return tuple(v)


if __name__ == "__main__":
    main()
