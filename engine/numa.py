"""--numa on machines with several NUMA nodes: which CPUs each compute thread may run on, as
ggml's strategies place them, and the pinning of Numba's thread pool.

distribute: thread i runs on the CPUs of node i mod n_nodes; isolate: every thread on the node
the process started on; numactl: every thread on the CPU set the process was given (numactl's).
The weights are then not prefetched at load (engine.model), so that each page lands on the node
of the thread that first reads it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import re
from typing import Callable

import numba
import numpy as np

STRATEGIES = ("distribute", "isolate", "numactl")


def topology() -> list[list[int]]:
    """The CPUs of each NUMA node (index = node), from sysfs; [] where the kernel does not say."""
    nodes = []
    paths = glob.glob("/sys/devices/system/node/node[0-9]*")
    for p in sorted(paths, key=lambda p: int(re.search(r"(\d+)$", p).group(1))):
        cpus = sorted(int(re.search(r"cpu(\d+)$", c).group(1)) for c in glob.glob(p + "/cpu[0-9]*"))
        nodes.append(cpus)
    return nodes


def current_node(nodes: list[list[int]]) -> int:
    cpu = libc().sched_getcpu()
    return next((i for i, cpus in enumerate(nodes) if cpu in cpus), 0)


def thread_cpus(strategy: str, n_threads: int, nodes: list[list[int]], node_now: int,
                cpuset: set[int]) -> list[set[int]]:
    """The CPUs thread i (0..n_threads-1) may run on under `strategy`, as ggml's
    set_numa_thread_affinity chooses them."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown NUMA strategy '{strategy}' (use {', '.join(STRATEGIES)})")
    if strategy == "numactl":
        return [set(cpuset) for _ in range(n_threads)]
    if strategy == "isolate":
        return [set(nodes[node_now]) for _ in range(n_threads)]
    return [set(nodes[i % len(nodes)]) for i in range(n_threads)]


@functools.lru_cache(maxsize=1)
def libc():
    """The C library through ctypes (errno kept), for the calls Python's os module lacks."""
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.sched_getcpu.restype, lib.sched_getcpu.argtypes = ctypes.c_int, ()
    return lib


_setaffinity = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").sched_setaffinity   # own handle: Numba calls it
_setaffinity.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t)   # the mask by address
_setaffinity.restype = ctypes.c_int


@numba.njit(parallel=True)      # not cached: it calls libc through ctypes (compiles in ~1 s)
def _pin_pool(masks: np.ndarray, rounds: int) -> np.ndarray:
    # every worker pins itself (pid 0 = the calling thread) to its row of masks; many small
    # iterations so that each pool thread takes at least one
    done = np.zeros(masks.shape[0], dtype=np.int32)
    for i in numba.prange(masks.shape[0] * rounds):
        t = numba.get_thread_id()
        if _setaffinity(0, masks.shape[1], masks[t].ctypes.data) == 0:
            done[t] = 1
    return done


def pin_pool(cpu_sets: list[set[int]]) -> int:
    """Pin Numba's pool thread t (t < len(cpu_sets), as many as the pool has) to cpu_sets[t];
    the number of threads pinned."""
    n = numba.config.NUMBA_NUM_THREADS
    width = (max(max(s) for s in cpu_sets) // 64 + 1) * 8        # bytes of a cpu_set_t that holds them
    masks = np.zeros((n, width), dtype=np.uint8)
    for t in range(n):
        for c in cpu_sets[t % len(cpu_sets)]:
            masks[t, c // 8] |= 1 << (c % 8)
    keep = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        return int(_pin_pool(masks, 64).sum())
    finally:
        numba.set_num_threads(keep)


def apply(strategy: str, log: Callable[[str], None]) -> None:
    """Pin the compute threads under `strategy` on this machine (several nodes), with ik's warning
    when the kernel's automatic NUMA balancing is on."""
    nodes = topology()
    sets = thread_cpus(strategy, numba.config.NUMBA_NUM_THREADS, nodes, current_node(nodes),
                       os.sched_getaffinity(0))
    pinned = pin_pool(sets)
    log(f"numa: {strategy}: {pinned} of {numba.config.NUMBA_NUM_THREADS} compute threads pinned over "
        f"{len(nodes)} nodes")
    try:
        with open("/proc/sys/kernel/numa_balancing") as fh:
            if fh.read().strip() != "0":
                log("WARNING: /proc/sys/kernel/numa_balancing is enabled, this has been observed to impair "
                    "performance")
    except OSError:
        pass
