#!/usr/bin/env python3
"""The numbers beside a GPU sweep-bench: the card's measured memory bandwidth and a model's bytes
per generated token, hence the bandwidth bound of S_TG.

    python scripts/bench_cuda.py bandwidth                  # device-to-device copy, GB/s (read + write)
    python scripts/bench_cuda.py launch                     # µs per launch from Python: 2 and 8 arguments
    python scripts/bench_cuda.py alloc                      # µs per device allocation (64 KiB), freed
    python scripts/bench_cuda.py host MODEL.gguf [--exps-cpu] [--profile]   # per generated token, no GPU
        needed: ikcli's own host time on the CUDA path, kernel launches, device allocations
    python scripts/bench_cuda.py bytes MODEL.gguf [--depth N] [--exps-cpu] [--ctk q8_0] [--mla 3]
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


def launch_us(reps: int = 2000) -> tuple[float, float]:
    """Host time of one launch of a one-block kernel, µs: with two array arguments, and with eight
    (five arrays, 2-D among them, and three scalars, as the products and attention take): what a
    generated token pays per kernel when the kernels themselves are short."""
    global cuda                # a global: the simulator swaps the kernel's globals, not its closure
    import quant.cuda_compat  # noqa: F401
    from numba import cuda

    @cuda.jit
    def axpy(y, x):
        i = cuda.threadIdx.x
        if i < y.size:
            y[i] += x[i]

    @cuda.jit
    def wide(y, w, x, ids, rows, n, scale, flag):
        i = cuda.threadIdx.x
        if i < y.shape[1] and flag:
            y[0, i] += w[0, i] * x[0, i] * scale + ids[0] + rows[0] + n

    x = cuda.to_device(np.ones(256, np.float32))
    y = cuda.to_device(np.zeros(256, np.float32))
    x2, w2, y2 = (cuda.to_device(np.ones((4, 256), np.float32)) for _ in range(3))
    ids, rows = cuda.to_device(np.zeros(4, np.int32)), cuda.to_device(np.zeros(4, np.int32))
    out = []
    for k, args in ((axpy, (y, x)), (wide, (y2, w2, x2, ids, rows, 3, np.float32(0.5), True))):
        k[1, 256](*args)
        cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            k[1, 256](*args)
        cuda.synchronize()
        out.append((time.perf_counter() - t) / reps * 1e6)
    return out[0], out[1]


def alloc_us(reps: int = 2000, nbytes: int = 65536) -> float:
    """Host time of one cuda.device_array of nbytes that is dropped at once (numba frees in
    batches: the frees are in the time), µs."""
    import quant.cuda_compat  # noqa: F401
    from numba import cuda
    cuda.device_array(nbytes // 4, np.float32)
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a = cuda.device_array(nbytes // 4, np.float32)
        del a
    cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def host_per_token(path: str, exps_cpu: bool = False, tokens: int = 20,
                   profile: bool = False) -> tuple[float, float, float, dict]:
    """(ms, kernel launches, device allocations, {kernel: launches}) per generated token of ikcli's
    own host code on the CUDA path (-ngl 99 -mla 3 -fa -ctk q8_0; routed experts on the CPU with
    exps_cpu), measured on
    Numba's simulator with every kernel launch a no-op: no GPU needed, any model size (the values
    are garbage; the host path, routing included, runs as on a GPU).  profile: cProfile's top 25."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    import collections
    import cProfile
    import pstats

    import numba.cuda as nc
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator.cudadrv import devicearray as sim_da
    counts = {"launch": 0, "alloc": 0}
    by_kernel: collections.Counter = collections.Counter()

    def launch(self, *args):
        counts["launch"] += 1
        by_kernel[self.fn.__name__] += 1

    sim_kernel.FakeCUDAKernel.__call__ = launch
    for name in ("device_array", "to_device", "device_array_like"):
        def counted(*a, _orig=getattr(sim_da, name), **k):
            counts["alloc"] += 1
            return _orig(*a, **k)
        setattr(sim_da, name, counted)
        setattr(nc, name, counted)
    from engine import cuda_ops, device_kernels
    from quant import cuda_matmul
    mods = (cuda_matmul, cuda_ops, device_kernels)
    # a GPU's launch sizes and paths, not the small ones engine.cuda_backend sets for the simulator
    gpu_sizes = [{k: v for k, v in vars(m).items() if k.isupper()} for m in mods]
    import engine.cuda_backend  # noqa: F401
    for m, vals in zip(mods, gpu_sizes):
        for k, v in vals.items():
            setattr(m, k, v)
    from engine.config import EngineConfig
    from engine.context import Context
    from engine.model import load_model, quiet_log
    ot = [("exps", "CPU")] if exps_cpu else []
    cfg = EngineConfig(path, n_ctx=512, mla=3, flash_attn=True, type_k="q8_0", n_gpu_layers=99, tensor_overrides=ot)
    ctx = Context(load_model(path, quiet_log, mla=3, overrides=ot, n_gpu_layers=99), cfg, quiet_log)
    ctx.decode(np.array([1, 2, 3], dtype=np.int32))
    for t in range(3):
        ctx.decode(np.array([5 + t], dtype=np.int32))
    counts.update(launch=0, alloc=0)
    by_kernel.clear()
    pr = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    for t in range(tokens):
        if pr:
            pr.enable()
        ctx.decode(np.array([9 + t], dtype=np.int32))
        if pr:
            pr.disable()
    dt = (time.perf_counter() - t0) / tokens
    if pr:
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    per_kernel = {k: v / tokens for k, v in by_kernel.most_common()}
    return dt * 1e3, counts["launch"] / tokens, counts["alloc"] / tokens, per_kernel


