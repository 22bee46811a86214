#!/usr/bin/env python3
"""Where a generated token's matrix-vector time goes: every quant.kernels.matvec_int / matvec_act call of
`--tokens` single-token decodes of random tokens, grouped by shape, with its effective weight bandwidth.

    python scripts/bench_tg_calls.py [--model /work/bench/ds-1b-q8_0.gguf] [--rtr] [--tokens 20]
    python scripts/bench_tg_calls.py --model M --batch 512 --tokens 3     (prompt batches instead)

Key: (type id, rows, cols, experts, pairs, fused).  The last line times the same tokens with the
weight products replaced by constants: what the rest of the forward pass costs.  Compare the GB/s with scripts/bench_matmul.py
(cache-hot, and --rows 32768 for a matrix that does not fit the caches) to see what the model's
small, cold, back-to-back calls lose.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.context import Context  # noqa: E402
from engine.model import load_model, quiet_log  # noqa: E402
from quant import kernels as K  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/bench/ds-1b-q8_0.gguf")
    ap.add_argument("--rtr", action="store_true", help="repack Q8_0/Q4_0 to _R8 at load (-rtr)")
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1,
                    help="tokens per decode: > 1 times prompt batches of that many at N_KV 0 (--tokens of them)")
    a = ap.parse_args()
    cfg = EngineConfig(a.model, n_ctx=max(1024, a.batch), n_batch=max(2048, a.batch), n_ubatch=max(512, a.batch),
                       n_threads=a.threads, mla=3, flash_attn=True)
    ctx = Context(load_model(a.model, quiet_log, mla=3, repack=a.rtr), cfg, quiet_log)
    ctx.decode(np.arange(1, 65, dtype=np.int32))
    # random tokens, as sweep-bench draws them (one token repeated keeps its experts partly cached)
    rng = np.random.default_rng(0)
    n_vocab = ctx.model.hp.n_vocab
    tok1 = lambda: rng.integers(1, n_vocab, size=a.batch, dtype=np.int32)   # noqa: E731

    def tok() -> np.ndarray:
        if a.batch > 1:         # a prompt batch at N_KV 0, as sweep-bench's first row
            ctx.clear()
        return tok1()

    def dec(t: np.ndarray) -> None:      # the last token's logits only, as sweep-bench
        ctx.decode(t, logits_from=len(t) - 1)
    for _ in range(5):
        dec(tok())
    # quant.matmul calls matvec_act for a few activation rows (quantization inside, the kernels'
    # time includes it) and matvec_int otherwise: both are timed, by attribute on quant.kernels
    orig = {n: getattr(K, n) for n in ("matvec_int", "matvec_act")}
    rec = collections.defaultdict(list)

    def timing(f):
        def timed(qtype, bufa, esa, sa, bufb, esb, sb, fused, nrows, cols, *rest):
            ge, gb = rest[-4], rest[-3]
            t = time.perf_counter()
            f(qtype, bufa, esa, sa, bufb, esb, sb, fused, nrows, cols, *rest)
            dt = time.perf_counter() - t
            tid = int(qtype)     # a kernel tag (quant.typetag) is an int subclass
            nbytes = len(ge) * nrows * int(K.type_row_bytes(tid, cols)) * (2 if fused else 1)
            rec[(tid, nrows, cols, len(ge), int(gb[-1]), bool(fused))].append((dt, nbytes))
        return timed

    def patch(fs: dict) -> None:
        for n, f in fs.items():
            setattr(K, n, f)

    patch({n: timing(f) for n, f in orig.items()})
    t0 = time.perf_counter()
    for _ in range(a.tokens):
        dec(tok())
    per_tok = (time.perf_counter() - t0) / a.tokens
    patch(orig)
    total = 0.0
    for key, v in sorted(rec.items(), key=lambda kv: -sum(x[0] for x in kv[1])):
        t = sum(x[0] for x in v) / a.tokens
        b = sum(x[1] for x in v) / a.tokens
        total += t
        n = len(v) / a.tokens
        print(f"{str(key):32s} calls/decode {n:3.0f}  {t * 1e3:6.3f} ms  {b / 1e6:6.2f} MB  "
              f"{b / t / 1e9:5.1f} GB/s  {t / n * 1e6:6.1f} us/call")
    print(f"decode of {a.batch} {per_tok * 1e3:.2f} ms (timing wrappers included), products {total * 1e3:.2f} ms")

    # everything but the weight products: the same tokens with matvec_int / matvec_act writing constants
    # (no wrappers); the rest of the forward pass (attention, norms, routing, Python) still runs
    def null(*args):
        args[-2][:] = 0.01       # out

    def timed_tokens() -> float:
        t0 = time.perf_counter()
        for _ in range(a.tokens):
            dec(tok())
        return (time.perf_counter() - t0) / a.tokens

    plain = timed_tokens()
    patch({n: null for n in orig})
    rest = timed_tokens()
    patch(orig)
    print(f"token {plain * 1e3:.2f} ms without wrappers; outside the products {rest * 1e3:.2f} ms "
          f"({rest / plain:.0%})")


if __name__ == "__main__":
    main()
