"""Thread count of the BLAS library numpy uses (OpenBLAS), changed at run time.

The many-token matmul path hands tiles to numpy's BLAS, whose thread pool is separate from
numba's.  On a busy or small machine a multi-threaded OpenBLAS can be dramatically slower
than a single-threaded one (measured on a loaded 2-core box: 512 tiles of 16 x 4096 x 256
took 1.26 s with 2 BLAS threads, 18 ms with 1), so the engine needs to set it together
with numba's.  threadpoolctl does this generically; this is the few lines of it we need,
without the dependency: find the OpenBLAS shared object already loaded into the process and
call its set/get_num_threads.  Every function is a no-op (returning None) when no OpenBLAS
is found (e.g. numpy linked against MKL or Accelerate).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np  # noqa: F401  (make sure numpy's BLAS is loaded before we look)

_SET = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
        "openblas_set_num_threads64_", "openblas_set_num_threads")
_GET = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
        "openblas_get_num_threads64_", "openblas_get_num_threads")

_lib: ctypes.CDLL | None = None
_looked = False


def _find(names, lib):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    return None


def _openblas() -> ctypes.CDLL | None:
    global _lib, _looked
    if _looked:
        return _lib
    _looked = True
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1] if line.strip() else ""
                if "openblas" in os.path.basename(p).lower() and p not in paths:
                    paths.append(p)
    except OSError:
        return None
    for p in paths:
        try:
            lib = ctypes.CDLL(p)
        except OSError:
            continue
        if _find(_SET, lib) is not None:
            _lib = lib
            break
    return _lib


def get_blas_threads() -> int | None:
    lib = _openblas()
    fn = _find(_GET, lib) if lib is not None else None
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    return int(fn())


def set_blas_threads(n: int) -> int | None:
    """Set OpenBLAS's thread count; returns the previous one (None: no OpenBLAS found)."""
    lib = _openblas()
    fn = _find(_SET, lib) if lib is not None else None
    if fn is None:
        return None
    prev = get_blas_threads()
    fn.argtypes = [ctypes.c_int]
    fn.restype = None
    fn(int(max(1, n)))
    return prev


_CORENAME = ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
             "openblas_get_corename")


def blas_core() -> str | None:
    """The kernel set numpy's OpenBLAS runs (its core name, e.g. "Haswell", "SkylakeX"; chosen at
    load from the CPU or OPENBLAS_CORETYPE); None without OpenBLAS."""
    lib = _openblas()
    fn = _find(_CORENAME, lib) if lib is not None else None
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    name = fn()
    return name.decode(errors="replace") if name else None
