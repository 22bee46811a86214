#!/usr/bin/env python3
"""The numbers beside a GPU sweep-bench: the card's measured memory bandwidth and a model's bytes
per generated token, hence the bandwidth bound of S_TG.

    python scripts/bench_cuda.py bandwidth                  # device-to-device copy, GB/s (read + write)
    python scripts/bench_cuda.py launch                     # µs per launch of a tiny kernel from Python
    python scripts/bench_cuda.py bytes MODEL.gguf [--depth N] [--exps-cpu] [--ctk q8_0]
    python scripts/bench_cuda.py bound MODEL.gguf --gbs G [--depth N] [--exps-cpu] [--ctk q8_0]

Bytes per token: every weight a token reads once (the token embedding: one row; the routed experts:
n_expert_used of n_expert; an MoE layer's experts are all different in generation), plus the
latent cache read at depth N (one 576-value row per cell and layer, in the cache's type).  With
--exps-cpu, the routed experts are left out (they are read from host memory).  scripts/gpu_check.sh
runs these beside `ikcli sweep-bench` on a lent GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
cuda = None


def bandwidth(gib: float = 4.0, reps: int = 20) -> float:
    """GB/s of a device-to-device copy (bytes read + written), the median of reps copies."""
    from numba import cuda
    n = int(gib * 2**30) // 4
    a = cuda.to_device(np.random.default_rng(0).standard_normal(n // 64).astype(np.float32).repeat(64))
    b = cuda.device_array_like(a)
    b.copy_to_device(a)
    cuda.synchronize()
    times = []
    for _ in range(reps):
        t0, t1 = cuda.event(), cuda.event()
        t0.record()
        b.copy_to_device(a)
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) / 1e3)
    return 2 * a.nbytes / float(np.median(times)) / 1e9


def launch_us(reps: int = 2000) -> float:
    """Host time of one launch of a one-block kernel with two array arguments (what a generated
    token pays per kernel when the kernels themselves are short), µs."""
    global cuda                # a global: the simulator swaps the kernel's globals, not its closure
    import quant.cuda_compat  # noqa: F401
    from numba import cuda

    @cuda.jit
    def axpy(y, x):
        i = cuda.threadIdx.x
        if i < y.size:
            y[i] += x[i]

    x = cuda.to_device(np.ones(256, np.float32))
    y = cuda.to_device(np.zeros(256, np.float32))
    axpy[1, 256](y, x)
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        axpy[1, 256](y, x)
    cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def bytes_per_token(path: str, depth: int = 0, exps_cpu: bool = False, ctk: str = "q8_0") -> tuple[int, int]:
    """(weight bytes, cache bytes) one generated token reads on the GPU at depth cells."""
    from engine.gguf_scan import read_layout
    from quant.types import type_info
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    lay = read_layout(buf)
    arch = lay.meta["general.architecture"]
    n_exp = int(lay.meta.get(f"{arch}.expert_count", 0))
    n_used = int(lay.meta.get(f"{arch}.expert_used_count", 0))
    n_layer = int(lay.meta[f"{arch}.block_count"])
    kv_rank = int(lay.meta.get(f"{arch}.attention.kv_lora_rank", 512))
    rope = int(lay.meta.get(f"{arch}.rope.dimension_count", 64))
    total = 0
    for t in lay.tensors:
        ti = type_info(t.type_id)
        ne = list(t.ne)
        row = ne[0] // ti.block_size * ti.type_size
        size = row * int(np.prod(ne[1:]))
        if t.name == "token_embd.weight":
            size = row
        elif "_exps." in t.name:
            if exps_cpu:
                continue
            size = size * n_used // n_exp
        total += size
    ct = type_info(ctk)
    cache = n_layer * depth * ((kv_rank + rope) // ct.block_size * ct.type_size)
    return total, cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["bandwidth", "launch", "bytes", "bound"])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--exps-cpu", action="store_true")
    ap.add_argument("--ctk", default="q8_0")
    ap.add_argument("--gbs", type=float, default=0.0, help="measured bandwidth, GB/s (bound)")
    a = ap.parse_args()
    if a.what == "bandwidth":
        t = time.perf_counter()
        print(f"device-to-device copy: {bandwidth():.0f} GB/s (read + write; {time.perf_counter() - t:.1f} s)")
        return
    if a.what == "launch":
        print(f"one launch from Python: {launch_us():.1f} us")
        return
    if not a.model:
        sys.exit("bench_cuda.py: the model is needed")
    w, c = bytes_per_token(a.model, a.depth, a.exps_cpu, a.ctk)
    line = f"bytes per token at N_KV {a.depth}: weights {w / 1e6:.1f} MB + cache {c / 1e6:.1f} MB"
    if a.what == "bound" and a.gbs > 0:
        line += f"; bound {a.gbs * 1e9 / (w + c):.0f} t/s at {a.gbs:.0f} GB/s"
    print(line + (" (routed experts on the CPU, not counted)" if a.exps_cpu else ""))


if __name__ == "__main__":
    main()
