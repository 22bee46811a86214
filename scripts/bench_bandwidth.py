#!/usr/bin/env python3
"""The memory-bandwidth bound of token generation: bytes of weights one token reads, and the
machine's read bandwidth.

    python scripts/bench_bandwidth.py [-m MODEL.gguf ...] [--threads 2] [--gib 2]

Read bandwidth: compiled parallel sums over a --gib GiB array (far larger than the caches),
best of 5 passes each, two ways: a plain sum over numpy's allocation, and a sum over memory
advised into huge pages whose loop prefetches PREFETCH_BYTES ahead, as the weight kernels do
(quant.simd.prefetch; the plain sum measured 48 GB/s on the 2-core test VM while the kernels read
56 in the model).  The larger is the bound.  Active bytes per token of a MoE model: every matrix except the routed
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

import mmap  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from quant.simd import PREFETCH_BYTES, prefetch  # noqa: E402


@njit(parallel=True, fastmath=True, cache=True)
def _sum(a):
    s = np.float32(0.0)
    for i in prange(a.shape[0]):       # a parallel reduction; fastmath lets it vectorize
        s += a[i]
    return s


@intrinsic
def _lines_sum(typingctx, a, i, n):
    """Sum of the n 64-byte lines from element i of a (f32), each line's load preceded by a prefetch
    PREFETCH_BYTES ahead; four vector accumulators."""
    sig = types.float32(a, types.int64, types.int64)

    def codegen(context, b, sig, args):
        v16 = ir.VectorType(ir.FloatType(), 16)
        arr = context.make_array(sig.args[0])(context, b, args[0])
        base = b.gep(arr.data, [args[1]])
        accs = [cgutils.alloca_once_value(b, ir.Constant(v16, [0.0] * 16)) for _ in range(4)]
        with cgutils.for_range(b, b.udiv(args[2], ir.Constant(ir.IntType(64), 4))) as loop:
            for k in range(4):
                p = b.gep(base, [b.add(b.mul(loop.index, ir.Constant(ir.IntType(64), 64)), ir.Constant(ir.IntType(64), 16 * k))])
                prefetch(b, p, PREFETCH_BYTES, 64)
                x = b.load(b.bitcast(p, v16.as_pointer()), align=64)
                b.store(b.fadd(b.load(accs[k]), x, flags=["fast"]), accs[k])
        tot = b.load(accs[0])
        for acc in accs[1:]:
            tot = b.fadd(tot, b.load(acc), flags=["fast"])
        r = b.extract_element(tot, ir.Constant(ir.IntType(32), 0))
        for k in range(1, 16):
            r = b.fadd(r, b.extract_element(tot, ir.Constant(ir.IntType(32), k)), flags=["fast"])
        return r
    return sig, codegen


@njit(parallel=True, cache=True)
def _sum_prefetched(a):
    """Parallel sum in 2 MiB chunks, each line prefetched PREFETCH_BYTES ahead."""
    chunk = 1 << 19                     # floats: 2 MiB
    s = np.float32(0.0)
    for c in prange(a.shape[0] // chunk):
        s += _lines_sum(a, c * chunk, chunk // 16)
    return s


def _best(f, a) -> float:
    f(a[:1 << 20])
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        f(a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def read_bandwidth(gib: float, threads: int) -> tuple[float, float]:
    """(GB/s of the plain sum, of the prefetching sum over huge pages)."""
    numba.set_num_threads(threads)
    n = int(gib * (1 << 30)) // (2 << 20) * (2 << 20)
    plain = _best(_sum, np.ones(n // 4, dtype=np.float32))
    mm = mmap.mmap(-1, n)
    if hasattr(mm, "madvise"):
        try:
            mm.madvise(getattr(mmap, "MADV_HUGEPAGE", 14))
        except OSError:                 # kernels without transparent huge pages
            pass
    a = np.frombuffer(mm, dtype=np.float32)
    a[:] = 1.0
    ahead = _best(_sum_prefetched, a)
    del a
    mm.close()
    return plain, ahead


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
    plain, ahead = read_bandwidth(a.gib, a.threads)
    bw = max(plain, ahead)
    print(f"read bandwidth, {a.threads} threads: {plain:.1f} GB/s plain sum, {ahead:.1f} GB/s prefetching over "
          f"huge pages; bound from {bw:.1f}")
    for m in a.model:
        act, tot = active_bytes(m)
        print(f"{os.path.basename(m)}: {act / 1e6:.1f} MB read per token ({tot / 1e6:.1f} MB of tensors); "
              f"TG bound {bw * 1e9 / act:.1f} t/s")


if __name__ == "__main__":
    main()
