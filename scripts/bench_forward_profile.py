#!/usr/bin/env python3
"""Where a decode's time goes, function by function: self time (time minus that of the wrapped
functions it calls) of the engine's and quant.matmul's steps over --reps decodes of --batch
random tokens (after two untimed ones), as a sweep-bench row at N_KV 0 runs them.

    python scripts/bench_forward_profile.py --model M [--batch 512] [--threads 2] [--reps 4]
    python scripts/bench_forward_profile.py --model M --tree /path/to/other/checkout
    python scripts/bench_forward_profile.py --model M --depth 3584     (on top of 3584 cached tokens)
    python scripts/bench_forward_profile.py --model M --depth 3584 --ctk q8_0     (KV cache type)

--tree imports ikcli's packages from another checkout (a `git worktree` of an older commit): the
same wrappers, so two trees' tables compare step by step.  Functions are replaced by their wrappers
as module attributes, in WRAP's order, before the engine's modules are imported: a name that a later
module imports from an earlier one (engine.flash_attn's gemm and gemm_t) is the wrapped one.  A name
a tree does not have is skipped.  Each wrapper costs ~1 us a call, which the one-token rows show.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

# (module, attribute) pairs; a class attribute as "Class.method"
WRAP = [
    ("quant.kernels", "matvec_int"), ("quant.kernels", "matvec_act"), ("quant.kernels", "quantize_act_q8_sums"),
    ("quant.kernels", "quantize_act_q8"), ("quant.kernels", "scatter_rows"), ("quant.kernels", "gather_rows"),
    ("quant.kernels", "group_pairs"),
    ("quant.matmul", "matmul"), ("quant.matmul", "matmul_id"), ("quant.matmul", "moe_up_gate"),
    ("quant.matmul", "up_gate"), ("quant.matmul", "get_rows"), ("quant.matmul", "_quantize_act"),
    ("quant.matmul", "_gather"), ("quant.matmul", "_few_pairs"), ("quant.gemm", "gemm"), ("quant.gemm", "gemm_t"),
    ("engine.ffn", "moe_ffn"), ("engine.ffn", "route"), ("engine.ffn", "weighted_row_sums"),
    ("engine.ffn", "ffn_silu"),
    ("engine.flash_attn", "flash_attn"), ("engine.flash_attn", "flash_attn_rows"),
    ("engine.flash_attn", "_flash_kernel"), ("engine.flash_lanes", "flash_kernel_lanes"),
    ("engine.arch.deepseek2", "per_head"),
    ("engine.arch.deepseek2", "rms_norm"), ("engine.arch.deepseek2", "apply_rope"),
    ("engine.arch.deepseek2", "DeepSeek2Arch.forward"), ("engine.arch.deepseek2", "DeepSeek2Arch.attention"),
    ("engine.arch.deepseek2", "DeepSeek2Arch._attend_decompressed"),
    ("engine.arch.deepseek2", "DeepSeek2Arch._attend_latent"),
    ("engine.arch.common", "Head.logits"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--depth", type=int, default=0, help="cached tokens under the timed batch (a sweep-bench row's N_KV)")
    ap.add_argument("--ctk", default="f16", help="KV cache type (-ctk)")
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.tree))
    import importlib

    import numpy as np
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.model import load_model, quiet_log

    self_t: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    stack = [0.0]

    def wrap(owner, attr: str, label: str) -> None:
        f = getattr(owner, attr)

        def timed(*args, **kw):
            stack.append(0.0)
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                dt = time.perf_counter() - t
                child = stack.pop()
                stack[-1] += dt
                self_t[label] += dt - child
                calls[label] += 1
        setattr(owner, attr, timed)

    for mod_name, name in WRAP:
        try:
            owner = importlib.import_module(mod_name)
        except ImportError:
            continue
        *cls, attr = name.split(".")
        if cls:
            owner = getattr(owner, cls[0], None)
        if owner is not None and hasattr(owner, attr):
            wrap(owner, attr, f"{mod_name.split('.')[-1]}.{name}")

    cfg = EngineConfig(a.model, n_ctx=max(1024, 2 * a.batch, a.depth + a.batch), n_batch=max(512, a.batch),
                       n_ubatch=max(512, a.batch), n_threads=a.threads, mla=3, flash_attn=True,
                       type_k=a.ctk)
    ctx = Context(load_model(a.model, quiet_log, mla=3), cfg, quiet_log)
    rng = np.random.default_rng(0)
    n_vocab = ctx.model.hp.n_vocab

    for d0 in range(0, a.depth, 512):      # the cached tokens, in ubatches
        n = min(512, a.depth - d0)
        ctx.decode(rng.integers(1, n_vocab, size=n, dtype=np.int32), logits_from=n - 1)

    def step() -> None:
        ctx.seq_rm(a.depth, -1)
        ctx.decode(rng.integers(1, n_vocab, size=a.batch, dtype=np.int32), logits_from=a.batch - 1)
    step()
    step()
    self_t.clear()
    calls.clear()
    t0 = time.perf_counter()
    for _ in range(a.reps):
        step()
    total = (time.perf_counter() - t0) / a.reps
    print(f"{a.model}: decode of {a.batch} tokens on {a.depth}, {a.threads} threads, tree {a.tree}: {total * 1e3:.2f} ms")
    print(f"{'function':38s} {'calls':>6s} {'us/call':>10s} {'ms/decode':>10s}")
    for k in sorted(self_t, key=lambda k: -self_t[k]):
        n = calls[k] / a.reps
        print(f"{k:38s} {n:6.1f} {self_t[k] / calls[k] * 1e6:10.1f} {self_t[k] / a.reps * 1e3:10.3f}")
    print(f"{'(not in any wrapped function)':38s} {'':6s} {'':10s} {(total - sum(self_t.values()) / a.reps) * 1e3:10.3f}")


if __name__ == "__main__":
    main()
