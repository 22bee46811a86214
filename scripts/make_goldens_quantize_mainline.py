#!/usr/bin/env python3
"""Write ik_llama.cpp's bytes (ggml_quantize_chunk via scripts/ik_oracle.py) for the mainline types:

* tests/data/golden_quantize_mainline.npz: a few synthetic rows (ties, zeros, tiny and heavy-tailed
  values), no imatrix;
* tests/data/golden_quantize_mainline_imatrix.npz: weight-like rows (16 x 512: Gaussian with a
  per-row scale, a few outlier columns, one heavy-tailed row) and a positive imatrix vector with a
  spread of magnitudes; every type quantized without ("none/<type>") and with ("imat/<type>") it.

    IK_GGML_LIB=/work/ik_build/ggml/src/libggml.so python scripts/make_goldens_quantize_mainline.py
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ik_oracle import IkGgml  # noqa: E402

TYPES = ("q4_1", "q5_0", "q5_1", "q6_K", "q4_K", "q5_K")
IMATRIX_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q6_0", "iq4_nl",
                 "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs")


def inputs() -> np.ndarray:
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((6, 1024)).astype(np.float32)
    x[1] *= 1e-3
    x[2] = np.round(x[2] * 4) / 4                 # exact ties
    x[3, :256] = 0                                # an all-zero super-block
    x[4] = rng.uniform(-1, 3, 1024).astype(np.float32)
    x[5] = (rng.standard_t(3, 1024) * 0.05).astype(np.float32)   # heavy tails
    return x


def weight_like(nrows: int = 16, ncols: int = 512, seed: int = 20240611) -> tuple[np.ndarray, np.ndarray]:
    """Rows like a trained weight matrix and an imatrix-like vector (mean squared activations)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((nrows, ncols)) * rng.uniform(0.01, 0.05, (nrows, 1))
    outliers = rng.choice(ncols, ncols // 64, replace=False)
    x[:, outliers] *= rng.uniform(4, 12, outliers.size)
    x[-1] = rng.standard_t(3, ncols) * 0.02
    imatrix = np.exp(rng.normal(0.0, 1.5, ncols)) * 1e-2          # positive, ~5 decades of spread
    imatrix[outliers[:4]] *= 100                                  # a few dominant channels
    return x.astype(np.float32), imatrix.astype(np.float32)


if __name__ == "__main__":
    ik = IkGgml()
    data = os.path.join(os.path.dirname(HERE), "tests", "data")
    x = inputs()
    out = {"x": x}
    for t in TYPES:
        out[t] = ik.quantize(t, x)
    path = os.path.join(data, "golden_quantize_mainline.npz")
    np.savez_compressed(path, **out)
    print(path, os.path.getsize(path), "bytes")

    x, im = weight_like()
    out = {"x": x, "imatrix": im}
    for t in IMATRIX_TYPES:
        out["none/" + t] = ik.quantize(t, x)
        out["imat/" + t] = ik.quantize(t, x, im)
    path = os.path.join(data, "golden_quantize_mainline_imatrix.npz")
    np.savez_compressed(path, **out)
    print(path, os.path.getsize(path), "bytes")
