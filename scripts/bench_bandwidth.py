#!/usr/bin/env python3
"""The memory-bandwidth bound of token generation: bytes of weights one token reads, and the
machine's read bandwidth.

    python scripts/bench_bandwidth.py [-m MODEL.gguf ...] [--threads 2] [--gib 2]

Read bandwidth: a compiled parallel sum over a --gib GiB array (far larger than the caches),
best of 5 passes.  Active bytes per token of a MoE model: every matrix except the routed
experts' (`*_exps`), which count n_expert_used / n_expert of their bytes, and except
token_embd (one row is looked up).  TG bound = bandwidth / active bytes; a sweep's S_TG at
N_KV 0 divided by it is the share of the bound reached.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402


@njit(parallel=True, fastmath=True, cache=True)
def _sum(a):
    s = np.float32(0.0)
    for i in prange(a.shape[0]):       # a parallel reduction; fastmath lets it vectorize
        s += a[i]
    return s


def read_bandwidth(gib: float, threads: int) -> float:
    numba.set_num_threads(threads)
    a = np.ones(int(gib * (1 << 30)) // 4, dtype=np.float32)
    _sum(a[:1024])
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        _sum(a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def active_bytes(path: str) -> tuple[float, float]:
    """(bytes read per generated token, total tensor bytes) of a GGUF model."""
    from engine.gguf_file import open_model_file
    from engine.model import quiet_log
    mf = open_model_file(path, quiet_log)
    meta = mf.meta
    arch = meta.get("general.architecture", "")
    used = meta.get(f"{arch}.expert_used_count", 0) or 0
    n_exp = meta.get(f"{arch}.expert_count", 0) or 0
    tot = act = 0.0
    for name, t in mf.tensors.items():
        tot += t.nbytes
        if name.startswith("token_embd"):
            continue
        act += t.nbytes * (used / n_exp if "_exps" in name and n_exp else 1.0)
    return act, tot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", default=[])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gib", type=float, default=2.0)
    a = ap.parse_args()
    bw = read_bandwidth(a.gib, a.threads)
    print(f"read bandwidth, {a.threads} threads: {bw:.1f} GB/s")
    for m in a.model:
        act, tot = active_bytes(m)
        print(f"{os.path.basename(m)}: {act / 1e6:.1f} MB read per token ({tot / 1e6:.1f} MB of tensors); "
              f"TG bound {bw * 1e9 / act:.1f} t/s")


if __name__ == "__main__":
    main()
