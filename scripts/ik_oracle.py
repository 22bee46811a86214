#!/usr/bin/env python3
"""Call a locally built ik_llama.cpp libggml.so through ctypes, as an oracle for quant tests.

Used only to make golden test data (tests/data/golden_*.npz) on a machine that has an
ik_llama.cpp build beside the project; the tests themselves never need the library.

    IK_GGML_LIB=/path/to/ik_build/ggml/src/libggml.so python scripts/ik_oracle.py --selftest
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from quant.types import type_info  # noqa: E402


def weight_like(rng: np.random.Generator, rows: int, n: int, n_outlier: int) -> tuple[np.ndarray, np.ndarray]:
    """Weight-like f32 rows for golden data: Gaussian (sd 0.02), n_outlier columns scaled 5-12x,
    row 1 tripled, the last row heavy-tailed (Student t, 4 dof); and positive column importances,
    20x on the outlier columns.  Callers add their own zero blocks / zero importance runs."""
    x = rng.standard_normal((rows, n)).astype(np.float32) * 0.02
    cols = rng.choice(n, n_outlier, replace=False)
    x[:, cols] *= rng.uniform(5, 12, n_outlier).astype(np.float32)
    x[1] *= 3
    x[rows - 1] = (rng.standard_t(4, n) * 0.01).astype(np.float32)
    im = (rng.gamma(0.7, 1.0, n) * np.exp(rng.standard_normal(n))).astype(np.float32)
    im[cols] *= 20
    return x, im


class IkGgml:
    def __init__(self, path: str | None = None) -> None:
        path = path or os.environ.get("IK_GGML_LIB")
        if not path or not os.path.exists(path):
            raise SystemExit("set IK_GGML_LIB to ik_llama.cpp's libggml.so (e.g. ik_build/ggml/src/libggml.so)")
        self.lib = ctypes.CDLL(path)
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        # ggml_init fills the f16 -> f32 table that the row dequantizers read
        class InitParams(ctypes.Structure):
            _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]
        self.lib.ggml_init.restype = ctypes.c_void_p
        self.lib.ggml_init.argtypes = [InitParams]
        self.ctx = self.lib.ggml_init(InitParams(1 << 20, None, False))

    def quantize(self, qtype: str | int, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """Rows of x (nrows, n_per_row) f32 -> ik_llama.cpp's bytes, (nrows, row_bytes) uint8."""
        ti = type_info(qtype)
        x = np.ascontiguousarray(x, dtype=np.float32)
        nrows, n = x.shape
        out = np.zeros((nrows, ti.row_bytes(n)), dtype=np.uint8)
        self.lib.ggml_quantize_init(ti.id)
        im = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
        got = self.lib.ggml_quantize_chunk(ti.id, x.ctypes.data, out.ctypes.data, 0, nrows, n,
                                           None if im is None else im.ctypes.data, None)
        if got != out.nbytes:
            raise RuntimeError(f"ggml_quantize_chunk wrote {got} bytes, expected {out.nbytes}")
        return out

    def dequantize(self, qtype: str | int, raw: np.ndarray, n_per_row: int) -> np.ndarray:
        """(nrows, row_bytes) bytes -> (nrows, n_per_row) f32 with dequantize_row_<type> per row
        (per group of 4 / 8 rows for the _R4 / _R8 types, as ggml's to_float calls them)."""
        ti = type_info(qtype)
        name = ti.name.lower()
        if ti.name.startswith("Q") and not ti.interleave:   # dequantize_row_q4_K, but ..._q4_k_r4
            name = name.replace("_k", "_K")
        fn = getattr(self.lib, f"dequantize_row_{name}")
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        out = np.empty((raw.shape[0], n_per_row), dtype=np.float32)
        step = ti.interleave or 1
        if raw.shape[0] % step:
            raise ValueError(f"{raw.shape[0]} rows is not a multiple of {ti.name}'s {step} interleaved rows")
        for r in range(0, raw.shape[0], step):
            fn(raw[r].ctypes.data, out[r].ctypes.data, step * n_per_row)
        return out


if __name__ == "__main__":
    ik = IkGgml()
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    for t in ("q4_1", "q5_0", "q6_K", "iq4_xs", "iq2_k", "iq4_ks"):
        raw = ik.quantize(t, x)
        y = ik.dequantize(t, raw, 512)
        print(t, raw.shape, "rmse", float(np.sqrt(((x - y) ** 2).mean())))
