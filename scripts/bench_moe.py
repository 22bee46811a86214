"""Speed of one MoE layer (engine.ffn.moe_ffn): the old per-expert loop vs the pair kernels.

    python scripts/bench_moe.py [--threads 2] [--type q8_0] [--cases small,small-pp,big]

Cases (n_embd, n_ff_exp, n_expert, n_used, T):
  small     1024  512  64 6    1   (token generation)
  small-pp  1024  512  64 6  512   (prompt processing)
  big       7168 2048  32 8    1   (DeepSeek-V3 expert shape; 32 experts, not 256, to fit in RAM)

"old" is the previous moe_ffn: route, then for each selected expert three quant.matmul calls
(gate, up, down) on the rows routed to it.  "fused" / "unfused" are moe_ffn(fused=True/False):
one matmul_id / moe_up_gate call per projection for all (token, expert) pairs.  Weights are
random Q8_0 / Q4_0 blocks written directly (quantizing 1.5 GB of floats would take minutes).
Prints the best time of each variant over >= 3 s of runs taken in turn (after a warm-up).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from engine.ffn import MoEWeights, moe_ffn, route  # noqa: E402
from engine.hparams import GATING_SIGMOID  # noqa: E402
from engine.ops import silu  # noqa: E402
from quant.matmul import matmul, quantize_tensor, set_num_threads  # noqa: E402
from quant.tensor import QTensor  # noqa: E402
from quant.types import F32, type_info  # noqa: E402

CASES = {"small": (1024, 512, 64, 6, 1), "small-pp": (1024, 512, 64, 6, 512), "big": (7168, 2048, 32, 8, 1)}


def bench_interleaved(fns: dict, min_time: float = 3.0, min_reps: int = 5) -> dict:
    """Best time of each function, calling them in turn so that load from other processes
    on a shared machine hits all of them alike."""
    for f in fns.values():
        f()                                    # warm-up: compilation, page faults
    best = dict.fromkeys(fns, float("inf"))
    reps, t0 = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - t0 < min_time:
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t)
        reps += 1
    return best


def random_blocks(rng, shape, qtype):
    """Random Q8_0 / Q4_0 tensor of logical shape (..., cols): random quants, f16 scales ~ 1/(16*sqrt(cols))."""
    ti = type_info(qtype)
    nb = shape[-1] // ti.block_size
    raw = rng.integers(0, 256, (*shape[:-1], nb, ti.type_size), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, (*shape[:-1], nb)) / (16 * np.sqrt(shape[-1]))).astype(np.float16)
    raw[..., :2] = d[..., None].view(np.uint8)
    return QTensor(raw.reshape(*shape[:-1], nb * ti.type_size), qtype, tuple(shape))


def old_moe_ffn(x, m, n_used, gating, norm_w, scale):
    """The loop moe_ffn was before the pair kernels: three matmul calls per selected expert."""
    ids, w = route(matmul(m.router, x), n_used, gating, m.probs_bias, norm_w, scale)
    out = np.zeros((x.shape[0], m.down.shape[-2]), dtype=np.float32)
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        xe = np.ascontiguousarray(x[rows])
        h = silu(matmul(m.gate[int(e)], xe))
        h *= matmul(m.up[int(e)], xe)
        out[rows] += w[rows, slots][:, None] * matmul(m.down[int(e)], h)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="2")
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("--cases", default="small,small-pp,big")
    a = ap.parse_args()
    qt = type_info(a.type).id
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs, weights {type_info(qt).name}", flush=True)
    rng = np.random.default_rng(0)
    for name in a.cases.split(","):
        n_embd, n_ff, n_exp, n_used, T = CASES[name]
        router = (rng.standard_normal((n_exp, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
        m = MoEWeights(router=quantize_tensor(router, F32),
                       probs_bias=(rng.standard_normal(n_exp) * 0.01).astype(np.float32),
                       gate=random_blocks(rng, (n_exp, n_ff, n_embd), qt),
                       up=random_blocks(rng, (n_exp, n_ff, n_embd), qt),
                       down=random_blocks(rng, (n_exp, n_embd, n_ff), qt))
        x = rng.standard_normal((T, n_embd)).astype(np.float32)
        args = (x, m, n_used, GATING_SIGMOID, True, 2.5)
        ref = old_moe_ffn(*args)
        for fused in (True, False):   # same answer as the old loop
            np.testing.assert_allclose(moe_ffn(*args, fused=fused), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        for nt in (int(t) for t in a.threads.split(",")):
            set_num_threads(nt)
            b = bench_interleaved({"old": lambda: old_moe_ffn(*args),
                                   "fused": lambda: moe_ffn(*args, fused=True),
                                   "unfused": lambda: moe_ffn(*args, fused=False)})
            t_old, t_f, t_u = b["old"], b["fused"], b["unfused"]
            print(f"{name:8s} n_embd={n_embd} n_ff_exp={n_ff} experts={n_exp} used={n_used} T={T:3d} threads={nt}: "
                  f"old {t_old * 1e3:8.2f} ms  fused {t_f * 1e3:8.2f} ms  unfused {t_u * 1e3:8.2f} ms  "
                  f"(old/fused {t_old / t_f:.2f}x)", flush=True)
        del m


if __name__ == "__main__":
    main()
