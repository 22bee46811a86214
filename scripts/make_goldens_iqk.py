#!/usr/bin/env python3
"""Write tests/data/golden_iqk.npz: rows quantized to ik_llama.cpp's IQK types by
ik_llama.cpp itself, and what its dequantize_row_<type> makes of them.

    IK_GGML_LIB=/work/ik_build/ggml/src/libggml.so python scripts/make_goldens_iqk.py

Contents: x (ROWS, N) f32 inputs (shared by every type); per type name T (e.g. "IQ4_KS"):
T/raw (ROWS, row_bytes) uint8 and T/y (ROWS, N) f32.  Rows of x: Gaussian; Gaussian with
a few large outliers; all zeros; tiny values (f16 block scales near the subnormal range);
heavy-tailed (Student t, 3 dof) with a per-256 change of scale.
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from ik_oracle import IkGgml  # noqa: E402

TYPES = ["IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ6_K", "IQ4_KS", "IQ4_KSS", "IQ2_KS"]
N = 512
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_iqk.npz")


def inputs(seed: int = 20240611) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.zeros((5, N), dtype=np.float32)
    x[0] = rng.standard_normal(N) * 0.02
    x[1] = rng.standard_normal(N) * 0.05
    x[1, rng.choice(N, 4, replace=False)] = [0.9, -1.3, 0.6, -0.7]
    # x[2] stays zero
    x[3] = rng.standard_normal(N) * 2e-4
    x[4] = rng.standard_t(3, N) * np.repeat([0.01, 0.3], N // 2)
    return x.astype(np.float32)


def main() -> None:
    ik = IkGgml()
    x = inputs()
    data = {"x": x}
    for t in TYPES:
        raw = ik.quantize(t, x)
        y = ik.dequantize(t, raw, N)
        data[f"{t}/raw"] = raw
        data[f"{t}/y"] = y
        rmse = np.sqrt(((x - y) ** 2).mean(axis=1) / np.maximum((x ** 2).mean(axis=1), 1e-30))
        print(f"{t:8s} row bytes {raw.shape[1]:4d}  relative rmse per row {np.round(rmse, 4)}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    np.savez_compressed(OUT, **data)
    print(OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
