"""--numa: the CPUs each thread gets under ggml's three strategies, the pinning of Numba's pool,
and the one-node case."""
from __future__ import annotations

import os

import numba
import numpy as np
import pytest

from conftest import cli
from engine.numa import libc

NODES = [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_thread_cpus_follow_ggml():
    from engine.numa import thread_cpus
    assert thread_cpus("distribute", 5, NODES, 1, {0, 5}) == [set(NODES[0]), set(NODES[1])] * 2 + [set(NODES[0])]
    assert thread_cpus("isolate", 3, NODES, 1, {0, 5}) == [set(NODES[1])] * 3
    assert thread_cpus("numactl", 2, NODES, 1, {0, 5}) == [{0, 5}] * 2
    with pytest.raises(ValueError, match="unknown NUMA strategy"):
        thread_cpus("spread", 2, NODES, 0, {0})


_getcpu = libc().sched_getcpu   # a ctypes function Numba can call


@numba.njit(parallel=True)
def _cpus_seen(n):
    out = np.zeros(n, dtype=np.int64)
    for i in numba.prange(n):
        out[i] = _getcpu()
    return out


def test_pin_pool_moves_every_pool_thread():
    """Every pool thread pinned to one CPU runs there; then the original set is given back."""
    from engine.numa import pin_pool
    allowed = os.sched_getaffinity(0)
    one = max(allowed)
    keep = numba.get_num_threads()
    try:
        assert pin_pool([{one}]) == numba.config.NUMBA_NUM_THREADS
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert set(_cpus_seen(4096).tolist()) == {one}
    finally:
        pin_pool([allowed])
        numba.set_num_threads(keep)
    assert os.sched_getaffinity(0) == allowed


def test_one_node_and_bad_values(capsys, monkeypatch):
    monkeypatch.setattr("ikcli.common.numa_nodes", lambda: 1)
    code, _, err = cli(capsys, "perplexity", "-c", "64", "--chunks", "1", "-t", "2", "--numa", "distribute")
    assert code == 0 and "--numa distribute: this machine has one NUMA node, nothing to place" in err
    code, _, err = cli(capsys, "perplexity", "-c", "64", "--chunks", "1", "--numa", "everywhere")
    assert code != 0 and "invalid value 'everywhere' for --numa: use distribute, isolate, numactl" in err


def test_several_nodes_pin_and_skip_the_prefetch(capsys, monkeypatch):
    """On a (simulated) two-node machine: the threads are pinned by the strategy and the weights
    are not prefetched (first touch places them); results unchanged."""
    import engine.numa as numa
    calls = []
    monkeypatch.setattr("ikcli.common.numa_nodes", lambda: 2)
    monkeypatch.setattr(numa, "topology", lambda: [sorted(os.sched_getaffinity(0)), []])
    monkeypatch.setattr(numa, "pin_pool", lambda sets: calls.append(sets) or len(sets))
    from engine.gguf_file import ModelFile
    prefetched = []
    monkeypatch.setattr(ModelFile, "prefetch", lambda self: prefetched.append(1))
    code, base, _ = cli(capsys, "perplexity", "-c", "64", "--chunks", "1", "-t", "2")
    assert code == 0 and prefetched
    prefetched.clear()
    code, out, err = cli(capsys, "perplexity", "-c", "64", "--chunks", "1", "-t", "2", "--numa", "isolate")
    assert code == 0 and out == base and not prefetched
    assert calls and all(s == set(os.sched_getaffinity(0)) for s in calls[-1])
    assert "numa: isolate: " in err and " compute threads pinned over 2 nodes" in err
