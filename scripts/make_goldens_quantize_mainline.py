#!/usr/bin/env python3
"""Write tests/data/golden_quantize_mainline.npz: ik_llama.cpp's bytes (ggml_quantize_chunk,
no imatrix) for a few rows per type, via scripts/ik_oracle.py.

    IK_GGML_LIB=/work/ik_build/ggml/src/libggml.so python scripts/make_goldens_quantize_mainline.py
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ik_oracle import IkGgml  # noqa: E402

TYPES = ("q4_1", "q5_0", "q5_1", "q6_K", "q4_K", "q5_K")


def inputs() -> np.ndarray:
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((6, 1024)).astype(np.float32)
    x[1] *= 1e-3
    x[2] = np.round(x[2] * 4) / 4                 # exact ties
    x[3, :256] = 0                                # an all-zero super-block
    x[4] = rng.uniform(-1, 3, 1024).astype(np.float32)
    x[5] = (rng.standard_t(3, 1024) * 0.05).astype(np.float32)   # heavy tails
    return x


if __name__ == "__main__":
    ik = IkGgml()
    x = inputs()
    out = {"x": x}
    for t in TYPES:
        out[t] = ik.quantize(t, x)
    path = os.path.join(os.path.dirname(HERE), "tests", "data", "golden_quantize_mainline.npz")
    np.savez_compressed(path, **out)
    print(path, os.path.getsize(path), "bytes")
