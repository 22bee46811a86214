#!/usr/bin/env python3
"""Write tests/data/golden_special.npz: ik_llama.cpp's bytes and values for its special types
Q8_KV, Q8_KV_R8, Q8_K_R16 and BF16_R16, via scripts/ik_oracle.py.

    IK_GGML_LIB=/work/ikbuild/build/ggml/src/libggml.so python scripts/make_goldens_special.py

Contents: x (ROWS, N) f32 weight-like rows (one all-zero row, one zero 32-block, a row of huge
and tiny magnitudes); per type T:
    T/r      ggml_quantize_chunk(T, x) bytes, (ROWS, row_bytes)  (with an imatrix ik writes the
             same bytes: checked here, not stored)
    T/deq    ik's dequantize_row_<t> of T/r, per row / per group of 8 or 16 rows as its to_float
             calls it (not for BF16_R16: ik's type has no to_float)
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ik_oracle import IkGgml, weight_like  # noqa: E402
from quant.types import type_info  # noqa: E402

ROWS, N = 32, 256
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_special.npz")
TYPES = ("Q8_KV", "Q8_KV_R8", "Q8_K_R16", "BF16_R16")
# ik's symbol names (ik_oracle.dequantize spells them q8_Kv / q8_kv_r8)
DEQ_FN = {"Q8_KV": "q8_KV", "Q8_KV_R8": "q8_KV_r8", "Q8_K_R16": "q8_k_r16"}


def inputs(seed: int = 1515) -> tuple[np.ndarray, np.ndarray]:
    x, im = weight_like(np.random.default_rng(seed), ROWS, N, 4)
    x[3] = 0
    x[9, 64:96] = 0
    x[20] *= np.float32(1e6)
    x[21] *= np.float32(1e-6)
    return x, im


def dequantize(ik: IkGgml, name: str, raw: np.ndarray) -> np.ndarray:
    fn = getattr(ik.lib, f"dequantize_row_{DEQ_FN[name]}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    step = type_info(name).interleave or 1
    raw = np.ascontiguousarray(raw)
    y = np.empty((raw.shape[0], N), dtype=np.float32)
    for r in range(0, raw.shape[0], step):
        fn(raw[r].ctypes.data, y[r].ctypes.data, step * N)
    return y


def main() -> None:
    ik = IkGgml()
    x, im = inputs()
    data: dict[str, np.ndarray] = {"x": x}
    for name in TYPES:
        r = ik.quantize(name, x)
        if not np.array_equal(ik.quantize(name, x, im), r):
            raise SystemExit(f"{name}: ik's bytes depend on the imatrix")
        data[f"{name}/r"] = r
        if name in DEQ_FN:
            y = dequantize(ik, name, r)
            data[f"{name}/deq"] = y
            print(f"{name:9s} rmse {float(np.sqrt(((x - y) ** 2).mean())):.5g}")
    np.savez_compressed(OUT, **data)
    print(OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
