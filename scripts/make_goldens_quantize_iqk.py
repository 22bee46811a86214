#!/usr/bin/env python3
"""Write tests/data/golden_quantize_iqk.npz: the bytes ik_llama.cpp's ggml_quantize_chunk writes
for its IQK types, without and with an importance matrix, via scripts/ik_oracle.py.

    IK_GGML_LIB=/work/ik_build/ggml/src/libggml.so python scripts/make_goldens_quantize_iqk.py

Contents, for each row length N in SHAPES: x{N} (rows, N) f32 weight-like inputs, im{N} (N,)
f32 column importances; per type T and N: T/{N} (no imatrix) and T/{N}/im (with im{N}),
(rows, row_bytes) uint8.  It also prints ik's RMSE per type.
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ik_oracle import IkGgml, weight_like  # noqa: E402

TYPES = ["IQ4_K", "IQ2_K", "IQ3_K", "IQ5_K", "IQ6_K", "IQ4_KS", "IQ4_KSS", "IQ2_KS"]
SHAPES = {512: 4, 1024: 4, 2048: 2}          # row length -> rows
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_quantize_iqk.npz")


def inputs(n: int, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Weight-like rows (Gaussian, a few outlier columns, one heavy-tailed row, for n=512 an
    all-zero super-block) and positive column importances with a zero run (ik replaces the
    weights of an all-~0 block by 1e-9)."""
    x, im = weight_like(np.random.default_rng(seed), rows, n, 4)
    if n == 512:
        x[2, :256] = 0
    im[64:96] = 0
    return x, im


def main() -> None:
    ik = IkGgml()
    data: dict[str, np.ndarray] = {}
    for k, (n, rows) in enumerate(SHAPES.items()):
        x, im = inputs(n, rows, 7000 + k)
        data[f"x{n}"], data[f"im{n}"] = x, im
    for t in TYPES:
        line = []
        for n in SHAPES:
            x, im = data[f"x{n}"], data[f"im{n}"]
            for use in (False, True):
                raw = ik.quantize(t, x, im if use else None)
                data[f"{t}/{n}" + ("/im" if use else "")] = raw
                y = ik.dequantize(t, raw, n)
                w = im if use else np.ones(n, np.float32)
                line.append(f"{n}{'w' if use else ' '} {np.sqrt((w * (x - y) ** 2).mean() / w.mean()):.3e}")
        print(f"{t:8s}", "  ".join(line))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez_compressed(OUT, **data)
    print(OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
