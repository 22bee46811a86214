#!/usr/bin/env python3
"""In-process token-generation time at two cache depths (the flatness goal: TG at N_KV 3584
>= 70 % of TG at N_KV 0), for one or more flash-attention kernels:

    python scripts/bench_tg_depth.py [--model /work/bench/ds-1b-q8_0.gguf] [--depths 64,3584]
                                     [--tokens 32] [--threads 2] [--repeats 3] [--mla 3]
                                     [--kernels f32,portable,bf16] [--fa-time]

The cache is filled once with a prompt of the deepest depth (in ubatches of 512); at each
depth (deepest first; the shallower ones remove the cells past them) every kernel times
`--tokens` single-token decodes, kernels interleaved, `--repeats` rounds, best kept.
Kernels: `f32` (engine.flash_lanes with f32 products; the engine's default on AVX-512 hosts
without bf16 preference), `portable` (engine.flash_attn's own kernel), `bf16` (engine.flash_lanes
with bf16 products, where the CPU has AVX512-BF16; the default on AMD Zen 4 and Zen 5, measured in the model),
`bf16-norefine` (bf16 scores without the f32 refinement).
The machine is shared and noisy: compare kernels within one run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from engine import flash_attn, flash_lanes  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.context import Context  # noqa: E402
from engine.model import load_model, quiet_log  # noqa: E402

KERNELS = {  # name: (flash_attn.USE_BF16, flash_attn.USE_LANES, flash_lanes.REFINE_LOG2)
    "bf16": (True, True, flash_lanes.REFINE_LOG2),
    "bf16-norefine": (True, True, -1.0),
    "f32": (False, True, flash_lanes.REFINE_LOG2),
    "portable": (False, False, flash_lanes.REFINE_LOG2),
}


def use(kernel: str) -> None:
    flash_attn.USE_BF16, flash_attn.USE_LANES, flash_lanes.REFINE_LOG2 = KERNELS[kernel]
    flash_attn._lanes_kind(16, 16, 16)                  # reads the host once
    # the f32 lanes kernel when asked for, also on a CPU without AVX-512 (not the engine's choice there)
    flash_attn._HOST = (*flash_attn._HOST[:2], True)


FA_TIME = [0.0]                             # seconds inside flash_attn (--fa-time)


def _timed_flash_attn(orig):
    def run(*args, **kw):
        t = time.perf_counter()
        try:
            return orig(*args, **kw)
        finally:
            FA_TIME[0] += time.perf_counter() - t
    return run


def time_decodes(ctx: Context, depth: int, n_tok: int, rng: np.random.Generator) -> tuple[float, float]:
    """(ms per token, of which ms in flash attention) of n_tok single-token decodes after the
    first `depth` cached tokens."""
    ctx.seq_rm(depth)                       # every run starts from the same depth
    toks = rng.integers(0, ctx.model.n_vocab, n_tok).astype(np.int32)
    FA_TIME[0] = 0.0
    t0 = time.perf_counter()
    for t in toks:
        ctx.decode(np.array([t], dtype=np.int32))
    return (time.perf_counter() - t0) / n_tok * 1e3, FA_TIME[0] / n_tok * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/bench/ds-1b-q8_0.gguf")
    ap.add_argument("--depths", default="64,3584")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mla", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--kernels", default="f32,portable", help=f"comma list of {', '.join(KERNELS)}")
    ap.add_argument("--fa-time", action="store_true", help="also time the flash-attention calls")
    a = ap.parse_args()
    if a.fa_time:                           # the engine imports flash_attn at call time
        flash_attn.flash_attn = _timed_flash_attn(flash_attn.flash_attn)
    kernels = a.kernels.split(",")
    bad = [k for k in kernels if k not in KERNELS]
    if bad:
        sys.exit(f"bench_tg_depth: unknown kernel {bad[0]!r} (choose from {', '.join(KERNELS)})")
    if any(k.startswith("bf16") for k in kernels) and not flash_lanes.bf16_available():
        print("note: no AVX512-BF16 on this CPU: the bf16 kernels fall back to f32")
    depths = sorted(int(d) for d in a.depths.split(","))
    if depths[-1] + a.tokens > a.ctx:
        sys.exit(f"bench_tg_depth: depth {depths[-1]} + {a.tokens} tokens does not fit --ctx {a.ctx}")
    cfg = EngineConfig(a.model, n_ctx=a.ctx, n_threads=a.threads, mla=a.mla)
    ctx = Context(load_model(a.model, quiet_log, mla=cfg.mla), cfg, quiet_log)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    ctx.decode(rng.integers(0, ctx.model.n_vocab, depths[-1]).astype(np.int32), logits_from=depths[-1] - 1)
    print(f"filled {depths[-1]} cells in {time.perf_counter() - t0:.1f} s")
    res = {}
    for d in reversed(depths):
        for k in kernels:                   # warm-up (compiles) outside the timing
            use(k)
            time_decodes(ctx, d, 2, rng)
        for _ in range(a.repeats):
            for k in kernels:
                use(k)
                ms, fa = time_decodes(ctx, d, a.tokens, rng)
                if ms < res.get((k, d), (float("inf"),))[0]:
                    res[k, d] = (ms, fa)
    for k in kernels:
        fa = lambda d: f", FA {res[k, d][1]:5.2f} ms" if a.fa_time else ""  # noqa: E731
        line = "  ".join(f"N_KV {d:5d}: {res[k, d][0]:7.2f} ms/token ({1e3 / res[k, d][0]:5.2f} t/s{fa(d)})"
                         for d in depths)
        ratio = res[k, depths[0]][0] / res[k, depths[-1]][0]
        print(f"{k:14s} {line}   TG({depths[-1]})/TG({depths[0]}) = {ratio:.3f}")


if __name__ == "__main__":
    main()
