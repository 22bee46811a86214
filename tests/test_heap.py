"""engine.heap: the allocator policy is applied once and leaves NumPy working."""
import sys

import numpy as np
import pytest

from engine import heap


def test_retain_freed_memory_once():
    first = heap.retain_freed_memory()
    assert heap.retain_freed_memory() is first          # applied once, same answer
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL(None).mallopt
        except AttributeError:
            pytest.skip("no mallopt (not glibc)")
        assert first is True
    # big arrays freed and allocated again still hold what is written to them
    for n in (1 << 20, 40 << 20):
        a = np.empty(n // 4, dtype=np.float32)
        a[:] = 1.5
        assert float(a.sum()) == 1.5 * a.size
        del a