def bytes_per_token(path: str, depth: int = 0, exps_cpu: bool = False, ctk: str = "q8_0",
                    mla: int = 3) -> tuple[int, int]:
    """(weight bytes, cache bytes) one generated token reads on the GPU at depth cells, from the
    file's own tensor table (engine.gguf_file; split files too).  Generation with -mla 1..3 reads
    attn_k_b / attn_v_b, not attn_kv_b (that decompresses prompts); -mla 0 the other way round."""
    from engine.gguf_file import open_model_file
    from quant.types import type_info
    mf = open_model_file(path)
    meta, arch = mf.meta, mf.arch
    n_exp = int(meta.get(f"{arch}.expert_count", 0))
    n_used = int(meta.get(f"{arch}.expert_used_count", 0))
    n_layer = int(meta[f"{arch}.block_count"])
    row = int(meta.get(f"{arch}.attention.kv_lora_rank", 512)) + int(meta.get(f"{arch}.rope.dimension_count", 64))
    unused = (".attn_kv_b.",) if mla else (".attn_k_b.", ".attn_v_b.")
    total = 0
    for name, t in mf.tensors.items():
        if name == "token_embd.weight":
            total += t.nbytes // t.shape[0]          # one row
        elif "_exps." in name:
            total += 0 if exps_cpu else t.nbytes * n_used // n_exp
        elif not any(u in name for u in unused):
            total += t.nbytes
    return total, n_layer * depth * type_info(ctk).row_bytes(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["bandwidth", "launch", "alloc", "host", "bytes", "bound"])
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("model", nargs="?")
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--exps-cpu", action="store_true")
    ap.add_argument("--ctk", default="q8_0")
    ap.add_argument("--mla", type=int, default=3)
    ap.add_argument("--gbs", type=float, default=0.0, help="measured bandwidth, GB/s (bound)")
    a = ap.parse_args()
    if a.what == "bandwidth":
        t = time.perf_counter()
        print(f"device-to-device copy: {bandwidth():.0f} GB/s (read + write; {time.perf_counter() - t:.1f} s)")
        return
    if a.what == "launch":
        two, eight = launch_us()
        print(f"one launch from Python: {two:.1f} us (2 arguments), {eight:.1f} us (8 arguments)")
        return
    if a.what == "alloc":
        print(f"one device allocation of 64 KiB, freed: {alloc_us():.1f} us")
        return
    if not a.model:
        sys.exit("bench_cuda.py: the model is needed")
    if a.what == "host":
        ms, launches, allocs, per_kernel = host_per_token(a.model, a.exps_cpu, a.tokens, a.profile)
        print(f"host time per generated token with no-op kernels: {ms:.2f} ms; {launches:.0f} kernel launches, "
              f"{allocs:.0f} device allocations")
        print("  launches: " + ", ".join(f"{k} {v:g}" for k, v in per_kernel.items()))
        return
    w, c = bytes_per_token(a.model, a.depth, a.exps_cpu, a.ctk, a.mla)
    line = f"bytes per token at N_KV {a.depth}: weights {w / 1e6:.1f} MB + cache {c / 1e6:.1f} MB"
    if a.what == "bound" and a.gbs > 0:
        line += f"; bound {a.gbs * 1e9 / (w + c):.0f} t/s at {a.gbs:.0f} GB/s"
    print(line + (" (routed experts on the CPU, not counted)" if a.exps_cpu else ""))


if __name__ == "__main__":
    main()
