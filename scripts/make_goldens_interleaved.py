#!/usr/bin/env python3
"""Write tests/data/golden_interleaved.npz: ik_llama.cpp's bytes and values for its row-interleaved
_R4 / _R8 types (8 rows: two groups of 4, one of 8), via scripts/ik_oracle.py.

    IK_GGML_LIB=/work/ik_build/ggml/src/libggml.so python scripts/make_goldens_interleaved.py

Contents: x (ROWS, N) f32 weight-like rows, im (N,) f32 column importances; per R type T
(quant.interleaved.R_TYPES):
    T/r      ggml_quantize_chunk(T, x) bytes, (ROWS, row_bytes)
    T/r/im   the same with imatrix im (not for Q8_0_R8 and Q8_K_R8, which ignore it)
    T/plain  ggml_quantize_chunk(base type of T, x) bytes (not for Q8_K_R8: no plain file type)
    T/deq    ik's dequantize_row_<t> of T/r, called per group of rows as its to_float is
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ik_oracle import IkGgml, weight_like  # noqa: E402
from quant.interleaved import R_TYPES, Q8_0_R8, Q8_K_R8  # noqa: E402
from quant.types import type_info  # noqa: E402

ROWS, N = 8, 512
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_interleaved.npz")


def inputs(seed: int = 4242) -> tuple[np.ndarray, np.ndarray]:
    """Weight-like rows (Gaussian, outlier columns, one heavy-tailed row, zero blocks of 16/32
    and one zero super-block so that ik's QHelper replaces block weights) and importances with
    a zero run (QHelper's other trigger)."""
    x, im = weight_like(np.random.default_rng(seed), ROWS, N, 5)
    x[2, 32:64] = 0
    x[5, 272:288] = 0
    x[6, 256:512] = 0
    im[128:160] = 0
    return x, im


def main() -> None:
    ik = IkGgml()
    x, im = inputs()
    data: dict[str, np.ndarray] = {"x": x, "im": im}
    for t in R_TYPES:
        ti = type_info(t)
        r = ik.quantize(ti.name, x)
        data[f"{ti.name}/r"] = r
        if t not in (Q8_0_R8, Q8_K_R8):
            data[f"{ti.name}/r/im"] = ik.quantize(ti.name, x, im)
        if t != Q8_K_R8:
            data[f"{ti.name}/plain"] = ik.quantize(ti.base, x)
        y = ik.dequantize(ti.name, r, N)
        data[f"{ti.name}/deq"] = y
        print(f"{ti.name:10s} rmse {float(np.sqrt(((x - y) ** 2).mean())):.5f}")
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
